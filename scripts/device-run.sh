#!/usr/bin/env bash
# The lent GPU machine's staging around scripts/reproduce.sh (the plain recipe for any GPU box: its
# synthetic files, `bench engines` command and results row are the ones used here): stages (build,
# exactness, model, calibration, benchmarks), one device call each, from an offline .carry/ bundle.
# Each stage fits one call (<= 10 min; state under /tmp stays while the machine is warm).
# Usage: STAGES="build exact model calib" bash scripts/device-run.sh [LAYERS] [bench args...]
# LAYERS defaults to 48 (the Qwen3-30B-A3B shape's own depth: the headline run of docs/benchmarks).
# Peer engine ik_llama.cpp (.carry/ik-src.tar.xz from `bash scripts/ik-carry.sh`):
#   ikbuild:  its llama-server with CUDA (sm_90, static, only that target) from .carry/ik-src.tar.xz
#             into /tmp/ik-build (-> /tmp/ik-build/bin/llama-server, never in git). The build runs in a
#             session of its own, so it goes on between calls while the machine is warm (30 s), and the
#             stage waits for it until the call's time is up; the next call's ikbuild waits for the same
#             build (or restarts ninja where it stopped). ~10-15 min of 16 cores in all: two calls. It runs
#             niced (nice 19), so our build and the tests beside it keep the cores they need.
#             IK_WAIT=0 only starts it (put ikbuild first: `IK_WAIT=0 STAGES="ikbuild build model"`
#             overlaps it with our build and the model). No bench runs while it builds.
#   peers:    45% pool: ostinato, stock-all-gpu, ik-llama-server (-ot at stock-layers' GPU expert bytes),
#             llama-server, stock-layers; 2 x 8 turns (~5-6 min)
#   peers100: the same at --budget-frac 1.0 without stock-layers (~3 min; `STAGES="peers peers100"` fits
#             one call, the second skipping engines past the time left with a note)
# Peer engine llama-server-moe-cache (.carry/moe-cache-src.tar.xz from `bash scripts/moe-cache-carry.sh`):
#   mcbuild:  upstream llama.cpp's llama-server (the llama.cpp in the xllamacpp sdist, with --moe-cache-mib)
#             the same way into /tmp/mc-build (-> /tmp/mc-build/bin/llama-server, never in git); PEER_WAIT=0
#             only starts it. ikbuild and mcbuild in one call share the cores: build them one after the other
#   q35mc:    45% pool on the Qwen3.5 file (as q35): ostinato, stock-all-gpu, llama-server-moe-cache (every
#             expert in host memory, its MoE cache at the pool's bytes), llama-server; 2 x 6 turns
#   build:    offline install from .carry/ + CUDA build with the stock llama-server (~300 s); with
#             PREWRITE="arch:shape:quant:layers ..." it writes those synthetic files (/tmp/a-<arch>.gguf)
#             beside the build (e.g. PREWRITE="qwen35moe:qwen3.5-35b-a3b:ud-q4_k_xl:40": ~110 s, hidden)
#   q35:      45% pool on /tmp/a-qwen35moe.gguf (the Qwen3.5-35B-A3B shape's 40 layers, UD-Q4_K_XL; written
#             here when missing, ~110 s): ostinato, stock-all-gpu, llama-server, ostinato-no-dprefetch, 2 x 6
#             turns (~4 min); bench args given go last (a later --engines replaces the list)
#   timeline: `ostinato bench timeline` after q35 (same warm machine): /tmp/a-qwen35moe.gguf with q35's
#             plan /tmp/bench-work-engines-h200-qwen35moe-45/residency.json (missing: the file is written and
#             a 45% plan made by a one-turn `bench engines --engines ostinato` in /tmp/bench-work-timeline-plan,
#             ~3 min), then per engine (ostinato, stock-all-gpu) in its own process: 2000 cached tokens, a
#             timed prefill of 420 and 8 decode steps under torch.profiler (CUPTI) -> timeline.{json,md},
#             timeline-<engine>.trace.json.gz (chrome://tracing, Perfetto) and .log, timeline.cmd.txt
#             (~1-2 min with the file and plan there); TL_ARGS: more `bench timeline` arguments (the bench
#             args after LAYERS are not passed to it)
#   q35peers: the same file and pool with every peer: ostinato, stock-all-gpu, ik-llama-server (stage
#             ikbuild first), llama-server, stock-layers (~4 min: 224 s on 2026-12-03)
#   exact:    GPU exactness tests and the op-level tests of the patches (on failure: rerun the first
#             failure with CUDA_LAUNCH_BLOCKING=1)
#   model:    the real-shape synthetic model /tmp/m.gguf (LAYERS layers, Qwen3-30B-A3B shape, Q4_0)
#   calib:    `ostinato calibrate --full` on that model (stored in the hardware profile: Np for the bench)
#   bench:    `ostinato bench engines` with the bench args given, results under $OUT
#   headline: `ostinato bench engines` at a 45% pool: ostinato, ostinato-class-slots (the pool layout with
#             one tensor per matrix: one upload transfer per matrix where the class tensor's pitch is past
#             the device's maximum), stock-all-gpu, stock-layers, llama-server; 2 x 8 turns
#   full:     the same at --budget-frac 1.0 (ostinato, stock-all-gpu, llama-server)
#   ab:       45% pool: ostinato, ostinato-no-prefetch, ostinato-hybrid, ostinato-pool-quarter (the
#             options changed from their defaults), stock-all-gpu, llama-server
#   sweep:    --budget-sweep 0.25,0.45,0.65,0.85 (ostinato per budget; stock-all-gpu, stock-layers and
#             llama-server once), with the plot <name>.svg
#   cpubench: `ostinato bench cpu-branch` on 2-layer files at real per-layer sizes (qwen35moe UD-Q4_K_XL
#             at the Qwen3.5-35B-A3B shape, qwen3moe Q4_K_M at the Qwen3-30B-A3B shape, deepseek4 MXFP4 at
#             the DeepSeek-V4-Flash shape): the CPU branch's own kernel against llama.cpp's CPU mul_mat_id
#             on the same experts, 1 and 16 experts, 1, 8, 32 and 64 tokens, 8 and 16 threads, with the
#             host's read bandwidth -> cpu-branch-h200.{json,md};
#             CB_ROWS ("arch:shape:quant ...") and CB_ARGS (the grid) narrow it
# Two GPUs (nvidia-h200-x2), each its own device call after build (+ model for serve2/bench2):
#   exact2:   the two-GPU exactness cases (pytest -m two_gpu, OSTINATO_TEST_GPUS=2): split, upload and
#             decode-graph paths against stock with the same layer split -> exactness-2gpu.txt
#   serve2:   unequal free memory: a torch process holds HOG_GIB (24) GiB on GPU HOG_GPU (1); then
#             scripts/serve_two_gpus.py plans over both GPUs at a 45% pool, starts the daemon, replays
#             one held-out session, the longest dev prefill, and records status, /metrics and the TUI
#             -> serve2.json (summary, checks), serve2.txt, serve2-tui.svg; the holder is stopped after
#   calib2:   `ostinato calibrate --full` twice: OSTINATO_CPU_SET=all (every physical core, unpinned),
#             then the default (NUMA-local cores): the decode step per thread count of each
#             -> calibration-{all,auto}.json/.log (the default's stays in the hardware profile)
#   bench2:   `ostinato bench engines --gpus 2` at a 45% pool: ostinato, ostinato-1gpu (the same model
#             on GPU 0 alone), llama-server and stock-layers with llama.cpp's layer split
# Representative cuts (a real model's layer kinds in proportion, docs/synthetic-models.md),
# after build; /tmp/a-<arch>.gguf is written once per layer count (/tmp/a-<arch>.layers), other /tmp/a-*.gguf
# are removed first when the disk would not hold it:
#   hot:      `ostinato bench engines --hot-shares-only` at a 45% pool, 2 x 6 turns, per row of HOT_ROWS
#             ("arch:shape:quant:layers ...", default the DeepSeek-V4-Flash 14-layer MXFP4 cut: 51 GB, ~4 min
#             to write) -> hot-<arch>.json (prefill and decode hot shares, their check); one call per big row
#   ds4:      45% pool on the DeepSeek-V4-Flash 14-layer MXFP4 cut (1 hash-routed layer as 3 of 43; 47.9 GB of
#             experts): ostinato, stock-all-gpu, llama-server (+ ik-llama-server when built), 2 x 6 turns
#   glm:      the same on the GLM-4.5-Air 12-layer Q4_K_M cut (1 dense + 11 MoE layers, 18.5 GB)
# Newer architectures, after build; one device call fits the four default rows (~8.5
# min on the H200 with the layer counts below; the deepseek4 row is a 4-layer representative cut, 1 hash
# layer: for figures that stand for the real model use stage ds4):
#   archs:    per row of ARCH_ROWS ("arch:shape:quant:layers ..."), the synthetic model at the shape's
#             real per-layer sizes with that many layers (/tmp/a-<arch>.gguf), then `ostinato bench
#             engines` at a 45% pool: ostinato, stock-all-gpu, llama-server, 1 session x 6 turns
#             -> archs-<arch>.{json,md,log,cmd.txt}, packed into archs.tar.gz (8 files come back)
#   skew:     --skew-sweep SKEWS (0.78,0.84,0.92,0.97: that shape's routers make no less than 0.771) on
#             SKEW_LAYERS (16) -layer Qwen3-30B-A3B-shape Q4_0 files (one
#             written per skew), 45% pool, ostinato, stock-all-gpu, llama-server, 1 session x SKEW_TURNS (6)
#             turns, with the plot <name>.svg (~7 min; SKEW_LAYERS=12 SKEW_TURNS=4 ~5 min)
# headline/full/sweep each need their own device call (<= 10 min: the bench skips, with a note,
# every engine whose estimate would pass the stage's time left, and writes its JSON after every
# engine); each writes <name>.json, .md (.svg) and <name>.cmd.txt (the exact command) into $OUT.
# OSTINATO_COMMIT: the commit the tree is (the lent machine's copy of .git may name an older one);
# give it on the command line (OSTINATO_COMMIT=$(git rev-parse --short HEAD) here, written into the
# call's command), else the stamps name git's HEAD there, with "+tree changes" where the tree differs.
set -uo pipefail
# the recipe's steps (repro_family, repro_model, repro_bench_cmd, repro_cmd_txt, repro_row)
PY=python3; REPRO_LIB=1 source "$(dirname "$0")/reproduce.sh"
# NCCL_NVLS_ENABLE: no NVLink multicast on the lent machines (kept if already set)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTHONUNBUFFERED=1 OSTINATO_HOME=${OSTINATO_HOME:-/tmp/ostinato-home}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; WORK=/tmp
LAYERS=${1:-48}; shift || true
SCRIPT_ARGS="$LAYERS $*"
STAGES=${STAGES:-build exact model calib bench}
# DEVICE_T0: when the device call began (epoch s), where a command ran other work before this script
T0=${DEVICE_T0:-$(date +%s)}; el() { echo $(( $(date +%s) - T0 )); }
if [ -z "${OSTINATO_COMMIT:-}" ]; then
  OSTINATO_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || OSTINATO_COMMIT="$OSTINATO_COMMIT+tree changes"
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }
IK_BIN=/tmp/ik-build/bin/llama-server
MC_BIN=/tmp/mc-build/bin/llama-server
building() { kill -0 "$(cat "/tmp/$1.pid" 2>/dev/null)" 2>/dev/null; }   # building ik-build|mc-build
peer_building() { building ik-build || building mc-build; }
# bench NAME ARGS...: one `ostinato bench engines` run within the time left of this call, on
# $BENCH_MODEL (default /tmp/m.gguf; $BENCH_NOTE, how it was written, goes into the .cmd.txt)
bench() {
  local name=$1; shift
  if peer_building; then echo "[$(el)s] $name: not run, a peer's build still runs beside it (stage ikbuild or mcbuild)"; return; fi
  local left=$(( 590 - $(el) ))
  repro_bench_cmd "$name" "${BENCH_MODEL:-/tmp/m.gguf}" .carry/sessions --time-limit $(( left - 25 )) "$@"
  local cmd=("${REPRO_CMD[@]}")
  repro_cmd_txt "$name" "stage of: STAGES=\"$STAGES\" bash scripts/device-run.sh $SCRIPT_ARGS${BENCH_NOTE:-}"
  echo "[$(el)s] $name: ${cmd[*]}"
  rm -f "/tmp/bench-work-$name"/replay-*.json   # a repeated stage packs only its own replays
  timeout "$left" "${cmd[@]}" 2>&1 | tee "$OUT/$name.log" | grep -vE "^\| prefill|^$" | tail -60
  grep -hE "ostinato: |pinned|CUDA error|GGML_ASSERT|Traceback|model buffer size" "/tmp/bench-work-$name"/*.log \
    2>/dev/null | sort | uniq -c | head -30
  # the per-turn figures of every engine (paired comparisons: same prompt, same cached tokens)
  (cd "/tmp/bench-work-$name" 2>/dev/null && ls replay-*.json >/dev/null 2>&1 && tar -czf "$OUT/$name-replays.tar.gz" replay-*.json)
  repro_row "$name" > /dev/null 2>&1 || true   # the results page's row: <name>.row.md
  echo "[$(el)s] $name done: $(ls "$OUT/$name".* 2>/dev/null | tr '\n' ' ')"
}
# peerbuild STAGE DIR CARRY SRC_GLOB WHAT [CMAKE ARGS...]: a peer's llama-server with CUDA (sm_90, static:
# its own ggml and llama, never our llama.cpp's libraries) from .carry/CARRY into /tmp/DIR/bin, ninja
# in a process session of its own (it goes on between calls while the machine is warm); waits for it
# until the call's time is up unless PEER_WAIT=0 (or IK_WAIT=0)
peerbuild() {
  local stage=$1 dir=$2 carry=$3 glob=$4 what=$5 src; shift 5
  local bin=/tmp/$dir/bin/llama-server
  if [ ! -x "$bin" ]; then
    src=$(ls -d $glob 2>/dev/null | head -1)
    if [ -z "$src" ]; then
      tar xJf ".carry/$carry" -C /tmp || { echo "no .carry/$carry: run bash scripts/$what-carry.sh"; exit 1; }
      src=$(ls -d $glob | head -1)
    fi
    [ -f "/tmp/$dir/build.ninja" ] || cmake -S "$src" -B "/tmp/$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_NCCL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF "$@" > "/tmp/$dir-cmake.log" 2>&1 \
      || { tail -30 "/tmp/$dir-cmake.log" | tee "$OUT/$dir-cmake-tail.txt"; exit 1; }
    if ! building "$dir"; then
      echo "[$(el)s] $stage: ninja llama-server -j$(nproc) in /tmp/$dir ($(grep -c . "/tmp/$dir.log" 2>/dev/null || echo 0) log lines so far)"
      setsid bash -c "echo \$\$ > /tmp/$dir.pid; exec nice -n 19 ninja -C /tmp/$dir -j$(nproc) llama-server" \
        >> "/tmp/$dir.log" 2>&1 < /dev/null &
      sleep 2
    fi
    if [ "${PEER_WAIT:-${IK_WAIT:-1}}" != 0 ]; then
      while building "$dir" && [ $(( 590 - $(el) )) -gt 15 ]; do sleep 5; done
    fi
  fi
  if [ -x "$bin" ]; then
    echo "[$(el)s] $stage: $bin ready ($(du -h "$bin" | cut -f1))"; "$bin" --version 2>&1 | tail -2
  elif building "$dir"; then
    echo "[$(el)s] $stage: still building, at $(grep -o '^\[[0-9]*/[0-9]*\]' "/tmp/$dir.log" | tail -1);" \
      "call STAGES=$stage again within 30 s (the machine stays warm and the build goes on meanwhile)"
  else
    grep -E "error|FAILED" "/tmp/$dir.log" | head -20; tail -30 "/tmp/$dir.log" > "$OUT/$dir-tail.txt"
    echo "[$(el)s] $stage: ninja stopped without the binary (log tail in $dir-tail.txt)"; exit 1
  fi
}
# ik_llama.cpp: only the CUDA FA kernels of f16/q8_0/q4_0 KV
has ikbuild && peerbuild ikbuild ik-build ik-src.tar.xz "/tmp/ik_llama_cpp_python-*/vendor/ik_llama.cpp" ik \
  -DGGML_IQK_FA_ALL_QUANTS=OFF
