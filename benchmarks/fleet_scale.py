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

`--rule-cost` measures the rule groups instead, as the engines report them: fresh data reaching past now, the engine
evaluating `diagnoser rules --prometheus-rules` (or each `--rule-files` file in turn, e.g. the groups before a change
and after it) every `--rule-interval` seconds, each group's and each rule's evaluation time read from the ruler's
/api/v1/rules after `--rule-warmup` evaluations, with the engine's CPU and the load; `--fleet-html` then runs `fleet`
and `fleet --html` over the same data (peak RSS, the report's size). Writes benchmarks/out/rule_cost.json.
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.installed import compile_bytecode
from diagnoser.collectors.dcgm import FIELDS_BY_KEY
from diagnoser.collectors.http import fetch
from diagnoser.collectors.prom_stats import STATS, identity_expr, stat_expr
from tests import own_usage
from tests.prom_harness import PrometheusServer, ScrapeTarget, VictoriaMetricsServer, free_port

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


def write_openmetrics(n_gpus: int, path: Path, stamps: list[int], extra: dict[str, str] | None = None) -> int:
    """Every GPU's history, grouped by metric family as OpenMetrics requires; returns the sample count."""
    count = len(stamps)
    ts = [f" {t}\n" for t in stamps]
    heads = [_label_text({**labels_of(n), **(extra or {})}) for n in range(n_gpus)]
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


def rules_file(workdir: Path, interval: str = "1m", extra: tuple[str, ...] = ()) -> Path:
    path = workdir / "diagnoser.rules.yml"
    r = subprocess.run([sys.executable, "-m", "diagnoser", "rules", "--prometheus-rules", "--window", "1h",
                        "--interval", interval, *extra], cwd=REPO, capture_output=True, text=True, check=True)
    path.write_text(r.stdout)
    return path


def load_prometheus(n: int, home: Path, stamps: list[int], made: dict, *, backfill_rules: bool = True) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool is not installed (Debian's prometheus package has it)")
    om = home / "history.om"
    t0 = time.monotonic()
    # Without the backfill (the rule cost), the history carries the scrape's labels, so the scraped samples that
    # follow it (live_exporter) continue the same series.
    made["samples"] = write_openmetrics(n, om, stamps, None if backfill_rules else LIVE_LABELS)
    made["generate_s"] = round(time.monotonic() - t0, 1)
    made["openmetrics_mib"] = round(om.stat().st_size / 2**20)
    t0 = time.monotonic()
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(home / "data")],
                   check=True, timeout=7200)
    made["promtool_s"] = round(time.monotonic() - t0, 1)
    om.unlink()
    if not backfill_rules:
        return
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


def load_victoria_metrics(n: int, home: Path, stamps: list[int], made: dict, *, backfill_rules: bool = True) -> None:
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
        if vmalert is None or not backfill_rules:
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
              jobs: int | None = None, html: Path | None = None) -> dict:
    """`diagnoser fleet` in a fresh process: wall time, its CPU with its workers, peak RSS, the engine's CPU."""
    args = [sys.executable, "-m", "diagnoser", "fleet", "--prometheus", engine.url, "--start", str(start), "--end",
            str(end), "--timeout", "600", *(["--json"] if json_out else []), *([] if recorded else ["--no-recorded"]),
            *(["--jobs", str(jobs)] if jobs else []), *(["--html", str(html)] if html else [])]
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


# --- the rule group's cost, as the engines report it ------------------------------------------------------------------

# VictoriaMetrics' rule-cost data runs this far past the moment it is loaded, so that every evaluation vmalert makes
# at its own clock in the next half hour sees a full window (60 samples) and the latest memory sample. Prometheus
# refuses to record anything older than its newest block ("out of bounds"), so its history ends at the load and a
# small exporter carries every GPU on, scraped once a minute (live_exporter).
RULE_LEAD_S = {"prometheus": 0, "victoria-metrics": 30 * 60}
LIVE_LABELS = {"job": "dcgm", "instance": "bench"}


