#!/usr/bin/env bash
# Puts ik_llama.cpp's source (the ik-llama-cpp-python sdist, stripped to what llama-server needs) in .carry/ for the device stage ikbuild.
# Run from the project root after ../shared/tools/device-carry.sh (which prepares the rest of .carry/).
# Writes .carry/ik-src.tar.xz (~6.5 MiB; the 42 MB sdist without its models, docs, web UI sources and
# non-CUDA GPU backends, plus one build step it lacks) and .carry/ik-src.version; does nothing when
# that version is already there.
# Usage: bash scripts/ik-carry.sh [VERSION]   (default: the version ostinatod/bench/bench_ik.py's IK_SDIST names)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
ver=${1:-$(python3 -c 'from ostinatod.bench.bench_ik import IK_SDIST; print(IK_SDIST.split("==")[1])')}
# .carry/ stays out of git (--git-path: also in a worktree, where .git is a file)
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
grep -qx '/.carry/' "$ex" 2>/dev/null || echo '/.carry/' >> "$ex"
mkdir -p .carry
if [ -f .carry/ik-src.tar.xz ] && [ "$(cat .carry/ik-src.version 2>/dev/null)" = "$ver" ]; then
  echo "ik-src $ver already in .carry/"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "ik-llama-cpp-python==$ver" -d "$tmp"
tar xzf "$tmp"/ik_llama_cpp_python-"$ver".tar.gz -C "$tmp"
d=ik_llama_cpp_python-$ver; v=$d/vendor/ik_llama.cpp; s=$v/ggml/src
# the sdist lacks the step of its build that writes common/build-info.cpp (the build_info target,
# which llama-server needs): the same step, without git (the commit reads "unknown")
mkdir -p "$tmp/$v/common/cmake"
cat > "$tmp/$v/common/cmake/build-info-gen-cpp.cmake" <<'EOF'
# written by Ostinato's scripts/ik-carry.sh: the sdist lacks this step of ik_llama.cpp's build
include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in ${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)
EOF
(cd "$tmp" && tar --exclude="$v/models" --exclude="$v/github-data" --exclude="$v/docs" --exclude="$v/media" \
   --exclude="$v/gguf-py" --exclude="$v/tests" --exclude="$v/spm-headers" --exclude="$v/prompts" \
   --exclude="$v/examples/server/webui" --exclude="$v/examples/server/webui_llamacpp" \
   --exclude="$v/examples/server/themes" --exclude="$v/examples/llama.android" --exclude="$v/examples/llama.swiftui" \
   --exclude="$s/kompute" --exclude="$s/ggml-vulkan*" --exclude="$s/vulkan-shaders" --exclude="$s/ggml-sycl" \
   --exclude="$s/ggml-cann" --exclude="$s/ggml-metal*" --exclude="$d/tests" --exclude="$d/ik_llama_cpp" \
   -cJf "$root/.carry/ik-src.tar.xz" "$d")
echo "$ver" > .carry/ik-src.version
du -h .carry/ik-src.tar.xz
