"""torch.profiler (Kineto) trace analysis: decode multi-GB traces in bounded memory (on every core), attribute GPU
idle time, classify kernels, cost matmul/attention ops, find serving phases and tell what ran; see docs/traces.md.

Public API (stable; `diagnoser attach` and `diagnoser analyze` call it):
    analyze_trace(path, window="auto", gpu_name=None, max_bytes=None, jobs=None) -> TraceAnalysis
        (a file, .gz, a folder of ranks, or a list of files)
    capture_from_trace(analysis, model=None, gpu_name=None) -> Capture

The names are loaded on first use: importing a submodule (decode, in a worker process; windows, for a CLI's help)
does not load the whole analysis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diagnoser.traces.analysis import (
        TraceAnalysis,
        analyze_trace,
        capture_from_trace,
    )
    from diagnoser.traces.decode import TraceError

__all__ = ["TraceAnalysis", "TraceError", "analyze_trace", "capture_from_trace"]


def __getattr__(name: str) -> Any:
    if name == "TraceError":
        from diagnoser.traces.decode import TraceError

        return TraceError
    if name in ("TraceAnalysis", "analyze_trace", "capture_from_trace"):
        from diagnoser.traces import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module 'diagnoser.traces' has no attribute {name!r}")
