"""`diagnoser attach PID | --port PORT`: observe a running server for a window, then give the verdict.

No restart and no code change: NVML/GPM for the GPU, psutil for the host, the server's own /metrics. Ctrl-C ends the
window early and still diagnoses (and saves, with --save) what was collected; so does SIGTERM, after which the
command exits 143.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from diagnoser import signals as S
from diagnoser.capture import Capture, ModelInfo, TraceCost
from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.collectors.base import DEFAULT_DURATION_S, DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from diagnoser.errors import DiagnoserError, InputError
from diagnoser.interrupts import arm, ends_window_on_signals
from diagnoser.textsafe import one_line
from diagnoser.units import fmt

if TYPE_CHECKING:  # the collectors (NVML, psutil, HTTP) load when the command runs, not with every CLI call
    from diagnoser.collectors.session import Progress
    from diagnoser.collectors.target import AttachTarget


class LiveView:
    """The progress line on stderr: a rich live line on a terminal, nothing but one-off messages otherwise."""

    def __init__(self, label: str) -> None:
        self.console = Console(stderr=True, highlight=False)
        self.label = label
        self.live: Live | None = None
        self.said_cpu_only = False

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            self.live = Live(_line(self.label), console=self.console, refresh_per_second=4, transient=True)
            self.live.__enter__()
        else:
            self.say(f"diagnoser: {self.label}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def say(self, message: str) -> None:
        # Messages quote command lines and endpoints' answers: control characters are shown, not sent.
        self.console.print(one_line(message), markup=False, highlight=False, soft_wrap=True)

    def __call__(self, p: Progress) -> None:
        if p.cpu_only and not self.said_cpu_only:
            self.said_cpu_only = True
            reason = f" ({p.gpu_problem})" if p.gpu_problem else ""
            self.say(f"diagnoser: no GPU visible{reason}; diagnosing host and server signals only.")
        if self.live is not None:
            self.live.update(_line(progress_line(p)))


def _line(text: str) -> Text:
    return Text(one_line(text), no_wrap=True, overflow="ellipsis")  # one line, cut to the terminal's width


def progress_line(p: Progress) -> str:
    """'4.2/10 s  GPU busy 63 %  ...' from the newest numbers; absent signals are left out, never shown as 0."""
    v = p.latest
    parts = [f"{min(p.elapsed_s, p.duration_s):4.1f}/{p.duration_s:g} s"]
    for name, label, unit in ((S.GPU_BUSY, "GPU busy", "ratio"), (S.GPU_SM_ACTIVE, "SM", "ratio"),
                              (S.GPU_DRAM_ACTIVE, "DRAM", "ratio"), (S.GPU_MEM_USED_BYTES, "mem", "bytes"),
                              (S.GPU_POWER_W, "power", "W"), (S.HOST_TARGET_CPU, "CPU", "cores"),
                              (S.HOST_TARGET_BUSIEST_THREAD, "top thread", "ratio"),
                              (S.SERVER_RUNNING, "running", ""), (S.SERVER_WAITING, "waiting", ""),
                              (S.SERVER_KV_USAGE, "KV", "ratio"), (S.SERVER_GEN_TOKENS_PER_S, "gen", "tok/s")):
        if name in v:
            parts.append(f"{label} {fmt(v[name], unit)}")
    return "  ".join(parts)


def add_trace(capture: Capture, target: AttachTarget, seconds: float, out_dir: Path, view: LiveView) -> None:
    """Take and analyse a torch.profiler trace after the counter window, and measure what it cost the server's
    throughput; a failure is recorded, not fatal."""
    from diagnoser.traces import analyze_trace
    from diagnoser.tracing import cost
    from diagnoser.tracing.acquire import acquire_trace_detailed, perfetto_hint

    if target.pid is None:
        capture.mark_unavailable("trace", "trace.*", "--trace needs a process to trace (give a PID or --port)")
        return
    pid = target.pid
    server_url = target.metrics_url.rsplit("/metrics", 1)[0] if target.metrics_url else None
    means = {s.name: sum(s.values) / len(s.values) for s in capture.series
             if s.name.startswith("server.") and s.values}
    view.say(f"diagnoser: tracing pid {target.pid} for {seconds:g} s")
    try:
        acquired, spent = cost.measure(lambda: acquire_trace_detailed(pid, seconds, out_dir, server_url),
                                       target.metrics_url, cost.window_rates(means))
        spent.pauses_ms = acquired.pauses_ms()
        view.say(f"diagnoser: trace written to {acquired.path} (via {acquired.method})")
        view.say(f"diagnoser: {perfetto_hint(acquired.path)}")
        view.say(f"diagnoser: {spent.sentence()}")
        capture.notes.append(spent.sentence())
        capture.serving.trace_cost = TraceCost(**spent.to_dict())
        capture.trace = analyze_trace(acquired.path).summary
    except DiagnoserError as exc:
        capture.mark_unavailable("trace", "trace.*", str(exc).rstrip("."))
        view.say(f"diagnoser: no trace: {exc}")
    except Exception as exc:
        capture.mark_unavailable("trace", "trace.*", f"tracing failed ({type(exc).__name__}: {exc})")
        view.say(f"diagnoser: no trace: tracing failed ({type(exc).__name__}: {exc}).")


def add_model(capture: Capture, model: ModelInfo | None, target: AttachTarget) -> None:
    """The model's shape: from --model, else from a config.json the server's command line points at; then the
    precision and tensor parallelism the command line serves it with."""
    from diagnoser.physics import load_hf_config
    from diagnoser.physics.models import apply_serving_flags

    if model is not None:
        capture.model = model
    elif target.model_config is not None:
        try:
            capture.model = load_hf_config(target.model_config)
            capture.notes.append(f"Model shape read from {target.model_config} (the server's command line).")
        except DiagnoserError as exc:
            capture.notes.append(f"The server's model config could not be read ({exc}); give --model.")
    apply_serving_flags(capture)


def register(app: typer.Typer) -> None:
    @app.command("attach")
    @handles_errors
    @ends_window_on_signals
    def attach_cmd(
        pid: int | None = typer.Argument(None, help="PID of the server; its child processes are included."),
        port: int | None = typer.Option(None, "--port", help="Attach to the process listening on this TCP port "
                                        "and read its /metrics."),
        metrics_url: str | None = typer.Option(None, "--metrics-url", help="The server's Prometheus endpoint, "
                                               "when it is not http://127.0.0.1:PORT/metrics."),
        duration: float = typer.Option(DEFAULT_DURATION_S, "--duration", "-d", help="Seconds to observe."),
        interval: float = typer.Option(DEFAULT_INTERVAL_S, "--interval", help="Seconds between GPU samples."),
        save_to: Path | None = typer.Option(None, "--save", help="Write the capture to this file (.dgc).",
                                            dir_okay=False),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
        html: Path | None = typer.Option(None, "--html", help="Also write the HTML report to this file.",
                                         dir_okay=False),
        model: str | None = typer.Option(None, "--model", help="The served model: a config.json, a folder with one, "
                                         "or a bundled model name (diagnoser theory --list-models)."),
        usd_per_gpu_hour: float | None = typer.Option(None, "--usd-per-gpu-hour", help="What one GPU hour costs "
                                                      "you, for the cost per million tokens."),
        trace: float | None = typer.Option(None, "--trace", help="After the window, take a torch.profiler trace "
                                           "of this many seconds and add its analysis."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
    ) -> None:
        """Attach to a running inference server, observe it, and say what limits it."""
        command_started = time.time()
        from diagnoser.collectors.session import Progress, collect
        from diagnoser.collectors.target import resolve_target
        from diagnoser.physics import resolve_model
        from diagnoser.pipeline import Pipeline
        from diagnoser.rules import load_thresholds

        # Everything that can be wrong with the options fails before the window, not after it.
        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(rules_config) if rules_config else None
        if trace is not None:
            if not trace > 0:
                raise InputError("--trace takes a positive number of seconds.")
        if not duration > 0:
            raise InputError(f"--duration must be positive, not {duration:g}.")
        if not interval >= MIN_INTERVAL_S:
            raise InputError(f"--interval must be at least {MIN_INTERVAL_S:g} s, not {interval:g}.")
        if usd_per_gpu_hour is not None and not usd_per_gpu_hour >= 0:
            raise InputError(f"--usd-per-gpu-hour must be zero or more, not {usd_per_gpu_hour:g}.")
        user_model = resolve_model(model) if model is not None else None
        pipeline = Pipeline(overrides=overrides, save_to=save_to, html=html)  # outputs checked before any probe
        target = resolve_target(pid, port, metrics_url)

        def observe() -> Capture:
            stop = arm()  # SIGINT/SIGTERM now end the window, which is still saved and diagnosed (interrupts.py)
            with LiveView(f"attaching to {target.description} for {duration:g} s (Ctrl-C ends early)") as view:
                capture = collect(target, duration, interval, on_sample=view, stop_event=stop.event)
            stop.check_captured(any(s.values for s in capture.series))
            capture.origin = "attach"
            if usd_per_gpu_hour is not None:
                capture.serving.usd_per_gpu_hour = usd_per_gpu_hour
            if capture.cpu_only and not view.said_cpu_only:  # a window too short for a progress report
                view(Progress(capture.duration_s, duration, {}, True, _gpu_problem(capture)))
            if capture.process is not None and capture.process.exited_at_s is not None:
                view.say(f"diagnoser: pid {capture.process.pid} exited {capture.process.exited_at_s:.1f} s into "
                         "the window; diagnosing what was captured until then.")
            line, note = window_said(capture, command_started)
            view.say(line)
            if note:
                capture.notes.append(note)
            add_model(capture, user_model, target)
            return capture

        steps = []
        if trace is not None:
            trace_dir = save_to.parent if save_to else Path(tempfile.mkdtemp(prefix="diagnoser-trace-"))
            steps.append(lambda capture: add_trace(capture, target, trace, trace_dir, LiveView("tracing")))
        # Saved after the window and again after the trace, so neither the trace nor a second Ctrl-C can lose it.
        outcome = pipeline.run(observe, steps)
        if save_to is not None:
            typer.echo(f"diagnoser: saved the capture to {save_to}", err=True)
        show(outcome, as_json=as_json, fail_on=wanted, verbose=verbose)


# A window that began this long after the command is said in the capture's notes, not only on the terminal.
LATE_START_S = 2.0


def window_said(capture: Capture, command_started: float) -> tuple[str, str]:
    """Where the window lay relative to the command (a host that stalls new processes began a 15 s window 16-34 s
    after it, read by the user as "the last 15 s"), and how the load visibly ended inside it: the line attach
    prints, and the note the capture keeps ("" when the window began on time and the load ran through it)."""
    from diagnoser.compare import load_ended

    began = capture.started_at - command_started
    ended = began + capture.duration_s
    line = (f"diagnoser: the window ran from {began:.1f} s to {ended:.1f} s after the command started "
            f"({capture.duration_s:.1f} s observed)")
    notes = []
    if began >= LATE_START_S:
        notes.append(f"The window began {began:.1f} s after the command and ended {ended:.1f} s after it: it describes "
                     "those seconds, not the moments before the command.")
    stopped = load_ended(capture)
    if stopped:
        line += f"; the load ended inside it: {stopped}"
        notes.append(f"The load ended inside the window ({stopped}): the rates describe a server running out of "
                     "work, not its load; attach again while the load runs through the whole window.")
    return line + ".", " ".join(notes)


def _gpu_problem(capture: Capture) -> str:
    return next((u.reason for u in capture.unavailable if u.source == "nvml" and u.what == "gpu.*"), "")
