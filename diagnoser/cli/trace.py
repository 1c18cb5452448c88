"""`diagnoser trace PID --seconds N -o DIR [--url URL]`: take a torch.profiler trace of a running server, save it,
say how to open it in Perfetto, and print its analysis."""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.errors import InputError
from diagnoser.textsafe import printable


def register(app: typer.Typer) -> None:
    @app.command("trace")
    @handles_errors
    def trace_cmd(
        pid: int = typer.Argument(..., help="The server's process id (its children are traced too)."),
        seconds: float = typer.Option(2.0, "--seconds", "-s", help="Length of the profiler window (a CUDA-graph decode "
                                      "on an H100 writes about 230 MB of trace per second)."),
        out: Path = typer.Option(Path("."), "--out", "-o", help="Folder to save the trace in."),
        url: str | None = typer.Option(None, "--url", help="The server's base URL, to use vLLM/SGLang's own "
                                       "/start_profile and /stop_profile endpoints."),
        analyze: bool = typer.Option(True, "--analyze/--no-analyze", help="Print the trace analysis after."),
    ) -> None:
        """Take a torch.profiler trace of a running PyTorch server (hook, vLLM/SGLang endpoints, or Kineto daemon)."""
        from diagnoser.tracing.acquire import acquire_trace_detailed, perfetto_hint

        if not seconds > 0 or seconds > 120:
            raise InputError("--seconds takes a number of seconds between 0 and 120.")
        typer.echo(f"Tracing pid {pid} for {seconds:g} s ...", err=True)
        acquired = acquire_trace_detailed(pid, seconds, out, url)
        typer.echo(f"Trace saved: {acquired.path} (via {acquired.method}"
                   + (f", {len(acquired.files)} processes" if len(acquired.files) > 1 else "") + ").")
        for traced_pid, ms in acquired.pauses_ms().items():
            typer.echo(f"  pid {traced_pid} was paused {ms:.0f} ms by the profiler's start, stop and export.")
        for note in acquired.notes:
            typer.echo(f"  note: {note}")
        typer.echo(perfetto_hint(acquired.path))
        if analyze:
            from diagnoser.reports.trace_text import render_analysis
            from diagnoser.traces import analyze_trace

            typer.echo("")
            for line in render_analysis(analyze_trace(acquired.path)):
                typer.echo(printable(line))  # kernel and op names come from the traced process
