#!/usr/bin/env bash
# GPU machine smoke run: install from .carry/, CUDA build (+ stock llama-server), a real-shape
# synthetic model, and the engine tests on the GPU. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-build-isolation --find-links .carry/wheels -e . > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
nproc; free -g | head -2
start=$(date +%s)
OSTINATO_CUDA=1 OSTINATO_CUDA_ARCHS=90 python3 -m ostinatod.cli build --sdist .carry/llama-src.tar.xz --with-server -j16 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build_s=$(( $(date +%s) - start ))"
python3 -c "import llama_cpp; print('gpu_offload', llama_cpp.llama_supports_gpu_offload())"
start=$(date +%s)
python3 -m ostinatod.cli synth --arch qwen3moe --shape qwen3-30b-a3b --layers ${LAYERS:-24} --quant q4_0 -o /tmp/m.gguf 2>&1 | tail -3
echo "synth_s=$(( $(date +%s) - start ))"; ls -la /tmp/m.gguf
"$@"
