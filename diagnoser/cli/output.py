"""Showing an outcome the way the user asked (terminal, --json) and the --fail-on exit code; shared by every
command that ends in a verdict (diagnose, attach, analyze, dcgm, demo, ...)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from diagnoser.diagnosis import Verdict
from diagnoser.errors import EXIT_FAIL_ON, InputError

if TYPE_CHECKING:  # the pipeline (evidence, rules, physics) loads when a command runs, not for its --help
    from diagnoser.pipeline import Outcome

FAIL_ON_HELP = ("Exit 1 when the verdict is one of these (comma-separated): "
                + ", ".join(v.value for v in Verdict) + ", or 'any'.")


def parse_fail_on(value: str | None) -> set[str]:
    if not value:
        return set()
    names = {v.strip().lower().replace("-", "_") for v in value.split(",") if v.strip()}
    known = {v.value for v in Verdict} | {"any"}
    unknown = names - known
    if unknown:
        raise InputError(f"--fail-on got unknown limiter(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}.")
    return names


def show(outcome: Outcome, *, as_json: bool, fail_on: set[str], verbose: bool = False) -> None:
    """Print the outcome's report (terminal or --json): the files it wrote are named first, on stderr."""
    if "report" in outcome.written:
        typer.echo(f"diagnoser: wrote the HTML report to {outcome.written['report']}", err=True)
    if as_json:  # the diagnosis itself (JsonRenderer's document): the report's other views are not built for it
        from diagnoser.reports.jsonout import dumps

        sys.stdout.write(dumps(outcome.diagnosis) + "\n")
    else:
        from diagnoser.reports.terminal import TerminalRenderer

        TerminalRenderer(color=None if sys.stdout.isatty() else False).render(outcome.report(), verbose=verbose)
    d = outcome.diagnosis
    if fail_on and ("any" in fail_on and d.verdict != Verdict.INCONCLUSIVE or d.verdict in fail_on):
        raise typer.Exit(EXIT_FAIL_ON)
