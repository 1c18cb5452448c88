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
# The trace analysis' pure-Python path as its own job: its tests with the compiled modules (_scan.c, _gaps.c)
# switched off at their import sites (DIAGNOSER_NO_C=1), as an install without a C compiler has it; about two minutes
# on 2 cores. Run only for the whole suite (no test paths given); first, so that the whole suite's pytest line is the
# last line printed, and `set -e` stops here, on this job's own failing line, if it fails.
run_pure_python=1
for arg in "$@"; do
  case "$arg" in -*) ;; *) run_pure_python=0 ;; esac
done
if [ "$run_pure_python" = 1 ]; then
  echo "== the trace analysis without its compiled modules (DIAGNOSER_NO_C=1) =="
  DIAGNOSER_NO_C=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_trace_*.py tests/test_traces_*.py tests/test_issue28_traces.py tests/test_recorded_gpu_traces.py \
    tests/test_report_trace.py \
    --ignore=tests/test_traces_acquire.py --ignore=tests/test_trace_endpoints_live.py \
    --ignore=tests/test_trace_wait.py --ignore=tests/test_traces_pure_python.py --ignore=tests/test_traces_setup.py
  echo "== the whole suite =="
fi
exec .venv/bin/python -m pytest "$@"
