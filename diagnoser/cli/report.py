"""`diagnoser report CAPTURE -o FILE`: the self-contained HTML report of a saved capture's diagnosis."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.errors import InputError


def register(app: typer.Typer) -> None:
    @app.command("report")
    @handles_errors
    def report_cmd(
        capture: Path = typer.Argument(..., help="A capture file (.dgc) saved by attach, agent or analyze."),
        output: Path | None = typer.Option(None, "--output", "-o", dir_okay=False,
                                           help="Where to write the report (default: the capture's name with "
                                           ".html)."),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding rule thresholds."),
    ) -> None:
        """Write an HTML report to forward: verdict, fixes, charts, evidence, context. One file, works offline."""
        if capture.is_dir():
            raise InputError(f"{capture} is a directory, not a capture file.")
        if output is None and not capture.name:
            raise InputError(f"{capture} names no capture file.")
        target = output if output is not None else capture.with_suffix(".html")
        if target.resolve() == capture.resolve():
            raise InputError(f"the report would overwrite the capture {capture}; pass -o with another file name.")
        from diagnoser.capture import load
        from diagnoser.pipeline import Pipeline
        from diagnoser.reports.model import verdict_label
        from diagnoser.rules import load_thresholds

        overrides = load_thresholds(rules_config) if rules_config else None
        pipeline = Pipeline(overrides=overrides, html=target,
                            html_option=_option_given() if output is not None else "the report")
        outcome = pipeline.write(pipeline.diagnose(load(capture)))
        diagnosis = outcome.diagnosis
        typer.echo(f"diagnoser: {verdict_label(diagnosis)} (confidence {diagnosis.confidence_label}); "
                   "report written to:", err=True)
        typer.echo(str(outcome.written["report"]))


def _option_given() -> str:
    """-o or --output, as the user spelled it, for errors about the output path."""
    for arg in sys.argv[1:]:
        if arg == "--output" or arg.startswith("--output="):
            return "--output"
        if arg.startswith("-o"):
            return "-o"
    return "--output"
