#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine (system packages, a venv with the CPU build of torch)
# and runs the whole suite. Used by the README and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-test-deps.sh

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch pinned: the CPU build is on local disk; an unpinned torch pulls several GB of CUDA wheels.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
# A real vLLM (its CPU build) in a venv of its own, for the real-engine tier (tests/test_real_vllm.py).
bash scripts/install-vllm.sh
# A real llama.cpp server (its CPU build, static) for the second real-engine tier (tests/test_real_llamacpp.py).
bash scripts/install-llamacpp.sh
# Lint and types first: they take seconds and name the line; the suite takes minutes.
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
