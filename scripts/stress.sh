#!/usr/bin/env bash
# The suite under load: every core kept busy by stress-ng while the tests that start processes, servers and send
# signals run three times, then the whole suite once. Each must pass every time; a test that only passes on an idle
# machine (a sleep that hoped, a fixed timeout, an assertion on speed) fails here. Slow (tens of minutes on two
# cores): run it by hand before a release, not in CI.
#
#   bash scripts/stress.sh                 # with .venv/bin/python (scripts/test.sh makes it), or $PYTHON
#   bash scripts/stress.sh -x              # extra arguments go to every pytest run
#
# Prints one line per run (PASS/FAIL, its pytest summary, seconds, load average) and exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
if ! command -v stress-ng >/dev/null 2>&1; then
  echo "stress.sh: stress-ng is not installed; run: bash scripts/install-test-deps.sh" >&2
  exit 2
fi

# Tests that start processes, servers or send signals: the slow and Prometheus marks, and the files that do so
# without being slow (child processes measured for memory, in-process signals, process trees).
PROCESS_TESTS=(-m "slow or prometheus" tests/)
SIGNAL_FILES=(tests/test_interrupts.py tests/test_collect_host.py tests/test_hostile_input.py
              tests/test_cli_attach_errors.py)

# 0 workers = one per online CPU, each spinning at 100 %.
stress-ng --cpu 0 --cpu-load 100 --timeout 0 --quiet &
STRESS=$!
trap 'kill "$STRESS" 2>/dev/null; wait "$STRESS" 2>/dev/null' EXIT
sleep 2  # let the load average start to show it

failed=0
run() {
  local label=$1; shift
  local start end log status summary
  start=$(date +%s)
  log=$(mktemp)
  "$PY" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  status=$?
  end=$(date +%s)
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$|(passed|failed|error).* in [0-9.]+s" "$log" \
            | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  if [ "$status" -eq 0 ]; then
    echo "PASS  $label: $summary ($((end - start)) s, load:$(cut -d' ' -f1-3 /proc/loadavg))"
  else
    failed=1
    echo "FAIL  $label: $summary ($((end - start)) s, load:$(cut -d' ' -f1-3 /proc/loadavg))"
    grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/      /'
  fi
  rm -f "$log"
}

echo "stress.sh: $(nproc) cores busy with stress-ng; $(date -u +%Y-%m-%dT%H:%MZ)"
for round in 1 2 3; do
  run "processes, servers, signals (round $round)" "${PROCESS_TESTS[@]}" "$@"
  run "signal and child-process files (round $round)" "${SIGNAL_FILES[@]}" "$@"
done
run "whole suite" "$@"
exit "$failed"
