"""The client side of diagnoser.hook: find the hooked processes of a target, ask them for a trace, wait for it."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.collectors.process import pid_alive
from diagnoser.errors import SourceUnavailable
from diagnoser.tracing import protocol

ACK_TIMEOUT_S = 15.0  # a hooked process answers as soon as its main thread runs Python again
START_TIMEOUT_S = 120.0  # the first profiler start in a process loads Kineto: seconds on a busy host
EXPORT_ALLOWANCE_S = 120.0  # writing a large trace takes time after the window closes


@dataclass
class HookedProcess:
    pid: int
    signum: int
    registry: Path  # the directory it registered in
    argv: list[str] = field(default_factory=list)


def process_tree(pid: int) -> list[int]:
    """The pid and all its descendants; SourceUnavailable when there is no such process."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        raise SourceUnavailable(f"no process {pid}.") from None
    except psutil.AccessDenied:
        return [pid]


def catches_signal(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (the SigCgt mask in /proc/<pid>/status): a signal nobody
    handles would kill it, so it is never sent then."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def find_hooked(pid: int) -> list[HookedProcess]:
    """The hooked processes among pid and its descendants (registered, same process, handler still in place)."""
    found = []
    for p in process_tree(pid):
        base = protocol.registry_dir_of(p)
        reg = protocol.read_json(protocol.registration_path(p, base))
        if reg is None or not isinstance(reg.get("signal"), int):
            continue
        if reg.get("start_ticks") is not None and reg["start_ticks"] != protocol.process_start_ticks(p):
            continue  # a stale file from an earlier process that had the same pid
        if not catches_signal(p, reg["signal"]):
            continue
        found.append(HookedProcess(p, reg["signal"], base, [str(a) for a in reg.get("argv", [])]))
    return found


def trace_hooked(procs: list[HookedProcess], seconds: float, out_dir: Path,
                 ack_timeout: float = ACK_TIMEOUT_S) -> tuple[list[Path], list[dict[str, Any]]]:
    """Ask every process for a window of `seconds`; return the trace files and each process's final status."""
    rid = uuid.uuid4().hex[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    asked: list[HookedProcess] = []
    statuses: list[dict[str, Any]] = []
    for p in procs:
        protocol.write_json(protocol.request_path(p.pid, p.registry), {"id": rid, "seconds": seconds,
                                                                        "out_dir": str(out_dir.resolve())})
        try:
            os.kill(p.pid, p.signum)
            asked.append(p)
        except ProcessLookupError:
            statuses.append({"pid": p.pid, "state": "error", "message": "the process exited"})
        except PermissionError:
            statuses.append({"pid": p.pid, "state": "error", "message": "no permission to signal it"})
    t0 = time.monotonic()
    pending = {p.pid: p for p in asked}
    base = {p.pid: p.registry for p in asked}
    accepted: set[int] = set()
    started: dict[int, float] = {}
    while pending:
        now = time.monotonic()
        for pid in list(pending):
            status = protocol.read_json(protocol.status_path(pid, rid, base[pid]))
            state = status.get("state") if status else None
            if state == "accepted":
                accepted.add(pid)
            elif state == "started":
                accepted.add(pid)
                started.setdefault(pid, now)
            elif state in ("done", "error", "busy"):
                statuses.append({"pid": pid, **status})  # type: ignore[dict-item]
                _remove(protocol.status_path(pid, rid, base[pid]))
                del pending[pid]
                continue
            if not pid_alive(pid):
                statuses.append({"pid": pid, "state": "error", "message": "the process exited during the trace"})
                del pending[pid]
            elif pid not in accepted and now - t0 > ack_timeout:
                statuses.append({"pid": pid, "state": "error", "message": f"no answer within {ack_timeout:.0f} s "
                                 "(its main thread may be stuck in a long call)"})
                _remove(protocol.request_path(pid, base[pid]))
                del pending[pid]
            elif pid not in started and now - t0 > ack_timeout + START_TIMEOUT_S:
                statuses.append({"pid": pid, "state": "error", "message": "the profiler did not start in time"})
                del pending[pid]
            elif pid in started and now - started[pid] > seconds + EXPORT_ALLOWANCE_S:
                statuses.append({"pid": pid, "state": "error", "message": "the trace was not written in time"})
                del pending[pid]
        time.sleep(0.05)
    paths = [Path(s["path"]) for s in statuses if s.get("state") == "done" and s.get("path")]
    return paths, statuses


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