# upstream llama.cpp with the MoE cache: no web UI (none is carried, and the machine reaches no network)
has mcbuild && peerbuild mcbuild mc-build moe-cache-src.tar.xz "/tmp/xllamacpp-*/thirdparty/llama.cpp" moe-cache \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
[ -x "$IK_BIN" ] && export OSTINATO_IK_SERVER=${OSTINATO_IK_SERVER:-$IK_BIN}
[ -x "$MC_BIN" ] && export OSTINATO_MOE_CACHE_SERVER=${OSTINATO_MOE_CACHE_SERVER:-$MC_BIN}
if has build; then
  python3 -m pip install -q --no-index --no-build-isolation --find-links .carry/wheels -e . openai anthropic \
    > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
  pw=()   # synthetic files beside the build (they need the install above, and the tokenizer's
  # vocabulary, which the build unpacks only later: taken from the carried sdist here)
  if [ -n "${PREWRITE:-}" ] && [ -z "${OSTINATO_VOCAB:-}" ]; then
    # once per machine: a new mtime would miss the parsed tokenizer's cache (~10 s)
    mkdir -p /tmp/vocab && { [ -s /tmp/vocab/ggml-vocab-qwen2.gguf ] || tar xJf .carry/llama-src.tar.xz -O \
      --wildcards '*/llama.cpp/models/ggml-vocab-qwen2.gguf' > /tmp/vocab/ggml-vocab-qwen2.gguf; } \
      && export OSTINATO_VOCAB=/tmp/vocab/ggml-vocab-qwen2.gguf
  fi
  for row in ${PREWRITE:-}; do
    IFS=: read -r a shape quant nl <<< "$row"
    [ -f "/tmp/a-$a.gguf" ] && continue
    { python3 -m ostinatod.cli synth --arch "$a" --shape "$shape" --quant "$quant" --layers "$nl" \
      -o "/tmp/a-$a.gguf" && echo "$nl" > "/tmp/a-$a.layers"; } > "/tmp/prewrite-$a.log" 2>&1 &
    pw+=($!)
  done
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  OSTINATO_CUDA=1 OSTINATO_CUDA_ARCHS=90 python3 -m ostinatod.cli build --sdist .carry/llama-src.tar.xz \
    --with-server -j"$(nproc)" > /tmp/build.log 2>&1 || { tail -60 /tmp/build.log | tee "$OUT/build-tail.txt"; exit 1; }
  echo "[$(el)s] built"
  for pid in ${pw[@]+"${pw[@]}"}; do wait "$pid" || echo "[$(el)s] a PREWRITE file failed (/tmp/prewrite-*.log)"; done
  [ ${#pw[@]} -gt 0 ] && { tail -qn1 /tmp/prewrite-*.log; echo "[$(el)s] PREWRITE done"; }
fi
if has exact; then
  OSTINATO_TEST_GPU=1 timeout 200 python3 -X faulthandler -m pytest -q -s -x -p no:cacheprovider \
    tests/engine/test_native_ops.py tests/engine/exactness > "$OUT/exactness-gpu.txt" 2>&1
  rc=$?; echo "[$(el)s] exactness rc=$rc: $(tail -1 "$OUT/exactness-gpu.txt")"
  grep -E "max \|d|delta|Δ" "$OUT/exactness-gpu.txt" | head -20
  if [ $rc -ne 0 ]; then
    grep -nE "error|Error|ERROR|assert|Abort|abort" "$OUT/exactness-gpu.txt" | head -30
    CUDA_LAUNCH_BLOCKING=1 OSTINATO_TEST_GPU=1 timeout 120 python3 -X faulthandler -m pytest -q -s -x \
      -p no:cacheprovider tests/engine/test_native_ops.py tests/engine/exactness > "$OUT/exactness-gpu-blocking.txt" 2>&1
    grep -nE "CUDA error|current device|in function|ggml_|GGML_ASSERT" "$OUT/exactness-gpu-blocking.txt" | head -30
  fi
fi
if has exact2; then
  # the host's shape for item 4: NUMA nodes, GPU affinity, the engine's CPU choice
  { lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)"; nvidia-smi topo -m
    python3 -c "from ostinatod import hardware as h; import json; print(json.dumps(h.cpu_placement())); [print(g['index'], g['pci_bus_id'], 'numa', g['numa_node']) for g in h.probe_gpus()]"
  } > "$OUT/topology.txt" 2>&1
  tail -4 "$OUT/topology.txt"
  # every two-GPU case, no -x: one failing path must not hide the others
  OSTINATO_TEST_GPU=1 OSTINATO_TEST_GPUS=2 timeout 300 python3 -X faulthandler -m pytest -q -s -rs \
    -p no:cacheprovider -m two_gpu tests/engine/exactness > "$OUT/exactness-2gpu.txt" 2>&1
  rc=$?; echo "[$(el)s] two-GPU exactness rc=$rc: $(tail -1 "$OUT/exactness-2gpu.txt")"
  grep -E "^\[exactness|SKIPPED|FAILED|PASSED" "$OUT/exactness-2gpu.txt" | head -40
  if [ $rc -ne 0 ]; then
    grep -nE "error|Error|assert|Abort" "$OUT/exactness-2gpu.txt" | head -30
    CUDA_LAUNCH_BLOCKING=1 OSTINATO_TEST_GPU=1 OSTINATO_TEST_GPUS=2 timeout 150 python3 -X faulthandler \
      -m pytest -q -s -x -p no:cacheprovider -m two_gpu tests/engine/exactness \
      > "$OUT/exactness-2gpu-blocking.txt" 2>&1
    grep -nE "CUDA error|current device|in function|ggml_|GGML_ASSERT" "$OUT/exactness-2gpu-blocking.txt" | head -30
  fi
fi
if has model; then
  # /tmp/m.layers records the layer count of /tmp/m.gguf: another LAYERS writes the model again
  if [ ! -f /tmp/m.gguf ] || [ "$(cat /tmp/m.layers 2>/dev/null)" != "$LAYERS" ]; then
    rm -f /tmp/m.gguf /tmp/m.layers
    repro_model /tmp/m.gguf --arch qwen3moe --shape qwen3-30b-a3b --quant q4_0 --layers "$LAYERS" \
      && echo "$LAYERS" > /tmp/m.layers
  fi
  echo "[$(el)s] model ready ($(cat /tmp/m.layers 2>/dev/null) layers, $(du -h /tmp/m.gguf | cut -f1))"
fi
if has cpubench; then
  ms=()
  for row in ${CB_ROWS:-qwen35moe:qwen3.5-35b-a3b:ud-q4_k_xl qwen3moe:qwen3-30b-a3b:q4_k_m deepseek4:deepseek-v4-flash:mxfp4}; do
    IFS=: read -r a shape quant <<< "$row"
    m=/tmp/cb-$a-$quant.gguf
    [ -f "$m" ] || python3 -m ostinatod.cli synth --arch "$a" --shape "$shape" --quant "$quant" --layers 2 -o "$m" 2>&1 | tail -1
    ms+=(--model "$m")
  done
  # CB_ARGS replaces the grid (e.g. "--experts 1,2,4,8 --tokens 1 --threads 8,15,16 --reps 20")
  cmd=(python3 -m ostinatod.cli bench cpu-branch "${ms[@]}" ${CB_ARGS:---experts 1,16 --tokens 1,8,32,64
       --threads 8,16 --reps 10} --read-bw-mib 4096 --json "$OUT/cpu-branch-h200.json")
  printf '%s\n' "# stage of: STAGES=\"$STAGES\" bash scripts/device-run.sh $SCRIPT_ARGS (commit $OSTINATO_COMMIT)" \
    "${cmd[*]}" > "$OUT/cpu-branch-h200.cmd.txt"
  timeout 240 "${cmd[@]}" > "$OUT/cpu-branch-h200.md" 2> "$OUT/cpu-branch-h200.log"
  rc=$?; echo "[$(el)s] cpubench rc=$rc"; grep -E "^\| (cb|model)|16 \| |15 \|" "$OUT/cpu-branch-h200.md" | head -40; tail -3 "$OUT/cpu-branch-h200.log"
fi
if has calib; then
  timeout 240 python3 -m ostinatod.cli calibrate --model /tmp/m.gguf --full --json > "$OUT/calibration.json" \
    2> "$OUT/calibration.log"
  rc=$?; echo "[$(el)s] calibrate rc=$rc"; tail -5 "$OUT/calibration.log"
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
if has calib2; then
  # decode step vs CPU threads, on every physical core (unpinned) and then on the engine's default
  # choice (NUMA-local cores, pinned, on a host with several nodes; stored in the profile last)
  for cs in all auto; do
    OSTINATO_CPU_SET=$cs timeout 270 python3 -m ostinatod.cli calibrate --model /tmp/m.gguf --full --json \
      > "$OUT/calibration-$cs.json" 2> "$OUT/calibration-$cs.log"
    rc=$?; echo "[$(el)s] calibrate cpu_set=$cs rc=$rc"; grep "CPU placement" "$OUT/calibration-$cs.log" | tail -1
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); [print(r) for r in c.get('decode_sweep') or []]; print({k: c.get(k) for k in ('cpu_placement', 'decode_threads', 'decode_graph', 'decode_overlap', 'decode_step_ms', 'np_tokens', 'error')})" "$OUT/calibration-$cs.json" 2>&1 | head -20
  done
