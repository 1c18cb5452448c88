"""How `diagnoser fleet` scales with the number of GPUs: wall time and peak memory at 100, 1,000 and 10,000 GPUs.

A real Prometheus (the Debian `prometheus` binary on 127.0.0.1) is loaded with synthetic dcgm-exporter data for N GPUs
(8 per node, every profile of tests/prom_harness.py), then `diagnoser fleet --json` runs against it in a fresh
process (its own peak RSS, from getrusage, is what is reported). Two ways to load Prometheus:

  live      one process serves every node's exporter (/node/<n>/metrics, N/8 scrape targets); Prometheus scrapes
            it every --scrape-interval seconds until --window seconds are filled; the fleet window is that span.
  backfill  one hour of history at a 30 s interval (dcgm-exporter's default collect interval) written as
            OpenMetrics and turned into TSDB blocks by `promtool tsdb create-blocks-from openmetrics`: the
            realistic query load of `--since 1h`, without waiting an hour.

Run:  .venv/bin/python benchmarks/fleet_scale.py [--mode live|backfill] [--sizes 100,1000,10000] [--repeat 3]
Writes benchmarks/out/fleet_scale-<mode>.json and prints a table. Numbers are from this machine (2 cores); read them as
ratios between sizes of the same run. See benchmarks/FLEET.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.prom_harness import (  # noqa: E402
    _SIM_FIELDS,
    ExporterProcess,
    PrometheusServer,
    SimFleet,
    find_prometheus,
    node_targets,
)

OUT = REPO / "benchmarks" / "out"
POINTS = 30


def measure_child(args: list[str], out_file: str) -> None:
    """Run `diagnoser fleet ARGS` in this process; write wall time and peak RSS (and the JSON it printed)."""
    import contextlib
    import io

    from diagnoser.cli.app import main

    buffer = io.StringIO()
    t0 = time.perf_counter()
    code = 0
    with contextlib.redirect_stdout(buffer):
        try:
            main(args)
        except SystemExit as exc:
            code = int(exc.code or 0)
    wall = time.perf_counter() - t0
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kib = me.ru_maxrss
    text = buffer.getvalue()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = {}
    Path(out_file).write_text(json.dumps({
        "exit": code, "wall_s": wall, "peak_rss_mib": peak_kib / 1024, "rows": len(doc.get("rows", [])),
        # the forked diagnosis workers: their largest peak, and the CPU of the command with them
        "worker_peak_rss_mib": workers.ru_maxrss / 1024,
        "cpu_s": me.ru_utime + me.ru_stime + workers.ru_utime + workers.ru_stime,
        "errors": doc.get("errors", []), "timings": doc.get("timings", {}), "json_bytes": len(text),
        "verdicts": _verdicts(doc),
    }))


def _verdicts(doc: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in doc.get("rows", []):
        v = row["diagnosis"]["verdict"]
        counts[v] = counts.get(v, 0) + 1
    return counts


def run_fleet_once(prom: PrometheusServer, window_args: list[str], workdir: Path) -> dict:
    out = workdir / f"measure-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "_measure", str(out), "--", "fleet", "--prometheus", prom.url, *window_args,
           "--json", "--timeout", "120", *(["--points", str(POINTS)] if POINTS else [])]
    before = prometheus_cpu_s(prom)
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    result = json.loads(out.read_text())
    after = prometheus_cpu_s(prom)
    result["prometheus_cpu_s"] = after - before if before is not None and after is not None else None
    return result


def prometheus_cpu_s(prom: PrometheusServer) -> float | None:
    try:
        import psutil

        assert prom.proc is not None
        times = psutil.Process(prom.proc.pid).cpu_times()
        return times.user + times.system
    except Exception:  # noqa: BLE001 (context only)
        return None


def prometheus_rss_mib(prom: PrometheusServer) -> float | None:
    try:
        import psutil

        assert prom.proc is not None
        return psutil.Process(prom.proc.pid).memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 (context only)
        return None


def bench_live(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    fleet = SimFleet(n_gpus=n, gpus_per_node=8)
    interval = args.scrape_interval
    window = args.window
    with ExporterProcess(fleet, workdir) as exporter:
        prom = PrometheusServer(workdir, node_targets(exporter), scrape_interval_s=interval)
        with prom:
            t0 = time.monotonic()
            scrapes = int(window / interval) + 2
            prom.wait_for_samples(scrapes, timeout=window + 600)
            fill_s = time.monotonic() - t0
            runs = [run_fleet_once(prom, ["--since", f"{window}s"], workdir) for _ in range(args.repeat)]
            return summarise(n, runs, {"fill_s": round(fill_s, 1), "scrape_interval_s": interval, "window_s": window,
                                       "targets": len(fleet.nodes), "prometheus_rss_mib": prometheus_rss_mib(prom)})


def write_openmetrics(fleet: SimFleet, path: Path, start: int, end: int, step: int) -> int:
    """One hour of every GPU's series, grouped by family as OpenMetrics requires; returns the sample count."""
    samples = 0
    stamps = list(range(start, end + 1, step))
    with open(path, "w", buffering=1 << 20) as fh:
        for key, legacy, _ in _SIM_FIELDS:
            # Typed gauge even for the violation counters: OpenMetrics wants counter samples named *_total, and
            # PromQL's rate() does not care about the declared type.
            fh.write(f"# TYPE {legacy} gauge\n")
            for g in fleet.gpus:
                if g.mig_id:
                    continue
                head = f"{legacy}{fleet._labels(g)} "
                fh.write("".join(f"{head}{fleet.value(g, key, ts)} {ts}\n" for ts in stamps))
                samples += len(stamps)
        fh.write("# EOF\n")
    return samples


