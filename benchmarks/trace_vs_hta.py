"""Time `diagnoser analyze` against HolisticTraceAnalysis (HTA) on the same traces, in the same run.

For every trace this runs, each in a fresh process whose peak RSS is read with wait4():
  cli-jN          `diagnoser analyze TRACE --json -j N` (the command users run: trace analysis + diagnosis), for
                  every N in --jobs (0 = all cores)
  lib-jN          `python -m diagnoser.traces TRACE -j N` (the analysis alone, no CLI imports)
  decode-stream   typed msgspec decode of every event, chunk by chunk, one process (the floor for a streaming
                  analysis)
  decode-whole    typed msgspec decode of the whole file in one call, one process (the "bare typed decode"; it holds
                  every event, so it is skipped above --whole-max-mb)
  decode-jN       the same typed decode of every event in N processes over the parallel reader's ranges, counting
                  the events (the floor for an analysis on N cores)
  hta             HTA 0.5.x: TraceAnalysis(...) + temporal, kernel-type and idle-time breakdowns
                  (include_last_profiler_step=True, so both tools see the same steps); skipped above --hta-max-mb
and prints wall-time and peak-RSS ratios, plus the numbers both tools report (idle share, kernel-type shares,
host-wait share of idle) side by side.

Large traces are made by repeating a real trace in time (`--make-big COPIES`): every non-metadata event is copied
with its timestamps shifted by the trace's span and its correlation ids, External ids, flow ids and
ProfilerStep numbers offset, so the result is a valid, longer trace of the same workload.

HTA is installed in its own venv, never in the project's: python3 -m venv benchmarks/.venv-hta &&
benchmarks/.venv-hta/bin/pip install HolisticTraceAnalysis. Results go to benchmarks/out/traces/ (git-ignored)
and are summarised in benchmarks/TRACES.md. Not part of the test suite.

    python benchmarks/trace_vs_hta.py                       # the A100 traces in tests/fixtures/traces
    python benchmarks/trace_vs_hta.py --make-big 80         # plus a ~700 MB trace made from the DDP fixture
    python benchmarks/trace_vs_hta.py --traces a.json.gz --repeat 3
    python benchmarks/trace_vs_hta.py --shape kernel-heavy=a100_ddp_2rank_nccl_rank0.json.gz:52 \
        many-ranks=a100_ddp_2rank_nccl_rank0.json.gz:7:8 --baseline ../before   # shapes of TRACES.md, + old code

A shape (`--shape NAME=SOURCE:COPIES[:RANKS]`, the set in TRACES.md is SHAPES) is a real trace repeated COPIES
times, or RANKS files of it with distributedInfo.rank 0..RANKS-1 in one folder, which both tools are given whole.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import own_usage  # this checkout's helper, found through the path set just above

FIXTURES = ROOT / "tests" / "fixtures" / "traces"
# The three real A100 traces from HTA's test data (tests/fixtures/traces/SOURCES.md), the default set.
A100_TRACES = ("a100_alexnet_forward.json.gz", "a100_ddp_2rank_nccl_rank0.json.gz", "a100_torch_compile_triton.json.gz")
OUT = ROOT / "benchmarks" / "out" / "traces"
HTA_PYTHON = ROOT / "benchmarks" / ".venv-hta" / "bin" / "python"
BIG_SOURCE = "a100_ddp_2rank_nccl_rank0.json.gz"
# The trace shapes of benchmarks/TRACES.md, each ~450 MB of JSON: CPU-op heavy (AlexNet forward: four CPU events
# to a kernel), kernel heavy (DDP), many streams (recsys all-to-all, five streams), many ranks (eight rank files).
SHAPES = ("cpu-op-heavy=a100_alexnet_forward.json.gz:1600", f"kernel-heavy={BIG_SOURCE}:52",
          "many-streams=a100-recsys-alltoall-16rank-rank0-step552.json.gz:55", f"many-ranks={BIG_SOURCE}:7:8")

_HTA_SCRIPT = r"""
import json, logging, os, sys, tempfile, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
path = os.path.abspath(sys.argv[1])
d = path if os.path.isdir(path) else tempfile.mkdtemp()  # a folder of rank files is HTA's own input
if d != path:
    os.symlink(path, os.path.join(d, os.path.basename(path)))