fi
# cutfile ARCH SHAPE QUANT LAYERS: /tmp/a-ARCH.gguf, the representative cut, written unless there with
# that layer count; the other /tmp/a-*.gguf (and /tmp/m.gguf) go first when the disk would not hold it
cutfile() {
  local a=$1 shape=$2 quant=$3 nl=$4 m=/tmp/a-$1.gguf need
  if [ -f "$m" ] && [ "$(cat "/tmp/a-$a.layers" 2>/dev/null)" = "$nl" ]; then echo "$m"; return; fi
  rm -f "$m" "/tmp/a-$a.layers"
  need=$(python3 -c "import sys; from ostinatod.synth.writer import planned_bytes; print(planned_bytes(*sys.argv[1:4], int(sys.argv[4])) // 2**30 + 4)" "$a" "$shape" "$quant" "$nl")
  if [ "$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)" -lt "$need" ]; then
    echo "[$(el)s] disk: removing $(ls /tmp/a-*.gguf /tmp/m.gguf 2>/dev/null | tr '\n' ' ')for $need GiB" >&2
    rm -f /tmp/a-*.gguf /tmp/a-*.layers /tmp/m.gguf /tmp/m.layers
  fi
  python3 -m ostinatod.cli synth --arch "$a" --shape "$shape" --quant "$quant" --layers "$nl" -o "$m" 2>&1 | tail -1 >&2 \
    && echo "$nl" > "/tmp/a-$a.layers"
  echo "$m"
}
if has archs; then
  # the shapes' real per-layer sizes; layer counts cut so that each file is ~9-21 GiB (written at
  # ~200-290 MB/s) and a row (write + bench) takes ~1-3 min (measured: 175, 140, 128, 70 s)
  ARCH_ROWS=${ARCH_ROWS:-"qwen35moe:qwen3.5-35b-a3b:ud-q4_k_xl:40 glm4moe:glm-4.5-air:q4_k_m:12 deepseek4:deepseek-v4-flash:mxfp4:4 minimax-m2:minimax-m2:q4_k_m:4"}
  for row in $ARCH_ROWS; do
    IFS=: read -r a shape quant nl <<< "$row"
    # the last row (minimax-m2, ~70 s) starts at ~445 s; a row's bench skips engines past its time limit
    if [ $(( 590 - $(el) )) -lt 120 ]; then echo "[$(el)s] archs: no time left for $row"; continue; fi
    m=$(cutfile "$a" "$shape" "$quant" "$nl")
    left=$(( 590 - $(el) ))
    cmd=(python3 -m ostinatod.cli bench engines --model "$m" --sessions-dir .carry/sessions --out-dir "$OUT"
         --work-dir "/tmp/bench-work-archs-$a" --name "archs-$a" --time-limit $(( left > 260 ? 230 : left - 25 ))
         --budget-frac 0.45 --sessions 1 --turns 6 --engines ostinato,stock-all-gpu,llama-server "$@")
    printf '%s\n' "# stage of: STAGES=\"$STAGES\" ARCH_ROWS=\"$ARCH_ROWS\" bash scripts/device-run.sh $SCRIPT_ARGS; model: synth --arch $a --shape $shape --quant $quant --layers $nl (commit $OSTINATO_COMMIT)" \
      "OSTINATO_HOME=$OSTINATO_HOME ${cmd[*]}" > "$OUT/archs-$a.cmd.txt"
    echo "[$(el)s] archs $a: ${cmd[*]}"
    timeout "$left" "${cmd[@]}" > "$OUT/archs-$a.log" 2>&1
    grep -E "engine .*: (decode|error)|^\| (decode|ttft|session)" "$OUT/archs-$a.log" | head -12
    rm -f "$m" "/tmp/a-$a.layers"   # disk: the next row's file
  done
  # one file back instead of four per row
  (cd "$OUT" && ls archs-* >/dev/null 2>&1 && tar -czf archs.tar.gz archs-* && rm -f archs-*.json archs-*.md \
    archs-*.log archs-*.cmd.txt && tar -tzf archs.tar.gz)
