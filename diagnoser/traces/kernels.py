"""Kernel roles, copy directions, CUDA-graph replays, collectives, launch statistics, the kernels that hold the time
and the distribution of kernel durations.

Shares are of summed GPU-op time (an op on two overlapping streams counts on both), so they add up to 1 and do not
depend on overlap; overlap of communication with compute is reported on its own.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from diagnoser.capture import DurationStats, KernelStat
from diagnoser.traces.classify import (
    COMM,
    KERNEL_CLASSES,
    LAUNCH_KIND_GRAPH,
    LAUNCH_KIND_KERNEL,
    MEMCPY,
    MEMSET,
    kernel_class,
    memcpy_direction,
)
from diagnoser.traces.compiled import require_compiled
from diagnoser.traces.names import full_name, short_name
from diagnoser.traces.tables import GPU_KERNEL, GPU_MEMCPY, Tables
from diagnoser.traces.timeline import Launches, sorted_floats

try:  # the loops over every op in C (diagnoser/traces/_gaps.c): the same results to the last bit
    require_compiled()  # (DIAGNOSER_NO_C=1: the Python path, as without a compiler)
    from diagnoser.traces._gaps import graph_kernels as _graph_kernels_c
    from diagnoser.traces._gaps import launch_stats as _launch_stats
    from diagnoser.traces._gaps import per_name as _per_name
    from diagnoser.traces._gaps import unions as _unions
except ImportError:  # installed without a C compiler: the Python below
    _graph_kernels_c = None  # type: ignore[assignment]
    _launch_stats = None  # type: ignore[assignment]
    _per_name = None  # type: ignore[assignment]
    _unions = None  # type: ignore[assignment]

TOP_KERNELS = 15
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "other")
# Histogram bin upper edges (µs), 1-2-5 steps from 1 µs to 1 s; the last bin is open.
DURATION_EDGES_US = tuple(m * 10.0 ** e for e in range(7) for m in (1, 2, 5))


@dataclass
class KernelStats:
    time_us_by_class: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0.0))
    count_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0))
    memcpy_us_by_direction: dict[str, float] = field(default_factory=dict)
    memcpy_bytes_by_direction: dict[str, int] = field(default_factory=dict)
    top_kernels: list[tuple[str, str, float, int]] = field(default_factory=list)  # (name, class, µs, count)
    top: list[KernelStat] = field(default_factory=list)  # the same kernels, in full (TraceSummary.top_kernels)
    kernels: int = 0  # kernel launches (not copies/memsets)
    kernel_us: float = 0.0  # their summed time
    kernel_names: dict[str, int] = field(default_factory=dict)  # kernel name -> count
    graph_launches: int = 0  # cudaGraphLaunch calls
    graph_kernels: int = 0  # kernels that ran inside a graph replay
    graph_kernel_us: float = 0.0
    comm_us_by_kind: dict[str, float] = field(default_factory=dict)
    # The collectives' kernels: how many ran and their median time (a few µs: latency-bound, too small to fill a link)
    comm_kernels: int = 0
    comm_us_p50: float | None = None
    durations: DurationStats | None = None
    # launch statistics over individually launched kernels (runtime or driver API, not graph replays)
    launched: int = 0
    # the medians of each call's time and of its delay to the kernel's start (not the lists: 40,000 floats a rank
    # that would travel back from each rank's worker)
    launch_call_us_p50: float | None = None
    launch_delay_us_p50: float | None = None
    short_kernels: int = 0  # kernels that ran shorter than their own launch call
    unlaunched: int = 0  # GPU ops with no launch record in the trace

    @property
    def total_us(self) -> float:
        return sum(self.time_us_by_class.values())

    def shares(self) -> dict[str, float]:
        total = self.total_us
        return {k: v / total for k, v in self.time_us_by_class.items()} if total > 0 else {}


def kernel_stats(t: Tables, selected: list[int], launches: Launches, top: int = TOP_KERNELS,
                 costs: dict[int, tuple[float, float]] | None = None) -> KernelStats:
    """Statistics over the GPU ops `selected` (indices into t's GPU columns, e.g. those inside the window).

    `costs` maps a GPU op to the FLOPs and bytes of the op that launched it (ops.kernel_costs), for the top kernels'
    achieved rates."""
    ks = KernelStats()
    names = t.names
    g_kind, g_dur, g_name, g_bytes = t.g_kind, t.g_dur, t.g_name, t.g_bytes
    # Per name first (a trace has few distinct names), then per class from the per-name totals.
    if _per_name is not None:
        per_name = _per_name(selected, g_name, g_dur, g_kind, len(names))
    else:
        per_name = _name_sums(t, selected)
    class_of_name = {nid: _op_class(names[nid], acc[2]) for nid, acc in per_name.items()}
    for nid, (us, n, kind) in per_name.items():
        cls = class_of_name[nid]
        ks.time_us_by_class[cls] += us
        ks.count_by_class[cls] += n
        if kind == GPU_KERNEL:
            ks.kernels += n
            ks.kernel_us += us
            ks.kernel_names[names[nid]] = ks.kernel_names.get(names[nid], 0) + n
        if cls == MEMCPY:
            d = memcpy_direction(names[nid])
            ks.memcpy_us_by_direction[d] = ks.memcpy_us_by_direction.get(d, 0.0) + us
    if ks.count_by_class[MEMCPY]:
        for i in selected:
            if g_kind[i] == GPU_MEMCPY and g_bytes[i] > 0:
                d = memcpy_direction(names[g_name[i]])
                ks.memcpy_bytes_by_direction[d] = ks.memcpy_bytes_by_direction.get(d, 0) + g_bytes[i]
    kernels = [i for i in selected if g_kind[i] == GPU_KERNEL]
    # Launch statistics over kernels launched one by one; graph replays are counted apart.
    ks.graph_launches = t.r_kind.count(LAUNCH_KIND_GRAPH)
    if _graph_kernels_c is not None:
        graph = _graph_kernels_c(kernels, t.g_corr, t.g_graph, launches.of_gpu, t.r_kind, LAUNCH_KIND_GRAPH)
    else:
        graph = _graph_kernels(t, kernels, launches)
    ks.graph_kernels = len(graph)
    ks.graph_kernel_us = sum(g_dur[i] for i in graph)
    if _launch_stats is not None:
        in_graph = bytearray(len(g_kind))
        for i in graph:
            in_graph[i] = 1
        ks.unlaunched, calls, delays, ks.short_kernels = _launch_stats(
            selected, launches.of_gpu, g_kind, in_graph, t.r_kind, t.g_ts, g_dur, t.r_ts, t.r_dur, GPU_KERNEL,
            LAUNCH_KIND_KERNEL)
    else:
        ks.unlaunched, calls, delays, ks.short_kernels = _launch_sums(t, selected, launches, set(graph))
    ks.launched = len(calls)
    if calls:
        ks.launch_call_us_p50, ks.launch_delay_us_p50 = median(calls), median(delays)
    total = ks.total_us
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    for nid, acc in ranked:
        ks.top_kernels.append((names[nid], class_of_name[nid], acc[0], acc[1]))
    ks.top = _top_stats(t, selected, ranked, class_of_name, total, costs or {})
    ks.durations = duration_stats([g_dur[i] for i in kernels])
    comm_names = {nid for nid, cls in class_of_name.items() if cls == COMM}
    if comm_names:
        comm = [i for i in kernels if g_name[i] in comm_names]
        ks.comm_us_by_kind = _comm_by_kind(t, comm, launches)
        ks.comm_kernels = len(comm)
        ks.comm_us_p50 = median([g_dur[i] for i in comm]) if comm else None
    return ks


def _name_sums(t: Tables, selected: list[int]) -> dict[int, list]:
    """Per name id, [µs, count, the kind of its first op], in the order the names first appear."""
    g_kind, g_dur, g_name = t.g_kind, t.g_dur, t.g_name
    per_name: dict[int, list] = {}
    for i in selected:
        acc = per_name.get(g_name[i])
        if acc is None:
            per_name[g_name[i]] = [g_dur[i], 1, g_kind[i]]
        else:
            acc[0] += g_dur[i]
            acc[1] += 1
    return per_name


def _launch_sums(t: Tables, selected: list[int], launches: Launches,
                 graph: set[int]) -> tuple[int, list[float], list[float], int]:
    """(GPU ops without a launch call, each single launch's call time, the delay from its return to the kernel's
    start, kernels shorter than their call) over the kernels launched one by one (not in a graph replay)."""
    g_kind, g_dur, g_ts, r_kind, r_ts, r_dur = t.g_kind, t.g_dur, t.g_ts, t.r_kind, t.r_ts, t.r_dur
    launch_of = [launches.of_gpu[i] for i in selected]
    single = [(i, li) for i, li in zip(selected, launch_of, strict=True)
              if li is not None and g_kind[i] == GPU_KERNEL and i not in graph and r_kind[li] == LAUNCH_KIND_KERNEL]
    return (launch_of.count(None), [r_dur[li] for _, li in single],
            [max(0.0, g_ts[i] - r_ts[li] - r_dur[li]) for i, li in single],
            sum(1 for i, li in single if g_dur[i] < r_dur[li]))


def _graph_kernels(t: Tables, kernels: list[int], launches: Launches) -> list[int]:
    """Kernels that ran inside a CUDA/HIP graph replay: launched by cudaGraphLaunch, carrying a "graph id", or sharing
    their correlation id with other kernels (a replay's kernels all carry its launch's id; a kernel launched on its
    own has an id of its own). The last rule finds replays whose launch call fell outside a trimmed window. In the
    kernels' order."""
    g_corr, g_graph, r_kind, of_gpu = t.g_corr, t.g_graph, t.r_kind, launches.of_gpu
    shared = {c for c, n in Counter(g_corr[i] for i in kernels).items() if n > 1 and c >= 0}
    return [i for i in kernels if g_graph[i] >= 0 or g_corr[i] in shared
            or ((li := of_gpu[i]) is not None and r_kind[li] == LAUNCH_KIND_GRAPH)]


def _top_stats(t: Tables, selected: list[int], ranked: list[tuple[int, list]], class_of_name: dict[int, str],
               total: float, costs: dict[int, tuple[float, float]]) -> list[KernelStat]:
    wanted: dict[int, list[int]] = {nid: [] for nid, _ in ranked}  # name id -> its ops' indices
    g_name = t.g_name
    for i in selected:
        ops = wanted.get(g_name[i])
        if ops is not None:
            ops.append(i)
    out = []
    for nid, (us, n, _) in ranked:
        ops = wanted[nid]
        durs = sorted_floats([t.g_dur[i] for i in ops])
        name = t.names[nid]
        stat = KernelStat(name=short_name(name), full_name=full_name(name), kind=class_of_name[nid], count=n,
                          total_us=us, share=us / total if total > 0 else 0.0, mean_us=us / n if n else 0.0,
                          p50_us=_quantile(durs, 0.5), p90_us=_quantile(durs, 0.9))
        costed = [(costs[i], t.g_dur[i]) for i in ops if i in costs]
        if costed:
            flops = sum(c[0] for c, _ in costed)
            nbytes = sum(c[1] for c, _ in costed)
            secs = sum(d for _, d in costed) / 1e6
            stat.costed_calls = len(costed)
            stat.flops_per_call = flops / len(costed)
            stat.bytes_per_call = nbytes / len(costed)
            if secs > 0:
                stat.achieved_flop_per_s = flops / secs
                stat.achieved_bytes_per_s = nbytes / secs
        out.append(stat)
    seen: dict[str, int] = {}
    for stat in out:  # template instantiations that shorten alike: number them
        n = seen[stat.name] = seen.get(stat.name, 0) + 1
        if n > 1:
            stat.name = f"{stat.name} #{n}"
    return out


def median(values: list[float]) -> float:
    """statistics.median, sorted by sorted_floats (in C where built)."""
    ordered = sorted_floats(values)
    n = len(ordered)
    if not n:
        raise ValueError("no median of no values")
    i = n // 2
    return ordered[i] if n % 2 else (ordered[i - 1] + ordered[i]) / 2


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, interpolated between the two nearest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def duration_stats(durations: list[float]) -> DurationStats | None:
    """Percentiles and a 1-2-5 histogram (counts and summed time per bin) of kernel durations in µs."""
    if not durations:
        return None
    values = sorted_floats(durations)
    edges = list(DURATION_EDGES_US)
    counts = [0] * (len(edges) + 1)
    time = [0.0] * (len(edges) + 1)
    for v in values:
        b = bisect_left(edges, v)
        counts[b] += 1
        time[b] += v
    total = sum(values)
    return DurationStats(count=len(values), mean_us=total / len(values), p10_us=_quantile(values, 0.1),
                         p50_us=_quantile(values, 0.5), p90_us=_quantile(values, 0.9), p99_us=_quantile(values, 0.99),
                         max_us=values[-1], bin_edges_us=edges, bin_counts=counts, bin_time_us=time)


# NCCL/RCCL kernel names (ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL),
# vLLM/SGLang custom all-reduce, and the collective names of c10d ops, record_param_comms and kernel args.
_KIND_PATTERNS = (
    ("all_reduce", re.compile(r"all_?reduce|AllReduce|cross_device_reduce|one_shot|two_shot|multimem_all_reduce",
                              re.IGNORECASE)),
    ("reduce_scatter", re.compile(r"reduce_?scatter|ReduceScatter", re.IGNORECASE)),
    ("all_gather", re.compile(r"all_?gather|AllGather", re.IGNORECASE)),
    ("all_to_all", re.compile(r"all_?to_?all|AllToAll|alltoall|deep_?ep|dispatch|combine", re.IGNORECASE)),
    ("send_recv", re.compile(r"SendRecv|send_?recv|\bSend\b|\bRecv\b|_Send|_Recv|p2p|sendrecv", re.IGNORECASE)),
)


@lru_cache(maxsize=4096)
def collective_kind(text: str) -> str | None:
    """The collective a kernel name or a collective name means; None when it says none."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(text):
            return kind
    return None


def _comm_by_kind(t: Tables, comm: list[int], launches: Launches) -> dict[str, float]:
    """Communication time by collective. The kernel's own "Collective name" arg, else the "nccl:<collective>"
    annotation over it on its stream, else the host-side record of the collective its launch call ran inside (an
    all-to-all runs as NCCL SendRecv kernels: the name alone says send_recv), else its name."""
    host = _HostCollectives(t)
    on_gpu = _GpuCollectives(t)
    out = dict.fromkeys(COMM_KINDS, 0.0)
    names, g_name, g_dur, of_gpu = t.names, t.g_name, t.g_dur, launches.of_gpu
    for i in comm:
        kind = None
        arg = t.g_coll.get(i)
        if arg:
            kind = collective_kind(arg)
        if kind is None:
            kind = on_gpu.at(t.g_dev[i], t.g_stream[i], t.g_ts[i], t.g_dur[i])
        li = of_gpu[i]
        if kind is None and li is not None:
            kind = host.at(t.r_tid[li], t.r_ts[li])
        if kind is None:
            kind = collective_kind(names[g_name[i]])
        out[kind or "other"] += g_dur[i]
    return out


class _HostCollectives:
    """The innermost host record of a collective open at a time on a thread."""

    def __init__(self, t: Tables) -> None:
        self.by_tid: dict[int, list[tuple[float, float, str]]] = {}
        for tid, ts, end, coll in t.comm_ops:
            kind = collective_kind(coll)
            if kind is not None:
                self.by_tid.setdefault(tid, []).append((ts, end, kind))
        for spans in self.by_tid.values():
            spans.sort()
        self.starts = {tid: [s for s, _, _ in spans] for tid, spans in self.by_tid.items()}

    def at(self, tid: int, ts: float) -> str | None:
        spans = self.by_tid.get(tid)
        if not spans:
            return None
        j = bisect_left(self.starts[tid], ts + 1e-9)
        best = None
        for k in range(j - 1, max(-1, j - 8), -1):  # the few records that started last before ts
            s, e, kind = spans[k]
            if s <= ts <= e and (best is None or s >= best[0]):
                best = (s, kind)
        return best[1] if best else None


class _GpuCollectives:
    """The collective annotation that covers most of a kernel on its device and stream (the first in the file among
    equals). Per stream the annotations are sorted by start, with the running maximum of their ends, so a kernel
    looks only at those that can overlap it: the ones started before it ends, back to where none reaches it."""

    def __init__(self, t: Tables) -> None:
        self.spans: dict[tuple[int, int], list[tuple[float, float, int, str]]] = {}
        for n, (dev, stream, ts, end, coll) in enumerate(t.gpu_comm):
            kind = collective_kind(coll)
            self.spans.setdefault((dev, stream), []).append((ts, end, n, kind or "other"))
        self.starts: dict[tuple[int, int], list[float]] = {}
        self.reach: dict[tuple[int, int], list[float]] = {}
        for key, spans in self.spans.items():
            spans.sort()
            self.starts[key] = [s for s, _, _, _ in spans]
            self.reach[key] = list(accumulate((e for _, e, _, _ in spans), max))

    def at(self, device: int, stream: int, ts: float, dur: float) -> str | None:
        spans = self.spans.get((device, stream))
        if not spans:
            return None
        reach = self.reach[(device, stream)]
        end = ts + dur
        best: tuple[float, int, str] | None = None  # (covered, file order negated, kind)
        k = bisect_left(self.starts[(device, stream)], end) - 1
        while k >= 0 and reach[k] > ts:
            s, e, n, kind = spans[k]
            c = min(e, end) - max(s, ts)
            if c > 0 and (best is None or (c, -n) > best[:2]):
                best = (c, -n, kind)
            k -= 1
        return best[2] if best is not None and best[0] >= 0.5 * dur else None


def _op_class(name: str, kind: int) -> str:
    if kind == GPU_MEMCPY:
        return MEMCPY
    if kind == GPU_KERNEL:
        return kernel_class(name)
    return MEMSET


def device_unions(t: Tables, order: list[int], window: tuple[float, float]) -> tuple[float, float, float]:
    """(compute time, communication time, the part of it overlapped by compute) on one device: compute_union_us and
    comm_overlap_us, in one pass in C where built (diagnoser/traces/_gaps.c: the same sums to the last bit)."""
    if _unions is None:
        return compute_union_us(t, order, window), *comm_overlap_us(t, order, window)
    is_comm = bytearray(len(t.names))
    for nid in set(t.g_name):
        is_comm[nid] = kernel_class(t.names[nid]) == COMM
    return _unions(order, t.g_ts, t.g_dur, t.g_kind, t.g_name, is_comm, *window, GPU_KERNEL)


def comm_overlap_us(t: Tables, order: list[int], window: tuple[float, float]) -> tuple[float, float]:
    """(communication time, the part of it overlapped by compute) on one device, as interval unions.

    `order` is sorted by start, so both unions are built in one pass without sorting."""
    names = t.names
    comm_names = {nid for nid in {t.g_name[i] for i in order} if kernel_class(names[nid]) == COMM}
    if not comm_names:
        return 0.0, 0.0
    w0, w1 = window
    g_ts, g_dur, g_name, g_kind = t.g_ts, t.g_dur, t.g_name, t.g_kind
    comm: list[list[float]] = []
    comp: list[list[float]] = []
    for i in order:
        if g_kind[i] != GPU_KERNEL:
            continue
        s = g_ts[i]
        e = s + g_dur[i]
        if e <= w0 or s >= w1:
            continue
        if s < w0:
            s = w0
        if e > w1:
            e = w1
        runs = comm if g_name[i] in comm_names else comp
        if runs and s <= runs[-1][1]:
            if e > runs[-1][1]:
                runs[-1][1] = e
        else:
            runs.append([s, e])
    total = sum(e - s for s, e in comm)
    overlap = 0.0
    j = 0
    for s, e in comm:
        while j < len(comp) and comp[j][1] <= s:
            j += 1
        k = j
        while k < len(comp) and comp[k][0] < e:
            overlap += min(e, comp[k][1]) - max(s, comp[k][0])
            k += 1
    return total, overlap


def compute_union_us(t: Tables, order: list[int], window: tuple[float, float]) -> float:
    """Time on one device with at least one compute kernel running (any kernel but a collective; memcpy and memset
    are not kernels), clipped to the window: HolisticTraceAnalysis' temporal "compute time". The rest of the busy
    time is its "non-compute time". `order` is sorted by start."""
    names = t.names
    comm_names = {nid for nid in {t.g_name[i] for i in order} if kernel_class(names[nid]) == COMM}
    w0, w1 = window
    g_ts, g_dur, g_name, g_kind = t.g_ts, t.g_dur, t.g_name, t.g_kind
    total = 0.0
    cur_s = cur_e = w0
    for i in order:
        if g_kind[i] != GPU_KERNEL or g_name[i] in comm_names:
            continue
        s = g_ts[i]
        e = s + g_dur[i]
        if e <= w0 or s >= w1:
            continue
        s, e = max(s, w0), min(e, w1)
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    return total + (cur_e - cur_s)
