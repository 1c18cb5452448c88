"""`diagnoser analyze TRACE [TRACE...]`: analyse a torch.profiler (Kineto) trace a user already has and diagnose it.

TRACE is a .json or .json.gz file, a folder of per-rank files, or several files (the ranks of one job, compared rank
by rank). The trace analysis is printed first (window, what ran, GPU busy/idle and why, kernel classes and the
kernels that hold the time, launches, FLOPs and intensity against the ridge point, serving phases, ranks, what was
skipped), then the diagnosis the rules draw from it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.textsafe import printable
from diagnoser.traces.windows import WINDOWS


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    @handles_errors
    def analyze_cmd(
        trace: list[Path] = typer.Argument(..., help="A torch.profiler trace (.json or .json.gz), a folder of "
                                           "per-rank traces, or several trace files of one job (compared rank by "
                                           "rank)."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON; the trace analysis is in "
                                     "its context.trace."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        save: Path | None = typer.Option(None, "--save", help="Also save the capture built from the trace (.dgc)."),
        html: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML report to this file.",
                                         dir_okay=False),
        gpu: str | None = typer.Option(None, "--gpu", help="The GPU the trace ran on (e.g. H100), when its "
                                       "deviceProperties are missing or wrong."),
        model: str | None = typer.Option(None, "--model", help="The served model: a config.json, a folder with "
                                         "one, or a bundled model name."),
        window: str = typer.Option("auto", "--window", help="Analysed window: " + ", ".join(WINDOWS) +
                                   " (auto: profiler steps if any, else the span of GPU activity)."),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding rule "
                                                 "thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
        jobs: int | None = typer.Option(None, "--jobs", "-j", min=1, help="Processes reading a large trace "
                                        "(default: the cores other work leaves idle; 1: one process)."),
        max_trace_size: str | None = typer.Option(None, "--max-trace-size", help="Refuse traces larger than this "
                                                  "(JSON bytes after gunzip; default 4G or $DIAGNOSER_TRACE_MAX_BYTES)"
                                                  "; e.g. 16G for a long window."),
    ) -> None:
        """Analyse a torch.profiler trace: idle causes, kernel classes, intensity, phases, then the verdict."""
        from diagnoser import physics
        from diagnoser.pipeline import Pipeline
        from diagnoser.rules import load_thresholds
        from diagnoser.traces import analyze_trace, capture_from_trace
        from diagnoser.traces.decode import parse_size

        limit = parse_size(max_trace_size) if max_trace_size is not None else None
        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(str(rules_config)) if rules_config else None
        model_info = physics.resolve_model(model) if model else None
        if gpu:
            physics.get_gpu(gpu)  # an unknown name is a bad option, before the (long) analysis
        pipeline = Pipeline(overrides=overrides, save_to=save, html=html)  # outputs checked before the analysis
        analysis = analyze_trace(trace[0] if len(trace) == 1 else trace, window=window, gpu_name=gpu,
                                 max_bytes=limit, jobs=jobs)
        capture = capture_from_trace(analysis, model=model_info, gpu_name=gpu)
        pipeline.checkpoint(capture)
        outcome = pipeline.diagnose(capture)
        if as_json:
            outcome.diagnosis.context["trace"] = analysis.to_dict()
        else:
            from diagnoser.reports.trace_text import render_analysis

            for line in render_analysis(analysis):
                typer.echo(printable(line))  # kernel and op names come from the trace file
            if save is not None:
                typer.echo(f"Capture saved to {save}.")
            typer.echo("")
        show(pipeline.write(outcome), as_json=as_json, fail_on=wanted, verbose=verbose)
