"""`diagnoser diagnose CAPTURE`: the verdict for a saved capture."""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show


def register(app: typer.Typer) -> None:
    @app.command("diagnose")
    @handles_errors
    def diagnose_cmd(
        capture: Path = typer.Argument(..., help="A capture file (.dgc) saved by attach, agent or analyze."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON (docs/diagnosis.schema.json)."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding rule thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
        html: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML report to this file.",
                                         dir_okay=False),
    ) -> None:
        """Diagnose a saved capture: verdict, evidence, ranked fixes."""
        from diagnoser.capture import load
        from diagnoser.pipeline import Pipeline
        from diagnoser.rules import load_thresholds

        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(rules_config) if rules_config else None
        pipeline = Pipeline(overrides=overrides, html=html)
        show(pipeline.write(pipeline.diagnose(load(capture))), as_json=as_json, fail_on=wanted, verbose=verbose)
