"""The target process and its descendants, as the collectors see them during a window.

Serving engines split across processes (vLLM runs an API server, an engine core and one worker per GPU), so every
collector works on the tree under the target PID. Listing descendants scans all of /proc, so the tree is refreshed
every few seconds rather than every sample: engines spawn their workers at start-up, not mid-window.
"""

from __future__ import annotations

import math
import os

import psutil

from diagnoser.capture import ProcessInfo

TREE_REFRESH_S = 5.0


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (one we may not signal counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

ZOMBIE_CHECK_S = 0.5


class ProcessTree:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.root = psutil.Process(pid)
        self._members: dict[int, psutil.Process] = {pid: self.root}
        self._refreshed_at = -math.inf
        self._status_at = -math.inf
        self.exited_at: float | None = None

    def refresh(self, t: float, *, force: bool = False) -> None:
        if not force and t - self._refreshed_at < TREE_REFRESH_S:
            return
        self._refreshed_at = t
        try:
            children = self.root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return
        except psutil.AccessDenied:
            children = []
        members = {self.pid: self.root}
        for child in children:
            # Keep the Process object we already hold: it carries psutil's cached create time and CPU baselines.
            members[child.pid] = self._members.get(child.pid, child)
        self._members = members

    def processes(self, t: float) -> list[psutil.Process]:
        self.refresh(t)
        return list(self._members.values())

    def pids(self, t: float) -> set[int]:
        self.refresh(t)
        return set(self._members)

    def children(self) -> list[int]:
        return sorted(p for p in self._members if p != self.pid)

    def forget(self, pid: int) -> None:
        if pid != self.pid:
            self._members.pop(pid, None)

    def alive(self, t: float) -> bool:
        """False once the target PID is gone or a zombie (exited but not yet reaped by its parent).

        Called every sampler tick, so the common case is one signal-0 syscall; the zombie check reads
        /proc/<pid>/stat and runs every ZOMBIE_CHECK_S (a reaped process is caught by the syscall at once).
        """
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, another user's: the status read below still works
        if t - self._status_at < ZOMBIE_CHECK_S:
            return True
        self._status_at = t
        try:
            return self.root.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return self.root.is_running()

    def info(self) -> ProcessInfo:
        root = self.root
        info = ProcessInfo(pid=self.pid, children=self.children())
        try:
            with root.oneshot():
                info.name = root.name()
                info.user = root.username()
                info.cmdline = root.cmdline()
        except (psutil.Error, KeyError):
            # KeyError: a UID with no passwd entry (common in containers); the rest is still useful.
            pass
        return info
