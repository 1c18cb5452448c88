"""Getting a torch.profiler trace out of a running server.

`acquire_trace(pid, seconds, out_dir, server_url=None) -> Path` tries, in order: the server's own profiler
endpoints (vLLM/SGLang `/start_profile` + `/stop_profile`, when `server_url` is given), diagnoser's in-process hook
(a process that imported diagnoser.hook, or was started with `python -m diagnoser.hook -- ...`), and Kineto's
on-demand daemon mode (KINETO_USE_DAEMON=1 with dynolog's `dyno` CLI). It returns the trace file, or a folder
with one trace per process when several processes of the target did GPU work; `diagnoser.traces.analyze_trace`
reads either.

Kept light: the hook imports `diagnoser.tracing.protocol` inside the traced server, so this package's __init__
imports nothing else eagerly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["acquire_trace", "perfetto_hint"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from diagnoser.tracing import acquire

        return getattr(acquire, name)
    raise AttributeError(f"module 'diagnoser.tracing' has no attribute {name!r}")
