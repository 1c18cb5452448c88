"""`diagnoser fleet --prometheus URL`: one verdict per GPU of a cluster over a window, most money at stake first."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import parse_fail_on
from diagnoser.collectors.dcgm import GpuSelector
from diagnoser.collectors.prom_client import PromClient, parse_headers
from diagnoser.collectors.prometheus_source import resolve_window
from diagnoser.diagnosis import Verdict
from diagnoser.errors import EXIT_FAIL_ON, EXIT_PARTIAL, InputError
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.fleet.run import (
    DEFAULT_DETAIL,
    GROUPINGS,
    PRICE_SOURCE,
    TRIAGE_CHUNK,
    FleetGroup,
    gc_paused,
    group_rows,
    iter_report_json,
    run_fleet,
)
from diagnoser.physics import match_gpu
from diagnoser.rules import load_thresholds
from diagnoser.textsafe import one_line, printable

SHORT_VERDICT = {
    "vram": "vram", "memory_bandwidth": "bandwidth", "compute": "compute", "batching": "batching",
    "host_launch": "host-bound", "throttling": "throttled", "interconnect": "interconnect", "idle": "idle",
    "errors": "gpu errors", Verdict.INCONCLUSIVE: "inconclusive",
}
DEFAULT_TERMINAL_ROWS = 40


def _model_short(name: str) -> str:
    spec = match_gpu(name) if name else None
    return spec.key if spec is not None else (name.replace("NVIDIA ", "").replace("Tesla ", "") or "?")


def _money(value: float) -> str:
    return f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"


def _verdict_counts(rows: list[FleetRow]) -> str:
    counts = Counter(SHORT_VERDICT.get(r.diagnosis.verdict, r.diagnosis.verdict) for r in rows)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def _table(rows: list[FleetRow]) -> Table:
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("$/h", justify="right", width=6, no_wrap=True)
    table.add_column("verdict", width=13, no_wrap=True, overflow="ellipsis")
    table.add_column("conf", justify="right", width=4, no_wrap=True)
    table.add_column("busy", justify="right", width=4, no_wrap=True)
    table.add_column("node", width=12, no_wrap=True, overflow="ellipsis")
    table.add_column("gpu", width=5, no_wrap=True, overflow="ellipsis")
    table.add_column("model", width=9, no_wrap=True, overflow="ellipsis")
    table.add_column("pod", width=17, no_wrap=True, overflow="ellipsis")
    for r in rows:
        d = r.diagnosis
        verdict = SHORT_VERDICT.get(d.verdict, d.verdict) + ("*" if r.partial else "")
        table.add_row(
            _money(r.usd_per_hour_at_stake) if r.usd_per_gpu_hour else "?",
            Text(verdict, style="yellow" if d.verdict == Verdict.INCONCLUSIVE else "bold"),
            f"{d.confidence:.2f}", f"{r.busy:.0%}" if r.busy is not None else "-",
            # Labels from Prometheus: Text (no markup), control characters shown (diagnoser/textsafe.py).
            Text(one_line(r.node)), Text(one_line(r.gpu)), Text(one_line(_model_short(r.model_name))),
            Text(one_line("/".join(x for x in (r.namespace, r.pod) if x) or "-")),
        )
    return table


def render_fleet(report: FleetReport, console: Console, *, groups: list[FleetGroup] | None = None,
                 limit: int | None = None, notes: list[str] | None = None) -> None:
    """The fleet as an 80-column table (plain text when not a terminal); groups, when given, get a line each."""
    rows = report.rows
    nodes = len({r.node for r in rows})
    window = report.window_end - report.window_start
    from diagnoser.collectors.prometheus_source import Window

    console.print(Text(f"Fleet: {len(rows)} GPUs on {nodes} node{'s' if nodes != 1 else ''}, "
                       f"{Window(report.window_start, report.window_end).describe()}", style="bold"))
    console.print(f"Source: {report.source}" + (f" (queried and diagnosed in {report.query_seconds:.1f} s)"
                                                if report.query_seconds is not None else ""), markup=False)
    at_stake = sum(r.usd_per_hour_at_stake for r in rows)
    priced = [r for r in rows if r.usd_per_gpu_hour]
    if priced:
        console.print(Text(f"At stake: ${_money(at_stake)}/h (${_money(at_stake * window / 3600)} over the window)",
                           style="bold red" if at_stake else "bold"))
        if report.usd_per_gpu_hour is None:
            console.print(f"Prices: {PRICE_SOURCE}.", markup=False, style="dim")
    if len(priced) < len(rows):
        console.print(f"{len(rows) - len(priced)} GPU(s) of unknown price ('?'): pass --usd-per-gpu-hour.",
                      markup=False, style="dim")
    console.print(f"Verdicts: {_verdict_counts(rows)}", markup=False)
    shown = 0
    budget = limit if limit is not None else DEFAULT_TERMINAL_ROWS
    if groups:
        for g in groups:
            if shown >= budget:
                break
            take = g.rows[: budget - shown]
            console.print(Text(f"\n{one_line(g.name)}: {len(g.rows)} GPU{'s' if len(g.rows) != 1 else ''}, "
                               f"${_money(g.usd_per_hour_at_stake)}/h at stake; {_verdict_counts(g.rows)}",
                               style="bold"), overflow="fold")
            console.print(_table(take))
            shown += len(take)
    else:
        console.print()
        take = rows[:budget]
        console.print(_table(take))
        shown = len(take)
    if shown < len(rows):
        console.print(f"... and {len(rows) - shown} more GPUs (--limit N shows more; --json has every row).",
                      markup=False, style="dim")
    if any(r.partial for r in rows):
        console.print("* partial: the GPU's series have gaps, stop early or lack fields whose query failed.",
                      markup=False, style="dim")
    for error in report.errors:
        console.print(Text(f"! {printable(error)}", style="yellow"), overflow="fold")
    for note in notes or []:
        console.print(Text(printable(note), style="dim"), overflow="fold")


def register(app: typer.Typer) -> None:
    @app.command("fleet")
    @handles_errors
    def fleet_cmd(
        prometheus: str = typer.Option(..., "--prometheus", help="Prometheus that scrapes dcgm-exporter, e.g. "
                                       "http://prometheus:9090."),
        since: str = typer.Option(None, "--since", help="Window length, ending now or at --at: 30m, 1h, 2d "
                                  "(default 1h)."),
        start: str = typer.Option(None, "--start", help="Window start: ISO 8601 (2026-11-21T03:00Z), unix "
                                  "seconds or now-2h."),
        end: str = typer.Option(None, "--end", help="Window end, with --start (default now)."),
        at: str = typer.Option(None, "--at", help="End of the --since window (default now): diagnose last night."),
        group_by: str = typer.Option(None, "--group-by", help="Group rows by " + ", ".join(GROUPINGS) + "."),
        as_json: bool = typer.Option(False, "--json", help="Print the fleet report as JSON."),
        html: Path = typer.Option(None, "--html", help="Also write an HTML report to this file."),
        usd_per_gpu_hour: float = typer.Option(None, "--usd-per-gpu-hour", help="Price of one GPU-hour (default: "
                                               "rough list prices per GPU model)."),
        limit: int = typer.Option(None, "--limit", min=1, help="Show only the N rows with most at stake (terminal "
                                  f"default {DEFAULT_TERMINAL_ROWS}; --json default all)."),
        timeout: float = typer.Option(30.0, "--timeout", min=1.0, help="Seconds each Prometheus query may take."),
        points: int = typer.Option(None, "--points", min=5, max=300, help="Values per GPU and field when a GPU is "
                                   "read as points (the --detail GPUs; default 30)."),
        detail: int = typer.Option(DEFAULT_DETAIL, "--detail", min=0, help="Read the N GPUs with most at stake "
                                   "again as points over the window, after the triage from window statistics "
                                   f"(default {DEFAULT_DETAIL}; 0: none)."),
        node: str = typer.Option(None, "--node", help="Only the GPUs of this node."),
        pod: str = typer.Option(None, "--pod", help="Only the GPUs of this pod, or namespace/pod (a unique prefix "
                                "works)."),
        gpu: int = typer.Option(None, "--gpu", help="Only GPUs with this index (with --node: one GPU)."),
        uuid: str = typer.Option(None, "--uuid", help="Only the GPU with this UUID (or a unique prefix)."),
        recorded: bool = typer.Option(True, "--recorded/--no-recorded", help="Read the statistics the diagnoser "
                                      "rule group records when Prometheus has them for this window length (default)."),
        headers: list[str] = typer.Option([], "--header", help="An HTTP header for every Prometheus request, "
                                          "'Name: value' (Mimir's X-Scope-OrgID, a bearer token); repeatable."),
        fail_on: str = typer.Option("", "--fail-on", help="Exit 1 when any GPU's verdict is one of these "
                                    "(comma-separated limiters, inconclusive, or 'any')."),
        rules_config: Path = typer.Option(None, "--rules-config", help="TOML file overriding rule thresholds."),
        jobs: int = typer.Option(None, "--jobs", "-j", min=1, help="Processes diagnosing the GPUs, this one included, "
                                 "at most four a core (default: this one and a worker per core, for "
                                 f"{2 * TRIAGE_CHUNK:,} GPUs or more)."),
    ) -> None:
        """Diagnose every GPU a Prometheus knows (via dcgm-exporter): idle, underused, limited, throttled, failing."""
        # No cyclic GC for the whole command: a fleet run holds millions of objects to its end, and at 100,000 GPUs
        # each full collection while the table or the JSON is made walked them all for about a second.
        with gc_paused():
            wanted = parse_fail_on(fail_on)
            if group_by is not None and group_by not in GROUPINGS:
                raise InputError(f"--group-by must be one of {', '.join(GROUPINGS)}, not '{group_by}'.")
            overrides = load_thresholds(rules_config) if rules_config else None
            window = resolve_window(since=since, start=start, end=end, at=at, default_s=3600.0)
            notes: list[str] = []
            timings: dict[str, float | int | None] = {}
            selector = GpuSelector(gpu=gpu, uuid=uuid, pod=pod, node=node)
            client = PromClient(prometheus, timeout_s=timeout, headers=parse_headers(headers))
            report = run_fleet(client, window, points=points, usd_per_gpu_hour=usd_per_gpu_hour, thresholds=overrides,
                               notes=notes, timings=timings, detail=detail, selector=selector, use_recorded=recorded,
                               processes=jobs)
            groups = group_rows(report.rows, group_by) if group_by else None
            if html is not None:
                from diagnoser.reports.html import write_fleet_html
                from diagnoser.reports.model import build_fleet_view

                try:
                    written = write_fleet_html(build_fleet_view(report), html)
                except OSError as exc:
                    raise InputError(f"cannot write {html}: {exc.strerror or exc}.") from None
                typer.echo(f"diagnoser: wrote {written}", err=True)
            for error in report.errors:
                typer.echo(f"diagnoser: warning: {one_line(error)}", err=True)
            if as_json:
                extra: dict[str, object] = {
                    "notes": notes, "timings": timings,
                    "price_source": "--usd-per-gpu-hour" if usd_per_gpu_hour is not None else PRICE_SOURCE}
                if groups is not None:
                    extra["group_by"] = group_by
                    extra["groups"] = [g.to_dict() for g in groups]
                binary = getattr(sys.stdout, "buffer", None)  # absent when stdout is a StringIO (tests, embedding)
                sys.stdout.flush()
                for piece in iter_report_json(report, extra, limit):
                    if binary is not None:
                        binary.write(piece)
                    else:
                        sys.stdout.write(piece.decode())
                if binary is not None:
                    binary.flush()
            else:
                tty = sys.stdout.isatty()
                console = Console(width=80, no_color=not tty, force_terminal=tty or None, highlight=False,
                                  soft_wrap=False)
                render_fleet(report, console, groups=groups, limit=limit, notes=notes)
            verdicts = {r.diagnosis.verdict for r in report.rows}
            lost = list(report.lost)
            # Freed while paused: with the collector back on, one full collection walked them all (1 s at 100,000).
            del report, groups
        if wanted and (("any" in wanted and verdicts - {Verdict.INCONCLUSIVE}) or verdicts & wanted):
            raise typer.Exit(EXIT_FAIL_ON)
        if lost:
            # The report above is whole but for these fields: said on stderr, and in the exit code for scripts.
            typer.echo(f"diagnoser: partial result: the statistics of {', '.join(lost)} could not be read (asked "
                       "twice); every row is marked partial.", err=True)
            raise typer.Exit(EXIT_PARTIAL)