from hta.trace_analysis import TraceAnalysis
t0 = time.perf_counter()
ta = TraceAnalysis(trace_dir=d, include_last_profiler_step=True)
load_s = time.perf_counter() - t0
tb = ta.get_temporal_breakdown(visualize=False)
types, per_kernel = ta.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
idle = ta.get_idle_time_breakdown(ranks=sorted(ta.t.traces), visualize=False)[0]  # every rank (default: rank 0)
summed = per_kernel.groupby("kernel_type")["sum (us)"].sum().to_dict()
idle_by = idle.groupby("idle_category")["idle_time"].sum().to_dict()
print(json.dumps({
    "load_s": load_s,
    "idle_pct": float(tb["idle_time_pctg"].iloc[0]),
    "kernel_time_us": float(tb["kernel_time(us)"].iloc[0]),
    "type_pct": {r["kernel_type"]: float(r["percentage"]) for _, r in types.iterrows()},
    "type_summed_us": {k: float(v) for k, v in summed.items()},
    "idle_by_category_us": {k: float(v) for k, v in idle_by.items()},
}))
"""

# `python -m diagnoser.traces` of the checkout named first.
_FROM_CHECKOUT = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                  "runpy.run_module('diagnoser.traces', run_name='__main__', alter_sys=True)")
# The bare decodes take a file or a folder of rank files (each file in turn, as one process would read them).
_FILES = ("import sys; from pathlib import Path\n"
          "p = Path(sys.argv[1]); files = sorted(p.glob('*.json')) if p.is_dir() else [p]\n")
_DECODE_WHOLE = _FILES + ("from diagnoser.traces.decode import decode_whole\n"
                          "print(sum(len(decode_whole(str(f))) for f in files))")
_DECODE_STREAM = _FILES + ("from diagnoser.traces.decode import iter_event_chunks\n"
                           "print(sum(len(c) for f in files for c in iter_event_chunks(str(f), max_bytes=1 << 40)[1]))")
# The bare typed decode on N processes: the parallel reader's ranges (plain files) or chunks (gzip), decoded into the
# same structs and counted; no columns, no analysis.
_DECODE_PAR = r"""
import gc, mmap, sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from diagnoser.traces import parallel as P
from diagnoser.traces.decode import DecodeStats, TraceFile, decode_chunk, _open_stream, raw_chunks, read_head

def count(chunks):
    gc.disable()
    stats = DecodeStats()
    return sum(len(decode_chunk(data, mode, stats)) for data, mode in chunks)

def count_range(path, a, b, mode):
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return count(P.range_chunks(mm, a, b, mode, P.CHUNK_BYTES, TraceFile(path=Path(path))))

def count_chunk(data, mode):
    return count([(data, mode)])

path, jobs = sys.argv[1], int(sys.argv[2]) or P.default_jobs()
with open(path, "rb") as f:
    gz = f.read(2) == b"\x1f\x8b"
with ProcessPoolExecutor(jobs) as pool:
    if gz:
        tf = TraceFile(path=Path(path))
        blocks = _open_stream(Path(path), tf.stats, 1 << 40)
        head, obj = read_head(blocks, Path(path), tf)
        futures = [pool.submit(count_chunk, d, m) for d, m in raw_chunks(head, obj, blocks, tf, P.CHUNK_BYTES)]
    else:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            size = len(mm)
            start, end, mode = P._events_span(mm, size, Path(path), TraceFile(path=Path(path)))
            ranges = P._split(mm, start, end, P.RANGE_BYTES)
        futures = [pool.submit(count_range, path, a, b, mode if b == end else 0) for a, b in ranges]
    print(sum(f.result() for f in futures))