fi
if has bench; then
  bench "engines-h200-L$LAYERS" "$@"
fi
if has headline; then
  bench "engines-h200-L$LAYERS" --budget-frac 0.45 --sessions 2 --turns 8 \
    --engines ostinato,ostinato-class-slots,stock-all-gpu,stock-layers,llama-server "$@"
fi
if has ab; then
  # the prefill options changed from their defaults, against the default, with a baseline and the limit
  bench "engines-h200-L$LAYERS-ab" --budget-frac 0.45 --sessions 2 --turns 8 \
    --engines ostinato,ostinato-pool-quarter,ostinato-no-prefetch,ostinato-hybrid,stock-all-gpu,llama-server "$@"
fi
if has full; then
  bench "engines-h200-L$LAYERS-full" --budget-frac 1.0 --sessions 2 --turns 8 \
    --engines ostinato,stock-all-gpu,llama-server "$@"
fi
if has sweep; then
  bench "engines-h200-L$LAYERS-sweep" --budget-frac 0.45 --budget-sweep 0.25,0.45,0.65,0.85 \
    --sessions 2 --turns 8 --engines ostinato,stock-all-gpu,stock-layers,llama-server "$@"
fi
if has skew; then
  left=$(( 590 - $(el) )); name="engines-h200-L${SKEW_LAYERS:-16}-skew-sweep"
  skews=${SKEWS:-0.78,0.84,0.92,0.97}; n_skews=$(( $(tr -cd , <<< "$skews" | wc -c) + 1 ))
  per=$(( (left - 40) / n_skews )); [ "$per" -ge 30 ] || per=30   # --time-limit per skew's run (0: none)
  cmd=(python3 -m ostinatod.cli bench engines --layers "${SKEW_LAYERS:-16}" --skew-sweep "$skews"
       --sessions-dir .carry/sessions --out-dir "$OUT" --work-dir /tmp/bench-work-skew --name "$name"
       --time-limit "$per" --budget-frac 0.45 --sessions 1 --turns "${SKEW_TURNS:-6}"
       --engines ostinato,stock-all-gpu,llama-server "$@")
  printf '%s\n' "# stage of: STAGES=\"$STAGES\" bash scripts/device-run.sh $SCRIPT_ARGS (commit $OSTINATO_COMMIT)" \
    "OSTINATO_HOME=$OSTINATO_HOME ${cmd[*]}" > "$OUT/$name.cmd.txt"
  echo "[$(el)s] skew: ${cmd[*]}"
  timeout "$left" "${cmd[@]}" > "$OUT/$name.log" 2>&1
  rc=$?; echo "[$(el)s] skew rc=$rc"; grep -E "skew sweep|^\| 0\." "$OUT/$name.log" | head -20
  # the per-skew runs in one file (at most 8 files come back from a call)
  (cd "$OUT" && ls "$name"-skew*.json >/dev/null 2>&1 && tar -czf "$name-runs.tar.gz" "$name"-skew*.json \
    "$name"-skew*.md && rm -f "$name"-skew*.json "$name"-skew*.md)
