#!/usr/bin/env bash
# Ostinato's one install command: a virtual environment in .venv with the package, its test tools,
# and the native engine (llama-cpp-python 0.3.36 + native/, CUDA when nvcc and a GPU driver exist).
# A second run reuses the cached build. Offline: OSTINATO_LLAMA_SDIST=/path/to/sdist ./install.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "scikit-build-core>=0.9.2" "cmake>=3.21" ninja
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ostinato build "$@"
echo "Installed. Start the daemon with: .venv/bin/ostinatod start"
