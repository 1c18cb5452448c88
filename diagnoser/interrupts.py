"""SIGINT and SIGTERM as a request to end the observation window, not the process.

A user ends a window with Ctrl-C (SIGINT); `timeout`, systemd and Kubernetes stop a program with SIGTERM. Either way
what was observed until then is still worth saving and diagnosing. A command that observes a window is decorated
with `@ends_window_on_signals` and calls `arm()` right before its window starts; from then on the first SIGINT or
SIGTERM only sets `stop.event` (a `StopRequest`, the event the sampler watches) and is remembered. The command then
ends its window, saves, diagnoses and prints as usual, and exits with its usual code after Ctrl-C, or with
EXIT_TERMINATED (143 = 128 + SIGTERM, what a shell reports for a program SIGTERM killed) after SIGTERM, so that a
supervisor still sees the program was stopped. A second signal raises KeyboardInterrupt in the main thread: the
command ends at once ("interrupted.", exit 130), once the window's last sample is taken (`run_sampler` waits for it).

An ignored SIGINT stays ignored, as Python itself leaves it at startup: a shell starts a script's background jobs
with SIGINT ignored so that a Ctrl-C meant for the script's foreground does not stop them (`diagnoser agent &` in a
node's start-up script). SIGTERM is always handled.

Handlers can only be installed from the main thread; elsewhere (a library caller's worker thread) `arm()` installs
none and the caller's own stop event and KeyboardInterrupt handling apply. The handlers are restored when the
decorated command returns, so a command run in-process (typer's test runner) leaves the process as it found it.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import typer

from diagnoser.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, DiagnoserError

F = TypeVar("F", bound=Callable[..., Any])
_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def signal_label(signum: int) -> str:
    """'Ctrl-C' for SIGINT, 'SIGTERM', else the signal's name."""
    if signum in _NAMES:
        return _NAMES[signum]
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest(threading.Event):
    """An event that also says who set it: `how` completes "the window was ended early ...", e.g. "by Ctrl-C"."""

    def __init__(self) -> None:
        super().__init__()
        self.how = "on request"

    def request(self, how: str) -> None:
        if not self.is_set():
            self.how = how
        self.set()


class Interrupted(DiagnoserError):
    """A signal came before anything was captured: one sentence, exit 130 (Ctrl-C) or 143 (SIGTERM)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def catch(signals: tuple[int, ...], handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
    """`handler` for each of `signals` but an inherited ignored SIGINT; the handlers replaced, by signal, to put
    back."""
    previous: dict[int, Any] = {}
    for sig in signals:
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, handler)
    return previous


class StopOnSignals:
    """The first SIGINT/SIGTERM after `install()` sets `event`; a second raises KeyboardInterrupt."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = signals
        self.event = StopRequest()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = catch(self.signals, self._handle)
        return self

    def restore(self) -> None:
        """Put the handlers back as they were (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            self.event.request(f"by {signal_label(signum)}")
            return
        raise KeyboardInterrupt  # the second signal: the user (or the supervisor) insists

    @property
    def stopped(self) -> bool:
        return self.received is not None

    @property
    def terminated(self) -> bool:
        """SIGTERM was received: the command ends with EXIT_TERMINATED once its work is saved."""
        return self.received == signal.SIGTERM

    def check_captured(self, captured: bool) -> None:
        """Raise `Interrupted` when the window was stopped before anything was captured (nothing to diagnose)."""
        if self.received is not None and not captured:
            code = EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED
            raise Interrupted(f"interrupted {self.event.how} before anything was captured.", code)


_active: list[StopOnSignals] = []


def arm() -> StopOnSignals:
    """Install the handlers of the running command (decorated with `ends_window_on_signals`) and return them."""
    if not _active:  # outside a decorated command (a library caller): its own signal handling stays as it is
        return StopOnSignals()
    return _active[-1].install()


def ends_window_on_signals(func: F) -> F:
    """For a command that observes a window: its `arm()` handlers are removed when it returns, and after SIGTERM it
    exits EXIT_TERMINATED (its saved capture and printed diagnosis are already out)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        guard = StopOnSignals()
        _active.append(guard)
        try:
            result = func(*args, **kwargs)
        except typer.Exit as exc:
            if guard.terminated and exc.exit_code != EXIT_TERMINATED:
                raise typer.Exit(EXIT_TERMINATED) from None
            raise
        finally:
            guard.restore()
            _active.remove(guard)
        if guard.terminated:
            raise typer.Exit(EXIT_TERMINATED)
        return result

    return wrapper  # type: ignore[return-value]
