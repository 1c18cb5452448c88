"""`diagnoser fleet` at 10,000 and 100,000 GPUs against Prometheus and VictoriaMetrics, each timed against a bare-query
baseline in the same run, with the confusion matrix of planted against found classes.

The engines are loaded with one hour of synthetic dcgm-exporter history, one sample a minute, for N GPUs (8 per node)
with planted classes in turn: idle, bandwidth, compute, vram, batching, throttled (HW power brake in the clock-event
bits, at 60 % of the clock; no DCGM_FI_DEV_MAX_SM_CLOCK, as dcgm-exporter's default counters), latency (busy, SMs and
DRAM both under half). Prometheus gets it through `promtool tsdb create-blocks-from openmetrics`, VictoriaMetrics
through its /api/v1/import; the rule group's recorded statistics are backfilled too (`promtool tsdb
create-blocks-from rules`, `vmalert -replay`), for the recorded path.

Each repeat, interleaved: the bare queries (the requests `fleet` makes for its statistics, bodies read and dropped:
what the engine costs), `fleet --no-recorded` (statistics computed ad hoc), the same with `--jobs 1` (the triage in
one process, no workers), and `fleet` on the recorded statistics
(one query), each a fresh process; its wall time, its CPU with its forked workers, the engine's CPU, peak RSS, and the
machine's load average. One `--json` run per engine gives the confusion matrix.

Run:  .venv/bin/python benchmarks/fleet_scale.py --sizes 10000,100000 --engines prometheus,victoria-metrics \\
          --repeat 3 --keep-data benchmarks/out/data
Writes benchmarks/out/fleet_scale.json; see benchmarks/FLEET.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.installed import compile_bytecode
from diagnoser.collectors.dcgm import FIELDS_BY_KEY
from diagnoser.collectors.http import fetch
from diagnoser.collectors.prom_stats import STATS, identity_expr, stat_expr
from tests import own_usage
from tests.prom_harness import PrometheusServer, VictoriaMetricsServer, free_port

OUT = REPO / "benchmarks" / "out"
STEP_S = 60
WINDOW_S = 3600
GPUS_PER_NODE = 8
MODEL = "NVIDIA H100 80GB HBM3"
BOARD_MIB = 81559
CLASSES = ("idle", "bandwidth", "compute", "vram", "batching", "throttled", "latency")
# Per class: GR_ENGINE_ACTIVE, SM_ACTIVE, PIPE_TENSOR_ACTIVE, DRAM_ACTIVE, memory used (share of the board), SM clock
# (MHz), clock event reasons.
LEVELS: dict[str, tuple[float, float, float, float, float, float, int]] = {
    "idle": (0.02, 0.01, 0.0, 0.01, 0.05, 1980, 0x1),
    "bandwidth": (0.95, 0.85, 0.22, 0.72, 0.85, 1980, 0),
    "compute": (0.97, 0.93, 0.78, 0.35, 0.70, 1900, 0),
    "vram": (0.80, 0.85, 0.35, 0.42, 0.995, 1980, 0),
    "batching": (0.30, 0.22, 0.08, 0.12, 0.60, 1980, 0),
    "throttled": (0.92, 0.80, 0.45, 0.40, 0.80, 1188, 0x84),
    "latency": (0.93, 0.34, 0.05, 0.28, 0.72, 1980, 0),
}
# What each class must be found as: the verdict, and the rule that leads the findings.
EXPECTED = {"idle": ("idle", "IDLE001"), "bandwidth": ("memory_bandwidth", "BW001"), "compute": ("compute", "CMP001"),
            "vram": ("vram", "VRAM003"), "batching": ("batching", "BAT003"), "throttled": ("throttling", "THR001"),
            "latency": ("latency", "LAT001")}
METRICS = ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
           "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_SM_CLOCK",
           "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
WAVE = [math.sin(2 * math.pi * i / 17) for i in range(17)]


def uuid_of(n: int) -> str:
    h = hashlib.sha1(f"bench/{n}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def planted(n: int) -> str:
    return CLASSES[n % len(CLASSES)]


def labels_of(n: int) -> dict[str, str]:
    return {"gpu": str(n % GPUS_PER_NODE), "UUID": uuid_of(n), "modelName": MODEL,
            "Hostname": f"node-{n // GPUS_PER_NODE:05d}", "namespace": f"team-{n % 13}",
            "pod": f"{planted(n)}-server-{n:06d}"}


def values_of(n: int, metric: int, count: int) -> list[str]:
    """One metric of GPU n at `count` steps: the class's level with a small wave, as dcgm-exporter prints them."""
    gr, sm, tensor, dram, mem, clock, reasons = LEVELS[planted(n)]
    seed = n % 17
    if metric == 7:  # a throttled GPU's clocks are held (0x84) two thirds of the time, released (0) otherwise
        if planted(n) != "throttled":
            return [str(reasons)] * count
        return [str(reasons if WAVE[(seed + i) % 17] > -0.5 else 0) for i in range(count)]
    if metric in (4, 5):
        used = [round(BOARD_MIB * min(0.999, mem + (0.002 * WAVE[(seed + i) % 17] if mem < 0.99 else 0.0)))
                for i in range(count)]
        return [str(u if metric == 4 else BOARD_MIB - u) for u in used]
    if metric == 6:
        return [str(round(clock - (20 * abs(WAVE[(seed + i) % 17]) if clock < 1980 else 0))) for i in range(count)]
    level = (gr, sm, tensor, dram)[metric]
    return [f"{min(1.0, max(0.0, level + 0.03 * WAVE[(seed + i) % 17])) if level > 0 else 0.0:.4f}"
            for i in range(count)]