"""


def run_measured(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command; wall time, its own peak RSS and CPU time (with the children it waited for), and stdout. This
    script holds a whole trace while it builds a big one, so a direct child would report that peak as its own
    (tests/own_usage.py)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as folder:
        usage_file = Path(folder) / "usage.json"
        t0 = time.perf_counter()
        proc = own_usage.start(cmd, usage_file, stdout=out, stderr=err, cwd=ROOT, env=env)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            own_usage.kill(proc)
        wall = time.perf_counter() - t0
        usage = own_usage.read(usage_file)
        out.seek(0)
        err.seek(0)
        return {"wall_s": wall, "rss_mb": usage.peak_rss_mib if usage else float("nan"),
                "user_s": usage.user_s if usage else float("nan"), "sys_s": usage.sys_s if usage else float("nan"),
                "rc": proc.returncode if usage else -9,
                "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")[-2000:]}


def make_big(source: Path, copies: int, out: Path, rank: int | None = None) -> Path:
    """Repeat a real trace `copies` times back to back (see the module docstring); `rank` rewrites
    distributedInfo.rank, so copies of one rank's trace make the files of a many-rank job."""
    if out.exists():
        return out
    data = json.loads(gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes())
    if rank is not None:
        data["distributedInfo"] = {**data.get("distributedInfo", {}), "rank": rank}
    events = data.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M" and e.get("cat") != "Trace"]
    timed = [e for e in body if isinstance(e.get("ts"), (int, float))]
    t0 = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - t0
    args = [e.get("args", {}) for e in body]
    steps = [int(m.group(1)) for e in body if (m := re.match(r"ProfilerStep#(\d+)", e.get("name", "")))]
    offsets = {"ts": span, "correlation": max((a.get("correlation", 0) for a in args), default=0) + 1,
               "External id": max((a.get("External id", 0) for a in args), default=0) + 1,
               "id": max((e["id"] for e in body if isinstance(e.get("id"), int)), default=0) + 1,
               "step": (max(steps) - min(steps) + 1) if steps else 0}
    tmp = out.with_suffix(".part")
    with open(tmp, "w") as f:
        f.write("{\n")
        f.writelines(f'  {json.dumps(k)}: {json.dumps(v)},\n' for k, v in data.items())
        f.write('  "traceEvents": [\n')
        f.write(",\n".join("  " + json.dumps(e) for e in meta))
        for c in range(copies):
            f.writelines(",\n  " + json.dumps(_shifted(e, c, offsets)) for e in body)
        trace_span = {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                      "tid": "PyTorch Profiler", "ts": t0, "dur": span * copies, "args": {"Op count": 0}}
        f.write(",\n  " + json.dumps(trace_span) + "\n  ]\n}\n")
    tmp.replace(out)
    return out


def _shifted(e: dict[str, Any], c: int, offsets: dict[str, Any]) -> dict[str, Any]:
    """Event `e` of copy `c`: its time, correlation, External id, flow id and ProfilerStep number moved on."""
    e = dict(e)
    if "ts" in e:
        e["ts"] = e["ts"] + c * offsets["ts"]
    if "args" in e:
        a = dict(e["args"])
        for key in ("correlation", "External id"):
            if isinstance(a.get(key), int):
                a[key] += c * offsets[key]
        e["args"] = a
    if isinstance(e.get("id"), int):
        e["id"] += c * offsets["id"]
    m = re.match(r"ProfilerStep#(\d+)", e.get("name", ""))
    if m:
        e["name"] = f"ProfilerStep#{int(m.group(1)) + c * offsets['step']}"
    return e


def make_shape(spec: str, dest: Path) -> Path:
    """`NAME=SOURCE:COPIES[:RANKS]`: SOURCE (a path, or a file of tests/fixtures/traces) repeated COPIES times, as one
    file, or as a folder of RANKS rank files (rank-0.json ...), the input both tools take for a many-rank job."""
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    counts = parts[1:]
    if not name or len(parts) not in (2, 3) or not all(c.isdigit() and int(c) > 0 for c in counts):
        raise SystemExit(f"--shape {spec!r}: expected NAME=SOURCE:COPIES[:RANKS], counts above 0")
    source = Path(parts[0]) if Path(parts[0]).is_file() else FIXTURES / parts[0]
    if not source.is_file():
        raise SystemExit(f"--shape {spec!r}: no trace at {parts[0]} (a path, or a file of {FIXTURES})")
    copies, ranks = int(counts[0]), int(counts[1]) if len(counts) == 2 else 1
    if ranks == 1:
        return make_big(source, copies, dest / f"{name}_x{copies}.json")
    folder = dest / f"{name}_x{copies}_r{ranks}"
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        make_big(source, copies, folder / f"rank-{r}.json", rank=r)
    return folder


def _warm(path: Path) -> None:
    """Read the trace (every file of a folder) once, so it is in the page cache when a tool starts."""
    for f in sorted(path.iterdir()) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.json")) if path.is_dir() else path.stat().st_size


