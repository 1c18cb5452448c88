"""acquire_trace: one entry point over the three ways to get a trace out of a live server."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.errors import SourceUnavailable
from diagnoser.tracing import daemon, endpoints, hook_client

PERFETTO_URL = "https://ui.perfetto.dev"
HOWTO = ("start it with `python -m diagnoser.hook -- <server command>` (or add `import diagnoser.hook` to it); "
         "for vLLM/SGLang pass --url with the server's profiler endpoints enabled; or run it with "
         "KINETO_USE_DAEMON=1 under dynolog")


@dataclass
class Acquired:
    """A trace taken from a live process: its path (a file, or a folder of per-process files) and how."""

    path: Path
    method: str  # "endpoint", "hook" or "daemon"
    files: list[Path] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)  # per process, from the hook
    notes: list[str] = field(default_factory=list)

    def pauses_ms(self) -> dict[int, float]:
        """Per traced pid: how long its main thread was held by the profiler's start, stop and export."""
        return {int(s["pid"]): sum(float(s.get(k) or 0.0) for k in ("start_pause_ms", "stop_pause_ms",
                                                                      "export_pause_ms"))
                for s in self.statuses if s.get("state") == "done"}


def acquire_trace(pid: int, seconds: float, out_dir: Path, server_url: str | None = None) -> Path:
    """Take a torch.profiler trace of `seconds` from a running process (and its children) into out_dir.

    Returns the trace file, or a folder holding one trace per process. Raises SourceUnavailable (exit 3) with one
    sentence saying how to make the process traceable when no method applies.
    """
    return acquire_trace_detailed(pid, seconds, out_dir, server_url).path


def acquire_trace_detailed(pid: int, seconds: float, out_dir: Path, server_url: str | None = None) -> Acquired:
    if not seconds > 0:
        raise SourceUnavailable("a trace needs a positive number of seconds.")
    out_dir = Path(out_dir)
    hook_client.process_tree(pid)  # SourceUnavailable("no process N.") early
    notes: list[str] = []
    if not server_url:
        # A vLLM started with its profiler on (or an SGLang): its endpoints, found from the command line and the page.
        server_url = endpoints.profiler_url(pid)
    if server_url:
        try:
            files = endpoints.trace_via_endpoint(server_url, pid, seconds, out_dir)
            return Acquired(_as_path(files), "endpoint", files)
        except endpoints.ServerGone:
            raise  # the server died or stopped answering: nothing else to try, and that comes first
        except SourceUnavailable as exc:
            notes.append(str(exc))
    hooked = hook_client.find_hooked(pid)
    if hooked:
        target = out_dir if len(hooked) == 1 else out_dir / f"trace-{pid}-{time.strftime('%Y%m%d-%H%M%S')}"
        files, statuses = hook_client.trace_hooked(hooked, seconds, target)
        if files:
            acquired = Acquired(_as_path(files), "hook", files, statuses, notes)
            for s in statuses:
                if s.get("state") != "done":
                    acquired.notes.append(f"pid {s['pid']}: {s.get('message') or s.get('state')}")
            return acquired
        reasons = "; ".join(f"pid {s['pid']}: {s.get('message') or s.get('state')}" for s in statuses)
        raise SourceUnavailable(f"the hooked process gave no trace ({reasons}).")
    daemon_pids = daemon.daemon_pids(pid)
    if daemon_pids:
        files = daemon.trace_via_daemon(daemon_pids, seconds, out_dir)
        return Acquired(_as_path(files), "daemon", files, notes=notes)
    if notes:
        raise SourceUnavailable(notes[0].rstrip(".") + f"; nor is process {pid} hooked: {HOWTO}.")
    raise SourceUnavailable(f"process {pid} cannot be traced as it runs: {HOWTO}.")


def _as_path(files: list[Path]) -> Path:
    """One file, or the folder of several (analyze_trace reads a folder of per-rank/per-process traces)."""
    if len(files) == 1:
        return files[0]
    parents = {f.parent for f in files}
    return parents.pop() if len(parents) == 1 else files[0].parent


def perfetto_hint(path: Path) -> str:
    what = "the files in" if path.is_dir() else "the file"
    return (f"Open it in Perfetto: go to {PERFETTO_URL}, click 'Open trace file' and choose {what} {path} "
            "(the file stays on this machine; Perfetto reads it in the browser).")
