"""The compiled gap classifier (diagnoser/traces/_gaps.c, issue 28.7) gives every idle gap the cause the Python rules
in timeline.py give it (timeline._host_sync_flags and _GapCauses, kept as the reference and as the fallback without
a C compiler), and the same sums to the last bit: on every public trace, and on random timelines built to reach
every rule (syncs open and late, pageable copies either side of a gap, read-backs, launches missing, long gaps the
host's activity decides)."""

from __future__ import annotations

import random
from array import array
from collections import Counter
from pathlib import Path

import pytest

from diagnoser.traces import kernels, timeline
from diagnoser.traces.analysis import analyze_tables
from diagnoser.traces.classify import LAUNCH_KIND_COPY, LAUNCH_KIND_GRAPH, LAUNCH_KIND_KERNEL, LAUNCH_KIND_SYNC
from diagnoser.traces.tables import Tables, collect
from diagnoser.traces.timeline import (
    HOST_BUSY_FRAC,
    IDLE_CAUSES,
    KERNEL_OVERHEAD_US,
    QUEUE_DRY_MIN_US,
    SYNC_SLACK_US,
    DeviceTimeline,
    HostActivity,
    Launches,
    build_timeline,
    device_order,
)

HERE = Path(__file__).resolve().parent
PUBLIC = sorted((HERE / "fixtures" / "traces").rglob("*.json.gz")) + sorted(
    (HERE / "fixtures" / "gpu" / "traces").glob("*.json.gz"))

# What compares the compiled loops against the Python needs them: an install without a C compiler (or one run with
# DIAGNOSER_NO_C=1, CI's pure-Python job) has only the Python, which the rest of the suite runs.
needs_gaps = pytest.mark.skipif(timeline._gap_causes is None,
                                reason="diagnoser/traces/_gaps.c is not built (no C compiler) or DIAGNOSER_NO_C is "
                                       "set: only the Python path is here, nothing to compare it with")


@needs_gaps
def test_the_gap_classifier_is_built_and_shares_the_rules_constants() -> None:
    # The project's install compiles it (setup.py); without a C compiler the Python rules classify every gap.
    from diagnoser.traces import _gaps

    assert _gaps.CAUSES == IDLE_CAUSES
    assert _gaps.CONSTANTS == {"KERNEL_OVERHEAD_US": KERNEL_OVERHEAD_US, "QUEUE_DRY_MIN_US": QUEUE_DRY_MIN_US,
                               "HOST_BUSY_FRAC": HOST_BUSY_FRAC, "SYNC_SLACK_US": SYNC_SLACK_US}


def _python_only(m: pytest.MonkeyPatch) -> None:
    """As installed without a C compiler: every compiled part of timeline.py and kernels.py replaced by its Python."""
    for name in ("_gap_causes", "_idle_inside", "_sorted_times", "_sweep_ops"):
        m.setattr(timeline, name, None)
    for name in ("_unions", "_per_name", "_graph_kernels_c", "_launch_stats"):
        m.setattr(kernels, name, None)


