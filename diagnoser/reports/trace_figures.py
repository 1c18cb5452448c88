"""The trace views an expert looks for beside Nsight Systems and HolisticTraceAnalysis, as data: the kernels holding
the GPU time (with each one's speed of light where its op's shapes were recorded), a short window of the timeline,
the distribution of kernel durations and, for a job of several ranks, each rank's time side by side.

They read the fields the trace analysis fills (TraceSummary.top_kernels, kernel_duration_us, timeline, ranks,
comm_share_by_kind; docs/traces.md). A summary without them (a capture recorded by an older version, a trace with no
kernels) gives a NotDrawn that says what is needed. Nothing here draws: svg.py does.
"""

from __future__ import annotations

from diagnoser import physics
from diagnoser.capture import Capture, DurationStats, KernelStat, RankStat, TimelineWindow, TraceSummary
from diagnoser.errors import DiagnoserError
from diagnoser.evidence import Evidence
from diagnoser.physics.gpus import GpuSpec
from diagnoser.reports.figdata import (
    PALETTE,
    Figure,
    Histogram,
    KernelRow,
    KernelTable,
    Lane,
    Lanes,
    NotDrawn,
    Segment,
    Span,
    StackedRow,
    StackedRows,
)
from diagnoser.reports.labels import COLLECTIVES, HOST_STYLE, IDLE_STYLE, KERNEL_STYLE, idle_look
from diagnoser.units import fmt

PERFETTO = ("open the whole trace at ui.perfetto.dev (Open trace file: it is read in the browser, not uploaded) or "
            "in chrome://tracing")
NEEDS_NEW = "a trace analysed by this version of diagnoser (re-run analyze on the trace file)"


def kernel_style(kind: str, platform: str = "") -> tuple[str, str]:
    """A class's name and colour; communication is RCCL's on ROCm, NCCL's elsewhere."""
    label, color = KERNEL_STYLE.get(kind, (kind or "other", PALETTE[6]))
    return (label.replace("NCCL", "RCCL") if platform == "rocm" else label), color


def comm_library(trace: TraceSummary) -> str:
    return "RCCL" if trace.platform == "rocm" else "NCCL"


def duration_text(value: float) -> str:
    """A duration in µs as a reader wants it: 2.3 µs, 377 µs, 1.24 ms, 0.62 s."""
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.2f} ms" if value < 1e4 else f"{value / 1e3:.1f} ms"
    return f"{value:.1f} µs" if value < 100 else f"{value:.0f} µs"


def window_text(seconds: float) -> str:
    """A window's length in seconds as a reader wants it: 30.0 s, 2.5 s, 32.0 ms (a trace's window), never 0.0 s."""
    return f"{seconds:.1f} s" if seconds >= 1 else duration_text(seconds * 1e6)


# --- the kernels holding the time --------------------------------------------------------------------------------

def _roofs(capture: Capture, ev: Evidence, trace: TraceSummary) -> tuple[GpuSpec | None, str, float | None]:
    """The GPU, the precision its matmuls ran at, and that precision's dense peak (None when unknown)."""
    gspec = ev.gpu_spec
    if gspec is None:
        return None, "", None
    dtype = trace.dtype or (capture.model.dtype if capture.model and capture.model.dtype else "bf16")
    try:
        key = physics.compute_dtype(gspec, physics.normalise_dtype(dtype))
    except DiagnoserError:
        return gspec, "", None
    return gspec, key, gspec.flops[key]


def _speed_of_light(k: KernelStat, gspec: GpuSpec | None, precision: str,
                    peak: float | None) -> tuple[str, float | None, str, str]:
    """Achieved rates in words, the fraction of the binding roof, which roof, or why there is none."""
    if not k.costed_calls or (k.achieved_flop_per_s is None and k.achieved_bytes_per_s is None):
        why = ("communication: the link sets its speed, not a roof" if k.kind == "comm"
               else "needs its op's shapes")
        return "", None, "", why
    parts = []
    if k.achieved_flop_per_s is not None:
        parts.append(fmt(k.achieved_flop_per_s, "FLOP/s"))
    if k.achieved_bytes_per_s is not None:
        parts.append(fmt(k.achieved_bytes_per_s, "B/s"))
    achieved = ", ".join(parts)
    if k.costed_calls < k.count:
        achieved += f" ({k.costed_calls:,} of {k.count:,} calls with shapes)"
    if gspec is None:
        return achieved, None, "", "the GPU is not in the physics table, so its roofs are unknown"
    fracs = []
    if k.achieved_flop_per_s is not None and peak:
        fracs.append((k.achieved_flop_per_s / peak, f"of the {precision.upper()} peak {fmt(peak, 'FLOP/s')}"))
    if k.achieved_bytes_per_s is not None:
        fracs.append((k.achieved_bytes_per_s / gspec.hbm_bytes_per_s, f"of HBM {fmt(gspec.hbm_bytes_per_s, 'B/s')}"))
    if not fracs:
        return achieved, None, "", "no roof for this precision"
    frac, roof = max(fracs)
    return achieved, frac, roof, ""


