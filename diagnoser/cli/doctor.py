"""`diagnoser doctor`: which data sources work on this machine and how to enable the missing ones."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.textsafe import printable

_STYLE = {"ok": "green", "limited": "yellow", "missing": "red"}


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @handles_errors
    def doctor_cmd(
        port: int | None = typer.Option(None, "--port", help="Also check the server metrics on this port."),
        metrics_url: str | None = typer.Option(None, "--metrics-url", help="Also check this metrics URL."),
        as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
    ) -> None:
        """Say which sources (NVML, GPM, DCGM, counters, server metrics) work here and how to enable the rest."""
        from diagnoser.collectors.doctor import run_checks

        checks = run_checks(port, metrics_url)
        if as_json:
            print_json([c.to_dict() for c in checks])
            return
        console = Console(highlight=False, markup=False)
        table = Table("source", "status", "detail", box=None, show_lines=False)
        for c in checks:
            # Details quote endpoints' answers and driver strings: control characters shown, not sent.
            detail = printable(c.detail) + (f"\n-> {printable(c.fix)}" if c.fix else "")
            table.add_row(c.source, Text(c.status, style=_STYLE.get(c.status, "dim")), Text(detail))
        console.print(table)