@needs_gaps
@pytest.mark.parametrize("path", PUBLIC, ids=[p.name for p in PUBLIC])
def test_the_same_analysis_with_and_without_the_compiled_classifier(path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    t = collect(path)
    compiled = analyze_tables(t).to_dict()
    _python_only(monkeypatch)
    assert analyze_tables(t).to_dict() == compiled


# --- random timelines ---------------------------------------------------------------------------------------------

_NAMES = ["gemm_kernel", "Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)",
          "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pinned -> Device)", "Memset (Device)", "elementwise"]


def _random_tables(rng: random.Random) -> Tables:
    """GPU ops on two devices and streams with gaps of every length, their launch calls before, during or after
    the gaps (some missing), host syncs and blocking copies, cuda_sync records and host activity in patches."""
    t = Tables()
    # On a grid of whole microseconds half of the time: times tie and gaps land on the rules' thresholds exactly.
    grid = rng.random() < 0.5
    q = (lambda x: float(round(x))) if grid else (lambda x: x)
    t.names = list(_NAMES) + ["cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "aten::op"]
    t.name_ids = {n: i for i, n in enumerate(t.names)}
    now = rng.uniform(0, 100)
    scale = rng.choice([5.0, 40.0, 400.0, 3000.0])
    reach = now
    for corr in range(1, rng.randint(1, 61)):
        step = rng.choice([rng.expovariate(1 / scale), KERNEL_OVERHEAD_US, QUEUE_DRY_MIN_US, SYNC_SLACK_US])
        now = q(now + step * rng.choice([0.0, 0.5, 1.0, 1.0, 3.0]))
        if rng.random() < 0.3:  # a gap of exactly a threshold after everything so far
            now = reach + rng.choice([KERNEL_OVERHEAD_US, QUEUE_DRY_MIN_US, 2 * SYNC_SLACK_US])
        dur = q(rng.expovariate(1 / scale))
        reach = max(reach, now + dur)
        name = rng.randrange(len(_NAMES)) if rng.random() < 0.5 else 0
        t.g_dev.append(rng.choice([0, 0, 0, 1]))
        t.g_stream.append(rng.choice([7, 7, 13]))
        t.g_kind.append(0)
        t.g_ts.append(now)
        t.g_dur.append(dur)
        t.g_name.append(name)
        t.g_bytes.append(rng.choice([0, 4, 1 << 20]))
        t.g_graph.append(-1)
        t.g_corr.append(corr if rng.random() < 0.9 else -1)
        if rng.random() < 0.85:  # its launch call: well before, just before, inside or after the gap before it
            copy = "Memcpy" in _NAMES[name]
            start = q(now - rng.choice([rng.uniform(0, 3 * scale), rng.uniform(0, 40), -rng.uniform(0, scale)]))
            t.r_kind.append(LAUNCH_KIND_COPY if copy else LAUNCH_KIND_KERNEL)
            t.r_ts.append(start)
            # (or returning exactly the turnaround threshold before the op starts)
            t.r_dur.append(q(rng.choice([rng.uniform(0, 10), rng.uniform(0, 2 * scale),
                                         max(0.0, now - KERNEL_OVERHEAD_US - start)])))
            t.r_tid.append(1)
            t.r_name.append(t.name_ids["cudaMemcpyAsync" if copy else "cudaLaunchKernel"])
            t.r_corr.append(corr)
    end = now + scale
    for _ in range(rng.randint(0, 8)):  # host syncs
        start = q(rng.uniform(0, end))
        t.r_kind.append(LAUNCH_KIND_SYNC)
        t.r_ts.append(start)
        t.r_dur.append(q(rng.expovariate(1 / scale)))
        t.r_tid.append(1)
        t.r_name.append(t.name_ids["cudaStreamSynchronize"])
        t.r_corr.append(-1)
    for _ in range(rng.randint(0, 5)):  # cuda_sync records (host waits, stream-wait events)
        t.s_dev.append(rng.choice([0, 1]))
        t.s_host.append(rng.choice([0, 1]))
        t.s_ts.append(q(rng.uniform(0, end)))
        t.s_dur.append(q(rng.expovariate(1 / scale)))
    for _ in range(rng.randint(0, 80)):  # host activity in patches, some overlapping
        start = q(rng.uniform(0, end))
        t.h_tid.append(rng.choice([1, 2]))
        t.h_ts.append(start)
        t.h_end.append(q(start + rng.expovariate(1 / scale) * rng.choice([0.05, 0.5, 2.0])))
    t.long_ops = [(rng.choice(["aten::copy_", "aten::item", "forward"]), s, s + rng.expovariate(1 / scale))
                  for s in (rng.uniform(0, end) for _ in range(rng.randint(0, 6)))]
    return t


def _timelines(t: Tables, window: tuple[float, float]) -> tuple[list[DeviceTimeline], Counter[str]]:
    launches, host = Launches(t), HostActivity(t)
    out = [build_timeline(t, dev, idx, window, launches, host, keep_longest=1000, keep_range=window)
           for dev, idx in sorted(device_order(t).items())]
    causes = Counter(g.cause for tl in out for g in tl.range_gaps)
    return out, causes


@needs_gaps
def test_random_timelines_get_the_same_causes_and_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(28)
    seen: Counter[str] = Counter()
    for _ in range(1500):
        t = _random_tables(rng)
        if not t.g_ts:
            continue
        lo, hi = min(t.g_ts), max(a + b for a, b in zip(t.g_ts, t.g_dur, strict=True))
        window = (lo - rng.choice([0.0, 50.0]), hi + rng.choice([0.0, 5000.0]))
        compiled, causes = _timelines(t, window)
        with monkeypatch.context() as m:
            _python_only(m)
            reference, _ = _timelines(t, window)
        assert compiled == reference  # every field, the floats to the last bit
        for a, b in zip(compiled, reference, strict=True):  # and the ops that held the host in the same order
            assert list(a.busy_us_by_stream.items()) == list(b.busy_us_by_stream.items())
            assert list(a.host_idle_ops_us.items()) == list(b.host_idle_ops_us.items())
            assert list(a.blocked_in_waits_us.items()) == list(b.blocked_in_waits_us.items())
        seen += causes
    # the random timelines reach every rule, so the equality above covers each
    assert set(seen) == set(IDLE_CAUSES), seen
    assert min(seen.values()) >= 20, seen


_KERNEL_NAMES = ["gemm_kernel", "ncclKernel_AllReduce_RING_LL_Sum_float", "ncclDevKernel_SendRecv",
                 "Memcpy HtoD (Pinned -> Device)", "Memset (Device)", "elementwise", "flash_fwd_kernel"]


def _random_kernels(rng: random.Random) -> Tables:
    """GPU ops of every kind on two devices and streams, compute and collective kernels overlapping or not, some in
    graph replays (a graph id, a shared correlation id, a graph launch call), launch calls of each kind or none."""
    t = Tables()
    grid = rng.random() < 0.5
    q = (lambda x: float(round(x))) if grid else (lambda x: x)
    t.names = ["unused"] + list(_KERNEL_NAMES) + ["cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync"]
    t.name_ids = {n: i for i, n in enumerate(t.names)}
    now = rng.uniform(0, 100)
    for k in range(rng.randint(0, 80)):
        now = q(now + rng.choice([0.0, rng.expovariate(1 / 20), -rng.uniform(0, 30)]))
        nid = 1 + rng.randrange(len(_KERNEL_NAMES))
        name = t.names[nid]
        t.g_dev.append(rng.choice([0, 0, 1]))
        t.g_stream.append(rng.choice([7, 7, 13, 1 << 40]))
        kind = 1 if "Memcpy" in name else 2 if "Memset" in name else 0
        t.g_kind.append(kind if rng.random() < 0.9 else rng.randrange(3))  # (a name's kind is its first op's)
        t.g_ts.append(max(0.0, now))
        t.g_dur.append(q(rng.choice([rng.expovariate(1 / 15), 0.0, 2.0])))
        t.g_name.append(nid)
        t.g_bytes.append(rng.choice([0, 4096]))
        t.g_graph.append(rng.choice([-1] * 9 + [3]))
        corr = rng.choice([k, k, k, 5, -1])  # some ids shared (a replay's kernels), some missing
        t.g_corr.append(corr)
        if corr >= 0 and rng.random() < 0.8:
            kind = rng.choice([LAUNCH_KIND_KERNEL] * 4 + [LAUNCH_KIND_GRAPH, LAUNCH_KIND_COPY])
            t.r_kind.append(kind)
            t.r_ts.append(q(t.g_ts[-1] - rng.uniform(0, 40)))
            t.r_dur.append(q(rng.choice([rng.uniform(0, 10), rng.uniform(0, 60)])))
            t.r_tid.append(1)
            t.r_name.append(t.name_ids[{LAUNCH_KIND_GRAPH: "cudaGraphLaunch",
                                        LAUNCH_KIND_COPY: "cudaMemcpyAsync"}.get(kind, "cudaLaunchKernel")])
            t.r_corr.append(corr)
    return t


@needs_gaps
def test_random_kernels_get_the_same_statistics_and_unions(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_stats (sums per name, graph replays, launch statistics) and device_unions (compute, communication and
    its overlap) equal with and without the compiled loops: every field, dicts in the same order."""
    rng = random.Random(2807)
    reached = Counter()
    for _ in range(1500):
        t = _random_kernels(rng)
        launches = Launches(t)
        order = device_order(t)
        selected = [i for idx in order.values() for i in idx if rng.random() < 0.9]
        windows = [(min(t.g_ts, default=0.0) + rng.choice([0.0, 15.0]), max(t.g_ts, default=0.0) + 10.0)]
        compiled = kernels.kernel_stats(t, selected, launches)
        unions = [kernels.device_unions(t, idx, w) for idx in order.values() for w in windows]
        with monkeypatch.context() as m:
            _python_only(m)
            reference = kernels.kernel_stats(t, selected, launches)
            ref_unions = [kernels.device_unions(t, idx, w) for idx in order.values() for w in windows]
        assert compiled == reference
        assert list(compiled.kernel_names.items()) == list(reference.kernel_names.items())
        assert unions == ref_unions
        reached.update(graph=compiled.graph_kernels > 0, launched=compiled.launched > 0,
                       unlaunched=compiled.unlaunched > 0, short=compiled.short_kernels > 0,
                       overlap=any(u[2] > 0 for u in unions), comm=any(u[1] > 0 for u in unions))
    assert min(reached.values()) >= 200, reached  # every branch taken in many cases


@needs_gaps
def test_the_compiled_kernel_loops_refuse_bad_arguments() -> None:
    from diagnoser.traces._gaps import graph_kernels, launch_stats, per_name, sweep, unions

    ts, dur, kind, name = array("d", [0.0, 1.0]), array("d", [1.0, 1.0]), array("b", [0, 0]), array("i", [0, 1])
    assert per_name([0, 1, 1], name, dur, kind, 2) == {0: [1.0, 1, 0], 1: [2.0, 2, 0]}
    with pytest.raises(IndexError):
        per_name([2], name, dur, kind, 2)  # an op past the columns
    with pytest.raises(IndexError):
        per_name([1], name, dur, kind, 1)  # a name id past the names
    with pytest.raises(TypeError):
        per_name([0], name, array("d", [1.0]), kind, 2)  # columns of unequal length
    with pytest.raises(IndexError):
        sweep([0, -1], ts, dur, array("q", [0, 0]), 0.0, 5.0)
    with pytest.raises(TypeError):
        sweep((0, 1), ts, dur, array("q", [0, 0]), 0.0, 5.0)  # not a list
    with pytest.raises(IndexError):
        unions([0, 1], ts, dur, kind, name, b"\0", 0.0, 5.0, 0)  # the comm mask shorter than the names
    corr, graph = array("q", [1, 1]), array("q", [-1, -1])
    assert graph_kernels([0, 1], corr, graph, [None, None], array("b"), 2) == [0, 1]
    with pytest.raises(IndexError):
        graph_kernels([0, 1], array("q", [1, 2]), graph, [None, 4], array("b", [1]), 2)  # a call past the calls
    with pytest.raises(ValueError):
        graph_kernels([0], corr, graph, [None], array("b"), 2)  # of_gpu shorter than the columns
    r = array("d", [0.0])
    assert launch_stats([0, 1], [0, None], kind, b"\0\0", array("b", [1]), ts, dur, r, r, 0, 1) == (1, [0.0], [0.0], 0)
    with pytest.raises(IndexError):
        launch_stats([0], [3, None], kind, b"\0\0", array("b", [1]), ts, dur, r, r, 0, 1)


@needs_gaps
def test_idle_inside_ops_the_same_sums_in_the_same_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops of a few names nesting, overlapping across threads, repeating, starting and ending on a gap's edges, and
    the profiler's step annotations (left out): the compiled sweep gives Python's dict, key order included (the
    order a name first held the host)."""
    rng = random.Random(7)
    several = 0
    for _ in range(2000):
        grid = rng.random() < 0.5
        q = (lambda x: float(round(x))) if grid else (lambda x: x)
        gaps, t = [], rng.uniform(0, 10)
        for _ in range(rng.randint(0, 40)):
            a = q(t + rng.expovariate(1 / 20))
            b = q(a + rng.expovariate(1 / 30))
            gaps.append((a, b))
            t = b
        ops = []
        for _ in range(rng.randint(0, 30)):
            a = q(rng.uniform(0, t + 10))
            if gaps and rng.random() < 0.3:  # on a gap's edge
                a = rng.choice(rng.choice(gaps))
            ops.append((rng.choice(["aten::copy_", "aten::item", "forward", "ProfilerStep#3", "x"]), a,
                        q(a + rng.expovariate(1 / rng.choice([5.0, 50.0, 500.0])))))
        compiled = list(timeline.idle_inside_ops(gaps, ops).items())
        with monkeypatch.context() as m:
            _python_only(m)
            reference = list(timeline.idle_inside_ops(gaps, ops).items())
        assert compiled == reference
        several += len(compiled) > 1
    assert several > 500  # most cases name several ops, so the order is tested


@needs_gaps
def test_sorted_times_sorts_as_python_does() -> None:
    from diagnoser.traces._gaps import sorted_times

    rng = random.Random(3)
    for n in (0, 1, 2, 17, 5000):
        xs = [rng.choice([rng.uniform(0, 2e15), float(rng.randint(0, 50)), rng.uniform(-1e3, 1e3), 1e308, 5e-324])
              for _ in range(n)]
        out = array("d")
        out.frombytes(sorted_times(array("d", xs)))
        assert out.tolist() == sorted(xs)
    with pytest.raises(TypeError):
        sorted_times(array("f", [1.0]))


def test_sorted_floats_and_median_as_python_gives_them() -> None:
    import statistics

    rng = random.Random(11)
    for n in (1, 2, 3, 4095, 4096, 4097, 20000):
        xs = [rng.choice([rng.expovariate(0.1), float(rng.randint(0, 9)), 0.0]) for _ in range(n)]
        assert list(timeline.sorted_floats(xs)) == sorted(xs)
        assert list(timeline.sorted_floats(array("d", xs))) == sorted(xs)
        assert kernels.median(xs) == statistics.median(xs)
    with pytest.raises(ValueError):
        kernels.median([])


@needs_gaps
def test_bad_arguments_are_refused_not_read_past() -> None:
    from diagnoser.traces._gaps import gap_causes

    names = array("i", [0])
    times = array("d", [0.0])
    ok = ([(0.0, 10.0, 0, None)], [], [], [], [], [0], names, times, times, b"\0", b"\0", lambda: ([], []))
    causes, idle, counts, unattributed = gap_causes(*ok)
    assert causes == ["kernel_overhead"] and counts[IDLE_CAUSES.index("kernel_overhead")] == 1 and unattributed == 0
    with pytest.raises(IndexError):
        gap_causes([(0.0, 10.0, 5, None)], *ok[1:])  # an op the columns do not hold
    with pytest.raises(IndexError):
        gap_causes(ok[0], *ok[1:5], [3], *ok[6:])  # a launch call the columns do not hold
    with pytest.raises(TypeError):
        gap_causes([(0.0, 10.0)], *ok[1:])
    with pytest.raises(TypeError):
        gap_causes(ok[0], *ok[1:6], array("q", [0]), *ok[7:])  # names as 64-bit ints
    with pytest.raises(ValueError):
        gap_causes(ok[0], [1.0], [], *ok[3:])
    with pytest.raises(TypeError):
        gap_causes(*ok[:8], array("d", [0.0, 1.0]), *ok[9:])  # call durations longer than their starts
    with pytest.raises(TypeError):
        gap_causes(*ok[:10], b"\0\0", ok[11])  # the two name masks of unequal length
    long_gap = [(0.0, 5000.0, None, None)]
    with pytest.raises(TypeError):
        gap_causes(long_gap, *ok[1:11], lambda: None)  # host activity that is not (starts, ends)

    from diagnoser.traces._gaps import idle_inside

    one = array("d", [0.0])
    assert idle_inside(one, array("d", [5.0]), array("i", [0]), one, array("d", [3.0]), 1) == [(0, 3.0)]
    with pytest.raises(IndexError):
        idle_inside(one, one, array("i", [4]), one, one, 1)  # a name id past the names
    with pytest.raises(TypeError):
        idle_inside(one, array("d", [1.0, 2.0]), array("i", [0]), one, one, 1)  # columns of unequal length
    with pytest.raises(TypeError):
        idle_inside(one, one, array("q", [0]), one, one, 1)