def kernel_table(capture: Capture, ev: Evidence) -> KernelTable | NotDrawn:
    title = "Top kernels by GPU time"
    trace = capture.trace
    if trace is None:
        return NotDrawn(title, "needs a torch.profiler trace (attach --trace 5 or analyze TRACE)")
    if not trace.top_kernels:
        return NotDrawn(title, "needs the trace's kernels by name: " + (NEEDS_NEW if trace.kernel_count else
                                                                        "this trace holds no GPU kernels"))
    gspec, precision, peak = _roofs(capture, ev, trace)
    rows = []
    for k in trace.top_kernels:
        label, color = kernel_style(k.kind, trace.platform)
        achieved, sol, roof, why = _speed_of_light(k, gspec, precision, peak)
        rows.append(KernelRow(k.name, k.full_name or k.name, label, color, k.count, k.total_us, k.share, k.mean_us,
                              k.p50_us, k.p90_us, achieved, sol, roof, why))
    shown = sum(r.share for r in rows)
    with_sol = sum(1 for r in rows if r.sol is not None)
    ranks = f" over {len(trace.ranks)} ranks (merged by name)" if len(trace.ranks) > 1 else ""
    caption = (f"The {len(rows)} kernel names holding the most GPU time{ranks}: {shown:.0%} of the "
               f"{trace.kernel_count:,} kernels' time in the trace. Names are shortened (no namespaces, template "
               "arguments or parameters; the full name opens under each). Share: of summed kernel time. ")
    if with_sol:
        caption += ("Speed of light: the kernel's achieved FLOP/s or bytes/s (from its op's recorded shapes, over its "
                    "own GPU time) against the roof it is closer to, as Nsight Compute's SOL reads it; under 60 % "
                    "the kernel, not the hardware, sets the pace. The others need their ops' input shapes "
                    "(torch.profiler record_shapes=True).")
    else:
        caption += ("Speed of light needs the ops' input shapes (torch.profiler record_shapes=True): none of these "
                    "kernels has them.")
    return KernelTable(title, rows, caption, shown)


# --- a short window of the timeline -----------------------------------------------------------------------------

def _stream_lanes(tl: TimelineWindow, platform: str) -> list[Lane]:
    devices = sorted({i.device for i in tl.items})
    keys = sorted({(i.device, i.stream) for i in tl.items})
    lanes = []
    for device, stream in keys:
        spans = []
        for i in tl.items:
            if (i.device, i.stream) == (device, stream):
                label, color = kernel_style(i.kind, platform)
                name = tl.names[i.name] if 0 <= i.name < len(tl.names) else "?"
                spans.append(Span(i.start_us, i.dur_us, color, name, label))
        short = f"stream {stream}" if len(devices) == 1 else f"GPU{device} s{stream}"
        lanes.append(Lane(short, spans, f"GPU {device}, stream {stream}"))
    return lanes


def trace_window_figure(capture: Capture) -> Figure | NotDrawn:
    title = "A window of the trace: streams, kernels and gaps"
    trace = capture.trace
    if trace is None:
        return NotDrawn(title, "needs a torch.profiler trace (attach --trace 5 or analyze TRACE)")
    tl = trace.timeline
    if tl is None or not tl.items:
        return NotDrawn(title, "needs the trace's timeline window: " + (NEEDS_NEW if trace.kernel_count else
                                                                        "this trace holds no GPU kernels"))
    lanes: list[Lane] = []
    tids = sorted({h.tid for h in tl.host_calls})
    for n, tid in enumerate(tids, 1):
        spans = [Span(h.start_us, h.dur_us, HOST_STYLE.get(h.kind, ("host call", PALETTE[6]))[1], h.kind,
                      HOST_STYLE.get(h.kind, ("host call", ""))[0]) for h in tl.host_calls if h.tid == tid]
        lanes.append(Lane(f"host {n}" if len(tids) > 1 else "host", spans, f"host thread {tid}: launch, copy and "
                          "sync calls"))
    lanes += _stream_lanes(tl, trace.platform)
    if tl.gaps:
        gap_spans = [Span(g.start_us, g.dur_us, idle_look(g.cause).color, f"idle: {idle_look(g.cause).label}", "idle")
                     for g in tl.gaps]
        lanes.append(Lane("GPU idle", gap_spans, "device-level idle gaps, coloured by what the GPU waited for"))
    kinds = [k for k in KERNEL_STYLE if any(i.kind == k for i in tl.items)]
    legend = [kernel_style(k, trace.platform) for k in kinds]
    legend += [HOST_STYLE[k] for k in HOST_STYLE if any(h.kind == k for h in tl.host_calls)]
    legend += [(f"idle: {look.label}", look.color) for c, look in IDLE_STYLE.items() if any(g.cause == c
                                                                                             for g in tl.gaps)]
    where = f"{tl.label}, " if tl.label else ""
    if len(trace.ranks) > 1:  # the analysis keeps the first rank's window
        first = trace.ranks[0]
        where = (f"rank {first.rank}" if first.rank is not None else first.path or "the first rank") + ", " + where
    start = (f"starting {duration_text(tl.offset_us)} into the analysed window" if tl.offset_us >= 0.05
             else "from the start of the analysed window")
    caption = (f"{where}{duration_text(tl.length_us)} {start}"
               + (" (shortened to keep the drawing small)" if tl.capped else "")
               + f": {len(tl.items):,} GPU ops on {len({(i.device, i.stream) for i in tl.items})} stream(s), coloured "
               "by kernel class; host calls above (launches, copies, syncs), idle gaps below coloured by what the GPU "
               "waited for. Ops closer than a pixel are drawn as one span a few pixels long, in the colour holding "
               "most of its time (hover for what it holds). To see every op, "
               f"{PERFETTO}" + (f": {trace.path}" if trace.path else "") + ".")
    return Figure("trace-window", title, Lanes(title, lanes, tl.length_us, legend), caption, wide=True)


