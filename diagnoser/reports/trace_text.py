"""The trace analysis as text, the way `analyze` and `trace` print it before the diagnosis: the window and what ran,
GPU busy/idle and why, kernel classes and the kernels that hold the time, launches, FLOPs and intensity against the
ridge point, serving phases, ranks, and what was skipped.

Each section is one function over the analysis; a section with nothing to say gives no lines. The caller makes the
lines safe for a terminal (kernel and op names come from the trace file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diagnoser.reports.labels import idle_look
from diagnoser.traces.timeline import IDLE_CAUSES
from diagnoser.units import fmt

if TYPE_CHECKING:
    from diagnoser.capture import EngineSteps, KernelStat, TraceSummary
    from diagnoser.traces import TraceAnalysis

SHOWN = 0.0005  # a share under this rounds to 0.0 %: not worth a line
_PLATFORMS = {"cuda": "CUDA", "rocm": "ROCm"}


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def flop_text(x: float) -> str:
    """A count of floating-point operations as people read it: 412 GFLOP, 2.1 TFLOP, 38.0 MFLOP (never 2.17e+03)."""
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= size:
            v = x / size
            return f"{v:.1f} {prefix}FLOP" if v < 100 else f"{v:.0f} {prefix}FLOP"
    return f"{x:.0f} FLOP"


def us_text(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} µs"


def _shares(share: dict[str, float]) -> str:
    """Shares largest first, those that round to nothing left out."""
    return ", ".join(f"{k} {pct(v)}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]) if v >= SHOWN)


def render_analysis(a: TraceAnalysis) -> list[str]:
    """The trace analysis as lines of text."""
    s = a.summary
    return [*_header(a), *engine_steps_lines(s.engine_steps), *_busy(a), *_kernels(a), *_launches(a), *_flops(a),
            *_phases(a), *_ranks(s), *_read(a), *(f"  skipped: {note}" for note in s.skipped)]


# --- the sections, in reading order ------------------------------------------------------------------------------

def _header(a: TraceAnalysis) -> list[str]:
    """The file(s), the window and what ran in it."""
    s = a.summary
    out = [f"Trace {a.path}"]
    if a.ranks:
        out.append(f"  {len(a.ranks)} rank files: " + ", ".join(r.path.name for r in a.ranks))
    out += [f"  frontend, not a rank (left out of the numbers): {front}" for front in s.frontends]
    gpus = ", ".join(sorted({d.name for d in a.devices})) or "no deviceProperties"
    out.append(f"  window {s.window_s * 1e3:.1f} ms ({a.window_policy}); GPUs: {gpus}")
    ran = []
    if s.platform:
        ran.append(_PLATFORMS.get(s.platform, s.platform))
    if s.workload:
        ran.append(f"{s.workload} ({'; '.join(s.workload_evidence[:2])})")
    if s.steps:
        ran.append(f"{s.steps} profiler steps")
    if ran:
        out.append("  " + ", ".join(ran))
    if s.sampled:
        out.append(f"  incomplete trace: {s.sampled_reason}")
    return out


def engine_steps_lines(e: EngineSteps | None) -> list[str]:
    """The engine's own step annotations (vLLM): the step split as it wrote it, and a CPU build's op classes."""
    if e is None:
        return []
    out = [f"Engine steps (the engine's own annotations): {e.steps}, p50 {e.step_ms_p50:.2f} ms, "
           f"{pct(e.steps_frac)} of the window inside them; {e.prefill_steps} carried a prefill "
           f"({e.prompt_tokens} prompt tokens, {pct(e.prefill_time_frac)} of the steps' time); "
           f"{e.generated_tokens} tokens generated"]
    if e.decode_batch is not None and e.decode_step_ms_p50 is not None:
        out.append(f"  decode-only steps: batch {e.decode_batch:.1f} on average, p50 {e.decode_step_ms_p50:.2f} ms")
    if e.op_share:
        parts = ", ".join(f"{k} {pct(v)}" for k, v in sorted(e.op_share.items(), key=lambda kv: -kv[1]))
        out.append(f"  the steps' time by CPU op: {parts} (other: ops fused into a compiled graph, Python between)")
    if e.outside_op_share:
        out.append(f"  outside the steps, {pct(1.0 - e.steps_frac)} of the window: {outside_text(e)}")
    return out


def outside_text(e: EngineSteps) -> str:
    """The window outside the engine's steps by CPU op class (sampling runs after vLLM's annotated forward), the
    rest named for what it is."""
    named = sorted(((k, v) for k, v in e.outside_op_share.items() if k != "other" and v > 0), key=lambda kv: -kv[1])
    parts = [f"{k} {pct(v)}" for k, v in named]
    parts.append(f"the rest {pct(e.outside_op_share.get('other', 0.0))} (scheduling, Python and waiting between "
                 "steps)")
    return ", ".join(parts)


def _busy(a: TraceAnalysis) -> list[str]:
    """GPU busy and idle, the temporal breakdown, idle by cause and each device's longest gaps."""
    s = a.summary
    if s.gpu_busy_frac is None:
        return []
    out = [f"GPU busy {pct(s.gpu_busy_frac)}, idle {pct(1 - s.gpu_busy_frac)} of the window"
           + (f" (mean over devices {', '.join(map(str, s.devices))})" if len(s.devices) > 1 else "")]
    if s.compute_time_frac is not None:
        out.append(f"  temporal breakdown: compute {pct(s.compute_time_frac)}, non-compute (communication, "
                   f"copies) {pct(s.non_compute_time_frac)}, idle {pct(s.idle_time_frac)}")
    out += _idle_causes(s)
    for tl in a.timelines[:4]:
        if tl.longest_gaps:
            gaps = "; ".join(f"{us_text(g.length)} {g.cause}" for g in tl.longest_gaps[:3])
            out.append(f"  device {tl.device} longest gaps: {gaps}")
    return out


