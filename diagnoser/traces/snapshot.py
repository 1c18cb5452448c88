"""A compact window of the GPU timeline to draw (TraceSummary.timeline): the kernels and copies of a representative
step, lane by stream, with the idle gaps and their causes and the host's launch calls.

The window is the GPU work launched inside the ProfilerStep of median duration (the GPU may run it later than the
host did), or, without steps, the few milliseconds from the median start of the GPU ops. It holds at most MAX_ITEMS
ops: a longer step is cut at the first op past the cap (`capped`).
"""

from __future__ import annotations

import statistics

from diagnoser.capture import HostCall, TimelineGap, TimelineItem, TimelineWindow
from diagnoser.traces.classify import (
    LAUNCH_KIND_COPY,
    LAUNCH_KIND_GRAPH,
    LAUNCH_KIND_KERNEL,
    LAUNCH_KIND_SYNC,
    MEMCPY,
    MEMSET,
    kernel_class,
)
from diagnoser.traces.names import short_name
from diagnoser.traces.tables import GPU_KERNEL, GPU_MEMCPY, Tables
from diagnoser.traces.timeline import DeviceTimeline, Launches

MAX_ITEMS = 2000
MIN_GAP_FRAC = 1 / 4000  # gaps shorter than this share of the window (and 2 µs) are invisible when drawn: left out
MIN_GAP_US = 2.0
MAX_HOST_CALLS = 1000
NO_STEP_US = 5_000.0  # window length without steps
MIN_ITEMS = 20  # ... extended until it holds this many ops
_CALL_KIND = {LAUNCH_KIND_KERNEL: "launch", LAUNCH_KIND_GRAPH: "graph", LAUNCH_KIND_COPY: "copy",
              LAUNCH_KIND_SYNC: "sync"}


def choose_range(t: Tables, selected: list[int], window: tuple[float, float],
                 launches: Launches) -> tuple[float, float, str] | None:
    """(start, end, label) of the window to show, before the item cap; None without GPU ops."""
    if not selected:
        return None
    w0, w1 = window
    g_ts, g_dur = t.g_ts, t.g_dur
    best: dict[str, tuple[float, float]] = {}
    for name, ts, dur, _ in t.steps:
        if ts < w1 and ts + dur > w0 and dur > 0 and dur > best.get(name, (0.0, -1.0))[1]:
            best[name] = (ts, dur)
    if best:
        ordered = sorted(best.items(), key=lambda kv: (kv[1][1], kv[1][0]))
        name, (ts, dur) = ordered[len(ordered) // 2]
        end = ts + dur
        r_ts, of_gpu = t.r_ts, launches.of_gpu
        launched = [i for i in selected if (li := of_gpu[i]) is not None and ts <= r_ts[li] <= end]
        if launched:
            return min(g_ts[i] for i in launched), max(g_ts[i] + g_dur[i] for i in launched), name
        return max(ts, w0), min(end, w1), name
    start = statistics.median_low([g_ts[i] for i in selected])
    return start, start + NO_STEP_US, "middle of the GPU activity"


def build_window(t: Tables, selected: list[int], rng: tuple[float, float, str], window: tuple[float, float],
                 launches: Launches, timelines: list[DeviceTimeline]) -> TimelineWindow:
    """The TimelineWindow for `rng` (from choose_range), its gaps taken from the device timelines built with
    keep_range=rng."""
    start, end, label = rng
    g_ts, g_dur = t.g_ts, t.g_dur
    in_range = sorted([i for i in selected if g_ts[i] < end and g_ts[i] + g_dur[i] > start], key=g_ts.__getitem__)
    capped = False
    if len(in_range) < MIN_ITEMS and label.startswith("middle"):  # (the ops past the end only here: a few)
        in_range = sorted([i for i in selected if g_ts[i] + g_dur[i] > start], key=g_ts.__getitem__)[:MIN_ITEMS]
        if in_range:
            end = max(end, g_ts[in_range[-1]] + g_dur[in_range[-1]])
    if len(in_range) > MAX_ITEMS:
        end = g_ts[in_range[MAX_ITEMS]]
        in_range = in_range[:MAX_ITEMS]
        capped = True
    names: list[str] = []
    index: dict[int, int] = {}
    items = []
    for i in in_range:
        nid = t.g_name[i]
        k = index.get(nid)
        if k is None:
            k = index[nid] = len(names)
            names.append(short_name(t.names[nid]))
        kind = t.g_kind[i]
        cls = kernel_class(t.names[nid]) if kind == GPU_KERNEL else MEMCPY if kind == GPU_MEMCPY else MEMSET
        s = max(g_ts[i], start)
        items.append(TimelineItem(device=t.g_dev[i], stream=t.g_stream[i], start_us=_ns(s - start),
                                  dur_us=_ns(max(0.0, min(g_ts[i] + g_dur[i], end) - s)), kind=cls, name=k))
    shortest = max(MIN_GAP_US, (end - start) * MIN_GAP_FRAC)
    gaps = [TimelineGap(device=tl.device, start_us=_ns(g.start - start), dur_us=_ns(min(g.end, end) - g.start),
                        cause=g.cause)
            for tl in timelines for g in tl.range_gaps if g.start < end and min(g.end, end) - g.start >= shortest]
    calls = []
    r_ts, r_dur, r_kind, r_tid = t.r_ts, t.r_dur, t.r_kind, t.r_tid
    inside = sorted([i for i, ts in enumerate(r_ts) if start <= ts < end], key=r_ts.__getitem__)
    for i in inside[:MAX_HOST_CALLS]:
        calls.append(HostCall(tid=r_tid[i], start_us=_ns(r_ts[i] - start), dur_us=_ns(r_dur[i]),
                              kind=_CALL_KIND.get(r_kind[i], "call")))
    return TimelineWindow(label=label, start_us=start, offset_us=_ns(start - window[0]),
                          length_us=_ns(max(0.0, end - start)), names=names, items=items, gaps=gaps, host_calls=calls,
                          capped=capped)


def _ns(us: float) -> float:
    """Microseconds kept to the nanosecond (shorter JSON; the trace has no finer resolution)."""
    return round(us, 3)
