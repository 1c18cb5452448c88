"""Several traces of one job (a folder of per-rank files, or files given together): one summary for the job and a
per-rank comparison (TraceSummary.ranks) in which a straggler stands out.

In synchronous data or model parallelism every rank waits for the slowest at each collective, so the slow rank shows
the most compute and the others show the time as communication (their collective kernels run while they wait). A rank
is called the straggler when its compute share is at least STRAGGLER_RATIO times the median rank's.

Shares are of each rank's own window, so they compare only ranks whose windows cover the same work: a rank whose file
is cut short (or whose window is under half the longest rank's) describes only the part it kept, and its compute and
communication shares are left out (None) with a note in `skipped`, never set against the others.

A serving frontend beside the ranks (vLLM writes its AsyncLLM process's trace, `<host>_<pid>.async_llm.*`, to the
same folder as the engine workers') is not a rank: it runs no kernels and none of the model's ops. It is left out of
every statistic and listed in `frontends` (`is_frontend`).

The job summary: busy and idle fractions are of the ranks' device time together (each rank's share weighed by its
window times its devices: a rank cut short counts for the time it kept, never as much as a whole one); counts are
summed; kernel-class and collective shares
are weighted by GPU time; top kernels are merged by name (counts and times exact, p50/p90 the count-weighted mean of
the ranks'); the duration histogram is summed (percentiles: count-weighted means of the ranks', the max exact); the
timeline window is the first rank's, and the only one kept: each rank's entry in the JSON (`context.trace.ranks`)
holds its statistics without a window of its own (at about 150 KB a window, a job of 64 ranks would carry 10 MB of
windows nobody draws).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from diagnoser.capture import DurationStats, KernelStat, RankStat, TraceSummary
from diagnoser.traces.classify import COMM, KERNEL_CLASSES
from diagnoser.traces.kernels import COMM_KINDS, TOP_KERNELS
from diagnoser.traces.result import TraceAnalysis
from diagnoser.traces.timeline import IDLE_CAUSES

STRAGGLER_RATIO = 1.1
# A cut-short rank's window against the longest rank's: below this it covers other work than theirs.
CUT_COMPARABLE = 0.9
# Any rank's window against the longest: below this its shares describe another stretch of the job.
SHORT_COMPARABLE = 0.5
# A frontend's own name (vLLM: "<host>_<pid>.async_llm", an optional "<prefix>_" before it).
_FRONTEND_NAME = re.compile(r"(?:^|[._-])(?:async_llm|api_server|frontend)(?:[._-]|$)", re.IGNORECASE)
# A file with under this share of the CPU ops of the busiest file, and no GPU events, runs none of the model.
FRONTEND_OPS_SHARE = 0.01


def is_frontend(a: TraceAnalysis, others: list[TraceAnalysis]) -> str:
    """Why this file is a serving frontend and not a rank ("" when it is a rank): it ran nothing on a GPU, and either
    its name says so or it ran next to none of the CPU ops the other files ran (the model's ops run in the workers)."""
    if a.gpu_ops or (a.summary.truncated and a.devices):
        return ""
    most_ops = max((o.cpu_ops for o in others), default=0)
    gpu_beside = any(o.gpu_ops for o in others)
    if _FRONTEND_NAME.search(a.path.name) and (gpu_beside or most_ops > a.cpu_ops):
        return "named as the serving frontend, no GPU events"
    if most_ops and a.cpu_ops < FRONTEND_OPS_SHARE * most_ops:
        what = "no GPU events" + (" beside ranks that have them" if gpu_beside else "")
        return f"{what}, {a.cpu_ops} CPU ops against {most_ops} in a rank"
    return ""


def split_frontends(files: list[TraceAnalysis]) -> tuple[list[TraceAnalysis], list[tuple[TraceAnalysis, str]]]:
    """(the ranks, the frontends with why); a folder of frontends alone keeps them all as its ranks."""
    ranks: list[TraceAnalysis] = []
    fronts: list[tuple[TraceAnalysis, str]] = []
    for a in files:
        why = is_frontend(a, [o for o in files if o is not a])
        if why:
            fronts.append((a, why))
        else:
            ranks.append(a)
    return (ranks, fronts) if ranks else (files, [])


def rank_stat(a: TraceAnalysis) -> RankStat:
    s = a.summary
    st = RankStat(rank=a.rank, path=a.path.name, window_s=s.window_s, gpu_busy_frac=s.gpu_busy_frac,
                  idle_frac_by_cause=dict(s.idle_frac_by_cause), kernel_count=s.kernel_count,
                  step_ms_p50=a.step_ms_p50)
    span_us = s.window_s * 1e6 * max(1, len(a.timelines))
    if s.gpu_busy_frac is not None and span_us > 0:
        st.comm_frac = a.comm_us / span_us
        st.comm_exposed_frac = max(0.0, a.comm_us - a.comm_overlapped_us) / span_us
        st.compute_frac = max(0.0, s.gpu_busy_frac - st.comm_exposed_frac)
    return st


def combine(path: Path, files: list[TraceAnalysis]) -> TraceAnalysis:
    ranks, fronts = split_frontends(files)
    first = ranks[0]
    s = TraceSummary(path=str(path), window_s=max(r.summary.window_s for r in ranks))
    with_gpu = [r for r in ranks if r.summary.gpu_busy_frac is not None]
    s.devices = sorted({d for r in ranks for d in r.summary.devices})
    if with_gpu:
        s.gpu_busy_frac = _by_time(with_gpu, [r.summary.gpu_busy_frac for r in with_gpu])
        s.idle_frac_by_cause = {c: _by_time(with_gpu, [r.summary.idle_frac_by_cause.get(c, 0.0) for r in with_gpu])
                                for c in IDLE_CAUSES}
    for name in ("compute_time_frac", "non_compute_time_frac", "idle_time_frac"):
        measured = [r for r in ranks if getattr(r.summary, name) is not None]
        if measured:
            setattr(s, name, _by_time(measured, [getattr(r.summary, name) for r in measured]))
    grand = _pool_kernels(s, ranks)
    s.kernel_count = sum(r.summary.kernel_count for r in ranks)
    s.cuda_graph_launches = sum(r.summary.cuda_graph_launches for r in ranks)
    _pool(s, ranks, ("short_kernel_frac", "launch_call_us_p50", "launch_delay_us_p50", "intensity_flop_per_byte",
                     "decode_batch", "prefill_frac", "attention_frac", "costed_time_frac", "collectives_per_step",
                     "collective_us_p50", "collective_host_frac"), statistics.fmean)
    _pool(s, ranks, ("achieved_flops", "achieved_bytes_per_s"), sum)  # rates of the ranks together: the job's
    s.skipped = [f"{r.path.name}: {note}" for r in ranks for note in r.summary.skipped]
    s.truncated = any(r.summary.truncated for r in ranks)
    s.events_total = sum(r.summary.events_total for r in ranks)
    s.events_skipped = sum(r.summary.events_skipped for r in ranks)
    reasons: Counter[str] = Counter()
    for r in ranks:
        reasons.update(r.summary.skip_reasons)
    s.skip_reasons = dict(sorted(reasons.items()))
    _what_ran(s, ranks)
    s.top_kernels = _merge_top([r.summary.top_kernels for r in ranks], grand)
    s.kernel_duration_us = _merge_durations([r.summary.kernel_duration_us for r in ranks])
    s.timeline = first.summary.timeline
    for other in files:  # the job's window is the first rank's: the others' are not carried on
        if other is not first:
            other.summary.timeline = None
            other.snapshot = None
    # The engine's step annotations: one rank's (a tensor-parallel engine's ranks run the same steps), the first's.
    s.engine_steps = next((r.summary.engine_steps for r in ranks if r.summary.engine_steps is not None), None)
    s.ranks = [rank_stat(r) for r in ranks]
    _uncomparable(s, ranks)
    s.straggler = _straggler(s.ranks)
    s.frontends = [f"{a.path.name}: {why}" for a, why in fronts]
    s.rank_count = len(ranks)
    exposed = [st.comm_exposed_frac for st in s.ranks if st.comm_exposed_frac is not None]
    if exposed:
        # Each rank's own exposed communication, averaged: the job's is measured, not "not measured".
        s.comm_exposed_frac = statistics.fmean(exposed)
    if grand > 0:
        s.comm_share_max_rank = max((r.summary.kernel_share.get(COMM, 0.0) for r in ranks), default=0.0)
    return TraceAnalysis(path=path, summary=s, window=first.window, window_policy=first.window_policy,
                         devices=first.devices, ranks=ranks, ridge_flop_per_byte=first.ridge_flop_per_byte,
                         gpu_spec=first.gpu_spec, world_size=first.world_size, snapshot=first.snapshot,
                         frontends=[a for a, _ in fronts])


def _device_time(r: TraceAnalysis) -> float:
    """A rank's window times its devices: what its busy and idle shares are shares of."""
    return r.summary.window_s * max(1, len(r.timelines))


def _by_time(ranks: list[TraceAnalysis], shares: list[float | None]) -> float:
    """The job's share of its device time: each rank's share (in ranks' order) weighed by its device time (a rank cut
    short counts for the time it kept, not as much as a whole one); the plain mean where no rank has a window."""
    weights = [_device_time(r) for r in ranks]
    values = [v or 0.0 for v in shares]
    total = sum(weights)
    if total <= 0:
        return statistics.fmean(values)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total


def _pool(s: TraceSummary, ranks: list[TraceAnalysis], names: tuple[str, ...],
          how: Callable[[list[float]], float]) -> None:
    """Each named summary field over the ranks that measured it (`how`: their mean, or their sum); unset when none
    did."""
    for name in names:
        values = [getattr(r.summary, name) for r in ranks if getattr(r.summary, name) is not None]
        if values:
            setattr(s, name, how(values))


def _pool_kernels(s: TraceSummary, ranks: list[TraceAnalysis]) -> float:
    """Kernel-class, collective and graph shares of the ranks' kernel time together; returns that time (µs)."""
    totals = dict.fromkeys(KERNEL_CLASSES, 0.0)
    comm = dict.fromkeys(COMM_KINDS, 0.0)
    kernel_us = graph_us = 0.0
    for r in ranks:
        if r.kernels is not None:
            for c, us in r.kernels.time_us_by_class.items():
                totals[c] += us
            for c, us in r.kernels.comm_us_by_kind.items():
                comm[c] += us
            kernel_us += r.kernels.kernel_us
            graph_us += r.kernels.graph_kernel_us
    grand = sum(totals.values())
    if grand > 0:
        s.kernel_share = {c: v / grand for c, v in totals.items()}
        s.comm_share_by_kind = {c: v / grand for c, v in comm.items()}
    if kernel_us > 0:
        s.graph_kernel_frac = graph_us / kernel_us
    return grand


def _uncomparable(s: TraceSummary, ranks: list[TraceAnalysis]) -> None:
    """Leave out of the rank comparison the ranks whose window covers another stretch of the job than the longest
    rank's (module docstring): their shares stay unset, and a note says why."""
    longest = max((r.summary.window_s for r in ranks), default=0.0)
    if len(ranks) < 2 or longest <= 0:
        return
    for a, st in zip(ranks, s.ranks, strict=True):
        share = a.summary.window_s / longest
        cut = a.summary.truncated and share < CUT_COMPARABLE
        if not cut and share >= SHORT_COMPARABLE:
            continue
        st.compute_frac = st.comm_frac = st.comm_exposed_frac = None
        name = f"rank {st.rank}" if st.rank is not None else st.path
        why = "its file is cut short" if cut else "its window is under half the longest rank's"
        s.skipped.append(f"{name} is not compared with the other ranks: {why} ({a.summary.window_s * 1e3:.0f} of "
                         f"{longest * 1e3:.0f} ms), so its compute and communication shares describe another "
                         "stretch of the job and no straggler is named from them; the job's busy and idle shares "
                         "count it for the time it kept")


def _what_ran(s: TraceSummary, ranks: list[TraceAnalysis]) -> None:
    """Platform and workload: the ranks' answer when they agree (the most common one otherwise)."""
    platforms = Counter(r.summary.platform for r in ranks if r.summary.platform)
    s.platform = platforms.most_common(1)[0][0] if platforms else ""
    workloads = Counter(r.summary.workload for r in ranks if r.summary.workload)
    if workloads:
        s.workload = workloads.most_common(1)[0][0]
        source = next(r for r in ranks if r.summary.workload == s.workload)
        s.workload_evidence = [f"{source.path.name}: {e}" for e in source.summary.workload_evidence]
    steps = [r.summary.steps for r in ranks if r.summary.steps is not None]
    s.steps = max(steps) if steps else None
    sampled = [r for r in ranks if r.summary.sampled]
    if sampled:
        s.sampled = True
        reasons = {r.summary.sampled_reason for r in sampled}
        if len(reasons) == 1 and len(sampled) == len(ranks):
            s.sampled_reason = f"every rank: {reasons.pop()}"
        else:
            s.sampled_reason = "; ".join(f"{r.path.name}: {r.summary.sampled_reason}" for r in sampled)


def _merge_top(tops: list[list[KernelStat]], grand: float) -> list[KernelStat]:
    merged: dict[str, KernelStat] = {}
    for top in tops:
        for k in top:
            key = k.full_name or k.name
            m = merged.get(key)
            if m is None:
                merged[key] = KernelStat(name=k.name, full_name=k.full_name, kind=k.kind, count=k.count,
                                         total_us=k.total_us, p50_us=k.p50_us * k.count, p90_us=k.p90_us * k.count,
                                         costed_calls=k.costed_calls,
                                         flops_per_call=(k.flops_per_call or 0.0) * k.costed_calls,
                                         bytes_per_call=(k.bytes_per_call or 0.0) * k.costed_calls,
                                         achieved_flop_per_s=_costed_secs(k))
                continue
            m.count += k.count
            m.total_us += k.total_us
            m.p50_us += k.p50_us * k.count
            m.p90_us += k.p90_us * k.count
            m.costed_calls += k.costed_calls
            m.flops_per_call = (m.flops_per_call or 0.0) + (k.flops_per_call or 0.0) * k.costed_calls
            m.bytes_per_call = (m.bytes_per_call or 0.0) + (k.bytes_per_call or 0.0) * k.costed_calls
            m.achieved_flop_per_s = (m.achieved_flop_per_s or 0.0) + (_costed_secs(k) or 0.0)
    out = sorted(merged.values(), key=lambda k: -k.total_us)[:TOP_KERNELS]
    for m in out:
        n = max(1, m.count)
        m.mean_us = m.total_us / n
        m.p50_us /= n
        m.p90_us /= n
        m.share = m.total_us / grand if grand > 0 else 0.0
        secs = m.achieved_flop_per_s  # (summed seconds of the costed calls, held here until now)
        if m.costed_calls:
            flops, nbytes = m.flops_per_call or 0.0, m.bytes_per_call or 0.0
            m.flops_per_call, m.bytes_per_call = flops / m.costed_calls, nbytes / m.costed_calls
            m.achieved_flop_per_s = flops / secs if secs else None
            m.achieved_bytes_per_s = nbytes / secs if secs else None
        else:
            m.flops_per_call = m.bytes_per_call = m.achieved_flop_per_s = None
    return out


def _costed_secs(k: KernelStat) -> float | None:
    """Seconds of GPU time of a kernel's costed calls, from its own totals."""
    if not k.costed_calls or not k.achieved_flop_per_s or k.flops_per_call is None:
        return None
    return k.flops_per_call * k.costed_calls / k.achieved_flop_per_s


def _merge_durations(parts: list[DurationStats | None]) -> DurationStats | None:
    ds = [d for d in parts if d is not None and d.count]
    if not ds:
        return None
    n = sum(d.count for d in ds)

    def wmean(attr: str) -> float:
        return sum(getattr(d, attr) * d.count for d in ds) / n

    return DurationStats(count=n, mean_us=wmean("mean_us"), p10_us=wmean("p10_us"), p50_us=wmean("p50_us"),
                         p90_us=wmean("p90_us"), p99_us=wmean("p99_us"), max_us=max(d.max_us for d in ds),
                         bin_edges_us=list(ds[0].bin_edges_us),
                         bin_counts=[sum(c) for c in zip(*(d.bin_counts for d in ds), strict=True)],
                         bin_time_us=[sum(c) for c in zip(*(d.bin_time_us for d in ds), strict=True)])


def _straggler(stats: list[RankStat]) -> str:
    """A sentence naming the rank whose compute share stands out (see the module docstring), or ""."""
    known = [r for r in stats if r.compute_frac is not None]
    if len(known) < 2:
        return ""
    median = statistics.median(r.compute_frac or 0.0 for r in known)
    slow = max(known, key=lambda r: r.compute_frac or 0.0)
    if not median or (slow.compute_frac or 0.0) < STRAGGLER_RATIO * median:
        return ""
    slow.straggler = True
    others = [r for r in known if r is not slow and r.comm_frac is not None]
    name = f"rank {slow.rank}" if slow.rank is not None else slow.path
    text = (f"{name} computes {(slow.compute_frac or 0.0) / median - 1:.0%} more than the median rank "
            f"({slow.compute_frac:.1%} vs {median:.1%} of its window)")
    if others and slow.comm_frac is not None:
        wait = statistics.fmean(r.comm_frac for r in others)  # type: ignore[misc]
        if wait > slow.comm_frac:
            text += f", while the others spend {wait:.1%} of theirs in communication against its {slow.comm_frac:.1%}"
    return text
