"""Kernel roles, copy directions, CUDA-graph replays and launch statistics.

Shares are of summed GPU-op time (an op on two overlapping streams counts on both), so they add up to 1 and do not
depend on overlap; overlap of communication with compute is reported on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from diagnoser.traces.tables import GPU_KERNEL, GPU_MEMCPY, Tables
from diagnoser.traces.timeline import Launches


@dataclass
class KernelStats:
    time_us_by_class: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0.0))
    count_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0))
    memcpy_us_by_direction: dict[str, float] = field(default_factory=dict)
    memcpy_bytes_by_direction: dict[str, int] = field(default_factory=dict)
    top_kernels: list[tuple[str, str, float, int]] = field(default_factory=list)  # (name, class, µs, count)
    kernels: int = 0  # kernel launches (not copies/memsets)
    graph_launches: int = 0  # cudaGraphLaunch calls
    graph_kernels: int = 0  # kernels that ran inside a graph replay
    # launch statistics over individually launched kernels (runtime or driver API, not graph replays)
    launched: int = 0
    launch_call_us: list[float] = field(default_factory=list)
    launch_delay_us: list[float] = field(default_factory=list)
    short_kernels: int = 0  # kernels that ran shorter than their own launch call
    unlaunched: int = 0  # GPU ops with no launch record in the trace

    @property
    def total_us(self) -> float:
        return sum(self.time_us_by_class.values())

    def shares(self) -> dict[str, float]:
        total = self.total_us
        return {k: v / total for k, v in self.time_us_by_class.items()} if total > 0 else {}


def kernel_stats(t: Tables, selected: list[int], launches: Launches, top: int = 10) -> KernelStats:
    """Statistics over the GPU ops `selected` (indices into t's GPU columns, e.g. those inside the window)."""
    ks = KernelStats()
    names = t.names
    g_kind, g_dur, g_name, g_ts, g_bytes, g_graph = t.g_kind, t.g_dur, t.g_name, t.g_ts, t.g_bytes, t.g_graph
    r_kind, r_ts, r_dur = t.r_kind, t.r_ts, t.r_dur
    of_gpu = launches.of_gpu
    # Per name first (a trace has few distinct names), then per class from the per-name totals.
    per_name: dict[int, list] = {}  # name id -> [µs, count, kind]
    for i in selected:
        acc = per_name.get(g_name[i])
        if acc is None:
            per_name[g_name[i]] = [g_dur[i], 1, g_kind[i]]
        else:
            acc[0] += g_dur[i]
            acc[1] += 1
    class_of_name = {nid: _op_class(names[nid], acc[2]) for nid, acc in per_name.items()}
    for nid, (us, n, kind) in per_name.items():
        cls = class_of_name[nid]
        ks.time_us_by_class[cls] += us
        ks.count_by_class[cls] += n
        if kind == GPU_KERNEL:
            ks.kernels += n
        if cls == MEMCPY:
            d = memcpy_direction(names[nid])
            ks.memcpy_us_by_direction[d] = ks.memcpy_us_by_direction.get(d, 0.0) + us
    if ks.count_by_class[MEMCPY]:
        for i in selected:
            if g_kind[i] == GPU_MEMCPY and g_bytes[i] > 0:
                d = memcpy_direction(names[g_name[i]])
                ks.memcpy_bytes_by_direction[d] = ks.memcpy_bytes_by_direction.get(d, 0) + g_bytes[i]
    # Launch statistics over kernels launched one by one; graph replays are counted apart.
    ks.graph_launches = r_kind.count(LAUNCH_KIND_GRAPH)
    launch_of = [of_gpu[i] for i in selected]
    ks.unlaunched = launch_of.count(None)
    if ks.graph_launches or max(g_graph, default=-1) >= 0:
        graph = [g_graph[i] >= 0 or (li is not None and r_kind[li] == LAUNCH_KIND_GRAPH)
                 for i, li in zip(selected, launch_of)]
        ks.graph_kernels = sum(1 for i, is_graph in zip(selected, graph) if is_graph and g_kind[i] == GPU_KERNEL)
        single = [(i, li) for i, li, is_graph in zip(selected, launch_of, graph)
                  if li is not None and not is_graph and g_kind[i] == GPU_KERNEL and r_kind[li] == LAUNCH_KIND_KERNEL]
    else:
        single = [(i, li) for i, li in zip(selected, launch_of)
                  if li is not None and g_kind[i] == GPU_KERNEL and r_kind[li] == LAUNCH_KIND_KERNEL]
    ks.launched = len(single)
    ks.launch_call_us = [r_dur[li] for _, li in single]
    ks.launch_delay_us = [max(0.0, g_ts[i] - r_ts[li] - r_dur[li]) for i, li in single]
    ks.short_kernels = sum(1 for i, li in single if g_dur[i] < r_dur[li])
    for nid, acc in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]:
        ks.top_kernels.append((names[nid], class_of_name[nid], acc[0], acc[1]))
    return ks


def _op_class(name: str, kind: int) -> str:
    if kind == GPU_MEMCPY:
        return MEMCPY
    if kind == GPU_KERNEL:
        return kernel_class(name)
    return MEMSET


def comm_overlap_us(t: Tables, order: list[int], window: tuple[float, float]) -> tuple[float, float]:
    """(communication time, the part of it overlapped by compute) on one device, as interval unions.

    `order` is sorted by start, so both unions are built in one pass without sorting."""
    names = t.names
    comm_names = {nid for nid in set(t.g_name[i] for i in order) if kernel_class(names[nid]) == COMM}
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
