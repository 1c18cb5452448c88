"""`diagnoser selftest`: run workloads with known limiters here, diagnose each, compare (docs/calibrate.md).

Each stage is one line on stderr as it starts (stdout keeps the table or the JSON). Without --out the captures,
workload logs and traces go to a temporary folder that is removed on every way out: success, failure, Ctrl-C and
SIGTERM (a CPU run's traces alone are hundreds of MB).
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

import typer
from rich.console import Console
from rich.table import Table

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import EXIT_FAIL_ON, EXIT_TERMINATED, InputError
from diagnoser.interrupts import catch
from diagnoser.selftest.harness import SelftestReport, resolve_device, run_selftest, scenario_names
from diagnoser.selftest.record import record_fixtures
from diagnoser.selftest.scenarios import DEFAULT_ORDER
from diagnoser.units import fmt


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def render(report: SelftestReport, console: Console) -> None:
    if report.cpu_run:
        console.print("Self-test on the CPU (toy size).", markup=False)
    else:
        console.print(f"Self-test on {report.gpu_name or 'GPU 0'} (driver {report.driver or 'unknown'}), roofs: "
                      f"{report.roofs or 'n/a'}.", markup=False)
    for note in report.notes:
        console.print(f"! {note}", style="yellow", markup=False)
    table = Table("scenario", "expected", "got", "confidence", "tokens/s", "ceiling", "of ceiling", "",
                  box=None, show_header=True)
    for r in report.results:
        mark = "" if r.passed is None else ("ok" if r.passed else "WRONG")
        share = (f"{r.measured_tokens_per_s / r.ceiling_tokens_per_s:.0%}"
                 if r.measured_tokens_per_s and r.ceiling_tokens_per_s else "")
        rate = _rate(r.measured_tokens_per_s) + (" prompt" if r.rate == "prompt" and r.measured_tokens_per_s else "")
        ran = not (r.error or r.skipped)
        ceiling = (_rate(r.ceiling_tokens_per_s) if r.ceiling_tokens_per_s
                   else "n/a (CPU)" if r.cpu_run and ran else "")
        table.add_row(r.scenario, " or ".join(r.expected), r.shown_verdict, f"{r.confidence:.2f}" if ran else "",
                      rate if ran else "", ceiling, share, mark)
    console.print(table)
    for r in report.results:
        if r.error:
            console.print(f"  {r.scenario}: error: {r.error}", style="red", markup=False)
        elif r.skipped:
            console.print(f"  {r.scenario}: skipped: {r.skipped}", style="dim", markup=False)
        elif r.trace:
            console.print(f"  {r.scenario}: {r.trace}", style="dim", markup=False)
    if report.checks:
        console.print("Physics checks", style="bold")
        checks = Table("check", "predicted", "measured", "", "note", box=None, show_header=True)
        for c in report.checks:
            unit = "" if c.unit == "x" else c.unit
            shown = [("n/a" if v is None else (f"{v:.2f}x" if c.unit == "x" else fmt(v, unit)))
                     for v in (c.predicted, c.measured)]
            checks.add_row(c.name, *shown, "" if c.ok is None else ("ok" if c.ok else "OFF"), c.note)
        console.print(checks)
    if report.out_dir:
        console.print(f"Captures and workload logs in {report.out_dir} (diagnoser diagnose FILE.dgc shows each "
                      "verdict).", markup=False, style="dim")
    else:
        console.print("Captures, workload logs and traces were in a temporary folder, now removed (--out DIR keeps "
                      "them).", markup=False, style="dim")
    if report.failed and not report.cpu_run:
        console.print(f"Self-test FAILED: {'; '.join(report.failed)}", style="bold red", markup=False)
    elif report.failed:
        console.print(f"Harness FAILED on the CPU: {'; '.join(report.failed)}", style="bold red", markup=False)
    elif report.cpu_run:
        console.print("Harness OK on the CPU. Run on a GPU for verdicts that count.", markup=False)
    else:
        console.print("Self-test passed: every verdict as expected and the physics agrees.", style="bold green",
                      markup=False)


def register(app: typer.Typer) -> None:
    @app.command("selftest")
    @handles_errors
    def selftest_cmd(
        scenarios: str = typer.Option("", "--scenarios", help="Comma-separated scenarios (default: all): "
                                      + ", ".join(DEFAULT_ORDER) + "."),
        device: str = typer.Option("auto", "--device", help="auto, cuda or cpu (toy size: tests the harness, "
                                   "never a GPU verdict)."),
        size: str = typer.Option("auto", "--size", help="auto (1-3B-parameter model sized to the GPU) or toy."),
        window: float | None = typer.Option(None, "--window", help="Seconds of counters per scenario (default 8 on "
                                            "a GPU, 3 on the CPU)."),
        trace: float | None = typer.Option(None, "--trace", help="Seconds of torch.profiler trace right after each "
                                           "window (0: none; default 2 on a GPU, 0.5 on the CPU)."),
        out: Path | None = typer.Option(None, "--out", help="Folder for captures and workload logs (default: a new "
                                        "temporary folder)."),
        record: Path | None = typer.Option(None, "--record", help="Also add each capture with its expected verdict "
                                           "to this GPU fixture folder (tests/fixtures/gpu); GPU runs only."),
        force: bool = typer.Option(False, "--force", help="Run even if another process uses the GPU."),
        compiled: bool = typer.Option(False, "--compile", help="Run the decode steps through torch.compile: fused "
                                      "kernels, a decode closer to its floor (not for --record)."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ) -> None:
        """Run workloads whose limiter is known (bandwidth, compute, batching/launch, VRAM, host) under attach, and
        check each verdict and the physics on this machine. Exit 1 if any verdict or physics check is off."""
        names = scenario_names(scenarios)
        err = Console(file=sys.stderr, no_color=True, highlight=False, soft_wrap=True)

        def say(message: str) -> None:  # progress on stderr, also with --json: stdout stays the JSON alone
            err.print(message, markup=False)

        if device.strip().lower() == "auto":
            say("looking for a GPU (loading PyTorch)")
        resolved = resolve_device(device.strip().lower())
        if record is not None and compiled:
            raise InputError("--record keeps the eager scenarios the fixtures describe; run --compile without it.")
        if record is not None and resolved == "cpu":
            raise InputError("--record keeps GPU recordings only; a CPU run is not a GPU fixture.")
        temporary = out is None
        out_dir = out or Path(tempfile.mkdtemp(prefix="diagnoser-selftest-"))
        terminated: list[int] = []

        def on_sigterm(signum: int, _frame: FrameType | None) -> None:
            terminated.append(signum)
            raise KeyboardInterrupt  # unwinds like Ctrl-C: the workload is stopped, the folder removed

        previous = catch((signal.SIGTERM,), on_sigterm)
        try:
            report, captures = run_selftest(names, device=resolved, size=size.strip().lower(), window_s=window,
                                            trace_s=trace, out_dir=out_dir, force=force, compiled=compiled,
                                            progress=say)
            if record is not None:
                written = record_fixtures(report, captures, record, command=" ".join(["diagnoser", *sys.argv[1:]]))
                report.notes.append(f"Recorded {len(written)} capture(s) in {record}.")
        except KeyboardInterrupt:
            if terminated:
                typer.echo("diagnoser: stopped by SIGTERM.", err=True)
                raise typer.Exit(EXIT_TERMINATED) from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if temporary:
                shutil.rmtree(out_dir, ignore_errors=True)
        if temporary:  # what the report would point to is gone
            report.out_dir = ""
            for r in report.results:
                r.capture_path = r.trace_path = ""
        if as_json:
            print_json(report.to_dict())
        else:
            render(report, Console(file=sys.stdout, width=140, no_color=not sys.stdout.isatty(), highlight=False))
        if report.failed:
            raise typer.Exit(EXIT_FAIL_ON)
