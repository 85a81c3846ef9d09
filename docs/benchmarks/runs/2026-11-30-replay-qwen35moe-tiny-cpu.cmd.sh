#!/usr/bin/env bash
# replay 1 swe session x 5 turns against a daemon serving the tiny qwen35moe, host cache on vs off
set -u
PY=/work/venv-native/bin/python
M=$($PY -c "from ostinatod.synth.writer import synthetic_model; from pathlib import Path; print(synthetic_model(Path.home()/'.cache/ostinato-test', arch='qwen35moe', shape='tiny'))")
for mb in 256 0; do
  H=/tmp/hy/home-$mb; rm -rf $H; mkdir -p $H
  OSTINATO_HOME=$H $PY -m ostinatod.daemon_cli run --port 0 --model "$M" --n-ctx 16384 --n-slots 1 --n-threads 2 --cache-ram-mb $mb > $H/out.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do [ -f $H/run/ostinatod.json ] && break; sleep 0.5; done
  url=$($PY -c "import json;print(json.load(open('$H/run/ostinatod.json'))['http_url'])")
  for i in $(seq 1 120); do curl -sf $url/health >/dev/null && break; sleep 0.5; done
  OSTINATO_HOME=$H $PY -m ostinatod.cli bench replay --sessions /work/shared/sessions/swe.jsonl --limit 1 --max-turns 5 --cap-tokens 8 --base-url $url --json /tmp/hy/replay-$mb.json > /tmp/hy/replay-$mb.txt 2>&1
  kill $pid; wait $pid 2>/dev/null
done
