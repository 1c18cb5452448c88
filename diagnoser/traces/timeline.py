"""The GPU timeline: busy and idle time per device and stream over the analysed window, and why each idle gap
happened.

Busy time is the union of kernel, memcpy and memset intervals over all streams of a device. `cuda_sync` records
and CPU ops that carry a `stream` arg are not GPU work and never enter the union (HolisticTraceAnalysis pitfall
P1). Idle is the rest of the window, cut into gaps between busy runs; each gap gets one cause:

- pageable_memcpy: the gap follows a host-to-device copy from pageable memory while the host was still in that
  copy or in the synchronisation after it, or precedes one whose copy call (host-side staging) covers most of the
  gap;
- sync: the host was blocked in a synchronisation (cudaStreamSynchronize, cudaDeviceSynchronize, a blocking copy,
  `.item()`/`.cpu()`, which copy device-to-host and wait) when the GPU ran out of work (nothing queued). A copy into
  pageable host memory blocks the host for its whole call, whatever its name (cudaMemcpyAsync too), so the call
  counts as a sync from its start, and is named among the ops that held the host (BLOCKS_HOST). With the next op
  already queued, a gap is stream_wait whatever the host was blocked in: the sync waits for that same device-side
  work (a TorchRec step's 64 ms stall, the host blocked 146 ms in a 704-byte read-back meanwhile, was once sync and
  three times stream wait);
- kernel_overhead: the next op was already queued when the GPU went idle and the gap is short
  (<= KERNEL_OVERHEAD_US): the GPU's own kernel-to-kernel turnaround;
- stream_wait: the next op was queued (its launch call had returned) and still the GPU sat idle for longer than
  that: it waited on something on the device side, another stream's event, a collective, a graph dependency. A GPU
  whose queue runs far behind the host shows its waits here, not as launch overhead;
- host: the next op's launch call began after the GPU went idle (the host had not launched yet), or was still
  running and the op started right after it returned, while the host was doing something (CPU ops or runtime calls
  of any of its threads cover >= HOST_BUSY_FRAC of the gap, or the gap is shorter than QUEUE_DRY_MIN_US);
- queue_dry: the host launched nothing and did nothing: there was no work to give.

Times are microseconds as in the trace; results are fractions of the window.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import gt, itemgetter

from diagnoser.traces.classify import LAUNCH_KIND_COPY, LAUNCH_KIND_SYNC, is_pageable_copy
from diagnoser.traces.compiled import require_compiled
from diagnoser.traces.tables import Tables

try:
    require_compiled()  # (DIAGNOSER_NO_C=1: the Python path, as without a compiler)
    from diagnoser.traces._gaps import gap_causes as _gap_causes
    from diagnoser.traces._gaps import idle_inside as _idle_inside
    from diagnoser.traces._gaps import sorted_times as _sorted_times
    from diagnoser.traces._gaps import sweep as _sweep_ops
except ImportError:  # installed without a C compiler: the Python below does it all (same answers, slower)
    _gap_causes = None  # type: ignore[assignment]
    _idle_inside = None  # type: ignore[assignment]
    _sorted_times = None  # type: ignore[assignment]
    _sweep_ops = None  # type: ignore[assignment]

IDLE_CAUSES = ("host", "sync", "pageable_memcpy", "queue_dry", "kernel_overhead", "stream_wait")
# HolisticTraceAnalysis' consecutive_kernel_delay is 30 (µs, although its docs say ns; pitfall P2). Same here, so
# the kernel-to-kernel share is comparable.
KERNEL_OVERHEAD_US = 30.0
# A late launch after a gap this short is the host's pace, whatever the host-activity records say.
QUEUE_DRY_MIN_US = 1000.0
# Share of a gap the launching thread must be busy for the gap to count as host-bound rather than queue-dry.
HOST_BUSY_FRAC = 0.2
# A host sync ending this close before the GPU went idle still explains the gap (clock skew CPU/GPU).
SYNC_SLACK_US = 2.0
# Marks a blocking copy's call among the ops that held the host (DeviceTimeline.host_idle_ops_us): the op to name.
BLOCKS_HOST = "which blocks the host"


@dataclass
class Gap:
    start: float
    end: float
    cause: str

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class DeviceTimeline:
    device: int
    window: tuple[float, float]
    busy_us: float = 0.0
    compute_us: float = 0.0  # a compute kernel running (kernels.compute_union_us); the rest of busy_us: non-compute
    idle_us_by_cause: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_CAUSES, 0.0))
    gaps_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(IDLE_CAUSES, 0))
    busy_us_by_stream: dict[int, float] = field(default_factory=dict)
    ops: int = 0
    longest_gaps: list[Gap] = field(default_factory=list)
    range_gaps: list[Gap] = field(default_factory=list)  # the gaps inside build_timeline's keep_range
    unattributed_launch_us: float = 0.0  # idle before ops whose launch call is not in the trace
    # Host-caused idle (host and sync gaps) inside each long CPU op (Tables.long_ops), by op name: what held the host
    # while the GPU waited. Each name's ops count their union once; ops of different names that nest count each.
    host_idle_ops_us: dict[str, float] = field(default_factory=dict)
    # the blocking copies (BLOCKS_HOST) the host was inside while the GPU idled with work queued (stream waits): the
    # host cannot queue more behind a read-back it waits for, whichever side started the wait
    blocked_in_waits_us: dict[str, float] = field(default_factory=dict)

    @property
    def window_us(self) -> float:
        return self.window[1] - self.window[0]

    @property
    def busy_frac(self) -> float:
        return self.busy_us / self.window_us if self.window_us > 0 else 0.0

    def idle_frac(self, cause: str) -> float:
        return self.idle_us_by_cause[cause] / self.window_us if self.window_us > 0 else 0.0


def sorted_floats(values: Sequence[float]) -> Sequence[float]:
    """The values sorted: in C where built, as an array('d') (a radix sort of the doubles' bits, no float object for
    each while sorting: host activity's million times, a trace's kernel durations); else, and below a few thousand
    values (where clearing and summing the radix sort's count tables costs more than the sort), by sorted()."""
    if _sorted_times is None or len(values) < 4096:
        return sorted(values)
    out = array("d")
    out.frombytes(_sorted_times(values if isinstance(values, array) else array("d", values)))
    return out


class HostActivity:
    """'How busy was the host process between a and b', from its host events (CPU ops, runtime calls,
    annotations) on any thread.

    Any thread counts: a process whose launching thread waits while another thread works is busy, not out of work.
    The busy time of a set of intervals (the time at least one is open) depends only on the sorted starts and the
    sorted ends, each sorted on its own (a fast sort of floats, no key function); a query sweeps the starts and
    ends inside the gap, counting open intervals, and stops as soon as the answer is known. Built on first use."""

    def __init__(self, t: Tables) -> None:
        self._t = t
        self._sorted: tuple[Sequence[float], Sequence[float]] | None = None

    def _events(self) -> tuple[Sequence[float], Sequence[float]]:
        if self._sorted is None:
            self._sorted = (sorted_floats(self._t.h_ts), sorted_floats(self._t.h_end))
        return self._sorted

    def busy_at_least(self, a: float, b: float, frac: float) -> bool:
        """Whether host events were open for at least `frac` of [a, b]."""
        if b <= a:
            return False
        starts, ends = self._events()
        need = frac * (b - a)
        i, j = bisect_right(starts, a), bisect_right(ends, a)
        open_now = i - j  # intervals started and not yet ended at a
        n_s, n_e = len(starts), len(ends)
        t = a
        busy = 0.0
        while busy < need:
            ns = starts[i] if i < n_s else b
            ne = ends[j] if j < n_e else b
            nxt = min(ne, ns)
            nxt = min(nxt, b)
            if open_now > 0:
                busy += nxt - t
            if nxt >= b:
                break
            t = nxt
            if ns <= ne:
                open_now += 1
                i += 1
            else:
                open_now -= 1
                j += 1
        return busy >= need


class Launches:
    """Launch/copy/sync calls indexed by correlation id, and host sync intervals sorted by start."""

    def __init__(self, t: Tables) -> None:
        self.t = t
        # later duplicates of a correlation id win, as with a dict built in a loop
        self.by_corr: dict[int, int] = dict(zip(t.r_corr, range(len(t.r_corr)), strict=True))
        self.by_corr.pop(-1, None)
        # copy calls whose copy lands in pageable host memory: the host is blocked until it is done (index -> its
        # GPU op)
        self.blocking: dict[int, int] = {}
        to_pageable = {nid for nid, name in enumerate(t.names) if is_pageable_copy(name) and "DtoH" in name}
        if to_pageable:
            for g, (corr, nid) in enumerate(zip(t.g_corr, t.g_name, strict=True)):
                call = self.by_corr.get(corr) if nid in to_pageable else None
                if call is not None and t.r_kind[call] == LAUNCH_KIND_COPY:
                    self.blocking[call] = g
        sync_idx = [i for i, k in enumerate(t.r_kind) if k == LAUNCH_KIND_SYNC] + list(self.blocking)
        sync_idx.sort(key=t.r_ts.__getitem__)
        self.sync_start = [t.r_ts[i] for i in sync_idx]
        self.sync_end_max = list(accumulate((t.r_ts[i] + t.r_dur[i] for i in sync_idx), max))
        # per GPU op: the index of its launch call, or None when the trace has none
        self.of_gpu: list[int | None] = list(map(self.by_corr.get, t.g_corr))

    def blocking_names(self) -> dict[tuple[str, float], str]:
        """(call name, start) of each blocking copy call -> how to name it among the ops that held the host."""
        t = self.t
        out = {}
        for call, g in self.blocking.items():
            name = t.names[t.r_name[call]]
            size = t.g_bytes[g]
            what = f"a {size:,}-byte copy" if size > 0 else "a copy"
            out[(name, t.r_ts[call])] = f"{name} ({what} to pageable host memory, {BLOCKS_HOST})"
        return out

    def host_sync_open(self, x: float, slack: float = SYNC_SLACK_US) -> bool:
        """Whether some host sync call had started by x and not yet returned (within slack)."""
        if not self.sync_start:
            return False
        i = bisect_right(self.sync_start, x)
        return i > 0 and self.sync_end_max[i - 1] >= x - slack


def device_order(t: Tables) -> dict[int, list[int]]:
    """GPU op indices per device, sorted by start time."""
    devices = set(t.g_dev)
    if len(devices) == 1:
        by_dev = {next(iter(devices)): list(range(len(t.g_dev)))}
    else:
        by_dev = {d: [i for i, x in enumerate(t.g_dev) if x == d] for d in devices}
    for idx in by_dev.values():
        starts = [t.g_ts[i] for i in idx]
        if any(map(gt, starts, starts[1:])):
            idx.sort(key=t.g_ts.__getitem__)
    return by_dev


def _gpu_sync_intervals(t: Tables, device: int) -> tuple[list[float], list[float]]:
    """cuda_sync records on this device that mirror a host wait, as sorted starts and the running max of their
    ends. (Stream-wait-event records are device-side waits: a gap they explain is stream_wait either way.)"""
    host: list[tuple[float, float]] = []
    for dev, is_host, ts, dur in zip(t.s_dev, t.s_host, t.s_ts, t.s_dur, strict=True):
        if dev == device and is_host:
            host.append((ts, ts + dur))
    host.sort()
    return [a for a, _ in host], _running_max([b for _, b in host])


def _running_max(values: Sequence[float]) -> list[float]:
    out, m = [], float("-inf")
    for v in values:
        m = max(m, v)
        out.append(m)
    return out


_RawGap = tuple[float, float, int | None, int | None]  # start, end, the op that ends it, the op that ended last before


def build_timeline(t: Tables, device: int, order: list[int], window: tuple[float, float], launches: Launches,
                   host: HostActivity, keep_longest: int = 5,
                   keep_range: tuple[float, float] | None = None) -> DeviceTimeline:
    """Busy/idle of one device over `window`, with every idle gap attributed to a cause; the gaps that overlap
    `keep_range` are kept in `range_gaps` (clipped to it)."""
    tl = DeviceTimeline(device=device, window=window)
    gaps = (_sweep_compiled if _sweep_ops is not None else _sweep)(t, order, window, tl)
    g0s = [g[0] for g in gaps]
    causes = (_classify_compiled if _gap_causes is not None else _classify)(t, device, launches, host, tl, gaps, g0s)
    if t.long_ops:
        host_gaps = [(g[0], g[1]) for g, c in zip(gaps, causes, strict=True) if c in ("host", "sync")]
        named = launches.blocking_names()
        ops = [(named.get((op[0], op[1]), op[0]), op[1], op[2]) for op in t.long_ops] if named else t.long_ops
        tl.host_idle_ops_us = idle_inside_ops(host_gaps, ops)
        waits = [(g[0], g[1]) for g, c in zip(gaps, causes, strict=True) if c == "stream_wait"]
        blocking = [op for op in ops if BLOCKS_HOST in op[0]]
        if waits and blocking:
            tl.blocked_in_waits_us = idle_inside_ops(waits, blocking)
    lengths = [g[1] - g[0] for g in gaps]
    longest = heapq.nlargest(keep_longest, range(len(gaps)), key=lengths.__getitem__)
    tl.longest_gaps = [Gap(gaps[k][0], gaps[k][1], causes[k]) for k in longest]
    if keep_range is not None and gaps:
        tl.range_gaps = _gaps_in_range(gaps, g0s, causes, keep_range)
    return tl


def _sweep(t: Tables, order: list[int], window: tuple[float, float], tl: DeviceTimeline) -> list[_RawGap]:
    """Sweep the ops in start order: the union of their intervals is the busy time (tl.busy_us, per stream, tl.ops);
    what lies between is a gap, returned with the op that ends it (next) and the one that ended last before it
    (prev)."""
    w0, w1 = window
    g_ts, g_dur, g_stream = t.g_ts, t.g_dur, t.g_stream
    starts = [g_ts[i] for i in order]
    ends = [s + g_dur[i] for s, i in zip(starts, order, strict=True)]
    gaps: list[_RawGap] = []
    streams: dict[int, float] = {}
    busy = 0.0
    cur_end = w0
    prev_op: int | None = None
    n = 0
    for s, e, i in zip(starts, ends, order, strict=True):
        if e <= w0 or s >= w1:
            continue
        n += 1
        if s < w0:
            s = w0
        if e > w1:
            e = w1
        st = g_stream[i]
        streams[st] = streams.get(st, 0.0) + (e - s)
        if s > cur_end:
            gaps.append((cur_end, s, i, prev_op))
            busy += e - s
            cur_end = e
            prev_op = i
        elif e > cur_end:
            busy += e - cur_end
            cur_end = e
            prev_op = i
    if cur_end < w1:
        gaps.append((cur_end, w1, None, prev_op))
    tl.ops = n
    tl.busy_us = busy
    tl.busy_us_by_stream = streams
    return gaps


def _sweep_compiled(t: Tables, order: list[int], window: tuple[float, float], tl: DeviceTimeline) -> list[_RawGap]:
    """_sweep in C (diagnoser/traces/_gaps.c): the same gaps, sums and per-stream dict (in the same order)."""
    gaps, tl.ops, tl.busy_us, tl.busy_us_by_stream = _sweep_ops(order, t.g_ts, t.g_dur, t.g_stream, *window)
    return gaps


def _classify(t: Tables, device: int, launches: Launches, host: HostActivity, tl: DeviceTimeline,
              gaps: list[_RawGap], g0s: list[float]) -> list[str]:
    """Each gap's cause, added up into tl (idle time and gaps by cause, unattributed launches)."""
    host_sync = _host_sync_flags(t, device, launches, gaps, g0s)
    causes = _GapCauses(t, launches, host, tl).classify(gaps, host_sync)
    idle = tl.idle_us_by_cause
    counts = tl.gaps_by_cause
    for (g0, g1, _, _), c in zip(gaps, causes, strict=True):
        idle[c] += g1 - g0
        counts[c] += 1
    return causes


def _classify_compiled(t: Tables, device: int, launches: Launches, host: HostActivity, tl: DeviceTimeline,
                       gaps: list[_RawGap], g0s: list[float]) -> list[str]:
    """_classify in C (diagnoser/traces/_gaps.c): the same rules gap by gap, so the same sums to the last bit."""
    pageable, to_host = _copy_names(t)
    gs_start, gs_end_max = _gpu_sync_intervals(t, device)
    causes, idle, counts, unattributed = _gap_causes(
        gaps, launches.sync_start, launches.sync_end_max, gs_start, gs_end_max, launches.of_gpu, t.g_name, t.r_ts,
        t.r_dur, pageable, to_host, host._events)
    tl.idle_us_by_cause = dict(zip(IDLE_CAUSES, idle, strict=True))
    tl.gaps_by_cause = dict(zip(IDLE_CAUSES, counts, strict=True))
    tl.unattributed_launch_us += unattributed
    return causes


def _copy_names(t: Tables) -> tuple[bytes, bytes]:
    """Per name id: whether it names a host-to-device copy from pageable memory; a copy to the host (_GapCauses)."""
    return (bytes(is_pageable_copy(name) and "HtoD" in name for name in t.names),
            bytes(name.startswith("Memcpy") and "DtoH" in name for name in t.names))


def _host_sync_flags(t: Tables, device: int, launches: Launches, gaps: list[_RawGap], g0s: list[float]) -> list[bool]:
    """Whether a host sync was open when each gap began, or began in its first half and lasted to its end (a
    blocking copy called just after the GPU ran dry: the host is blocked, not late to launch), for all gaps at once
    (C-level bisects)."""
    host_sync = _open_flags(launches.sync_start, launches.sync_end_max, g0s)
    if launches.sync_start:
        late = _covered_flags(launches.sync_start, launches.sync_end_max, gaps)
        host_sync = [x or y for x, y in zip(host_sync, late, strict=True)]
    gs_start, gs_end_max = _gpu_sync_intervals(t, device)
    if gs_start:
        host_sync = [x or y for x, y in zip(host_sync, _open_flags(gs_start, gs_end_max, g0s), strict=True)]
    return host_sync


def _gaps_in_range(gaps: list[_RawGap], g0s: list[float], causes: list[str],
                   keep_range: tuple[float, float]) -> list[Gap]:
    """The gaps that overlap keep_range, clipped to it (g0s: the gaps' sorted starts)."""
    out = []
    lo = max(0, bisect_right(g0s, keep_range[0]) - 1)
    for k in range(lo, len(gaps)):
        g0, g1 = gaps[k][0], gaps[k][1]
        if g0 >= keep_range[1]:
            break
        if g1 > keep_range[0]:
            out.append(Gap(max(g0, keep_range[0]), min(g1, keep_range[1]), causes[k]))
    return out


class _GapCauses:
    """Each gap's cause (the module's docstring says the rules), from the ops around it, their launch calls, the
    host's syncs and its activity. Idle before an op whose launch call is not in the trace is added to
    tl.unattributed_launch_us."""

    def __init__(self, t: Tables, launches: Launches, host: HostActivity, tl: DeviceTimeline) -> None:
        self.g_name, self.r_ts, self.r_dur = t.g_name, t.r_ts, t.r_dur
        self.of_gpu = launches.of_gpu
        self.host = host
        self.tl = tl
        pageable, to_host = _copy_names(t)
        self.pageable_htod = {nid for nid, x in enumerate(pageable) if x}
        self.to_host = {nid for nid, x in enumerate(to_host) if x}

    def classify(self, gaps: list[_RawGap], host_sync: list[bool]) -> list[str]:
        # Most gaps are plain: no sync open, no copy around them, the next op's launch known; those are classified
        # inline (a function call per gap costs more than the rule).
        g_name, r_ts, of_gpu, cause = self.g_name, self.r_ts, self.of_gpu, self.cause
        special = self.pageable_htod | self.to_host
        causes: list[str] = []
        append = causes.append
        for (g0, g1, nxt, prev), sync_open in zip(gaps, host_sync, strict=True):
            launch = of_gpu[nxt] if nxt is not None else None
            if sync_open or launch is None or (special and (g_name[nxt] in special  # type: ignore[index]
                                                             or (prev is not None and g_name[prev] in special))):
                append(cause(g0, g1, nxt, prev, sync_open))
            elif r_ts[launch] <= g0:
                append("kernel_overhead" if g1 - g0 <= KERNEL_OVERHEAD_US else cause(g0, g1, nxt, prev, False))
            else:
                append("host" if g1 - g0 < QUEUE_DRY_MIN_US else cause(g0, g1, nxt, prev, False))
        return causes

    def _call_open(self, op: int, x: float) -> bool:
        call = self.of_gpu[op]
        return call is not None and self.r_ts[call] + self.r_dur[call] >= x - SYNC_SLACK_US

    def _pageable(self, g0: float, g1: float, nxt: int | None, prev: int | None, sync_open: bool) -> bool:
        # A host-to-device copy from pageable memory drains the stream and blocks the host (the driver stages
        # it; PyTorch then synchronises): the idle around it is the copy's, fixed by pinned memory.
        g_name, pageable = self.g_name, self.pageable_htod
        if prev is not None and g_name[prev] in pageable and (sync_open or self._call_open(prev, g0)):
            return True
        if nxt is not None and g_name[nxt] in pageable:
            call = self.of_gpu[nxt]
            return call is not None and self.r_ts[call] <= g0 + (g1 - g0) / 2
        return False

    def cause(self, g0: float, g1: float, nxt: int | None, prev: int | None, sync_open: bool) -> str:
        if self.pageable_htod and self._pageable(g0, g1, nxt, prev, sync_open):
            return "pageable_memcpy"
        r_ts, r_dur = self.r_ts, self.r_dur
        launch = self.of_gpu[nxt] if nxt is not None else None
        # The time between the launch call's return and the op's start, when the launch came before the gap.
        queued_wait = g1 - max(g0, r_ts[launch] + r_dur[launch]) if launch is not None else 0.0
        if (sync_open and launch is not None and r_ts[launch] <= g0 and g1 - g0 > KERNEL_OVERHEAD_US
                and queued_wait > KERNEL_OVERHEAD_US):
            # The next op was queued (its launch had returned) and still the GPU idled: it waited on the device
            # side, and the host's sync or blocking copy waits for that same work; the host did not starve it.
            return "stream_wait"
        if sync_open or (prev is not None and self.g_name[prev] in self.to_host and self._call_open(prev, g0)):
            # the host was blocked (a sync, or a blocking device-to-host copy such as .item()'s) when the GPU ran
            # dry. (A launch call that outlasts its short kernel is launch overhead, not a wait: not here.)
            return "sync"
        if launch is not None and r_ts[launch] <= g0:
            # launched before the GPU went idle: its own turnaround when short; the launch call still running (the
            # op started as soon as it returned) is the host's; else the queued op waited on the device side
            if g1 - g0 <= KERNEL_OVERHEAD_US:
                return "kernel_overhead"
            return "host" if queued_wait <= KERNEL_OVERHEAD_US else "stream_wait"
        if launch is None and nxt is not None:
            self.tl.unattributed_launch_us += g1 - g0  # no launch record: judged by host activity alone
        if g1 - g0 < QUEUE_DRY_MIN_US:
            return "host"
        return "host" if self.host.busy_at_least(g0, g1, HOST_BUSY_FRAC) else "queue_dry"


def idle_inside_ops(gaps: list[tuple[float, float]], ops: list[tuple[str, float, float]]) -> dict[str, float]:
    """Microseconds of the gaps (sorted by start) inside each op name: one sweep over both, the ops open at a gap
    held in a heap by their end. Ops of one name that nest or overlap (copy_ inside copy_, two threads) count their
    union once. The profiler's step annotations enclose everything and name nothing."""
    ops = sorted((op for op in ops if not op[0].startswith("ProfilerStep#")), key=_START)
    if _idle_inside is not None:  # the same sweep in C (_gaps.c), the same sums and order
        ids: dict[str, int] = {}
        name_ids = array("i", [ids.setdefault(op[0], len(ids)) for op in ops])
        pairs = _idle_inside(array("d", map(itemgetter(0), gaps)), array("d", map(itemgetter(1), gaps)), name_ids,
                             array("d", map(_START, ops)), array("d", map(itemgetter(2), ops)), len(ids))
        names = list(ids)
        return {names[i]: us for i, us in pairs}
    out: dict[str, float] = {}
    active: list[tuple[float, int]] = []
    k, n = 0, len(ops)
    push = heapq.heappush
    for g0, g1 in gaps:
        while k < n and ops[k][1] < g1:
            end = ops[k][2]
            if end > g0:  # one that ended before this gap is in none of the later ones either
                push(active, (end, k))
            k += 1
        while active and active[0][0] <= g0:
            heapq.heappop(active)  # ended before this gap, so before every later one
        # Most names have a single op open in a gap: its overlap counts as it is; only a name with several open
        # needs the union of their parts. (Names keep the order they first appear in, as `out` does.)
        spans: dict[str, tuple[float, float] | list[tuple[float, float]]] = {}
        for end, j in active:
            name, start, _ = ops[j]
            lo, hi = (start if start > g0 else g0), (end if end < g1 else g1)
            if hi > lo:
                had = spans.get(name)
                if had is None:
                    spans[name] = (lo, hi)
                elif isinstance(had, list):
                    had.append((lo, hi))
                else:
                    spans[name] = [had, (lo, hi)]
        for name, span in spans.items():
            covered = _union(span, g0) if isinstance(span, list) else span[1] - span[0]
            out[name] = out.get(name, 0.0) + covered
    return out


_START = itemgetter(1)


def _union(parts: list[tuple[float, float]], start: float) -> float:
    """The length of the union of intervals that all lie at or after `start`."""
    parts.sort()
    covered, reach = 0.0, start
    for lo, hi in parts:
        if hi > reach:
            covered += hi - max(lo, reach)
            reach = hi
    return covered


def _covered_flags(starts: list[float], ends_max: list[float],
                   gaps: list[tuple[float, float, int | None, int | None]]) -> list[bool]:
    """For each gap: whether an interval that started by its midpoint lasted to its end (within slack)."""
    mids = [(g[0] + g[1]) / 2 for g in gaps]
    idx = list(map(bisect_right, repeat(starts), mids))
    return [i > 0 and ends_max[i - 1] >= g[1] - SYNC_SLACK_US for i, g in zip(idx, gaps, strict=True)]


def _open_flags(starts: list[float], ends_max: list[float], xs: list[float]) -> list[bool]:
    """For each x: whether an interval (sorted starts, running max of ends) had started by x and not ended
    before x - slack."""
    if not starts:
        return [False] * len(xs)
    idx = list(map(bisect_right, repeat(starts), xs))
    return [i > 0 and ends_max[i - 1] >= x - SYNC_SLACK_US for i, x in zip(idx, xs, strict=True)]