fi
if has serve2; then
  HOG_GPU=${HOG_GPU:-1}; HOG_GIB=${HOG_GIB:-24}
  rm -f /tmp/hog.ready
  # another process holding part of one GPU (torch: cudaMalloc'd and touched), until we stop it
  python3 - "$HOG_GPU" "$HOG_GIB" > /tmp/hog.log 2>&1 <<'PY' &
import sys, time
import torch
g, gib = int(sys.argv[1]), float(sys.argv[2])
x = torch.ones(int(gib * 2**30), dtype=torch.uint8, device=f"cuda:{g}")
torch.cuda.synchronize(g)
print(f"holding {gib} GiB on GPU {g}", flush=True)
open("/tmp/hog.ready", "w").write("1")
while True:
    time.sleep(5)
PY
  HOG_PID=$!
  for _ in $(seq 120); do [ -f /tmp/hog.ready ] || ! kill -0 $HOG_PID 2>/dev/null && break; sleep 0.5; done
  cat /tmp/hog.log
  nvidia-smi --query-gpu=index,memory.used,memory.free --format=csv,noheader
  left=$(( 590 - $(el) ))
  # SIGINT: the script's finally stops the daemon and writes its summary
  timeout -s INT -k 20 $(( left - 25 )) python3 scripts/serve_two_gpus.py --model /tmp/m.gguf --sessions-dir .carry/sessions \
    --out-dir "$OUT" --work-dir /tmp/serve2-work --gpus 2 --budget-frac 0.45 --hog "$HOG_GPU:$HOG_GIB" \
    > /tmp/serve2.out 2>&1
  rc=$?
  grep -vE "^llama_|^load|^print_info|^\s*$" /tmp/serve2.out | tail -25
  echo "[$(el)s] serve2 rc=$rc"
  kill $HOG_PID 2>/dev/null; wait $HOG_PID 2>/dev/null
  # a daemon left by a killed script: its process group (it runs in a session of its own)
  pidf=/tmp/serve2-work/home-serve2/run/ostinatod.pid
  [ -f $pidf ] && kill -- -"$(cat $pidf)" 2>/dev/null
  python3 -c "import json; d = json.load(open('$OUT/serve2.json')); print(json.dumps({k: d.get(k) for k in ('checks', 'ok')})); [print(g) for g in d['plan']['per_gpu']]" 2>&1 | cut -c1-400
