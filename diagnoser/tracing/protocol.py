"""The files a hooked process and `diagnoser trace` exchange. Standard library only: this module is imported inside
the traced server, whose environment may not have diagnoser's dependencies.

Layout, in a per-user directory (mode 0700; DIAGNOSER_HOOK_DIR overrides it):
  <pid>.json                     written by the hook at install: pid, signal, process start time, version
  <pid>.request.json             written by the client before it signals: id, seconds, out_dir
  <pid>.<id>.status.json         written by the hook: state accepted | started | done | error | busy, trace
                                 path, pauses
Every file is written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
# The longest window a request may ask for; the hook clamps to it whatever the client sends.
# A GPU decode writes ~230 MB of trace per second (measured on an H100); the profiler holds it all in memory until
# stop, so the window is clamped well below what would fill a host.
MAX_SECONDS = 30.0
MIN_SECONDS = 0.05


def registry_dir(environ: dict[str, str] | None = None, uid: int | None = None) -> Path:
    """This process's registry (or, given another process's environment and uid, that process's)."""
    env = os.environ if environ is None else environ
    override = env.get("DIAGNOSER_HOOK_DIR")
    if override:
        return Path(override)
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.access(runtime, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"diagnoser-hook-{os.getuid() if uid is None else uid}"


def registry_dir_of(pid: int) -> Path:
    """Where a hooked process registered: computed from its own environment and user, which may differ from the
    client's (another DIAGNOSER_HOOK_DIR, another user seen by root). Falls back to the client's registry."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        environ = dict(item.split("=", 1) for item in raw if "=" in item)
        uid = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return registry_dir()
    return registry_dir(environ, uid)


def ensure_registry_dir(base: Path | None = None) -> Path:
    d = registry_dir() if base is None else base
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def registration_path(pid: int, base: Path | None = None) -> Path:
    return (registry_dir() if base is None else base) / f"{pid}.json"


def request_path(pid: int, base: Path | None = None) -> Path:
    return (registry_dir() if base is None else base) / f"{pid}.request.json"


def status_path(pid: int, request_id: str, base: Path | None = None) -> Path:
    return (registry_dir() if base is None else base) / f"{pid}.{request_id}.status.json"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a temporary file in the same directory, then rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it names one
    process even after the pid is reused."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after the last ')'.
    fields = raw[raw.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
