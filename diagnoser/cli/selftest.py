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
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import typer
from rich.console import Console

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import EXIT_FAIL_ON, EXIT_TERMINATED, InputError
from diagnoser.interrupts import catch
from diagnoser.reports.selftest_text import render
from diagnoser.selftest.harness import SelftestReport, resolve_device, run_selftest, scenario_names
from diagnoser.selftest.record import record_fixtures
from diagnoser.selftest.scenarios import DEFAULT_ORDER


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
        _check_record(record, compiled=compiled, device=resolved)
        report = _run(names, resolved, size=size.strip().lower(), window=window, trace=trace, out=out, record=record,
                      force=force, compiled=compiled, say=say)
        if as_json:
            print_json(report.to_dict())
        else:
            render(report, Console(file=sys.stdout, width=140, no_color=not sys.stdout.isatty(), highlight=False))
        if report.failed:
            raise typer.Exit(EXIT_FAIL_ON)


def _check_record(record: Path | None, *, compiled: bool, device: str) -> None:
    """--record keeps what the fixtures describe: eager scenarios on a GPU."""
    if record is not None and compiled:
        raise InputError("--record keeps the eager scenarios the fixtures describe; run --compile without it.")
    if record is not None and device == "cpu":
        raise InputError("--record keeps GPU recordings only; a CPU run is not a GPU fixture.")


def _run(names: list[str], device: str, *, size: str, window: float | None, trace: float | None, out: Path | None,
         record: Path | None, force: bool, compiled: bool, say: Callable[[str], None]) -> SelftestReport:
    """Run the scenarios (and record them); a temporary folder is removed on every way out, SIGTERM included."""
    temporary = out is None
    out_dir = out or Path(tempfile.mkdtemp(prefix="diagnoser-selftest-"))
    terminated: list[int] = []

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt  # unwinds like Ctrl-C: the workload is stopped, the folder removed

    previous = catch((signal.SIGTERM,), on_sigterm)
    try:
        report, captures = run_selftest(names, device=device, size=size, window_s=window, trace_s=trace,
                                        out_dir=out_dir, force=force, compiled=compiled, progress=say)
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
    return report