# --- how long kernels run ---------------------------------------------------------------------------------------

def _shown_bins(d: DurationStats) -> tuple[int, int]:
    used = [i for i, c in enumerate(d.bin_counts) if c]
    return (used[0], used[-1]) if used else (0, -1)


def durations_figure(capture: Capture) -> Figure | NotDrawn:
    title = "How long kernels run"
    trace = capture.trace
    if trace is None:
        return NotDrawn(title, "needs a torch.profiler trace (attach --trace 5 or analyze TRACE)")
    d = trace.kernel_duration_us
    if d is None or not d.count or len(d.bin_counts) != len(d.bin_edges_us) + 1:
        return NotDrawn(title, "needs the trace's kernel durations: " + (NEEDS_NEW if trace.kernel_count else
                                                                          "this trace holds no GPU kernels"))
    first, last = _shown_bins(d)
    total_n = sum(d.bin_counts) or 1
    times = d.bin_time_us if len(d.bin_time_us) == len(d.bin_counts) else [0.0] * len(d.bin_counts)
    total_t = sum(times) or 1.0
    open_last = last == len(d.bin_counts) - 1
    edges = [d.bin_edges_us[i] for i in range(first, min(last + 1, len(d.bin_edges_us)))]
    if open_last:
        edges.append(d.max_us)
    lower = d.bin_edges_us[first - 1] if first > 0 else 0.0
    chart = Histogram(title, [lower, *edges], [d.bin_counts[i] / total_n for i in range(first, last + 1)],
                      [times[i] / total_t for i in range(first, last + 1)],
                      [("p50", d.p50_us), ("p90", d.p90_us), ("p99", d.p99_us)], open_last=open_last)
    short = sum(c for c, e in zip(d.bin_counts, d.bin_edges_us, strict=False) if e <= 5.0) / total_n
    caption = (f"{d.count:,} kernels: median {duration_text(d.p50_us)}, p90 {duration_text(d.p90_us)}, "
               f"p99 {duration_text(d.p99_us)}, longest {duration_text(d.max_us)}. Light bars: share of kernels per "
               "duration bin; dark: share of GPU kernel time. ")
    if short >= 0.5:
        caption += (f"{short:.0%} of the kernels run 5 µs or less, about the time a launch takes: many small "
                    "kernels leave the GPU waiting on the host unless graphs or fusion batch them.")
    return Figure("durations", title, chart, caption)


# --- ranks side by side ------------------------------------------------------------------------------------------

def _rank_segments(r: RankStat) -> list[Segment]:
    segs = []
    busy = r.gpu_busy_frac or 0.0
    exposed = r.comm_exposed_frac or 0.0
    compute = r.compute_frac if r.compute_frac is not None else max(0.0, busy - exposed)
    segs.append(Segment("compute", compute, PALETTE[2], "GPU busy with anything but exposed communication"))
    segs.append(Segment("exposed communication", exposed, KERNEL_STYLE["comm"][1],
                        "collectives with no compute beside them"))
    attributed = 0.0
    for cause, look in IDLE_STYLE.items():
        frac = r.idle_frac_by_cause.get(cause, 0.0)
        if frac > 0:
            segs.append(Segment(f"idle: {look.label}", frac, look.color))
            attributed += frac
    rest = 1.0 - compute - exposed - attributed
    if rest > 0.0005:
        segs.append(Segment("idle: not attributed", rest, "#B8BEC4"))
    return segs