def live_exporter(n: int) -> tuple[Any, str]:
    """An HTTP server with one page: every GPU's latest values (the class's levels), labelled as the history."""
    import http.server
    import threading

    page = "".join(f"{name}{_label_text({**labels_of(g), **LIVE_LABELS})} {values_of(g, m, 1)[0]}\n"
                   for m, name in enumerate(METRICS) for g in range(n)).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def rule_cost_stamps(kind: str) -> list[int]:
    now = int(time.time()) // STEP_S * STEP_S
    return list(range(now - WINDOW_S + STEP_S, now + RULE_LEAD_S[kind] + 1, STEP_S))


def _seconds(stamp: str) -> float:
    """An RFC 3339 time as the rules APIs write it (nanoseconds, trailing zeros cut) -> unix seconds."""
    import datetime as dt
    import re

    frac = re.search(r"\.(\d+)", stamp)
    whole = dt.datetime.fromisoformat(re.sub(r"\.\d+", "", stamp).replace("Z", "+00:00")).timestamp()
    return whole + (float("0." + frac.group(1)) if frac else 0.0)


def rule_groups(api: str) -> list[dict]:
    """The ruler's /api/v1/rules (Prometheus's, or vmalert's Prometheus-compatible one)."""
    return json.loads(fetch(f"{api}/api/v1/rules", timeout_s=60, max_bytes=1 << 27))["data"]["groups"]


def completed(group: dict) -> float | None:
    """When the group's last evaluation began, once each of its rules has been evaluated in it (vmalert sets the
    group's time as it starts, Prometheus as it ends), else None."""
    start = _seconds(group.get("lastEvaluation") or "0001-01-01T00:00:00Z")
    if start <= 0 or not all(_seconds(r["lastEvaluation"]) >= start for r in group["rules"]):
        return None
    return start


def snapshot(group: dict, at: float, cpu_s: float) -> dict:
    """One evaluation as the engine reports it: the group's duration (Prometheus's evaluationTime, which it exports as
    prometheus_rule_group_last_duration_seconds; vmalert 1.79 times each rule from the start of the group's
    evaluation, its rules waiting their turn, so its slowest rule's is the group's), each rule's, and the errors."""
    # Several recording rules share a name (one per finding): each is told apart by its `rule` label.
    rules = {r["name"] + (f'{{rule="{r["labels"]["rule"]}"}}' if "rule" in (r.get("labels") or {}) else ""):
             r["evaluationTime"] for r in group["rules"]}
    return {"group": group["name"], "at": at, "group_s": group.get("evaluationTime", max(rules.values(), default=0.0)),
            "rules": rules, "errors": sorted({r["lastError"][:300] for r in group["rules"] if r.get("lastError")}),
            "series": sum(r.get("lastSamples", 0) for r in group["rules"]), "engine_cpu_s": cpu_s,
            "load": os.getloadavg()[0]}


def watch_evaluations(api: str, cpu: Callable[[], float], *, warmup: int, evaluations: int,
                      timeout_s: float) -> list[dict]:
    """Each group's evaluations as they complete, after `warmup` of them (the first reads cold blocks; vmalert's
    rules read what the previous evaluation wrote)."""
    seen: dict[str, list[float]] = {}
    snaps: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        groups = rule_groups(api)
        for g in groups:
            at = completed(g)
            if at is None or at in seen.setdefault(g["name"], []):
                continue
            seen[g["name"]].append(at)
            if len(seen[g["name"]]) > warmup:
                snaps.append(snapshot(g, at, cpu()))
        if groups and all(len(seen.get(g["name"], [])) >= warmup + evaluations for g in groups):
            return snaps
        time.sleep(0.5)
    raise SystemExit(f"the rule groups did not complete {warmup + evaluations} evaluations in {timeout_s:.0f} s: "
                     f"{ {k: len(v) for k, v in seen.items()} }")


def process_cpu_s(*procs: subprocess.Popen) -> float:
    import psutil

    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)