fi
if has hot; then
  for row in ${HOT_ROWS:-deepseek4:deepseek-v4-flash:mxfp4:14}; do
    IFS=: read -r a shape quant nl <<< "$row"
    m=$(cutfile "$a" "$shape" "$quant" "$nl")
    left=$(( 590 - $(el) ))
    cmd=(python3 -m ostinatod.cli bench engines --model "$m" --hot-shares-only --sessions-dir .carry/sessions
         --out-dir "$OUT" --work-dir "/tmp/bench-work-hot-$a" --name "hot-$a" --budget-frac 0.45 --sessions 2
         --turns 6 "$@")
    printf '%s\n' "# stage of: STAGES=\"$STAGES\" HOT_ROWS=\"${HOT_ROWS:-}\" bash scripts/device-run.sh $SCRIPT_ARGS; model: synth --arch $a --shape $shape --quant $quant --layers $nl (commit $OSTINATO_COMMIT)" \
      "OSTINATO_HOME=$OSTINATO_HOME ${cmd[*]}" > "$OUT/hot-$a.cmd.txt"
    echo "[$(el)s] hot $a: ${cmd[*]}"
    timeout "$left" "${cmd[@]}" > "$OUT/hot-$a.log" 2>&1
    echo "[$(el)s] hot $a rc=$?"; grep -E "WARNING|hot shares at" "$OUT/hot-$a.log" | head -8
  done