def _label_text(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def write_openmetrics(n_gpus: int, path: Path, stamps: list[int]) -> int:
    """Every GPU's history, grouped by metric family as OpenMetrics requires; returns the sample count."""
    count = len(stamps)
    ts = [f" {t}\n" for t in stamps]
    heads = [_label_text(labels_of(n)) for n in range(n_gpus)]
    with open(path, "w", buffering=1 << 22) as fh:
        for m, name in enumerate(METRICS):
            fh.write(f"# TYPE {name} gauge\n")
            for n in range(n_gpus):
                head = name + heads[n] + " "
                fh.write("".join(head + v + t for v, t in zip(values_of(n, m, count), ts, strict=True)))
        fh.write("# EOF\n")
    return n_gpus * len(METRICS) * count


def import_lines(n_gpus: int, stamps: list[int]) -> Iterator[bytes]:
    """VictoriaMetrics' /api/v1/import format: one JSON line per series, all its samples."""
    millis = json.dumps([t * 1000 for t in stamps])
    count = len(stamps)
    batch: list[str] = []
    for m, name in enumerate(METRICS):
        for n in range(n_gpus):
            metric = json.dumps({"__name__": name, **labels_of(n)})
            batch.append(f'{{"metric":{metric},"values":[{",".join(values_of(n, m, count))}],"timestamps":{millis}}}\n')
            if len(batch) >= 2000:
                yield "".join(batch).encode()
                batch = []
    if batch:
        yield "".join(batch).encode()


# --- the engines ------------------------------------------------------------------------------------------------------


def rules_file(workdir: Path) -> Path:
    path = workdir / "diagnoser.rules.yml"
    r = subprocess.run([sys.executable, "-m", "diagnoser", "rules", "--prometheus-rules", "--window", "1h",
                        "--interval", "1m"], cwd=REPO, capture_output=True, text=True, check=True)
    path.write_text(r.stdout)
    return path


def load_prometheus(n: int, home: Path, stamps: list[int], made: dict) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool is not installed (Debian's prometheus package has it)")
    om = home / "history.om"
    t0 = time.monotonic()
    made["samples"] = write_openmetrics(n, om, stamps)
    made["generate_s"] = round(time.monotonic() - t0, 1)
    made["openmetrics_mib"] = round(om.stat().st_size / 2**20)
    t0 = time.monotonic()
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(home / "data")],
                   check=True, timeout=7200)
    made["promtool_s"] = round(time.monotonic() - t0, 1)
    om.unlink()
    # The recorded statistics at the window's end: the rule group evaluated once, by promtool, against the data.
    rules = rules_file(home)
    with PrometheusServer(home, [], data_dir=home / "data", extra_args=["--storage.tsdb.retention.time=3650d"]) as p:
        t0 = time.monotonic()
        end = stamps[-1] + 1
        subprocess.run([promtool, "tsdb", "create-blocks-from", "rules", f"--start={end - 60}", f"--end={end}",
                        "--eval-interval=60s", f"--url={p.url}", f"--output-dir={home / 'rules-data'}", str(rules)],
                       check=True, timeout=7200, capture_output=True)
        made["rules_backfill_s"] = round(time.monotonic() - t0, 1)
    for block in (home / "rules-data").iterdir():
        if block.is_dir():
            shutil.move(str(block), str(home / "data" / block.name))


