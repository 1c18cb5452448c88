#!/usr/bin/env bash
# Record Hugging Face generate() workloads under `diagnoser attach` on a GPU: the corpus entries nobody on the
# project wrote (../../../shared/gpu-recording.md). Expected verdicts, written before any recording: EXPECTED.md.
#
#   scripts/gpu/record_hf.sh OUT_DIR
#
# Runs, one process at a time, each attached for $DURATION s (NVML/GPM, psutil, py-spy if present, the workload's
# /metrics) and traced for $TRACE_S s after the window:
#   hf-eager-b1           generate(), eager, batch 1
#   hf-eager-b16          the same at batch 16 (the larger-batch fix applied)
#   hf-static-compile-b1  generate(cache_implementation="static"): transformers compiles the decode step with
#                         torch.compile (reduce-overhead: CUDA graphs) on a GPU; skipped when too little time is left
#                         or it is not warm within the time left
# then `diagnoser compare` of b1 -> b16 and eager -> static+compile. Everything lands in $WORK (default
# /tmp/hfrec); OUT_DIR gets three files: hf-record.tar.gz (captures, trace windows, logs, diagnoses, comparisons,
# nvidia-smi -q, calibration), summary.md and record.log.
#
# Settings (environment): HF_SIZE 2.4b | 1.1b | toy (default 2.4b on a GPU, toy without), HF_DEVICE auto|cuda|cpu,
# DURATION 8, TRACE_S 0.5 ("" for none), NEW_TOKENS 512, PROMPT 128, STATIC 1 (0 skips the third run),
# BUDGET_S 400 (the script's own deadline: the third run starts only with 170 s left, and waits for warm-up only
# until 70 s before it), CAL_BUDGET 15 (diagnoser calibrate first, GPU only; 0 skips), PY python3,
# COMPILE_ON_CPU 0 (1: the third run compiles on a CPU too, for testing this script), RUNS default | precision
# (precision: hf-static-compile-bN-fp32 then hf-static-compile-bN in bf16, compared: the precision fix; N is
# PRECISION_BATCH, default 1).
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
OUT_DIR=${1:-${OUT:-/tmp/hfrec-out}}
WORK=${WORK:-/tmp/hfrec}
PY=${PY:-python3}
DURATION=${DURATION:-8}
TRACE_S=${TRACE_S-0.5}
NEW_TOKENS=${NEW_TOKENS:-512}
PROMPT=${PROMPT:-128}
STATIC=${STATIC:-1}
BUDGET_S=${BUDGET_S:-400}
CAL_BUDGET=${CAL_BUDGET:-15}
COMPILE_ON_CPU=${COMPILE_ON_CPU:-0}
RUNS=${RUNS:-default}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PY PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$repo"
[ -d /tmp/site/bin ] && export PATH="/tmp/site/bin:$PATH"  # py-spy from the carried wheel
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT_DIR"
LOG=$WORK/record.log
T0=$SECONDS
log() { printf '[%4ds] %s\n' $((SECONDS - T0)) "$*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
HF_DEVICE=${HF_DEVICE:-auto}
if [ "$HF_DEVICE" = cpu ]; then gpu=0; fi
if [ $gpu = 1 ]; then HF_SIZE=${HF_SIZE:-2.4b}; else HF_SIZE=${HF_SIZE:-toy}; fi
log "record_hf: size $HF_SIZE, device $HF_DEVICE (gpu=$gpu), window ${DURATION}s, trace ${TRACE_S:-none}, work $WORK"

# --- facts of the machine ---------------------------------------------------------------------------------------
{
  date -u +%Y-%m-%dT%H:%M:%SZ; uname -srm; echo "nproc $(nproc)"
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Socket|CPU max MHz|CPU MHz)' || true
  "$PY" -c 'import sys,torch,transformers;print("python",sys.version.split()[0],"torch",torch.__version__,"cuda",torch.version.cuda,"transformers",transformers.__version__)'
  "$PY" -c 'import msgspec,typer,rich,psutil,prometheus_client as p,pynvml;print("msgspec",msgspec.__version__,"typer",typer.__version__,"psutil",psutil.__version__)' 2>&1
  command -v py-spy && py-spy --version
  if [ $gpu = 1 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,power.default_limit,clocks.max.sm,clocks.max.mem --format=csv
  fi
} > "$WORK/env.txt" 2>&1
[ $gpu = 1 ] && nvidia-smi -q > "$WORK/nvidia-smi-q.txt" 2>&1
"$PY" - "$WORK" <<'EOF' 2>>"$LOG" || true
import json, platform, subprocess, sys
import torch, transformers
env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
if torch.cuda.is_available():
    env["gpu"] = torch.cuda.get_device_name()
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
        env["driver, power limit, memory"] = q
    except Exception as exc:
        env["nvidia-smi"] = str(exc)
cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
env["cpu"] = f"{cpu[0] if cpu else '?'} x{len(cpu)}"
json.dump(env, open(f"{sys.argv[1]}/env.json", "w"), indent=1)
EOF
cat "$WORK/env.txt" | tee -a "$LOG" >&2

if [ $gpu = 1 ] && [ "$CAL_BUDGET" != 0 ]; then
  log "calibrate --budget $CAL_BUDGET"
  timeout $((CAL_BUDGET + 60)) "$PY" -m diagnoser calibrate --budget "$CAL_BUDGET" > "$WORK/calibrate.txt" 2>&1
  log "calibrate rc=$? $(grep -iE 'bandwidth|bf16|launch' "$WORK/calibrate.txt" | head -4 | tr -s ' ' | tr '\n' ';')"
fi

# --- one run: start the workload, wait until warm, attach, stop ----------------------------------------------------
run_one() {  # name batch static(0/1) ready_timeout_s [dtype]
  local name=$1 batch=$2 static=$3 ready_timeout=$4 dtype=${5:-auto}
  local d=$WORK/$name cfg=$WORK/$name/hf-random-llama-$HF_SIZE
  mkdir -p "$d"
  local flags=(--dtype "$dtype")
  [ "$static" = 1 ] && flags+=(--static)
  [ "$static" = 1 ] && [ "$COMPILE_ON_CPU" = 1 ] && flags+=(--compile-on-cpu)
  log "$name: start (batch $batch, static $static; ready within ${ready_timeout}s)"
  "$PY" "$here/hf_generate.py" --size "$HF_SIZE" --device "$HF_DEVICE" --batch "$batch" --prompt "$PROMPT" \
    --new-tokens "$NEW_TOKENS" ${flags[@]+"${flags[@]}"} --hook --seconds 300 --config-dir "$cfg" --ready-file "$d/ready.json" \
    --progress-file "$d/progress.jsonl" --stats-file "$d/stats.json" > "$d/workload.log" 2>&1 &
  local wpid=$! t=$SECONDS
  while [ ! -f "$d/ready.json" ]; do
    if ! kill -0 $wpid 2>/dev/null; then
      log "$name: the workload exited before it was ready:"; tail -n 15 "$d/workload.log" | tee -a "$LOG" >&2
      wait $wpid 2>/dev/null; return 1
    fi
    if [ $((SECONDS - t)) -ge "$ready_timeout" ]; then
      log "$name: not warm after ${ready_timeout}s: stopped, skipped"; tail -n 5 "$d/workload.log" | tee -a "$LOG" >&2
      stop_workload $wpid; echo "not warm after ${ready_timeout}s" > "$d/SKIPPED"; return 1
    fi
    sleep 0.5
  done
  log "$name: ready after $((SECONDS - t))s: $(grep -E 'params|warm-up' "$d/workload.log" | tr '\n' ' ')"
  local trace=()
  [ -n "${TRACE_S}" ] && [ "$name" != hf-eager-b16 ] && trace=(--trace "$TRACE_S")
  timeout $((DURATION + 120)) "$PY" -m diagnoser attach $wpid --duration "$DURATION" --model "$cfg/config.json" \
    --save "$d/$name.raw.dgc" --json ${trace[@]+"${trace[@]}"} > "$d/attach.json" 2> "$d/attach.err"
  local rc=$?
  log "$name: attach rc=$rc: $("$PY" -c 'import json,sys;d=json.load(open(sys.argv[1]));print(d["verdict"],"|",d["headline"])' "$d/attach.json" 2>&1 | tail -1)"
  stop_workload $wpid
  log "$name: workload: $(grep -E '^hf_generate: call' "$d/workload.log" | tail -2 | tr '\n' ' ')"
  return 0
}

stop_workload() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && { log "pid $pid did not stop: SIGKILL"; kill -KILL "$pid" 2>/dev/null; }
  wait "$pid" 2>/dev/null
}

