#!/usr/bin/env bash
# The GPU benchmark run (one device call, <= 10 min): offline install from .carry/, CUDA build with the
# stock llama-server, native load check, GPU exactness tests, a real-shape synthetic model, and
# `ostinato bench engines` (Ostinato vs stock baselines on held-out recorded sessions).
# Results and logs go to $OUT. Usage: bash scripts/device-bench.sh [LAYERS] [extra bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 OSTINATO_HOME=${OSTINATO_HOME:-/tmp/ostinato-home}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LAYERS=${1:-16}; shift || true
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-build-isolation --find-links .carry/wheels -e . > /tmp/pip.log 2>&1 \
  || { tail -20 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
OSTINATO_CUDA=1 OSTINATO_CUDA_ARCHS=90 python3 -m ostinatod.cli build --sdist .carry/llama-src.tar.xz \
  --with-server -j16 > /tmp/build.log 2>&1 || { tail -60 /tmp/build.log | tee "$OUT/build-tail.txt"; exit 1; }
echo "[$(el)s] built"
if ! timeout 60 python3 -X faulthandler -c "import llama_cpp; from ostinatod.engine import native; native.lib(); print('libostinato loaded')" > "$OUT/native-load.txt" 2>&1; then
  echo "libostinato load FAILED"; tail -20 "$OUT/native-load.txt"
  timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 -c "import llama_cpp; from ostinatod.engine import native; native.lib()" > "$OUT/native-gdb.txt" 2>&1
  grep -E "^#[0-9]+ " "$OUT/native-gdb.txt" | head -20
  exit 1
fi
cat "$OUT/native-load.txt" | tail -1
OSTINATO_TEST_GPU=1 timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_exactness.py > "$OUT/exactness-gpu.txt" 2>&1
echo "[$(el)s] exactness rc=$? : $(tail -1 "$OUT/exactness-gpu.txt")"
python3 -m ostinatod.cli synth --arch qwen3moe --shape qwen3-30b-a3b --layers "$LAYERS" --quant q4_0 -o /tmp/m.gguf 2>&1 | tail -1
echo "[$(el)s] model written"
left=$(( 575 - $(el) ))
timeout "$left" python3 -m ostinatod.cli bench engines --model /tmp/m.gguf --sessions-dir .carry/sessions \
  --out-dir "$OUT" --work-dir /tmp/bench-work --name "engines-h200-L$LAYERS" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
echo "[$(el)s] done"