def _idle_causes(s: TraceSummary) -> list[str]:
    # In the timeline's order of causes, not by size: the same order in every trace.
    fracs = ((cause, s.idle_frac_by_cause.get(cause, 0.0)) for cause in IDLE_CAUSES)
    return [f"  idle {pct(frac):>6}  {idle_look(cause).text}" for cause, frac in fracs if frac >= SHOWN]


def _kernels(a: TraceAnalysis) -> list[str]:
    """GPU time by kernel class, the top kernels, kernel durations, copies, communication and CUDA graphs."""
    s = a.summary
    out = []
    if s.kernel_share:
        out.append(f"GPU time by kind ({s.kernel_count} kernels): {_shares(s.kernel_share)}")
    out += [_top_kernel(ks) for ks in s.top_kernels[:8]]
    d = s.kernel_duration_us
    if d is not None:
        out.append(f"  kernel durations: p10 {us_text(d.p10_us)}, p50 {us_text(d.p50_us)}, p90 {us_text(d.p90_us)}, "
                   f"p99 {us_text(d.p99_us)}, max {us_text(d.max_us)}")
    out += _copies_and_comm(a)
    if s.graph_kernel_frac:
        out.append(f"  {pct(s.graph_kernel_frac)} of kernel time ran in CUDA/HIP graph replays")
    return out


def _top_kernel(ks: KernelStat) -> str:
    rate = ""
    if ks.achieved_flop_per_s:
        rate = f"  {ks.achieved_flop_per_s / 1e12:.1f} TFLOP/s, {(ks.achieved_bytes_per_s or 0) / 1e9:.0f} GB/s"
    return (f"  {pct(ks.share):>6} {us_text(ks.total_us):>10} {ks.count:>6}x  p50 {us_text(ks.p50_us):>9}  "
            f"{ks.kind:<16} {ks.name[:60]}{rate}")


def _copies_and_comm(a: TraceAnalysis) -> list[str]:
    out = []
    k = a.kernels
    if k is not None:
        if k.memcpy_us_by_direction:
            copies = sorted(k.memcpy_us_by_direction.items())
            out.append("  copies: " + ", ".join(f"{d} {us_text(v)}" for d, v in copies))
        if a.comm_us:
            out.append(f"  communication {us_text(a.comm_us)}, {a.comm_overlapped_us / a.comm_us:.0%} of it "
                       "overlapped by compute")
    kinds = {c: v for c, v in a.summary.comm_share_by_kind.items() if v >= SHOWN}
    if kinds:
        out.append("  collectives: " + _shares(kinds))
    return out


def _launches(a: TraceAnalysis) -> list[str]:
    s = a.summary
    if s.launch_call_us_p50 is not None:
        k = a.kernels
        launched = k.launched if k else sum(r.kernels.launched for r in a.ranks if r.kernels is not None)
        return [f"Launches: {launched} kernels launched one by one, launch call p50 "
                f"{s.launch_call_us_p50:.1f} µs, launch-to-start p50 {s.launch_delay_us_p50:.1f} µs, "
                f"{pct(s.short_kernel_frac)} shorter than their launch; CUDA graph replays: "
                f"{s.cuda_graph_launches}"]
    if s.cuda_graph_launches:
        return [f"Launches: CUDA graph replays: {s.cuda_graph_launches}"]
    return []