fi
if has ds4; then
  m=$(cutfile deepseek4 deepseek-v4-flash mxfp4 14)
  BENCH_MODEL=$m BENCH_NOTE="; model: synth --arch deepseek4 --shape deepseek-v4-flash --quant mxfp4 --layers 14" \
    bench engines-h200-deepseek4-L14-45 --budget-frac 0.45 --sessions 2 --turns 6 \
    --engines "ostinato,stock-all-gpu,llama-server${OSTINATO_IK_SERVER:+,ik-llama-server}" "$@"
fi
if has glm; then
  m=$(cutfile glm4moe glm-4.5-air q4_k_m 12)
  BENCH_MODEL=$m BENCH_NOTE="; model: synth --arch glm4moe --shape glm-4.5-air --quant q4_k_m --layers 12" \
    bench engines-h200-glm4moe-L12-45 --budget-frac 0.45 --sessions 2 --turns 6 \
    --engines "ostinato,stock-all-gpu,llama-server${OSTINATO_IK_SERVER:+,ik-llama-server}" "$@"
fi
# q35run NAME ENGINES [bench args]: `ostinato bench engines` at a 45% pool on the Qwen3.5 file, 2 x 6 turns
q35run() {
  local name=$1 engines=$2; shift 2
  local m=/tmp/a-qwen35moe.gguf synth
  repro_family qwen3.5-35b-a3b; synth=("${REPRO_SYNTH[@]}")
  [ -f $m ] || peer_building || repro_model $m "${synth[@]}"
  BENCH_MODEL=$m BENCH_NOTE="; model: synth ${synth[*]}" bench "$name" --budget-frac 0.45 --sessions 2 \
    --turns 6 --engines "$engines" "$@"
}
if has q35; then
  q35run engines-h200-qwen35moe-45 ostinato,stock-all-gpu,llama-server,ostinato-no-dprefetch "$@"