def ours_numbers(analysis: dict[str, Any]) -> dict[str, Any]:
    """Our numbers in HTA's terms: idle %, summed time by HTA kernel type, host-wait share of idle."""
    s = analysis["summary"]
    # one file's kernel time by class, or a job's pooled shares (a folder of ranks has no single kernels table)
    k = (analysis.get("kernels") or {}).get("time_us_by_class") or s.get("kernel_share") or {}
    total = sum(k.values()) or 1.0
    comm = k.get("comm", 0.0)
    mem = k.get("memcpy", 0.0) + k.get("memset", 0.0)
    idle = s.get("idle_frac_by_cause") or {}
    idle_total = sum(idle.values()) or 1.0
    return {
        "window_us": analysis["window_us"][1] - analysis["window_us"][0],
        "idle_pct": 100 * (1 - s["gpu_busy_frac"]) if s.get("gpu_busy_frac") is not None else None,
        "type_pct": {"COMPUTATION": 100 * (total - comm - mem) / total, "COMMUNICATION": 100 * comm / total,
                     "MEMORY": 100 * mem / total},
        "host_wait_pct_of_idle": 100 * idle.get("host", 0.0) / idle_total,
        "kernel_wait_pct_of_idle": 100 * idle.get("kernel_overhead", 0.0) / idle_total,
    }


def hta_numbers(h: dict[str, Any]) -> dict[str, Any]:
    summed = h["type_summed_us"]
    total = sum(summed.values()) or 1.0
    idle = h["idle_by_category_us"]
    idle_total = sum(idle.values()) or 1.0
    return {
        "window_us": h["kernel_time_us"],
        "idle_pct": h["idle_pct"],
        "type_pct": {t: 100 * summed.get(t, 0.0) / total for t in ("COMPUTATION", "COMMUNICATION", "MEMORY")},
        "host_wait_pct_of_idle": 100 * idle.get("host_wait", 0.0) / idle_total,
        "kernel_wait_pct_of_idle": 100 * idle.get("kernel_wait", 0.0) / idle_total,
    }


DEFAULT_JOBS = -1  # --jobs -1: no -j option, the tool's own default (the cores the load average leaves idle)


def _jobs_name(n: int) -> str:
    return "def" if n == DEFAULT_JOBS else str(n or "all")


def _jobs_args(n: int) -> list[str]:
    return [] if n == DEFAULT_JOBS else ["-j", str(n or os.cpu_count())]


def bench_trace(path: Path, repeat: int, jobs: list[int], skip_hta: bool, timeout: float, whole_max_mb: float,
                hta_max_mb: float, only: list[str], baseline: Path | None = None,
                hta_repeat: int | None = None) -> dict[str, Any]:
    diagnoser = str(Path(sys.executable).with_name("diagnoser"))
    mb = _size(path) / 1e6
    tools: dict[str, list[str]] = {}
    for n in jobs:
        j = _jobs_name(n)
        tools[f"cli-j{j}"] = [diagnoser, "analyze", str(path), "--json", *_jobs_args(n)]
        tools[f"lib-j{j}"] = [sys.executable, "-m", "diagnoser.traces", str(path), *_jobs_args(n)]
        if baseline is not None:  # the same analysis from another checkout (the code before a change)
            tools[f"base-lib-j{j}"] = [sys.executable, "-c", _FROM_CHECKOUT, str(baseline), str(path),
                                       *_jobs_args(n)]
    tools["decode-stream"] = [sys.executable, "-c", _DECODE_STREAM, str(path)]
    if mb <= whole_max_mb:
        tools["decode-whole"] = [sys.executable, "-c", _DECODE_WHOLE, str(path)]
    for n in jobs:
        if n not in (1, DEFAULT_JOBS) and path.is_file():
            tools[f"decode-j{_jobs_name(n)}"] = [sys.executable, "-c", _DECODE_PAR, str(path), str(n)]
    if not skip_hta and mb <= hta_max_mb:
        tools["hta"] = [str(HTA_PYTHON), "-c", _HTA_SCRIPT, str(path)]
    tools = {name: cmd for name, cmd in tools.items() if not only or name in only}
    # this checkout first on the path, so a shared virtual environment runs this code
    env = {**os.environ, "DIAGNOSER_TRACE_MAX_BYTES": "64G", "PYTHONPATH": str(ROOT)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in tools}
    for rep in range(repeat):
        for name, cmd in tools.items():  # interleaved, so a burst of load hits every tool alike
            if name == "hta" and hta_repeat is not None and rep >= hta_repeat:
                continue
            _warm(path)  # every tool reads the trace from the page cache (HTA's gigabytes push it out)
            load = os.getloadavg()[0]
            r = run_measured(cmd, timeout, env)
            r["load"] = (load + os.getloadavg()[0]) / 2
            if r["rc"] != 0:
                print(f"  {name} failed (rc {r['rc']}): {r['stderr'][-300:]}", file=sys.stderr)
            runs[name].append(r)
            print(f"  {name}: {r['wall_s']:.2f} s, {r['rss_mb']:.0f} MB, load {r['load']:.1f}", file=sys.stderr,
                  flush=True)
    result: dict[str, Any] = {"trace": str(path), "bytes": _size(path), "tools": {}}
    for name, rs in runs.items():
        ok = [r for r in rs if r["rc"] == 0]
        if not ok:
            result["tools"][name] = {"failed": rs[-1]["stderr"][-500:]}
            continue
        result["tools"][name] = {"wall_s": statistics.median(r["wall_s"] for r in ok),
                                 "rss_mb": statistics.median(r["rss_mb"] for r in ok),
                                 "cpu_s": statistics.median(r["user_s"] + r["sys_s"] for r in ok),
                                 "load": statistics.median(r["load"] for r in ok), "runs": len(ok),
                                 # each run's figures in turn, for ratios taken run by run against a peer
                                 "each_cpu_s": [r["user_s"] + r["sys_s"] for r in rs if r["rc"] == 0],
                                 "each_wall_s": [r["wall_s"] for r in rs if r["rc"] == 0]}
    lib = [r for name, rs in runs.items() if name.startswith("lib-") for r in rs if r["rc"] == 0]
    if lib:
        result["ours"] = ours_numbers(json.loads(lib[-1]["stdout"]))
    hta = [r for r in runs.get("hta", []) if r["rc"] == 0]
    if hta:
        result["hta"] = hta_numbers(json.loads(hta[-1]["stdout"].strip().splitlines()[-1]))
    return result


