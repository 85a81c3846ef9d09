#!/usr/bin/env bash
# GPU machine run in stages (one device call each, <= 10 min; state under /tmp stays while the machine
# is warm). Usage: STAGES="build exact model calib" bash scripts/device-run.sh [LAYERS] [bench args...]
#   build: offline install from .carry/ + CUDA build with the stock llama-server (~300 s)
#   exact: GPU exactness tests (on failure: rerun the first failure with CUDA_LAUNCH_BLOCKING=1)
#   model: the real-shape synthetic model /tmp/m.gguf (LAYERS layers, Qwen3-30B-A3B shape, Q4_0)
#   calib: `ostinato calibrate --full` on that model (stored in the hardware profile: Np for the bench)
#   bench: `ostinato bench engines` (Ostinato vs the stock baselines), results under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 OSTINATO_HOME=${OSTINATO_HOME:-/tmp/ostinato-home}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LAYERS=${1:-16}; shift || true
STAGES=${STAGES:-build exact model calib bench}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has build; then
  python3 -m pip install -q --no-index --no-build-isolation --find-links .carry/wheels -e . openai anthropic \
    > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  OSTINATO_CUDA=1 OSTINATO_CUDA_ARCHS=90 python3 -m ostinatod.cli build --sdist .carry/llama-src.tar.xz \
    --with-server -j16 > /tmp/build.log 2>&1 || { tail -60 /tmp/build.log | tee "$OUT/build-tail.txt"; exit 1; }
  echo "[$(el)s] built"
fi
if has exact; then
  OSTINATO_TEST_GPU=1 timeout 200 python3 -X faulthandler -m pytest -q -s -x -p no:cacheprovider \
    tests/test_exactness.py > "$OUT/exactness-gpu.txt" 2>&1
  rc=$?; echo "[$(el)s] exactness rc=$rc: $(tail -1 "$OUT/exactness-gpu.txt")"
  grep -E "max \|d|delta|Δ" "$OUT/exactness-gpu.txt" | head -20
  if [ $rc -ne 0 ]; then
    grep -nE "error|Error|ERROR|assert|Abort|abort" "$OUT/exactness-gpu.txt" | head -30
    CUDA_LAUNCH_BLOCKING=1 OSTINATO_TEST_GPU=1 timeout 120 python3 -X faulthandler -m pytest -q -s -x \
      -p no:cacheprovider tests/test_exactness.py > "$OUT/exactness-gpu-blocking.txt" 2>&1
    grep -nE "CUDA error|current device|in function|ggml_|GGML_ASSERT" "$OUT/exactness-gpu-blocking.txt" | head -30
  fi
fi
if has model; then
  [ -f /tmp/m.gguf ] || python3 -m ostinatod.cli synth --arch qwen3moe --shape qwen3-30b-a3b --layers "$LAYERS" \
    --quant q4_0 -o /tmp/m.gguf 2>&1 | tail -1
  echo "[$(el)s] model ready"
fi
if has calib; then
  timeout 240 python3 -m ostinatod.cli calibrate --model /tmp/m.gguf --full --json > "$OUT/calibration.json" \
    2> "$OUT/calibration.log"
  echo "[$(el)s] calibrate rc=$?"; tail -5 "$OUT/calibration.log"
  python3 - "$OUT/calibration.json" <<'PY'
import json, sys
try:
    c = json.load(open(sys.argv[1]))
except Exception as e:
    print("no calibration JSON:", e); sys.exit()
print({k: c.get(k) for k in ("np_tokens", "np_measured_crossing", "gpu_branch_ms", "h2d_pinned_gbps", "error")})
print("cpu_branch", c.get("cpu_branch"))
for p in (c.get("measurements") or {}).get("prefill", []):
    print(p)
PY
fi
if has bench; then
  left=$(( 590 - $(el) ))
  timeout "$left" python3 -m ostinatod.cli bench engines --model /tmp/m.gguf --sessions-dir .carry/sessions \
    --out-dir "$OUT" --work-dir /tmp/bench-work --name "engines-h200-L$LAYERS" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
  grep -hE "ostinato: |pinned|CUDA error|GGML_ASSERT|Traceback|model buffer size" /tmp/bench-work/*.log \
    2>/dev/null | sort | uniq -c | head -30
  echo "[$(el)s] done"
fi
