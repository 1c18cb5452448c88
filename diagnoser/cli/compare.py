"""`diagnoser compare BEFORE AFTER`: what changed, the verdicts, the measured change, and every fix's predicted gain
against the realised one (diagnoser/compare.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.errors import InputError


def _is_trace(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith((".json", ".json.gz")) and not name.endswith(".dgc")


def _outcome(path: Path, rules_config: Path | None):  # type: ignore[no-untyped-def]
    from diagnoser.capture import load
    from diagnoser.pipeline import Pipeline
    from diagnoser.rules import load_thresholds

    pipeline = Pipeline(overrides=load_thresholds(rules_config) if rules_config else None)
    if _is_trace(path):
        from diagnoser.traces import analyze_trace, capture_from_trace

        capture = capture_from_trace(analyze_trace(path))
    else:
        capture = load(path)
    return pipeline.diagnose(capture)


def register(app: typer.Typer) -> None:
    @app.command("compare")
    @handles_errors
    def compare_cmd(
        before: Path = typer.Argument(..., help="The capture (.dgc) or trace (.json[.gz]) before the change."),
        after: Path = typer.Argument(..., help="The capture or trace after it."),
        as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
        html: Path | None = typer.Option(None, "--html", help="Also write the comparison as an HTML page.",
                                         dir_okay=False),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding thresholds."),
    ) -> None:
        """Compare two captures or traces: what changed, and each fix's predicted gain against the realised one."""
        from diagnoser.compare import compare
        from diagnoser.reports import compare as view

        if before.resolve() == after.resolve():
            raise InputError("BEFORE and AFTER are the same file; compare two captures of the same server.")
        if _is_trace(before) != _is_trace(after):
            raise InputError("compare two captures or two traces, not one of each.")
        result = compare(_outcome(before, rules_config), _outcome(after, rules_config))
        if html is not None:
            typer.echo(f"diagnoser: wrote {view.write_html(result, html)}", err=True)
        if as_json:
            sys.stdout.write(view.render_json(result) + "\n")
        else:
            view.render_terminal(result, sys.stdout)
