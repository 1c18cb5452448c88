"""FLOPs, bytes and arithmetic intensity of the traced matmul/conv/attention ops, weighted by the time they took.

An op is costed once: when a costed op runs inside another (aten::linear -> aten::addmm), only the outermost is
counted. Its time is the GPU time of the kernels launched from inside it (launch calls on the same thread within
the op's span, matched to kernels by correlation id); in a CPU-only trace it is the op's own duration.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from diagnoser.traces.classify import ATTENTION, LAUNCH_KIND_SYNC, kernel_class
from diagnoser.traces.flops import OpCost, op_cost
from diagnoser.traces.tables import CostedOp, Tables
from diagnoser.traces.timeline import Launches

_LIST = msgspec.json.Decoder(list)


@dataclass
class CostedRun:
    """One counted op instance."""

    name: str
    tid: int
    ts: float
    end: float
    cost: OpCost
    time_us: float  # GPU time of its kernels, or CPU time in a CPU-only trace
    dtype: str  # the cost's dtype, or "tf32" when fp32 ops ran TF32 kernels
    shapes: str
    kernels: list[int] = field(default_factory=list)  # the GPU ops it launched (indices into the GPU columns)


@dataclass
class LaunchIndex:
    """GPU ops that have a launch record, sorted by launch time, with prefix sums for window queries."""

    ts: array = field(default_factory=lambda: array("d"))
    tid: array = field(default_factory=lambda: array("q"))
    dur: array = field(default_factory=lambda: array("d"))
    gpu: array = field(default_factory=lambda: array("q"))  # index into the GPU columns
    cum: array = field(default_factory=lambda: array("d"))  # GPU time before entry i
    cum_attn: array = field(default_factory=lambda: array("d"))

    def gpu_time(self, a: float, b: float) -> tuple[float, float]:
        """(GPU time, attention GPU time) of ops launched in [a, b)."""
        i, j = bisect_left(self.ts, a), bisect_left(self.ts, b)
        return self.cum[j] - self.cum[i], self.cum_attn[j] - self.cum_attn[i]


def build_launch_index(t: Tables, launches: Launches, selected: list[int]) -> LaunchIndex:
    rows = []
    by_corr = launches.by_corr
    r_ts, r_tid, r_kind = t.r_ts, t.r_tid, t.r_kind
    for i in selected:
        launch = by_corr.get(t.g_corr[i])
        if launch is not None and r_kind[launch] != LAUNCH_KIND_SYNC:
            rows.append((r_ts[launch], r_tid[launch], t.g_dur[i], i))
    rows.sort()
    li = LaunchIndex()
    attention = {nid for nid, name in enumerate(t.names) if kernel_class(name) == ATTENTION}
    total = attn = 0.0
    for ts, tid, dur, i in rows:
        li.ts.append(ts)
        li.tid.append(tid)
        li.dur.append(dur)
        li.gpu.append(i)
        li.cum.append(total)
        li.cum_attn.append(attn)
        total += dur
        if t.g_name[i] in attention:
            attn += dur
    li.cum.append(total)
    li.cum_attn.append(attn)
    return li


@dataclass
class OpsSummary:
    runs: list[CostedRun] = field(default_factory=list)
    total_flops: float = 0.0
    total_bytes: float = 0.0
    weighted_time_us: float = 0.0
    intensity: float | None = None  # time-weighted mean FLOP/byte
    dtype: str | None = None  # precision holding most of the costed time
    time_basis: str = "gpu"  # "gpu" (kernel time) or "cpu" (op duration, CPU-only trace)
    uncosted: int = 0  # costed-op records whose shapes were incomplete
    by_op: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self, top: int = 10) -> dict[str, object]:
        slowest = sorted(self.runs, key=lambda r: -r.time_us)[:top]
        return {
            "ops_costed": len(self.runs),
            "ops_uncosted": self.uncosted,
            "total_flops": self.total_flops,
            "total_bytes": self.total_bytes,
            "intensity_flop_per_byte": self.intensity,
            "dtype": self.dtype,
            "time_basis": self.time_basis,
            "by_op": self.by_op,
            "slowest": [{"op": r.name, "shapes": r.shapes, "flops": r.cost.flops, "bytes": r.cost.bytes,
                         "intensity": r.cost.intensity if r.cost.bytes > 0 else None, "time_us": r.time_us,
                         "dtype": r.dtype} for r in slowest],
        }


def _outermost(costed: list[CostedOp]) -> list[CostedOp]:
    """Drop costed ops nested inside another costed op on the same thread."""
    by_tid: dict[int, list[CostedOp]] = defaultdict(list)
    for op in costed:
        by_tid[op.tid].append(op)
    keep: list[CostedOp] = []
    for ops in by_tid.values():
        ops.sort(key=lambda o: (o.ts, -o.dur))
        open_end = -math.inf  # end of the last kept op; ops are sorted by start, outer before inner
        for op in ops:
            end = op.ts + op.dur
            if end <= open_end:
                continue
            keep.append(op)
            open_end = end
    keep.sort(key=lambda o: o.ts)
    return keep


def cost_ops(t: Tables, index: LaunchIndex | None, window: tuple[float, float]) -> OpsSummary:
    out = OpsSummary()
    w0, w1 = window
    gpu_trace = index is not None and len(index.ts) > 0
    out.time_basis = "gpu" if gpu_trace else "cpu"
    time_by_dtype: dict[str, float] = defaultdict(float)
    names = t.names
    for op in _outermost(t.costed):
        if op.ts + op.dur <= w0 or op.ts >= w1:
            continue
        try:
            dims = _LIST.decode(op.dims)
            types = _LIST.decode(op.types) if op.types else []
            concrete = _LIST.decode(op.concrete) if op.concrete else []
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            out.uncosted += 1
            continue
        cost = op_cost(op.name, dims, [str(x) for x in types], [str(x) for x in concrete])
        if cost is None:
            out.uncosted += 1
            continue
        dtype = cost.dtype
        launched: list[int] = []
        if gpu_trace:
            assert index is not None
            time_us, tf32, launched = _gpu_time_of(index, t, op, names)
            if dtype == "fp32" and tf32:
                dtype = "tf32"
        else:
            time_us = op.dur
        run = CostedRun(op.name, op.tid, op.ts, op.ts + op.dur, cost, time_us, dtype, _shape_text(dims), launched)
        out.runs.append(run)
        out.total_flops += cost.flops
        out.total_bytes += cost.bytes
        agg = out.by_op.setdefault(op.name, {"count": 0, "flops": 0.0, "bytes": 0.0, "time_us": 0.0})
        agg["count"] += 1
        agg["flops"] += cost.flops
        agg["bytes"] += cost.bytes
        agg["time_us"] += time_us
        if time_us > 0 and cost.bytes > 0:
            out.weighted_time_us += time_us
            time_by_dtype[dtype] += time_us
    if out.weighted_time_us > 0:
        out.intensity = sum(r.time_us * r.cost.intensity for r in out.runs
                            if r.time_us > 0 and r.cost.bytes > 0) / out.weighted_time_us
        out.dtype = max(time_by_dtype, key=time_by_dtype.__getitem__)
    return out


def _gpu_time_of(index: LaunchIndex, t: Tables, op: CostedOp, names: list[str]) -> tuple[float, bool, list[int]]:
    """GPU time of the kernels launched from inside `op`, whether any of them was a TF32 kernel, and which they are."""
    i, j = bisect_left(index.ts, op.ts), bisect_right(index.ts, op.ts + op.dur)
    total = 0.0
    tf32 = False
    launched = []
    for k in range(i, j):
        if index.tid[k] == op.tid:
            total += index.dur[k]
            launched.append(index.gpu[k])
            if not tf32 and "tf32" in names[t.g_name[index.gpu[k]]]:
                tf32 = True
    return total, tf32, launched


def kernel_costs(t: Tables, ops: OpsSummary) -> dict[int, tuple[float, float]]:
    """FLOPs and bytes of each costed op, given to the longest kernel it launched (the GEMM or attention kernel; the
    others are its split-K reductions, casts and copies): GPU op index -> (flops, bytes)."""
    out: dict[int, tuple[float, float]] = {}
    g_dur, g_kind = t.g_dur, t.g_kind
    for r in ops.runs:
        kernels = [i for i in r.kernels if g_kind[i] == 0]
        if kernels and r.cost.bytes > 0:
            main = max(kernels, key=g_dur.__getitem__)
            prev = out.get(main, (0.0, 0.0))
            out[main] = (prev[0] + r.cost.flops, prev[1] + r.cost.bytes)
    return out


def covered_kernel_us(t: Tables, ops: OpsSummary) -> float:
    """GPU kernel time launched by costed ops (each kernel once)."""
    seen = {i for r in ops.runs for i in r.kernels if t.g_kind[i] == 0}
    return sum(t.g_dur[i] for i in seen)


def _shape_text(dims: list[object]) -> str:
    parts = [("x".join(str(d) for d in s) if isinstance(s, list) and s else "") for s in dims[:4]]
    return ", ".join(p for p in parts if p)
