"""What a trace analysis found (`TraceAnalysis`), apart from the code that finds it: `analysis.py` builds one per
file and `ranks.py` combines those of a folder, and both read this type without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.capture import TimelineWindow, TraceSummary
from diagnoser.traces.decode import DecodeStats
from diagnoser.traces.kernels import KernelStats
from diagnoser.traces.ops import OpsSummary
from diagnoser.traces.phases import Phases
from diagnoser.traces.timeline import IDLE_CAUSES, DeviceTimeline


@dataclass
class DeviceInfo:
    index: int
    name: str
    memory_bytes: int | None = None
    sms: int | None = None
    capability: str = ""


@dataclass
class TraceAnalysis:
    """Everything the analysis found in one trace (or, for a folder, the ranks and their combination)."""

    path: Path
    summary: TraceSummary
    window: tuple[float, float] = (0.0, 0.0)  # trace µs
    window_policy: str = ""
    devices: list[DeviceInfo] = field(default_factory=list)  # from deviceProperties
    timelines: list[DeviceTimeline] = field(default_factory=list)
    kernels: KernelStats | None = None
    comm_us: float = 0.0
    comm_overlapped_us: float = 0.0
    ops: OpsSummary | None = None
    phases: Phases | None = None
    decode: DecodeStats | None = None
    rank: int | None = None
    world_size: int | None = None
    base_time_ns: int | None = None
    metadata_keys: list[str] = field(default_factory=list)
    ranks: list[TraceAnalysis] = field(default_factory=list)  # per-file analyses of a folder
    ridge_flop_per_byte: float | None = None
    gpu_spec: str | None = None
    snapshot: TimelineWindow | None = None  # also summary.timeline
    step_ms_p50: float | None = None
    gpu_ops: int = 0  # GPU events read (kernels, copies, memsets), in the window or not
    cpu_ops: int = 0  # CPU op events read (aten:: and the like: the model's ops); a serving frontend has none
    frontends: list[TraceAnalysis] = field(default_factory=list)  # files of a folder that are not ranks (ranks.py)

    @property
    def skipped(self) -> list[str]:
        return self.summary.skipped

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view for `diagnoser analyze --json`."""
        import msgspec

        d: dict[str, Any] = {
            "path": str(self.path),
            "summary": msgspec.to_builtins(self.summary),
            "window_us": [self.window[0], self.window[1]],
            "window_policy": self.window_policy,
            "devices": [vars(dev) for dev in self.devices],
            "rank": self.rank,
            "world_size": self.world_size,
            "ridge_flop_per_byte": self.ridge_flop_per_byte,
            "gpu_spec": self.gpu_spec,
            "timelines": [{
                "device": tl.device, "busy_frac": tl.busy_frac, "ops": tl.ops,
                "idle_frac_by_cause": {c: tl.idle_frac(c) for c in IDLE_CAUSES},
                "gaps_by_cause": tl.gaps_by_cause,
                "busy_us_by_stream": {str(k): v for k, v in tl.busy_us_by_stream.items()},
                "longest_gaps": [{"start_us": g.start - self.window[0], "length_us": g.length, "cause": g.cause}
                                 for g in tl.longest_gaps],
            } for tl in self.timelines],
        }
        if self.kernels is not None:
            k = self.kernels
            d["kernels"] = {
                "time_us_by_class": k.time_us_by_class, "count_by_class": k.count_by_class,
                "memcpy_us_by_direction": k.memcpy_us_by_direction,
                "memcpy_bytes_by_direction": k.memcpy_bytes_by_direction,
                "top": [{"name": n, "class": c, "time_us": us, "count": cnt} for n, c, us, cnt in k.top_kernels],
                "graph_launches": k.graph_launches, "graph_kernels": k.graph_kernels,
                "launched": k.launched, "short_kernels": k.short_kernels, "unlaunched": k.unlaunched,
                "comm_us": self.comm_us, "comm_overlapped_us": self.comm_overlapped_us,
            }
        if self.ops is not None:
            d["ops"] = self.ops.to_dict()
        if self.phases is not None:
            d["phases"] = self.phases.to_dict()
        if self.decode is not None:
            d["decode"] = {"bytes_in": self.decode.bytes_in, "bytes_json": self.decode.bytes_json,
                           "events": self.decode.events, "skips": dict(self.decode.skips),
                           "dropped_bytes": self.decode.dropped_bytes, "truncated": self.decode.truncated}
        if self.ranks:
            d["ranks"] = [r.to_dict() for r in self.ranks]
        if self.frontends:
            d["frontends"] = [str(f.path) for f in self.frontends]
        return d


__all__ = ["DeviceInfo", "TraceAnalysis"]