def _flops(a: TraceAnalysis) -> list[str]:
    """The costed ops: FLOPs, bytes, intensity against the ridge point, the ops holding the most time."""
    s, ops = a.summary, a.ops
    if ops is None or not ops.runs:
        return []
    ridge = f", ridge {a.ridge_flop_per_byte:.0f} FLOP/B on {a.gpu_spec} at {ops.dtype}" \
        if a.ridge_flop_per_byte else ""
    intensity = (f"intensity {s.intensity_flop_per_byte:.1f} FLOP/B (time-weighted, {ops.time_basis} time){ridge}"
                 if s.intensity_flop_per_byte is not None else "intensity left out (see skipped)")
    covered = f" launching {s.costed_time_frac:.0%} of the kernel time" if s.costed_time_frac is not None else ""
    out = [f"FLOPs: {len(ops.runs)} matmul/conv/attention ops{covered}, {flop_text(ops.total_flops)}, "
           f"{fmt(ops.total_bytes, 'bytes')}; {intensity}"]
    below = s.time_frac_below_ridge
    if below is not None:
        out.append(f"  {below:.0%} of that time is in ops below the ridge point (memory-bound)")
    for name, agg in sorted(ops.by_op.items(), key=lambda kv: -kv[1]["time_us"])[:4]:
        ai = agg["flops"] / agg["bytes"] if agg["bytes"] else 0.0
        out.append(f"  {name:<40} {int(agg['count']):>6}x  {flop_text(agg['flops']):>11}  {ai:8.1f} FLOP/B  "
                   f"{us_text(agg['time_us'])}")
    return out


def _phases(a: TraceAnalysis) -> list[str]:
    """Prefill and decode steps as the shapes show them, or why they were left out."""
    s, ph = a.summary, a.phases
    if ph is None or not ph.steps:
        return []
    if s.prefill_frac is None and s.decode_batch is None and ph.prefill_frac is not None:
        return [f"Phases: left out ({len(ph.steps)} shaped steps seen, too little of the GPU time; see skipped)"]
    n_dec = sum(1 for st in ph.steps if st.phase == "decode")
    n_pre = sum(1 for st in ph.steps if st.phase == "prefill")
    line = f"Phases ({ph.source}): {len(ph.steps)} steps, {n_pre} prefill-like, {n_dec} decode-like"
    if ph.decode_batch is not None:
        line += f"; decode batch {ph.decode_batch:.1f}"
    if ph.prefill_frac is not None:
        line += f"; prefill {pct(ph.prefill_frac)} of step time"
    out = [line]
    if ph.attention_frac is not None:
        out.append(f"  attention {pct(ph.attention_frac)} of step time")
    if ph.context_growth is not None:
        (kv0, f0), (kv1, f1) = ph.context_growth
        # The first and last decode steps' contexts: the mean context can fall (long requests finish, short ones join).
        moved = "grows" if kv1 > kv0 else "falls" if kv1 < kv0 else "stays"
        span = f"at {kv0}" if kv1 == kv0 else f"from {kv0} to {kv1}"
        out.append(f"  as context {moved} {span} tokens, attention goes from {pct(f0)} to {pct(f1)} of a decode step")
    return out


def _ranks(s: TraceSummary) -> list[str]:
    """Several ranks of one job side by side, the straggler marked."""
    if not s.ranks:
        return []
    out = ["Ranks:          busy  compute     comm  exposed  idle (largest cause)         step p50"]
    for r in s.ranks:
        # A rank with no GPU timeline (a CPU-only trace) has no idle share to show, not 0 %.
        top_cause: tuple[str, float | None] = max(r.idle_frac_by_cause.items(), key=lambda kv: kv[1], default=(
            "", 0.0)) if r.gpu_busy_frac is not None else ("", None)
        step = f"{r.step_ms_p50:.1f} ms" if r.step_ms_p50 is not None else "-"
        name = f"rank {r.rank}" if r.rank is not None else r.path[:10]
        out.append(f"  {name:<10} {pct(r.gpu_busy_frac):>7} {pct(r.compute_frac):>8} {pct(r.comm_frac):>8} "
                   f"{pct(r.comm_exposed_frac):>8}  {pct(top_cause[1]):>6} {top_cause[0]:<20} {step:>9}"
                   + ("  <- straggler" if r.straggler else ""))
    if s.straggler:
        out.append(f"  straggler: {s.straggler}")
    return out


def _read(a: TraceAnalysis) -> list[str]:
    """How much was read: events and JSON bytes over every rank."""
    decode = [r.decode for r in a.ranks] if a.ranks else [a.decode]
    read = [d for d in decode if d is not None and d.bytes_json]
    if not read:
        return []
    return [f"Read {sum(d.events for d in read)} events, {sum(d.bytes_json for d in read) / 1e6:.1f} MB of JSON."]


__all__ = ["engine_steps_lines", "flop_text", "outside_text", "pct", "render_analysis", "us_text"]