def ranks_figure(capture: Capture) -> Figure | NotDrawn:
    title = "Ranks side by side"
    trace = capture.trace
    if trace is None or len(trace.ranks) < 2:
        return NotDrawn(title, "needs the traces of two or more ranks of one job (analyze a folder of per-rank "
                        "traces, or several files)")
    rows = []
    for r in sorted(trace.ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.path)):
        label = f"rank {r.rank}" if r.rank is not None else (r.path or "rank ?")
        step = f", step {r.step_ms_p50:.0f} ms" if r.step_ms_p50 else ""
        rows.append(StackedRow(label, _rank_segments(r), "straggler" if r.straggler else "",))
        rows[-1].segments[0].detail += f" ({r.kernel_count:,} kernels{step})"
    names: dict[str, Segment] = {}
    for row in rows:
        for s in row.segments:
            names.setdefault(s.label, Segment(s.label, 0.0, s.color))
    caption = ("Each rank's own analysed window: compute (busy minus exposed communication), communication with no "
               "compute beside it, and idle time by cause. In synchronous data or tensor parallelism the slow rank "
               "computes while the others wait in their collectives, so a straggler shows the most compute and the "
               "least exposed communication. ")
    caption += (trace.straggler[:1].upper() + trace.straggler[1:] + "." if trace.straggler
                else "No rank computes 10 % more than the median rank: no straggler.")
    return Figure("ranks", title, StackedRows(title, rows, list(names.values())), caption)


# A CPU build's op classes (traces/engine_steps.py) in the kernel classes' colours where one matches.
_CPU_OP_COLOR = {"matmul": KERNEL_STYLE["gemm"][1], "attention": KERNEL_STYLE["attention"][1],
                 "kv_write": KERNEL_STYLE["memcpy"][1], "sampling": KERNEL_STYLE["reduction"][1],
                 "other": KERNEL_STYLE["other"][1]}
_BETWEEN = "#D9D9D9"


def engine_steps_figure(capture: Capture) -> Figure | NotDrawn:
    """The window as the engine's own step annotations split it (vLLM's CPU build): inside the steps by CPU op class,
    and outside them, where sampling and scheduling run."""
    title = "The window by the engine's steps"
    trace = capture.trace
    e = trace.engine_steps if trace is not None else None
    if e is None or not e.op_share:
        return NotDrawn(title, "needs a CPU build's trace with the engine's step annotations (vLLM's "
                        "execute_context_N(T)_generation_M(G))")
    inside = [Segment(f"in steps: {k}", v * e.steps_frac, _CPU_OP_COLOR.get(k, PALETTE[0]))
              for k, v in sorted(e.op_share.items(), key=lambda kv: (kv[0] == "other", -kv[1])) if v > 0]
    outside = [Segment(f"between steps: {k}" if k != "other" else "between steps: scheduling, Python, waiting",
                       v, _CPU_OP_COLOR.get(k, PALETTE[0]) if k != "other" else _BETWEEN)
               for k, v in sorted(e.outside_op_share.items(), key=lambda kv: (kv[0] == "other", -kv[1])) if v > 0]
    if not e.outside_op_share and e.steps_frac < 1.0:
        outside = [Segment("between steps", 1.0 - e.steps_frac, _BETWEEN)]
    row = StackedRow(f"{e.steps} steps", inside + outside)
    caption = (f"The engine's own step annotations hold {e.steps_frac:.1%} of the window (p50 {e.step_ms_p50:.2f} ms "
               "a step), split by the CPU ops that ran in them (other: ops fused into a compiled graph, Python "
               f"between); the {1.0 - e.steps_frac:.1%} outside them by the same ops: vLLM samples after the annotated "
               "forward, and schedules, processes outputs and waits for requests between steps.")
    return Figure("engine-steps", title, StackedRows(title, [row], inside + outside), caption)


def collective_items(trace: TraceSummary) -> list[tuple[str, float]]:
    """The communication share split by collective, where the trace says which (else one item)."""
    comm = trace.kernel_share.get("comm", 0.0)
    kinds = {k: v for k, v in trace.comm_share_by_kind.items() if v > 0}
    if not comm or not kinds:
        return [(kernel_style("comm", trace.platform)[0], comm)] if comm else []
    return [(f"{comm_library(trace)} {COLLECTIVES.get(k, k)}", v) for k, v in kinds.items()]


__all__ = ["IDLE_STYLE", "KERNEL_STYLE", "collective_items", "duration_text", "durations_figure",
           "engine_steps_figure", "kernel_style", "kernel_table", "ranks_figure", "trace_window_figure"]