def _ratios(t: dict[str, Any], cli: str) -> str:
    """One line of ratios for `cli` (cli-jN): HTA over it (wall and CPU), and lib-jN against the code before, the
    bare decodes and HTA's memory."""
    n = cli.removeprefix("cli-")

    def of(name: str, key: str = "wall_s") -> float | None:
        return t.get(name, {}).get(key)

    pairs = [("HTA/ours", "hta", cli), ("HTA/ours CPU", "hta", cli), ("HTA/lib", "hta", f"lib-{n}"),
             ("base-lib/lib", f"base-lib-{n}", f"lib-{n}"), ("lib/decode-whole", f"lib-{n}", "decode-whole"),
             ("lib/decode-stream", f"lib-{n}", "decode-stream"), (f"lib/decode-{n}", f"lib-{n}", f"decode-{n}")]
    parts = [f"{cli}:"]
    for label, top, bottom in pairs:
        key = "cpu_s" if label.endswith("CPU") else "wall_s"
        x, y = of(top, key), of(bottom, key)
        if x and y:
            parts.append(f"{label} {x / y:.2f}x")
    rss, hrss = of(cli, "rss_mb"), of("hta", "rss_mb")
    if rss and hrss:
        parts.append(f"RSS ours/HTA {rss / hrss:.2f}")
    return " ".join(parts)


