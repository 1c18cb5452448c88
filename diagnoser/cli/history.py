"""`diagnoser history`: the timeline of verdicts the agent stored, per target."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.textsafe import one_line


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def register(app: typer.Typer) -> None:
    @app.command("history")
    @handles_errors
    def history_cmd(
        target: str = typer.Option(None, "--target", "-t", help="Only this target (its name in the agent)."),
        since: str = typer.Option("7d", "--since", help="How far back, e.g. 24h, 7d, 30d ('0' for everything)."),
        as_json: bool = typer.Option(False, "--json", help="Print the runs and the timeline as JSON."),
        every_run: bool = typer.Option(False, "--runs", help="List every run, not spans of the same verdict."),
        db: Path = typer.Option(None, "--db", help="History store (default: where the agent keeps it)."),
    ) -> None:
        """Show how each target's verdict changed over time (from `diagnoser agent`'s history)."""
        from diagnoser.agent.config import state_dir
        from diagnoser.agent.history import HistoryStore, outcome, segments
        from diagnoser.units import parse_duration

        window = parse_duration(since, "--since")
        start = time.time() - window if window > 0 else None
        with HistoryStore(db or state_dir() / "history.db", create=False) as store:
            names = [target] if target else store.targets()
            per_target = {name: store.runs(target=name, since=start) for name in names}
        per_target = {k: v for k, v in per_target.items() if v}
        if as_json:
            print_json({"since": start, "targets": {
                name: {"timeline": [s.to_dict() for s in segments(runs)], "runs": [r.summary() for r in runs]}
                for name, runs in per_target.items()}})
            return
        # Rows hold targets' errors and headlines: no markup, control characters shown, not sent (textsafe.py).
        console = Console(color_system=None if not sys.stdout.isatty() else "auto", highlight=False, markup=False)
        if not per_target:
            which = f"target {target}" if target else "any target"
            console.print(one_line(f"No runs of {which} in the history since "
                                   f"{_when(start) if start else 'the start'}."))
            return
        for name, runs in per_target.items():
            table = Table(title=one_line(f"{name}: {len(runs)} run(s)"), title_justify="left", show_edge=False,
                          pad_edge=False)
            if every_run:
                for col in ("time (UTC)", "outcome", "conf.", "efficiency", "top fix", "detail"):
                    table.add_column(col)
                for r in runs:
                    table.add_row(_when(r.started_at), outcome(r), _num(r.confidence), _pct(r.efficiency),
                                  one_line(_fix(r.top_fix, r.top_fix_gain)), one_line(r.error or r.headline))
            else:
                for col in ("from (UTC)", "to (UTC)", "runs", "outcome", "mean conf.", "latest"):
                    table.add_column(col)
                for s in segments(runs):
                    last = s.last
                    detail = last.error if last.status != "ok" else _fix(last.top_fix, last.top_fix_gain)
                    table.add_row(_when(s.first_at), _when(s.last_at), str(s.runs), one_line(s.outcome),
                                  _num(s.confidence_mean), one_line(detail))
            console.print(table)
            console.print()


def _num(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _pct(x: float | None) -> str:
    return f"{x * 100:.0f} %" if x is not None else "-"


def _fix(title: str | None, gain: float | None) -> str:
    if not title:
        return "-"
    from diagnoser.units import gain as gain_text

    return f"{title} ({gain_text(gain)})" if gain is not None else title
