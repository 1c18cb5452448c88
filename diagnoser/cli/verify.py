"""`diagnoser verify PID | --port PORT`: the loop closed live. Observe the server and keep its first fix and that
fix's estimate; wait for the server to come back on the same port with a change (a new process, other flags); let
the load settle; observe the same window again; then print what `diagnoser compare` prints: what changed, and the
realised gain against the estimate, a regression called one.
"""

from __future__ import annotations

import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from diagnoser.cli.attach import LiveView, add_model
from diagnoser.cli.common import handles_errors
from diagnoser.collectors.base import DEFAULT_DURATION_S, DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from diagnoser.errors import DiagnoserError, InputError, SourceUnavailable
from diagnoser.interrupts import arm, ends_window_on_signals

if TYPE_CHECKING:
    from diagnoser.capture import Capture
    from diagnoser.collectors.target import AttachTarget
    from diagnoser.pipeline import Outcome

POLL_S = 2.0  # how often the port is asked whether the server is back


def port_of(target: AttachTarget) -> int | None:
    """The port the server answers on: the one named, else its metrics URL's (the restarted server keeps it)."""
    if target.port is not None:
        return target.port
    if target.metrics_url:
        return urllib.parse.urlparse(target.metrics_url).port
    return None


def changed(before: AttachTarget, now: AttachTarget) -> str:
    """What differs between the server observed and the one on the port now ("" when it is the same process with
    the same command line)."""
    if now.pid != before.pid:
        return f"pid {before.pid} -> {now.pid}"
    if now.cmdline != before.cmdline:
        return "its command line changed"
    return ""


def wait_for_change(before: AttachTarget, port: int, wait_s: float, say: Callable[[str], None],
                    resolve: Callable[[int], AttachTarget], poll_s: float = POLL_S,
                    stopped: Callable[[], bool] = lambda: False) -> AttachTarget:
    """The server on `port` once it answers again as a changed process; SourceUnavailable after `wait_s` or when
    `stopped` (Ctrl-C) says so."""
    deadline = time.monotonic() + wait_s
    state = ""
    while time.monotonic() < deadline:
        if stopped():
            raise SourceUnavailable("stopped before the server came back.")
        news = _news(before, port, resolve)
        if not isinstance(news, str):
            say(f"diagnoser: the server on port {port} is back: {changed(before, news)}")
            return news
        if news != state:
            say(f"diagnoser: the server on port {port} is {news}; waiting for it to come back with the change")
            state = news
        time.sleep(poll_s)
    raise SourceUnavailable(f"the server on port {port} did not come back with a change within {wait_s:g} s "
                            "(--wait); restart it with the fix applied, or give a longer --wait.")


def _news(before: AttachTarget, port: int, resolve: Callable[[int], AttachTarget]) -> AttachTarget | str:
    """The changed server on the port, or what it is doing instead."""
    try:
        now = resolve(port)
    except DiagnoserError:
        return "down (restarting?)"
    if not now.metrics_url:
        return "up, its metrics not answering yet"
    return now if changed(before, now) else "unchanged"


def _first_fix_lines(outcome: Outcome) -> list[str]:
    d = outcome.diagnosis
    if not d.fixes:
        return [f"diagnoser: {d.headline}",
                "diagnoser: no fix is offered, so the comparison will grade only the change you make."]
    f = d.fixes[0]
    if f.gain is None:
        gain = "no gain estimated"
    else:
        gain = f"{'up to' if f.gain_kind.value == 'upper_bound' else 'about'} x{f.gain:.2g}"
    return [f"diagnoser: {d.headline}", f"diagnoser: first fix: {f.title} ({gain}): {f.action}"]


def register(app: typer.Typer) -> None:
    @app.command("verify")
    @handles_errors
    @ends_window_on_signals
    def verify_cmd(
        pid: int | None = typer.Argument(None, help="PID of the server (its port is read from its metrics URL)."),
        port: int | None = typer.Option(None, "--port", help="The port the server listens on, before and after."),
        duration: float = typer.Option(DEFAULT_DURATION_S, "--duration", "-d", help="Seconds to observe, each time."),
        interval: float = typer.Option(DEFAULT_INTERVAL_S, "--interval", help="Seconds between GPU samples."),
        wait: float = typer.Option(1800.0, "--wait", help="Seconds to wait for the server to come back changed."),
        settle: float = typer.Option(10.0, "--settle", help="Seconds of load after the restart before the second "
                                     "window (the batch and queue reach their steady state)."),
        save_dir: Path | None = typer.Option(None, "--save-dir", help="Keep before.dgc and after.dgc here.",
                                             file_okay=False),
        as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
        model: str | None = typer.Option(None, "--model", help="The served model (as attach's --model)."),
    ) -> None:
        """Diagnose a server, wait for it to come back with a change, measure again, and grade the first fix."""
        from diagnoser.collectors.session import collect
        from diagnoser.collectors.target import resolve_target
        from diagnoser.compare import LOSS, compare
        from diagnoser.physics import resolve_model
        from diagnoser.pipeline import Pipeline
        from diagnoser.reports import compare as view

        for name, value, least in (("--duration", duration, 0.0), ("--wait", wait, 0.0), ("--settle", settle, -1e-9)):
            if not value > least:
                raise InputError(f"{name} must be {'positive' if least == 0 else 'zero or more'}, not {value:g}.")
        if not interval >= MIN_INTERVAL_S:
            raise InputError(f"--interval must be at least {MIN_INTERVAL_S:g} s, not {interval:g}.")
        folder = save_dir or Path(tempfile.mkdtemp(prefix="diagnoser-verify-"))
        folder.mkdir(parents=True, exist_ok=True)
        user_model = resolve_model(model) if model is not None else None
        target = resolve_target(pid, port, None)
        server_port = port_of(target)
        if server_port is None:
            raise InputError("verify needs the server's port to find it again after the restart: give --port.")

        def window(on: AttachTarget, name: str) -> Outcome:
            def observe() -> Capture:
                stop = arm()
                with LiveView(f"{name}: {on.description} for {duration:g} s") as live:
                    capture = collect(on, duration, interval, on_sample=live, stop_event=stop.event)
                stop.check_captured(any(s.values for s in capture.series))
                capture.origin = "attach"
                add_model(capture, user_model, on)
                return capture

            outcome = Pipeline(save_to=folder / f"{name}.dgc").run(observe)
            typer.echo(f"diagnoser: saved the {name} window to {folder / f'{name}.dgc'}", err=True)
            return outcome

        say = LiveView("verify").say
        before = window(target, "before")
        for line in _first_fix_lines(before):
            say(line)
        say(f"diagnoser: apply it and restart the server on port {server_port}; waiting up to {wait:g} s")
        stop = arm()
        try:
            now = wait_for_change(target, server_port, wait, say, lambda p: resolve_target(None, p, None),
                                  stopped=lambda: stop.stopped)
        except (KeyboardInterrupt, SourceUnavailable) as exc:
            why = str(exc).rstrip(".") if isinstance(exc, SourceUnavailable) else "stopped before the server came back"
            raise SourceUnavailable(f"{why}; the first window is in {folder / 'before.dgc'}.") from None
        if settle > 0:
            say(f"diagnoser: letting the load settle for {settle:g} s")
            time.sleep(settle)
        after = window(now, "after")
        result = compare(before, after)
        if as_json:
            sys.stdout.write(view.render_json(result) + "\n")
        else:
            view.render_terminal(result, sys.stdout)
        if any(p.applied and p.verdict == LOSS for p in result.predictions):
            raise typer.Exit(1)
