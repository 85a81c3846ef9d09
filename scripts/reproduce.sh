#!/usr/bin/env bash
# Reproduce a row of docs/benchmarks/README.md on your own Linux machine with an NVIDIA GPU:
#
#   SESSIONS_DIR=/path/to/sessions bash scripts/reproduce.sh [FAMILY] [more `bench engines` args...]
#
# FAMILY (the results page's rows): qwen3.5-35b-a3b (default), qwen3-30b-a3b, glm-4.5-air,
# deepseek-v4-flash, minimax-m2. Steps, each skipped when already done:
#   1. ./install.sh --with-server: .venv, the CUDA engine and llama.cpp's stock llama-server (the
#      baseline), ~10-20 min the first time;
#   2. the family's synthetic GGUF (real per-layer shape and quant, routing as skewed as a real
#      model's; 10-52 GiB, a few minutes) under $WORK;
#   3. `ostinato bench engines` at a $POOL pool: Ostinato, every expert on the GPU (the limit),
#      llama-server and llama.cpp at the same placement, $SESSIONS held-out sessions x $TURNS turns;
#   4. the results page's row (`ostinato bench table`).
# Results in $OUT: <name>.json, .md (the run's tables), .cmd.txt (the exact command), .log, .row.md.
# Env: SESSIONS_DIR (recorded agent sessions: swe.jsonl, format in docs/benchmarks/METHOD.md;
# default: the bench's own search), OUT (./bench-out), WORK (/tmp/ostinato-repro: models, work dirs),
# POOL (0.45), SESSIONS (2), TURNS (6), ENGINES (ostinato,stock-all-gpu,llama-server,stock-layers),
# NAME (repro-<family>), PY (.venv/bin/python), INSTALL=0 (skip step 1), ALLOW_CPU=1 (run without a GPU).
# Peers built elsewhere: OSTINATO_IK_SERVER,
# OSTINATO_MOE_CACHE_SERVER (docs/benchmarks/METHOD.md, "Peer engines").
#
# Sourced with REPRO_LIB=1 (scripts/device-run.sh, the lent GPU machine's stages) it only defines
# the functions below.

# repro_family FAMILY: REPRO_SYNTH=(synth args) of the family's file; 1 for an unknown family.
# The layer counts are the results page's: a representative cut of the real depth (its layer kinds
# in proportion, docs/synthetic-models.md) where the whole model would not fit the machine's disk
# and time: GLM-4.5-Air 12 of 46, DeepSeek-V4-Flash 14 of 43, MiniMax-M2 4 of 62.
repro_family() {
  case "$1" in
    qwen3-30b-a3b)     REPRO_SYNTH=(--arch qwen3moe --shape qwen3-30b-a3b --quant q4_k_m --layers 48) ;;
    qwen3.5-35b-a3b)   REPRO_SYNTH=(--arch qwen35moe --shape qwen3.5-35b-a3b --quant ud-q4_k_xl --layers 40) ;;
    glm-4.5-air)       REPRO_SYNTH=(--arch glm4moe --shape glm-4.5-air --quant q4_k_m --layers 12) ;;
    deepseek-v4-flash) REPRO_SYNTH=(--arch deepseek4 --shape deepseek-v4-flash --quant mxfp4 --layers 14) ;;
    minimax-m2)        REPRO_SYNTH=(--arch minimax-m2 --shape minimax-m2 --quant q4_k_m --layers 4) ;;
    *) echo "unknown family '$1' (qwen3-30b-a3b, qwen3.5-35b-a3b, glm-4.5-air, deepseek-v4-flash, minimax-m2)" >&2
       return 1 ;;
  esac
}

# repro_model PATH SYNTH_ARGS...: write the synthetic file unless it is there
repro_model() {
  local m=$1; shift
  [ -f "$m" ] && return 0
  mkdir -p "$(dirname "$m")"
  "${PY:-.venv/bin/python}" -m ostinatod.cli synth "$@" -o "$m" 2>&1 | tail -1
  [ -f "$m" ]
}

