"""A signal-triggered torch.profiler window inside a running PyTorch server.

Add one line to the server (`import diagnoser.hook`), or start it unchanged with
`python -m diagnoser.hook -- <server command>`. Then `diagnoser trace PID --seconds 5 -o DIR` (or
`diagnoser attach PID --trace 5`) asks for a trace and gets a Chrome/Perfetto JSON file.

How: importing this module installs a handler for one real-time signal (SIGRTMIN+7 unless DIAGNOSER_HOOK_SIGNAL
names another) and registers the process in a per-user directory (diagnoser.tracing.protocol). The client writes
a request file and sends the signal. Python runs signal handlers on the main thread, between bytecodes, so the
profiler is started where the server's work runs: a profiler started from a side thread records nothing of the
main thread's ops (measured in shared/research/stack-notes.md). With torch's `profile_all_threads` the ops of the
server's other threads are recorded too; CUDA kernels are recorded process-wide by CUPTI either way. A timer
thread signals again after the requested seconds and the handler stops the profiler and exports the trace.

Safety: the window is clamped to MAX_SECONDS; no stacks or memory events are recorded (they multiply the size); a
request is refused when the output folder has less than MIN_FREE_BYTES free; a trigger while a window is open is
answered "busy" and changes nothing; every error is caught and reported in the status file, never raised into
the server. The server pauses only while the profiler starts, stops and writes the file (the status reports
these pauses in milliseconds).

Standard library only at import; torch is imported when a trace is requested, and only if the process has already
imported it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from diagnoser.tracing import protocol

MIN_FREE_BYTES = 256 << 20
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _default_signal() -> int:
    named = os.environ.get("DIAGNOSER_HOOK_SIGNAL", "").strip().upper()
    if named:  # "41", "SIGUSR2" or "SIGRTMIN+3"
        base, _, offset = named.partition("+")
        number = int(base) if base.isdigit() else int(getattr(signal, base))
        return number + (int(offset) if offset else 0)
    rt = getattr(signal, "SIGRTMIN", None)
    return int(rt) + 7 if rt is not None else int(signal.SIGUSR2)


class _Session:
    """One open profiler window."""

    def __init__(self, request_id: str, seconds: float, out_dir: Path, profiler: Any, started: float,
                 start_pause_ms: float, all_threads: bool) -> None:
        self.request_id = request_id
        self.seconds = seconds
        self.out_dir = out_dir
        self.profiler = profiler
        self.started = started
        self.start_pause_ms = start_pause_ms
        self.all_threads = all_threads
        self.stop_requested = False


class _Hook:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: Any = None
        self.session: _Session | None = None
        self.traces = 0
        self.pid = os.getpid()
        self.in_handler = False  # a second signal can be handled inside the first handler's Python code

    # --- installation -------------------------------------------------------------------------------

    def install(self, signum: int | None = None) -> bool:
        if self.signum is not None and self.pid == os.getpid():
            return True
        if threading.current_thread() is not threading.main_thread():
            _warn("diagnoser.hook: not installed: signal handlers can only be set from the main thread; call "
                  "diagnoser.hook.install() there.")
            return False
        self.pid = os.getpid()
        signum = _default_signal() if signum is None else signum
        current = signal.getsignal(signum)
        if current not in (signal.SIG_DFL, signal.SIG_IGN, None):
            _warn(f"diagnoser.hook: not installed: signal {signum} already has a handler in this process; set "
                  "DIAGNOSER_HOOK_SIGNAL to a free signal.")
            return False
        self.previous = current
        signal.signal(signum, self._on_signal)
        self.signum = signum
        try:
            protocol.ensure_registry_dir()
            protocol.write_json(protocol.registration_path(self.pid), {
                "pid": self.pid, "signal": signum, "start_ticks": protocol.process_start_ticks(self.pid),
                "protocol": protocol.PROTOCOL_VERSION, "python": sys.version.split()[0],
                "argv": sys.argv[:6], "installed_at": time.time(),
            })
        except OSError as exc:
            _warn(f"diagnoser.hook: installed, but cannot register in {protocol.registry_dir()}: {exc}")
        atexit.register(self.uninstall)
        return True

    def uninstall(self) -> None:
        if self.signum is None or self.pid != os.getpid():
            return
        try:
            signal.signal(self.signum, self.previous if self.previous is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass  # not on the main thread at exit: the process is going away anyway
        for path in (protocol.registration_path(self.pid), protocol.request_path(self.pid)):
            try:
                path.unlink()
            except OSError:
                pass
        self.signum = None

    # --- the signal handler (main thread) -------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.pid != os.getpid():  # a forked child inherited the handler: not registered, nothing to do
            return
        if self.in_handler:
            self._answer_busy()
            return
        self.in_handler = True
        try:
            session = self.session
            if session is not None:
                if session.stop_requested or time.monotonic() >= session.started + session.seconds:
                    self._stop(session)
                else:
                    self._answer_busy()
                return
            self._start()
        except Exception as exc:
            self._report_failure(exc)
        finally:
            self.in_handler = False

    def _answer_busy(self) -> None:
        request = self._take_request()
        if request is not None:
            self._status(request["id"], "busy", message="a trace window is already open in this process")
        elif self.session is not None and (self.session.stop_requested or
                                           time.monotonic() >= self.session.started + self.session.seconds):
            # the timer's stop signal arrived while a handler ran: stop on the next one
            threading.Timer(0.05, _resignal, (self.pid, self.signum)).start()

    def _take_request(self) -> dict[str, Any] | None:
        path = protocol.request_path(self.pid)
        request = protocol.read_json(path)
        try:
            path.unlink()
        except OSError:
            pass
        if request is None or not isinstance(request.get("id"), str) or not _ID.match(request["id"]):
            return None
        return request

    def _start(self) -> None:
        request = self._take_request()
        if request is None:
            return  # a stray signal: nothing was asked
        rid = request["id"]
        try:
            seconds = float(request.get("seconds", 5.0))
        except (TypeError, ValueError):
            seconds = 5.0
        seconds = min(protocol.MAX_SECONDS, max(protocol.MIN_SECONDS, seconds))
        out_dir = Path(str(request.get("out_dir") or ".")).expanduser()
        if "torch" not in sys.modules:
            self._status(rid, "error", message="this process has not imported torch: there is nothing to profile")
            return
        # Answer at once: the first profiler start in a process loads Kineto and can take seconds.
        self._status(rid, "accepted", seconds=seconds)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(out_dir).free
        except OSError as exc:
            self._status(rid, "error", message=f"cannot write to {out_dir}: {exc.strerror or exc}")
            return
        if free < MIN_FREE_BYTES:
            self._status(rid, "error", message=f"only {free >> 20} MB free in {out_dir}; a trace needs room")
            return
        t0 = time.perf_counter()
        profiler = None
        try:
            profiler, all_threads = _new_profiler()
            profiler.start()
        except Exception as exc:
            _stop_quietly(profiler)
            self._status(rid, "error", message=f"the profiler did not start: {type(exc).__name__}: {exc}")
            return
        try:
            profiler.add_metadata_json(_WINDOW_KEY, json.dumps({"pid": self.pid, "seconds": seconds,
                                                                 "request": rid, "all_threads": all_threads}))
        except Exception:
            pass
        pause_ms = (time.perf_counter() - t0) * 1e3
        session = _Session(rid, seconds, out_dir, profiler, time.monotonic(), pause_ms, all_threads)
        self.session = session
        self._status(rid, "started", seconds=seconds, start_pause_ms=pause_ms, all_threads=all_threads)
        signum = self.signum
        pid = self.pid

        def _stop_later() -> None:
            time.sleep(seconds)
            session.stop_requested = True
            try:
                os.kill(pid, signum)  # type: ignore[arg-type]
            except OSError:
                pass

        threading.Thread(target=_stop_later, name="diagnoser-hook-timer", daemon=True).start()

    def _stop(self, session: _Session) -> None:
        self.session = None
        t0 = time.perf_counter()
        try:
            session.profiler.stop()
            t1 = time.perf_counter()
            stamp = time.strftime("%Y%m%d-%H%M%S")
            final = session.out_dir / f"trace-{self.pid}-{stamp}-{session.request_id[:8]}.json"
            tmp = session.out_dir / f".{final.name}.part"
            session.profiler.export_chrome_trace(str(tmp))
            os.replace(tmp, final)
        except Exception as exc:
            _stop_quietly(session.profiler)
            self._status(session.request_id, "error", message=f"the trace could not be written: "
                         f"{type(exc).__name__}: {exc}")
            return
        t2 = time.perf_counter()
        self.traces += 1
        self._status(session.request_id, "done", path=str(final), seconds=session.seconds,
                     start_pause_ms=session.start_pause_ms, stop_pause_ms=(t1 - t0) * 1e3,
                     export_pause_ms=(t2 - t1) * 1e3, bytes=final.stat().st_size, all_threads=session.all_threads)

    def _status(self, rid: str, state: str, **fields: Any) -> None:
        try:
            protocol.write_json(protocol.status_path(self.pid, rid), {"id": rid, "state": state, **fields})
        except OSError as exc:
            _warn(f"diagnoser.hook: cannot write the status of request {rid}: {exc}")

    def _report_failure(self, exc: BaseException) -> None:
        session, self.session = self.session, None
        if session is not None:
            _stop_quietly(session.profiler)
        rid = session.request_id if session is not None else None
        message = f"{type(exc).__name__}: {exc}"
        if rid is not None:
            self._status(rid, "error", message=message)
        else:
            _warn(f"diagnoser.hook: trace request failed: {message}")


_WINDOW_KEY = "diagnoser_window"  # read by diagnoser.traces: the profiler window is the analysed window


def _new_profiler() -> tuple[Any, bool]:
    """A torch.profiler that records shapes (for FLOPs) and, where torch allows it, every thread's ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    try:
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True)
        return profile(activities=activities, record_shapes=True, experimental_config=config), True
    except (ImportError, TypeError):  # older torch: the thread that handles the signal (main) only
        return profile(activities=activities, record_shapes=True), False