if [ "$RUNS" = precision ]; then
  # The precision fix on the compiled decode: FP32 weights and matmuls, then the same in bf16.
  pb=${PRECISION_BATCH:-1}
  for spec in "hf-static-compile-b$pb-fp32 fp32" "hf-static-compile-b$pb bf16"; do
    set -- $spec
    if [ "$(left)" -ge 150 ]; then
      run_one "$1" "$pb" 1 $(($(left) - 60)) "$2"
    else
      log "$1: skipped, only $(left)s of the ${BUDGET_S}s budget left"
    fi
  done
else
  run_one hf-eager-b1 1 0 90
  run_one hf-eager-b16 16 0 90
  if [ "$STATIC" = 1 ]; then
    if [ "$(left)" -ge 170 ]; then
      run_one hf-static-compile-b1 1 1 $(($(left) - 70))
    else
      log "hf-static-compile-b1: skipped, only $(left)s of the ${BUDGET_S}s budget left"
    fi
  fi
fi

log "finish: mark, trim, diagnose, compare"
timeout 150 "$PY" "$here/hf_record_finish.py" "$WORK" > "$WORK/finish.txt" 2>&1
log "finish rc=$?"
cat "$WORK/finish.txt" >&2
cp "$WORK/summary.md" "$OUT_DIR/summary.md" 2>/dev/null
find "$WORK" -name 'trace-*.json*' -delete  # full traces stay behind: the trimmed windows travel
log "done in $((SECONDS - T0))s"
cp "$LOG" "$OUT_DIR/record.log"
tar -czf "$OUT_DIR/hf-record.tar.gz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
ls -la "$OUT_DIR" >&2