VM_LIMITS = ["-search.maxUniqueTimeseries=10000000", "-search.maxQueryDuration=600s",
             "-search.maxSamplesPerQuery=10000000000"]


def load_victoria_metrics(n: int, home: Path, stamps: list[int], made: dict) -> None:
    vmalert = shutil.which("vmalert")
    with VictoriaMetricsServer(home, [], data_dir=home / "vm-data", extra_args=VM_LIMITS) as vm:
        t0 = time.monotonic()
        url = urllib.parse.urlsplit(vm.url)
        import http.client

        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
        conn.request("POST", "/api/v1/import", body=import_lines(n, stamps),
                     headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
        answer = conn.getresponse()
        answer.read()
        if answer.status // 100 != 2:
            raise SystemExit(f"VictoriaMetrics refused the import: HTTP {answer.status}")
        fetch(f"{vm.url}/internal/force_flush", timeout_s=600, max_bytes=1 << 20)
        made["samples"] = n * len(METRICS) * len(stamps)
        made["import_s"] = round(time.monotonic() - t0, 1)
        if vmalert is None:
            return
        rules = rules_file(home)
        end = stamps[-1] + 1
        t0 = time.monotonic()
        span = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
        replay = subprocess.run([vmalert, f"-rule={rules}", f"-datasource.url={vm.url}", f"-remoteWrite.url={vm.url}",
                        f"-replay.timeFrom={span(end - 60)}", f"-replay.timeTo={span(end)}",
                        "-replay.maxDatapointsPerQuery=1000", f"-httpListenAddr=127.0.0.1:{free_port()}",
                        "-remoteWrite.maxQueueSize=100000000",
                        "-loggerLevel=WARN"], timeout=7200, capture_output=True,
                       check=False)
        if replay.returncode != 0:
            raise SystemExit(f"vmalert -replay failed: {replay.stderr.decode()[-3000:]}")
        fetch(f"{vm.url}/internal/force_flush", timeout_s=600, max_bytes=1 << 20)
        made["rules_backfill_s"] = round(time.monotonic() - t0, 1)


def open_engine(kind: str, n: int, keep: Path | None, workdir: Path) -> tuple[PrometheusServer, dict, list[int]]:
    home = (keep.resolve() / f"{kind}-{n}") if keep else workdir / f"{kind}-{n}"
    made_file = home / "made.json"
    if made_file.exists():  # loaded by an earlier run with --keep-data
        made = json.loads(made_file.read_text())
    else:
        home.mkdir(parents=True, exist_ok=True)
        end = int(time.time()) // STEP_S * STEP_S - STEP_S
        made = {"stamps": [end - WINDOW_S + STEP_S * (i + 1) for i in range(WINDOW_S // STEP_S)]}
        (load_prometheus if kind == "prometheus" else load_victoria_metrics)(n, home, made["stamps"], made)
        made_file.write_text(json.dumps(made))
    if kind == "prometheus":
        engine: PrometheusServer = PrometheusServer(workdir, [], data_dir=home / "data",
                                                    extra_args=["--storage.tsdb.retention.time=3650d",
                                                                "--query.max-samples=500000000"])
    else:
        engine = VictoriaMetricsServer(workdir, [], data_dir=home / "vm-data", extra_args=VM_LIMITS)
    return engine.start(timeout=600), made, made["stamps"]


def engine_cpu_s(engine: PrometheusServer) -> float:
    import psutil

    assert engine.proc is not None
    t = psutil.Process(engine.proc.pid).cpu_times()
    return t.user + t.system


# --- the measurements -------------------------------------------------------------------------------------------------


# The development VM's single-core speed swings by a half within seconds (the same loop: 0.23-0.36 s) while its load
# average reads 0: its host is shared. A fixed loop timed before each run says how fast the machine was then.
PROBE_LOOPS = 2_000_000


def speed_probe() -> float:
    """Seconds for a fixed pure-Python loop in this process: the machine's speed just before a run."""
    t0 = time.perf_counter()
    x = 0
    for i in range(PROBE_LOOPS):
        x += i * i
    return time.perf_counter() - t0


def bare_queries(engine: PrometheusServer, start: int, end: int, recorded: bool) -> dict:
    """The requests fleet makes for its statistics, four at a time, bodies read and dropped: the engine's cost."""
    window = end - start
    names = {f.key: [f.name] for f in FIELDS_BY_KEY.values()}
    if recorded:
        from diagnoser.collectors.prom_stats import identity_record_name, record_name

        queries = [identity_record_name(window), *(record_name(s, window) for s in STATS)]  # as fleet reads them
    else:
        queries = [identity_expr(names["fb_used"], window)]
        for s in STATS:
            if s.field == "fb_total":
                queries.append(stat_expr(s, names["fb_used"], window, extra_names=names["fb_free"]))
            elif FIELDS_BY_KEY[s.field].name in METRICS:
                queries.append(stat_expr(s, names[s.field], window))

    def one(query: str) -> int:
        body = urllib.parse.urlencode({"query": query, "time": str(end), "timeout": "600s"}).encode()
        return len(fetch(f"{engine.url}/api/v1/query", timeout_s=600, max_bytes=1 << 31, method="POST", data=body,
                         headers={"Content-Type": "application/x-www-form-urlencoded"}))

    load, probe = os.getloadavg()[0], speed_probe()
    cpu0, t0 = engine_cpu_s(engine), time.perf_counter()
    fetch(f"{engine.url}/api/v1/label/__name__/values?start={start}&end={end}", timeout_s=600, max_bytes=1 << 26)
    with ThreadPoolExecutor(max_workers=4) as pool:
        sizes = list(pool.map(one, queries))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "engine_cpu_s": engine_cpu_s(engine) - cpu0, "queries": len(queries) + 1,
            "answer_mib": sum(sizes) / 2**20, "load": load, "probe_s": probe}


def fleet_run(engine: PrometheusServer, start: int, end: int, *, recorded: bool, json_out: Path | None,
              jobs: int | None = None) -> dict:
    """`diagnoser fleet` in a fresh process: wall time, its CPU with its workers, peak RSS, the engine's CPU."""
    args = [sys.executable, "-m", "diagnoser", "fleet", "--prometheus", engine.url, "--start", str(start), "--end",
            str(end), "--timeout", "600", *(["--json"] if json_out else []), *([] if recorded else ["--no-recorded"]),
            *(["--jobs", str(jobs)] if jobs else [])]
    load, probe = os.getloadavg()[0], speed_probe()
    cpu0 = engine_cpu_s(engine)
    with open(json_out or os.devnull, "wb") as out, tempfile.TemporaryDirectory() as folder:
        usage_file = Path(folder) / "usage.json"
        t0 = time.perf_counter()
        # Its own CPU and peak RSS: a direct child would report this script's peak (tests/own_usage.py).
        proc = own_usage.start(args, usage_file, cwd=REPO, stdout=out, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
        err = proc.stderr.read().decode() if proc.stderr else ""
        code = proc.wait()
        wall = time.perf_counter() - t0
        usage = own_usage.read(usage_file)
    if code != 0 or usage is None:
        raise SystemExit(f"fleet failed ({code}): {err[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.cpu_s, "peak_rss_mib": usage.peak_rss_mib,
            "engine_cpu_s": engine_cpu_s(engine) - cpu0, "load": load, "probe_s": probe,
            "warnings": [line for line in err.splitlines() if "warning" in line][:5]}


def confusion(doc: dict) -> dict[str, dict[str, int]]:
    """Planted class -> found class: the verdict and the rule that leads the findings ("latency LAT001")."""
    by_uuid = {uuid_of(n): planted(n) for n in range(len(doc["rows"]) + 8)}
    matrix: dict[str, Counter[str]] = {c: Counter() for c in CLASSES}
    for row in doc["rows"]:
        d = row["diagnosis"]
        lead = d["findings"][0]["code"] if d["findings"] else "-"
        matrix[by_uuid[row["uuid"]]][f"{d['verdict']} {lead}"] += 1
    return {c: dict(m.most_common()) for c, m in matrix.items()}


def recovered(matrix: dict[str, dict[str, int]]) -> dict[str, float]:
    out = {}
    for c, found in matrix.items():
        want = " ".join(EXPECTED[c])
        total = sum(found.values())
        out[c] = round(found.get(want, 0) / total, 4) if total else 0.0
    return out


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def bench(kind: str, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    engine, made, stamps = open_engine(kind, n, args.keep_data, workdir)
    start, end = stamps[0] - STEP_S + 1, stamps[-1] + 1
    try:
        runs: dict[str, list[dict]] = {"bare": [], "bare_recorded": [], "fleet": [], "fleet_j1": [],
                                       "fleet_recorded": []}
        fleet_run(engine, start, end, recorded=False, json_out=None)  # warm the engine's caches once
        for _ in range(args.repeat):
            runs["bare"].append(bare_queries(engine, start, end, recorded=False))
            runs["fleet"].append(fleet_run(engine, start, end, recorded=False, json_out=None))
            # the same in one process (--jobs 1): what the triage workers change, in the same run
            runs["fleet_j1"].append(fleet_run(engine, start, end, recorded=False, json_out=None, jobs=1))
            runs["bare_recorded"].append(bare_queries(engine, start, end, recorded=True))
            runs["fleet_recorded"].append(fleet_run(engine, start, end, recorded=True, json_out=None))
        doc_path = workdir / "fleet.json"
        json_run = fleet_run(engine, start, end, recorded=False, json_out=doc_path)
        doc = json.loads(doc_path.read_bytes())
        doc_path.unlink()
        matrix = confusion(doc)
        return {
            "engine": kind, "gpus": n, "made": {k: v for k, v in made.items() if k != "stamps"},
            "runs": runs, "json_run": json_run, "json_mib": None, "rows": len(doc["rows"]),
            "timings": doc.get("timings"), "errors": doc.get("errors"),
            "summary": {name: {k: median(rs, k) for k in rs[0] if isinstance(rs[0][k], (int, float))}
                        for name, rs in runs.items()},
            "confusion": matrix, "recovered": recovered(matrix),
        }
    finally:
        engine.stop()


def print_summary(r: dict) -> None:
    s = r["summary"]
    print(f"\n{r['engine']}, {r['gpus']:,} GPUs ({r['rows']:,} rows); load {s['fleet']['load']:.1f}; speed probe "
          f"{s['fleet']['probe_s']:.3f} s (median; {min(x['probe_s'] for x in r['runs']['fleet']):.3f}-"
          f"{max(x['probe_s'] for x in r['runs']['fleet']):.3f})")
    for name in ("bare", "fleet", "fleet_j1", "bare_recorded", "fleet_recorded"):
        row = s[name]
        extra = f" cpu {row['cpu_s']:.2f} s, rss {row['peak_rss_mib']:.0f} MiB" if "cpu_s" in row else ""
        print(f"  {name:15} wall {row['wall_s']:7.2f} s  engine cpu {row['engine_cpu_s']:6.2f} s{extra}")
    print(f"  recovered: {r['recovered']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000")
    ap.add_argument("--engines", default="prometheus,victoria-metrics")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep-data", type=Path, default=None, help="keep (and reuse) the loaded data under this "
                    "directory: 100,000 GPUs take a long while to load")
    args = ap.parse_args()
    compile_bytecode()  # each `fleet` is a fresh process: start it as an installed one starts
    results = []
    for n in (int(x) for x in args.sizes.split(",")):
        for kind in args.engines.split(","):
            with tempfile.TemporaryDirectory(prefix=f"fleet-{kind}-{n}-") as tmp:
                print(f"{kind}: {n:,} GPUs ...", file=sys.stderr, flush=True)
                result = bench(kind, n, args, Path(tmp))
                results.append(result)
                print_summary(result)
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / "fleet_scale.json").write_text(json.dumps(
                    {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "results": results},
                    indent=2))


if __name__ == "__main__":
    main()