def report(results: list[dict[str, Any]]) -> str:
    lines = [("Wall seconds, CPU seconds of the whole process tree (user+sys, children included), peak RSS of the "
              "largest process, load average while it ran."), ""]
    for r in results:
        t = r["tools"]
        lines.append(f"### {Path(r['trace']).name} ({r['bytes'] / 1e6:.0f} MB)")
        lines.append("")
        lines.append("| tool | wall s | CPU s | peak RSS MB | load |")
        lines.append("|---|---:|---:|---:|---:|")
        for name, v in t.items():
            if "failed" in v:
                lines.append(f"| {name} | failed | | | |")
                continue
            lines.append(f"| {name} | {v['wall_s']:.2f} | {v['cpu_s']:.2f} | {v['rss_mb']:.0f} | {v['load']:.1f} |")
        ratios = [_ratios(t, name) for name in t if name.startswith("cli-")]
        lines += [""] + [f"- {x}" for x in ratios] + [""]
    lines += [("| trace | tool | window ms | idle % | COMPUTATION % | COMMUNICATION % | MEMORY % "
               "| host-wait % of idle | kernel-wait % of idle |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for tool in ("ours", "hta"):
            n = r.get(tool)
            if not n:
                continue
            tp = n["type_pct"]
            idle = "-" if n["idle_pct"] is None else f"{n['idle_pct']:.2f}"
            lines.append(f"| {Path(r['trace']).name} | {tool} | {n['window_us'] / 1e3:.1f} | {idle} | "
                         f"{tp['COMPUTATION']:.2f} | {tp['COMMUNICATION']:.2f} | {tp['MEMORY']:.2f} | "
                         f"{n['host_wait_pct_of_idle']:.1f} | {n['kernel_wait_pct_of_idle']:.1f} |")
    return "\n".join(lines)


def _compile_bytecode(*checkouts: Path | None) -> None:
    """Every module's bytecode written before anything is timed, as `pip install` does for an installed package: a
    checkout run with PYTHONDONTWRITEBYTECODE set (or a read-only one) would compile each module changed since its
    last .pyc from source at every start, about 0.1 s of every run after a change to the trace modules."""
    for checkout in checkouts:
        if checkout is not None and (checkout / "diagnoser").is_dir():
            compileall.compile_dir(checkout / "diagnoser", quiet=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="*", type=Path, help="traces to run (default: the kineto fixtures)")
    ap.add_argument("--make-big", type=int, nargs="*", default=[], metavar="COPIES",
                    help=f"also make and run traces of {BIG_SOURCE} repeated COPIES times")
    ap.add_argument("--shape", nargs="*", default=[], metavar="NAME=SOURCE:COPIES[:RANKS]",
                    help=("also make and run SOURCE (a path or a fixture's name) repeated COPIES times, as one file "
                          "or as a folder of RANKS rank files; e.g. " + " ".join(SHAPES)))
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool per trace (median reported)")
    ap.add_argument("--big-repeat", type=int, default=1, help="runs per tool on traces over 100 MB")
    ap.add_argument("--hta-repeat", type=int, default=None, metavar="N",
                    help="HTA only in the first N rounds (its minute-long runs; the other tools in every round)")
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--baseline", type=Path, default=None, metavar="CHECKOUT",
                    help="also time the analysis of another checkout of this repository (base-lib-jN), e.g. a "
                         "worktree of the commit before a change")
    ap.add_argument("--only", nargs="*", default=[], metavar="TOOL", help="run only these tools (e.g. lib-j1 hta)")
    ap.add_argument("--jobs", type=int, nargs="*", default=[1, 2, 0],
                    help="processes for ours (0: all cores, -1: the default, no -j)")
    ap.add_argument("--whole-max-mb", type=float, default=1000.0, help="skip decode-whole above this size")
    ap.add_argument("--hta-max-mb", type=float, default=1000.0, help="skip HTA above this size (it needs ~5x in RAM)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = ap.parse_args(argv)
    if not args.skip_hta and not HTA_PYTHON.exists():
        print(f"HTA venv missing: python3 -m venv {HTA_PYTHON.parents[1]} && {HTA_PYTHON.parent}/pip install "
              "HolisticTraceAnalysis (or pass --skip-hta)", file=sys.stderr)
        return 2
    traces = list(args.traces or [FIXTURES / name for name in A100_TRACES if (FIXTURES / name).is_file()])
    OUT.mkdir(parents=True, exist_ok=True)
    for copies in args.make_big:
        traces.append(make_big(FIXTURES / BIG_SOURCE, copies, OUT / f"{BIG_SOURCE.split('.')[0]}_x{copies}.json"))
    traces += [make_shape(spec, OUT) for spec in args.shape]
    if not traces:
        print("no traces: pass --traces (tests/fixtures/traces has none of the A100 traces)", file=sys.stderr)
        return 2
    _compile_bytecode(ROOT, args.baseline)
    results = []
    for path in traces:
        repeat = args.big_repeat if _size(path) > 100e6 else args.repeat
        print(f"{path.name} ({_size(path) / 1e6:.1f} MB) x{repeat} ...", file=sys.stderr, flush=True)
        jobs = sorted(set(args.jobs), key=lambda n: n or 1 << 30)
        if (os.cpu_count() or 1) <= 2:
            jobs = [n for n in jobs if n != 0] or [1]  # "all" is 2 here: the same run as -j 2
        results.append(bench_trace(path, repeat, jobs, args.skip_hta, args.timeout, args.whole_max_mb,
                                   args.hta_max_mb, args.only, args.baseline, args.hta_repeat))
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_at_end": os.getloadavg()}
    (OUT / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    print(f"machine: {machine}\n")
    print(report(results))
    shutil.rmtree(OUT / "tmp", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