def rule_engine(kind: str, n: int, home: Path, rules: Path, workdir: Path, interval_s: int) -> tuple[list, str, list]:
    """The engine evaluating `rules` over the loaded data: the servers to stop, the rules API, the processes whose
    CPU is the engine's."""
    if kind == "prometheus":
        exporter, address = live_exporter(n)
        prom = PrometheusServer(workdir, [ScrapeTarget(address, "/metrics", LIVE_LABELS["instance"])],
                                data_dir=home / "data", rule_files=[rules], scrape_interval_s=STEP_S,
                                extra_args=["--storage.tsdb.retention.time=3650d",
                                            "--query.max-samples=500000000"]).start(timeout=600)
        assert prom.proc is not None
        return [exporter, prom], prom.url, [prom.proc]
    vm = VictoriaMetricsServer(workdir, [], data_dir=home / "vm-data", extra_args=VM_LIMITS).start(timeout=600)
    port = free_port()
    with open(workdir / "vmalert.log", "ab") as log:
        ruler = subprocess.Popen([str(shutil.which("vmalert")), f"-rule={rules}", f"-datasource.url={vm.url}",
                                  f"-remoteWrite.url={vm.url}", f"-notifier.url=http://127.0.0.1:{free_port()}",
                                  f"-evaluationInterval={interval_s}s", f"-httpListenAddr=127.0.0.1:{port}",
                                  "-remoteWrite.maxQueueSize=10000000", "-loggerLevel=WARN"],
                                 stdout=log, stderr=subprocess.STDOUT)
    assert vm.proc is not None
    return [vm, ruler], f"http://127.0.0.1:{port}", [vm.proc, ruler]


def stop_all(servers: list) -> None:
    for s in reversed(servers):
        if isinstance(s, subprocess.Popen):
            s.terminate()
            s.wait(30)
        elif hasattr(s, "shutdown"):  # the live exporter
            s.shutdown()
            s.server_close()
        else:
            s.stop()


def summarise_rule_cost(snaps: list[dict], interval_s: int) -> dict:
    """Per group: the median evaluation, each rule's median, the engine's CPU per interval over the span watched."""
    out: dict = {}
    for name in dict.fromkeys(s["group"] for s in snaps):
        own = [s for s in snaps if s["group"] == name]
        rules = {r: round(statistics.median(s["rules"][r] for s in own), 3) for r in own[-1]["rules"]}
        out[name] = {"evaluation_s": round(statistics.median(s["group_s"] for s in own), 3),
                     "evaluations": [round(s["group_s"], 3) for s in own], "share_of_interval":
                     round(statistics.median(s["group_s"] for s in own) / interval_s, 3),
                     "rules": dict(sorted(rules.items(), key=lambda kv: -kv[1])), "errors": own[-1]["errors"],
                     "load": [round(s["load"], 2) for s in own]}
    if len(snaps) > 1:
        span = snaps[-1]["at"] - snaps[0]["at"]
        if span > 0:
            out["engine_cpu_s_per_interval"] = round((snaps[-1]["engine_cpu_s"] - snaps[0]["engine_cpu_s"])
                                                     / span * interval_s, 2)
    return out