# repro_bench_cmd NAME MODEL SESSIONS_DIR [bench args...]: REPRO_CMD=(the `bench engines` command),
# results into $OUT, work files under $WORK
repro_bench_cmd() {
  local name=$1 model=$2 sessions=$3; shift 3
  REPRO_CMD=("${PY:-.venv/bin/python}" -m ostinatod.cli bench engines --model "$model"
             ${sessions:+--sessions-dir "$sessions"} --out-dir "$OUT" --work-dir "$WORK/bench-work-$name"
             --name "$name" "$@")
}

# repro_cmd_txt NAME NOTE: $OUT/NAME.cmd.txt, the exact command of the run with a first comment line
repro_cmd_txt() {
  printf '%s\n' "# $2 (commit ${OSTINATO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})" \
    "OSTINATO_HOME=${OSTINATO_HOME:-} ${OSTINATO_IK_SERVER:+OSTINATO_IK_SERVER=$OSTINATO_IK_SERVER }${OSTINATO_MOE_CACHE_SERVER:+OSTINATO_MOE_CACHE_SERVER=$OSTINATO_MOE_CACHE_SERVER }${REPRO_CMD[*]}" \
    > "$OUT/$1.cmd.txt"
}

# repro_row NAME: the results page's row of $OUT/NAME.json into $OUT/NAME.row.md (and stdout)
repro_row() {
  [ -f "$OUT/$1.json" ] || { echo "no $OUT/$1.json: the bench wrote no result" >&2; return 1; }
  "${PY:-.venv/bin/python}" -m ostinatod.cli bench table "$OUT/$1.json" | tee "$OUT/$1.row.md"
}

if [ "${REPRO_LIB:-0}" = 1 ]; then
  return 0 2>/dev/null || exit 0
fi

set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
FAMILY=${1:-qwen3.5-35b-a3b}; shift || true
repro_family "$FAMILY" || exit 2
if ! command -v nvidia-smi > /dev/null && [ "${ALLOW_CPU:-0}" != 1 ]; then
  echo "no nvidia-smi: this reproduces a GPU figure and needs an NVIDIA GPU and driver (ALLOW_CPU=1 runs it on the CPU anyway)" >&2
  exit 2
fi
command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] || echo "warning: no nvcc (CUDA toolkit): the build is CPU-only" >&2
if [ -n "${SESSIONS_DIR:-}" ] && [ ! -f "$SESSIONS_DIR/swe.jsonl" ]; then
  echo "no $SESSIONS_DIR/swe.jsonl: SESSIONS_DIR names a folder of recorded sessions (docs/benchmarks/METHOD.md, \"Recorded sessions\")" >&2
  exit 2
fi
OUT=$(mkdir -p "${OUT:-bench-out}" && cd "${OUT:-bench-out}" && pwd)
WORK=${WORK:-/tmp/ostinato-repro}; mkdir -p "$WORK"
NAME=${NAME:-repro-$FAMILY}
export PYTHONUNBUFFERED=1

if [ "${INSTALL:-1}" != 0 ]; then
  echo "[1/4] install with the stock llama-server"
  ./install.sh --with-server
fi
echo "[2/4] model: synth ${REPRO_SYNTH[*]}"
MODEL=$WORK/$FAMILY.gguf
repro_model "$MODEL" "${REPRO_SYNTH[@]}"
echo "[3/4] bench"
repro_bench_cmd "$NAME" "$MODEL" "${SESSIONS_DIR:-}" --budget-frac "${POOL:-0.45}" --sessions "${SESSIONS:-2}" \
  --turns "${TURNS:-6}" --engines "${ENGINES:-ostinato,stock-all-gpu,llama-server,stock-layers}" "$@"
repro_cmd_txt "$NAME" "scripts/reproduce.sh $FAMILY $*; model: synth ${REPRO_SYNTH[*]}"
"${REPRO_CMD[@]}" 2>&1 | tee "$OUT/$NAME.log"
echo "[4/4] the results page's row ($OUT/$NAME.row.md):"
repro_row "$NAME"
