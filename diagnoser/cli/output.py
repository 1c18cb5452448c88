"""Showing a diagnosis the way the user asked (terminal, --json) and the --fail-on exit code; shared by every
command that ends in a verdict (diagnose, attach, analyze, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from diagnoser.capture import Capture
from diagnoser.diagnosis import INCONCLUSIVE, Diagnosis, Limiter
from diagnoser.errors import EXIT_FAIL_ON, InputError
from diagnoser.evidence import Evidence
from diagnoser.reports.jsonout import dumps
from diagnoser.reports.terminal import TerminalRenderer

FAIL_ON_HELP = ("Exit 1 when the verdict is one of these (comma-separated): "
                + ", ".join(l.value for l in Limiter) + f", {INCONCLUSIVE}, or 'any'.")


def parse_fail_on(value: str | None) -> set[str]:
    if not value:
        return set()
    names = {v.strip().lower().replace("-", "_") for v in value.split(",") if v.strip()}
    known = {l.value for l in Limiter} | {INCONCLUSIVE, "any"}
    unknown = names - known
    if unknown:
        raise InputError(f"--fail-on got unknown limiter(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}.")
    return names


def show(d: Diagnosis, *, as_json: bool, fail_on: set[str], verbose: bool = False,
         capture: Capture | None = None, html: Path | None = None, evidence: Evidence | None = None) -> None:
    """Print the diagnosis (terminal or --json); with `html` also write the HTML report of `capture` there, first,
    so the file exists whatever the exit code."""
    if html is not None:
        if capture is None:
            raise InputError("--html needs the capture the diagnosis came from.")
        from diagnoser.reports.html import write_html

        written = write_html(d, capture, html, evidence)
        typer.echo(f"diagnoser: wrote the HTML report to {written}", err=True)
    if as_json:
        sys.stdout.write(dumps(d) + "\n")
    else:
        TerminalRenderer(color=None if sys.stdout.isatty() else False).render(d, verbose=verbose)
    if fail_on and ("any" in fail_on and d.verdict != INCONCLUSIVE or d.verdict in fail_on):
        raise typer.Exit(EXIT_FAIL_ON)