def rule_cost(kind: str, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """The rule group evaluated by the engine itself (Prometheus's rule manager, vmalert over VictoriaMetrics) over
    N GPUs' data reaching past now, for each rule file given (default: `diagnoser rules --prometheus-rules` as it
    is now), one after another on the same data."""
    home = workdir / f"rulecost-{kind}-{n}"
    home.mkdir(parents=True)
    made: dict = {}
    loader = load_prometheus if kind == "prometheus" else load_victoria_metrics
    loader(n, home, rule_cost_stamps(kind), made, backfill_rules=False)
    interval_s = args.rule_interval
    files = [Path(f).resolve() for f in args.rule_files.split(",")] if args.rule_files else [None]
    results = []
    for given in files:
        rules = given or rules_file(home, f"{interval_s}s", tuple(args.rule_args.split()))
        servers, api, procs = rule_engine(kind, n, home, rules, workdir, interval_s)
        try:
            snaps = watch_evaluations(api, partial(process_cpu_s, *procs), warmup=args.rule_warmup,
                                      evaluations=args.rule_evals, timeout_s=args.rule_timeout)
        finally:
            stop_all(servers)
        results.append({"rules": str(given or "diagnoser rules --prometheus-rules " + args.rule_args),
                        "interval_s": interval_s, "summary": summarise_rule_cost(snaps, interval_s),
                        "snapshots": snaps})
    fleet = fleet_memory(kind, n, home, workdir) if args.fleet_html else None
    return {"engine": kind, "gpus": n, "made": made, "results": results, "fleet": fleet}


def fleet_memory(kind: str, n: int, home: Path, workdir: Path) -> dict:
    """`fleet` over the last hour of the same data (statistics computed: the rulers are stopped), without and with
    --html: peak RSS, wall time and the HTML report's size."""
    if kind == "prometheus":  # with the live exporter, no rules
        rules = workdir / "none.rules.yml"
        rules.write_text("groups: []\n")
        servers: list = rule_engine(kind, n, home, rules, workdir, STEP_S)[0]
    else:
        servers = [VictoriaMetricsServer(workdir, [], data_dir=home / "vm-data", extra_args=VM_LIMITS).start(600)]
    try:
        engine = next(s for s in servers if isinstance(s, PrometheusServer))
        end = int(time.time())
        html = workdir / "fleet.html"
        plain = fleet_run(engine, end - WINDOW_S, end, recorded=False, json_out=None)
        with_html = fleet_run(engine, end - WINDOW_S, end, recorded=False, json_out=None, html=html)
        return {"plain": plain, "html": with_html, "html_mib": round(html.stat().st_size / 2**20, 2)}
    finally:
        stop_all(servers)


def print_rule_cost(r: dict) -> None:
    print(f"\n{r['engine']}, {r['gpus']:,} GPUs: the rule group's evaluations as the engine reports them")
    for res in r["results"]:
        print(f"  {res['rules']} (interval {res['interval_s']} s; engine CPU per interval "
              f"{res['summary'].get('engine_cpu_s_per_interval', 'n/a')} s)")
        for name, g in res["summary"].items():
            if not isinstance(g, dict):
                continue
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(g["rules"].items())[:4])
            print(f"    {name}: {g['evaluation_s']:.2f} s ({g['share_of_interval']:.0%} of the interval) "
                  f"evaluations {g['evaluations']} load {g['load']}; slowest rules: {top}")
            for e in g["errors"]:
                print(f"      error: {e}")
    if r.get("fleet"):
        f = r["fleet"]
        print(f"  fleet: {f['plain']['wall_s']:.1f} s, peak RSS {f['plain']['peak_rss_mib']:.0f} MiB (load "
              f"{f['plain']['load']:.1f}); with --html {f['html']['wall_s']:.1f} s, {f['html']['peak_rss_mib']:.0f} "
              f"MiB (load {f['html']['load']:.1f}), the report {f['html_mib']} MiB")


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
    ap.add_argument("--rule-cost", action="store_true", help="instead: the rule group's evaluation cost as the "
                    "engine reports it (Prometheus's rule manager; vmalert over VictoriaMetrics), on fresh data that "
                    "reaches past now; writes benchmarks/out/rule_cost.json")
    ap.add_argument("--rule-files", default="", help="with --rule-cost: rule files to measure one after another on "
                    "the same data (comma-separated; default: `diagnoser rules --prometheus-rules` now)")
    ap.add_argument("--rule-args", default="", help="with --rule-cost: more options for `diagnoser rules "
                    "--prometheus-rules` (e.g. '--shards 4')")
    ap.add_argument("--rule-interval", type=int, default=60, help="with --rule-cost: the evaluation interval, s")
    ap.add_argument("--rule-warmup", type=int, default=2, help="with --rule-cost: evaluations not counted")
    ap.add_argument("--rule-evals", type=int, default=2, help="with --rule-cost: evaluations counted")
    ap.add_argument("--rule-timeout", type=float, default=3600, help="with --rule-cost: seconds to wait for them (at "
                    "100,000 GPUs on two cores one evaluation of the findings took 7 min on vmalert)")
    ap.add_argument("--fleet-html", action="store_true", help="with --rule-cost: then `fleet` and `fleet --html` over "
                    "the same data: peak RSS and the report's size")
    args = ap.parse_args()
    compile_bytecode()  # each `fleet` is a fresh process: start it as an installed one starts
    results = []
    for n in (int(x) for x in args.sizes.split(",")):
        for kind in args.engines.split(","):
            with tempfile.TemporaryDirectory(prefix=f"fleet-{kind}-{n}-") as tmp:
                print(f"{kind}: {n:,} GPUs ...", file=sys.stderr, flush=True)
                result = (rule_cost if args.rule_cost else bench)(kind, n, args, Path(tmp))
                results.append(result)
                (print_rule_cost if args.rule_cost else print_summary)(result)
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / ("rule_cost.json" if args.rule_cost else "fleet_scale.json")).write_text(json.dumps(
                    {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "results": results},
                    indent=2))


if __name__ == "__main__":
    main()
