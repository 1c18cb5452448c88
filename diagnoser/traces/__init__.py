"""torch.profiler (Kineto) trace analysis: decode multi-GB traces in bounded memory, attribute GPU idle time,
classify kernels, cost matmul/attention ops and find serving phases; see docs/traces.md.

Public API (stable; `diagnoser attach` and `diagnoser analyze` call it):
    analyze_trace(path, window="auto", gpu_name=None) -> TraceAnalysis   (a file, .gz, or a folder of ranks)
    capture_from_trace(analysis, model=None, gpu_name=None) -> Capture
"""

from diagnoser.traces.analysis import TraceAnalysis, analyze_trace, capture_from_trace
from diagnoser.traces.decode import TraceError

__all__ = ["TraceAnalysis", "TraceError", "analyze_trace", "capture_from_trace"]