fi
if has timeline && [ $(( 590 - $(el) )) -lt 120 ]; then
  echo "[$(el)s] timeline: not run, $(( 590 - $(el) )) s left in this call (STAGES=timeline in a call of its own)"
elif has timeline; then
  # where the prefill's and the decode step's own GPU work goes: ours beside the limit, kernel by kernel
  m=/tmp/a-qwen35moe.gguf; res=/tmp/bench-work-engines-h200-qwen35moe-45/residency.json
  repro_family qwen3.5-35b-a3b; tsynth=("${REPRO_SYNTH[@]}")
  [ -f $m ] || repro_model $m "${tsynth[@]}"
  if [ ! -f $res ]; then
    res=/tmp/bench-work-timeline-plan/residency.json
    [ -f $res ] || timeout $(( 590 - $(el) )) $PY -m ostinatod.cli bench engines --model $m --sessions-dir .carry/sessions \
      --budget-frac 0.45 --time-limit $(( 565 - $(el) )) \
      --sessions 1 --turns 1 --engines ostinato --no-server --out-dir /tmp/timeline-plan-out \
      --work-dir /tmp/bench-work-timeline-plan --name timeline-plan 2>&1 | grep -E "plan at|Error|error" | tail -5
  fi
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
  REPRO_CMD=($PY -m ostinatod.cli bench timeline --model $m --residency $res --out-dir "$OUT"
             --work-dir /tmp/timeline-work ${TL_ARGS:-})
  repro_cmd_txt timeline "stage of: STAGES=\"$STAGES\" TL_ARGS=\"${TL_ARGS:-}\" bash scripts/device-run.sh $SCRIPT_ARGS; model: synth ${tsynth[*]}"
  echo "[$(el)s] timeline: ${REPRO_CMD[*]}"
  left=$(( 590 - $(el) ))
  if [ $left -lt 30 ]; then echo "[$(el)s] timeline: the plan took the call's time (${left} s left); run STAGES=timeline again"
  else timeout $left "${REPRO_CMD[@]}" > "$OUT/timeline.log" 2>&1; echo "[$(el)s] timeline rc=$?"; fi
  grep -E "^\[ " "$OUT/timeline.log" | tail -8; [ -f "$OUT/timeline.md" ] && head -60 "$OUT/timeline.md"
fi
if has q35peers; then
  # every peer side by side on the file whose routing is as skewed as a real model's
  q35run engines-h200-qwen35moe-45-peers ostinato,stock-all-gpu,ik-llama-server,llama-server,stock-layers "$@"
fi
if has q35mc; then
  # the strongest stock configuration, upstream's MoE cache, at Ostinato's GPU expert bytes
  q35run engines-h200-qwen35moe-45-moe-cache ostinato,stock-all-gpu,llama-server-moe-cache,llama-server "$@"
fi
if has peers; then
  bench "engines-h200-L$LAYERS-peers" --budget-frac 0.45 --sessions 2 --turns 8 \
    --engines ostinato,stock-all-gpu,ik-llama-server,llama-server,stock-layers "$@"
fi
if has peers100; then
  bench "engines-h200-L$LAYERS-peers100" --budget-frac 1.0 --sessions 2 --turns 8 \
    --engines ostinato,stock-all-gpu,ik-llama-server,llama-server "$@"
fi
if has bench2; then
  bench "engines-h200x2-L$LAYERS" --gpus 2 --budget-frac 0.45 --sessions 2 --turns 6 \
    --engines ostinato,ostinato-1gpu,llama-server,stock-layers "$@"
fi
