"""Stopping an engine server started in its own process group: SIGTERM to the group, then SIGKILL after a grace."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None, grace_s: float) -> None:
    """Stop the process group `proc` leads (the engine and the workers it forked); nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
