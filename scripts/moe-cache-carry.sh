#!/usr/bin/env bash
# Puts upstream llama.cpp's source with the MoE cache (--moe-cache-mib) in .carry/ for the device stage
# mcbuild: the llama.cpp that the xllamacpp sdist vendors (thirdparty/llama.cpp), stripped to what
# llama-server needs with CUDA.
# Run from the project root after ../shared/tools/device-carry.sh (which prepares the rest of .carry/).
# Writes .carry/moe-cache-src.tar.xz (the 38 MB sdist without its Python binding, models, docs, tests,
# web UI sources and non-CUDA GPU backends) and .carry/moe-cache-src.version; does nothing when that
# version is already there.
# Usage: bash scripts/moe-cache-carry.sh [VERSION]
#   (default: the version ostinatod/bench/bench_moe_cache.py's MOE_CACHE_SDIST names)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
ver=${1:-$(python3 -c 'from ostinatod.bench.bench_moe_cache import MOE_CACHE_SDIST; print(MOE_CACHE_SDIST.split("==")[1])')}
# .carry/ stays out of git (--git-path: also in a worktree, where .git is a file)
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
grep -qx '/.carry/' "$ex" 2>/dev/null || echo '/.carry/' >> "$ex"
mkdir -p .carry
if [ -f .carry/moe-cache-src.tar.xz ] && [ "$(cat .carry/moe-cache-src.version 2>/dev/null)" = "$ver" ]; then
  echo "moe-cache-src $ver already in .carry/"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# the sdist only: --no-build-isolation, since preparing its metadata needs nothing of its build
python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation "xllamacpp==$ver" -d "$tmp" 2>/dev/null \
  || python3 -m pip download -q --no-deps --no-binary :all: "xllamacpp==$ver" -d "$tmp"
tar xzf "$tmp"/xllamacpp-"$ver".tar.gz -C "$tmp"
d=xllamacpp-$ver; v=$d/thirdparty/llama.cpp; s=$v/ggml/src
grep -q -- '"--moe-cache-mib"' "$tmp/$v/common/arg.cpp" \
  || { echo "xllamacpp $ver: its llama.cpp has no --moe-cache-mib"; exit 1; }
# llama-server's build reads tools/ui's CMakeLists.txt, sources.cmake and ui.{cpp,h}.in (without the
# UI's assets it embeds none); every tools/ directory's CMakeLists.txt is read, so they stay
(cd "$tmp" && tar --exclude="$v/models" --exclude="$v/docs" --exclude="$v/media" --exclude="$v/benches" \
   --exclude="$v/tests" --exclude="$v/gguf-py" --exclude="$v/conversion" --exclude="$v/examples" \
   --exclude="$v/tools/ui/src" --exclude="$v/tools/ui/static" --exclude="$v/tools/ui/tests" \
   --exclude="$v/tools/ui/package-lock.json" --exclude="$v/scripts/apple" --exclude="$v/scripts/snapdragon" \
   --exclude="$s/ggml-vulkan" --exclude="$s/ggml-sycl" --exclude="$s/ggml-opencl" --exclude="$s/ggml-hexagon" \
   --exclude="$s/ggml-metal" --exclude="$s/ggml-cann" --exclude="$s/ggml-musa" --exclude="$s/ggml-webgpu" \
   --exclude="$s/ggml-zdnn" --exclude="$s/ggml-openvino" --exclude="$s/ggml-virtgpu" --exclude="$s/ggml-et" \
   --exclude="$s/ggml-zendnn" \
   -cJf "$root/.carry/moe-cache-src.tar.xz" "$v")
echo "$ver" > .carry/moe-cache-src.version
du -h .carry/moe-cache-src.tar.xz