def _resignal(pid: int, signum: int | None) -> None:
    if signum is not None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _stop_quietly(profiler: Any) -> None:
    if profiler is None:
        return
    try:
        profiler.stop()
    except Exception:
        pass


def _after_fork_in_child() -> None:
    """A forked worker (multiprocessing 'fork') inherits the handler: register it under its own pid."""
    hook = _HOOK
    if hook.signum is None:
        return
    hook.pid = os.getpid()
    hook.session = None
    try:
        protocol.write_json(protocol.registration_path(hook.pid), {
            "pid": hook.pid, "signal": hook.signum, "start_ticks": protocol.process_start_ticks(hook.pid),
            "protocol": protocol.PROTOCOL_VERSION, "python": sys.version.split()[0], "argv": sys.argv[:6],
            "installed_at": time.time(), "forked": True,
        })
    except OSError:
        pass


def _warn(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
    except Exception:
        pass


_HOOK = _Hook()


def install(signum: int | None = None) -> bool:
    """Install the trigger (idempotent). Importing this module calls it; call it yourself from the main thread if
    the import happened elsewhere. Returns whether the hook is active."""
    return _HOOK.install(signum)


def uninstall() -> None:
    _HOOK.uninstall()


def installed_signal() -> int | None:
    return _HOOK.signum


def traces_taken() -> int:
    return _HOOK.traces


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

if os.environ.get("DIAGNOSER_HOOK", "1") != "0":
    install()