def bench_backfill(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool is not installed (it comes with the Debian prometheus package)")
    step = 30
    home = (args.keep_data.resolve() / f"backfill-{n}") if args.keep_data else workdir
    data_dir, window_file = home / "data", home / "window"
    made: dict[str, float] = {}
    if window_file.exists():  # made by an earlier run with --keep-data: measure again without regenerating
        start, end = (int(x) for x in window_file.read_text().split()[:2])
        made = json.loads((home / "made.json").read_text()) if (home / "made.json").exists() else {}
    else:
        home.mkdir(parents=True, exist_ok=True)
        end = int(time.time()) // step * step - step
        start = end - 3600
        fleet = SimFleet(n_gpus=n, gpus_per_node=8, start=start - 600)
        om = home / "history.om"
        t0 = time.monotonic()
        samples = write_openmetrics(fleet, om, start, end, step)
        made["generate_s"] = round(time.monotonic() - t0, 1)
        made["samples"], made["openmetrics_mib"] = samples, round(om.stat().st_size / 2**20)
        t0 = time.monotonic()
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(data_dir)],
                       check=True, timeout=3600)
        made["promtool_s"] = round(time.monotonic() - t0, 1)
        om.unlink()
        window_file.write_text(f"{start} {end}")
        (home / "made.json").write_text(json.dumps(made))
    # Nothing to scrape: the data is all history. The window ends at the last backfilled sample.
    with PrometheusServer(workdir, [], data_dir=data_dir,
                          extra_args=["--storage.tsdb.retention.time=3650d"]) as prom:
        window = ["--start", str(start), "--end", str(end + 1)]
        runs = [run_fleet_once(prom, window, workdir) for _ in range(args.repeat)]
        return summarise(n, runs, {**made, "window_s": 3600, "scrape_interval_s": step,
                                   "prometheus_rss_mib": prometheus_rss_mib(prom)})


def summarise(n: int, runs: list[dict], extra: dict) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {
        "gpus": n, "runs": len(runs), "wall_s_median": round(statistics.median(walls), 3),
        "wall_s_min": round(min(walls), 3), "wall_s_max": round(max(walls), 3),
        "peak_rss_mib_max": round(max(r["peak_rss_mib"] for r in runs), 1),
        "worker_peak_rss_mib_max": round(max(r["worker_peak_rss_mib"] for r in runs), 1),
        "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 2),
        "prometheus_cpu_s_median": round(statistics.median(r["prometheus_cpu_s"] or 0 for r in runs), 2),
        "rows": runs[-1]["rows"], "errors": runs[-1]["errors"], "timings": runs[-1]["timings"],
        "json_mib": round(runs[-1]["json_bytes"] / 2**20, 1), "verdicts": runs[-1]["verdicts"], **extra,
    }


def print_table(results: list[dict]) -> None:
    print(f"{'GPUs':>6} {'wall s':>7} {'x prev':>6} {'cpu s':>6} {'prom cpu':>8} {'peak MiB':>8} {'worker':>6} "
          f"{'discover':>8} {'fields':>6} {'diagnose':>8} {'load':>5}")
    prev = None
    for r in results:
        t = r["timings"]
        growth = f"{r['wall_s_median'] / prev:.1f}" if prev else "-"
        print(f"{r['gpus']:>6} {r['wall_s_median']:>7.2f} {growth:>6} {r['cpu_s_median']:>6.1f} "
              f"{r['prometheus_cpu_s_median']:>8.1f} {r['peak_rss_mib_max']:>8.0f} {r['worker_peak_rss_mib_max']:>6.0f} "
              f"{t.get('discover_s', 0):>8.2f} {t.get('fields_s', 0):>6.2f} {t.get('diagnose_s', 0):>8.2f} "
              f"{r['load_average_after']:>5.1f}")
        prev = r["wall_s_median"]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_measure":
        measure_child(sys.argv[4:], sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("live", "backfill"), default="live")
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scrape-interval", type=float, default=5.0, help="live mode: seconds between scrapes")
    ap.add_argument("--window", type=float, default=150.0, help="live mode: window (s) filled before measuring")
    ap.add_argument("--keep-data", type=Path, default=None, help="backfill mode: keep (and reuse) the generated "
                    "TSDB blocks under this directory; 10,000 GPUs take minutes and ~6 GB of OpenMetrics to make")
    ap.add_argument("--points", type=int, default=0, help="values per GPU and field (diagnoser fleet --points; "
                    "0: the fleet's own default)")
    args = ap.parse_args()
    global POINTS
    POINTS = args.points
    if find_prometheus() is None:
        raise SystemExit("the prometheus binary is not installed (scripts/install-test-deps.sh installs it)")
    results = []
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"fleet-{n}-") as tmp:
            workdir = Path(tmp)
            print(f"{args.mode}: {n} GPUs ...", file=sys.stderr, flush=True)
            result = (bench_live if args.mode == "live" else bench_backfill)(n, args, workdir)
            result["mode"] = args.mode
            result["load_average_after"] = os.getloadavg()[0]
            result["points"] = args.points
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"fleet_scale-{args.mode}-{args.points or 'default'}pts.json"
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                               "results": results}, indent=2))
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
