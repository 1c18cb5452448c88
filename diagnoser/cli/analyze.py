"""`diagnoser analyze TRACE [TRACE...]`: analyse a torch.profiler (Kineto) trace a user already has and diagnose it.

TRACE is a .json or .json.gz file, a folder of per-rank files, or several files (the ranks of one job, compared rank
by rank). The trace analysis is printed first (window, what ran, GPU busy/idle and why, kernel classes and the
kernels that hold the time, launches, FLOPs and intensity against the ridge point, serving phases, ranks, what was
skipped), then the diagnosis the rules draw from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.textsafe import printable
from diagnoser.traces.windows import WINDOWS
from diagnoser.units import fmt

if TYPE_CHECKING:
    from diagnoser.capture import EngineSteps
    from diagnoser.traces import TraceAnalysis

_CAUSE_TEXT = {
    "host": "host had not launched yet",
    "sync": "host synchronisation",
    "pageable_memcpy": "pageable-memory copy",
    "queue_dry": "nothing to do (queue dry)",
    "kernel_overhead": "kernel-to-kernel overhead",
    "stream_wait": "queued work waiting on the device (another stream, a collective)",
}


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    @handles_errors
    def analyze_cmd(
        trace: list[Path] = typer.Argument(..., help="A torch.profiler trace (.json or .json.gz), a folder of "
                                           "per-rank traces, or several trace files of one job (compared rank by "
                                           "rank)."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON; the trace analysis is in "
                                     "its context.trace."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        save: Path | None = typer.Option(None, "--save", help="Also save the capture built from the trace (.dgc)."),
        html: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML report to this file.",
                                         dir_okay=False),
        gpu: str | None = typer.Option(None, "--gpu", help="The GPU the trace ran on (e.g. H100), when its "
                                       "deviceProperties are missing or wrong."),
        model: str | None = typer.Option(None, "--model", help="The served model: a config.json, a folder with "
                                         "one, or a bundled model name."),
        window: str = typer.Option("auto", "--window", help="Analysed window: " + ", ".join(WINDOWS) +
                                   " (auto: profiler steps if any, else the span of GPU activity)."),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding rule "
                                                 "thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
        jobs: int | None = typer.Option(None, "--jobs", "-j", min=1, help="Processes reading a large trace "
                                        "(default: every core; 1: one process)."),
        quick: bool = typer.Option(False, "--quick", help="First print a verdict from part of a large trace (64 MB "
                                   "from its middle; the start of a .gz), labelled as such, then the exact result."),
        max_trace_size: str | None = typer.Option(None, "--max-trace-size", help="Refuse traces larger than this "
                                                  "(JSON bytes after gunzip; default 4G or $DIAGNOSER_TRACE_MAX_BYTES)"
                                                  "; e.g. 16G for a long window."),
    ) -> None:
        """Analyse a torch.profiler trace: idle causes, kernel classes, intensity, phases, then the verdict."""
        from diagnoser import physics
        from diagnoser.pipeline import Pipeline
        from diagnoser.rules import load_thresholds
        from diagnoser.traces import analyze_trace, capture_from_trace
        from diagnoser.traces.decode import parse_size

        limit = parse_size(max_trace_size) if max_trace_size is not None else None
        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(str(rules_config)) if rules_config else None
        model_info = physics.resolve_model(model) if model else None
        if gpu:
            physics.get_gpu(gpu)  # an unknown name is a bad option, before the (long) analysis
        pipeline = Pipeline(overrides=overrides, save_to=save, html=html)  # outputs checked before the analysis
        if quick:
            _quick_look(trace, window, gpu, limit, model_info, pipeline, err=as_json)
        analysis = analyze_trace(trace[0] if len(trace) == 1 else trace, window=window, gpu_name=gpu,
                                 max_bytes=limit, jobs=jobs)
        capture = capture_from_trace(analysis, model=model_info, gpu_name=gpu)
        pipeline.checkpoint(capture)
        outcome = pipeline.diagnose(capture)
        if as_json:
            outcome.diagnosis.context["trace"] = analysis.to_dict()
        else:
            for line in render_analysis(analysis):
                typer.echo(printable(line))  # kernel and op names come from the trace file
            if save is not None:
                typer.echo(f"Capture saved to {save}.")
            typer.echo("")
        show(pipeline.write(outcome), as_json=as_json, fail_on=wanted, verbose=verbose)


def _quick_look(trace: list[Path], window: str, gpu: str | None, limit: int | None, model_info: object,
                pipeline: object, *, err: bool) -> None:
    """The quick look: a verdict from part of the trace, printed (on stderr with --json) before the exact one."""
    from diagnoser.traces import capture_from_trace
    from diagnoser.traces.analysis import quick_look

    if len(trace) != 1:
        typer.echo("Quick look: not for several traces; the exact analysis follows.", err=err)
        return
    q = quick_look(trace[0], window=window, gpu_name=gpu, max_bytes=limit)
    if q is None:
        typer.echo("Quick look: the trace is small enough to analyse whole at once; the exact analysis follows.",
                   err=err)
        return
    capture = capture_from_trace(q, model=model_info, gpu_name=gpu)  # type: ignore[arg-type]
    d = pipeline.diagnose(capture).diagnosis  # type: ignore[attr-defined]
    s = q.summary
    shares = ", ".join(f"{k} {_pct(v)}" for k, v in sorted(s.kernel_share.items(), key=lambda kv: -kv[1])[:3]
                       if v >= 0.0005)
    lines = [f"QUICK LOOK, not the result: {s.sampled_reason.removeprefix('quick look: ')}.",
             f"  GPU busy {_pct(s.gpu_busy_frac)}; {shares}" if s.gpu_busy_frac is not None else "  no GPU events read",
             f"  verdict {d.verdict.upper().replace('_', '-')} (confidence {d.confidence:.2f}): {d.headline}",
             "The exact analysis of the whole trace follows.", ""]
    for line in lines:
        typer.echo(line, err=err)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _flop(x: float) -> str:
    """A count of floating-point operations as people read it: 412 GFLOP, 2.1 TFLOP, 38.0 MFLOP (never 2.17e+03)."""
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= size:
            v = x / size
            return f"{v:.1f} {prefix}FLOP" if v < 100 else f"{v:.0f} {prefix}FLOP"
    return f"{x:.0f} FLOP"


def _us(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} µs"


def _engine_steps(e: EngineSteps | None) -> list[str]:
    """The engine's own step annotations (vLLM): the step split as it wrote it, and a CPU build's op classes."""
    if e is None:
        return []
    out = [f"Engine steps (the engine's own annotations): {e.steps}, p50 {e.step_ms_p50:.2f} ms, "
           f"{_pct(e.steps_frac)} of the window inside them; {e.prefill_steps} carried a prefill "
           f"({e.prompt_tokens} prompt tokens, {_pct(e.prefill_time_frac)} of the steps' time); "
           f"{e.generated_tokens} tokens generated"]
    if e.decode_batch is not None and e.decode_step_ms_p50 is not None:
        out.append(f"  decode-only steps: batch {e.decode_batch:.1f} on average, p50 {e.decode_step_ms_p50:.2f} ms")
    if e.op_share:
        parts = ", ".join(f"{k} {_pct(v)}" for k, v in sorted(e.op_share.items(), key=lambda kv: -kv[1]))
        out.append(f"  the steps' time by CPU op: {parts} (other: ops fused into a compiled graph, Python between)")
    return out


def render_analysis(a: TraceAnalysis) -> list[str]:
    """The trace analysis as lines of text."""
    from diagnoser.traces.timeline import IDLE_CAUSES

    s = a.summary
    out = [f"Trace {a.path}"]
    if a.ranks:
        out.append(f"  {len(a.ranks)} rank files: " + ", ".join(r.path.name for r in a.ranks))
    for front in s.frontends:
        out.append(f"  frontend, not a rank (left out of the numbers): {front}")
    gpus = ", ".join(sorted({d.name for d in a.devices})) or "no deviceProperties"
    out.append(f"  window {s.window_s * 1e3:.1f} ms ({a.window_policy}); GPUs: {gpus}")
    ran = []
    if s.platform:
        ran.append({"cuda": "CUDA", "rocm": "ROCm"}.get(s.platform, s.platform))
    if s.workload:
        ran.append(f"{s.workload} ({'; '.join(s.workload_evidence[:2])})")
    if s.steps:
        ran.append(f"{s.steps} profiler steps")
    if ran:
        out.append("  " + ", ".join(ran))
    if s.sampled:
        out.append(f"  incomplete trace: {s.sampled_reason}")
    out.extend(_engine_steps(s.engine_steps))
    if s.gpu_busy_frac is not None:
        out.append(f"GPU busy {_pct(s.gpu_busy_frac)}, idle {_pct(1 - s.gpu_busy_frac)} of the window"
                   + (f" (mean over devices {', '.join(map(str, s.devices))})" if len(s.devices) > 1 else ""))
        if s.compute_time_frac is not None:
            out.append(f"  temporal breakdown: compute {_pct(s.compute_time_frac)}, non-compute (communication, "
                       f"copies) {_pct(s.non_compute_time_frac)}, idle {_pct(s.idle_time_frac)}")
        for cause in IDLE_CAUSES:
            frac = s.idle_frac_by_cause.get(cause, 0.0)
            if frac >= 0.0005:
                out.append(f"  idle {_pct(frac):>6}  {_CAUSE_TEXT[cause]}")
        for tl in a.timelines[:4]:
            if tl.longest_gaps:
                gaps = "; ".join(f"{_us(g.length)} {g.cause}" for g in tl.longest_gaps[:3])
                out.append(f"  device {tl.device} longest gaps: {gaps}")
    if s.kernel_share:
        shares = ", ".join(f"{k} {_pct(v)}" for k, v in sorted(s.kernel_share.items(), key=lambda kv: -kv[1])
                           if v >= 0.0005)
        out.append(f"GPU time by kind ({s.kernel_count} kernels): {shares}")
    for ks in s.top_kernels[:8]:
        rate = ""
        if ks.achieved_flop_per_s:
            rate = f"  {ks.achieved_flop_per_s / 1e12:.1f} TFLOP/s, {(ks.achieved_bytes_per_s or 0) / 1e9:.0f} GB/s"
        out.append(f"  {_pct(ks.share):>6} {_us(ks.total_us):>10} {ks.count:>6}x  p50 {_us(ks.p50_us):>9}  "
                   f"{ks.kind:<16} {ks.name[:60]}{rate}")
    d = s.kernel_duration_us
    if d is not None:
        out.append(f"  kernel durations: p10 {_us(d.p10_us)}, p50 {_us(d.p50_us)}, p90 {_us(d.p90_us)}, "
                   f"p99 {_us(d.p99_us)}, max {_us(d.max_us)}")
    k = a.kernels
    if k is not None:
        if k.memcpy_us_by_direction:
            out.append("  copies: " + ", ".join(f"{d} {_us(v)}" for d, v in sorted(k.memcpy_us_by_direction.items())))
        if a.comm_us:
            out.append(f"  communication {_us(a.comm_us)}, {a.comm_overlapped_us / a.comm_us:.0%} of it overlapped "
                       "by compute")
    kinds = {c: v for c, v in s.comm_share_by_kind.items() if v >= 0.0005}
    if kinds:
        out.append("  collectives: " + ", ".join(f"{c} {_pct(v)}" for c, v in sorted(kinds.items(),
                                                                                     key=lambda kv: -kv[1])))
    if s.graph_kernel_frac:
        out.append(f"  {_pct(s.graph_kernel_frac)} of kernel time ran in CUDA/HIP graph replays")
    if s.launch_call_us_p50 is not None:
        launched = k.launched if k else sum(r.kernels.launched for r in a.ranks if r.kernels is not None)
        out.append(f"Launches: {launched} kernels launched one by one, launch call p50 "
                   f"{s.launch_call_us_p50:.1f} µs, launch-to-start p50 {s.launch_delay_us_p50:.1f} µs, "
                   f"{_pct(s.short_kernel_frac)} shorter than their launch; CUDA graph replays: "
                   f"{s.cuda_graph_launches}")
    elif s.cuda_graph_launches:
        out.append(f"Launches: CUDA graph replays: {s.cuda_graph_launches}")
    ops = a.ops
    if ops is not None and ops.runs:
        ridge = f", ridge {a.ridge_flop_per_byte:.0f} FLOP/B on {a.gpu_spec} at {ops.dtype}" \
            if a.ridge_flop_per_byte else ""
        intensity = (f"intensity {s.intensity_flop_per_byte:.1f} FLOP/B (time-weighted, {ops.time_basis} time){ridge}"
                     if s.intensity_flop_per_byte is not None else "intensity left out (see skipped)")
        covered = f" launching {s.costed_time_frac:.0%} of the kernel time" if s.costed_time_frac is not None else ""
        out.append(f"FLOPs: {len(ops.runs)} matmul/conv/attention ops{covered}, {_flop(ops.total_flops)}, "
                   f"{fmt(ops.total_bytes, 'bytes')}; {intensity}")
        below = s.extra.get("time_frac_below_ridge")
        if below is not None:
            out.append(f"  {below:.0%} of that time is in ops below the ridge point (memory-bound)")
        for name, agg in sorted(ops.by_op.items(), key=lambda kv: -kv[1]["time_us"])[:4]:
            ai = agg["flops"] / agg["bytes"] if agg["bytes"] else 0.0
            out.append(f"  {name:<40} {int(agg['count']):>6}x  {_flop(agg['flops']):>11}  {ai:8.1f} FLOP/B  "
                       f"{_us(agg['time_us'])}")
    ph = a.phases
    left_out = s.prefill_frac is None and s.decode_batch is None and ph is not None and ph.prefill_frac is not None
    if ph is not None and ph.steps and left_out:
        out.append(f"Phases: left out ({len(ph.steps)} shaped steps seen, too little of the GPU time; see skipped)")
    elif ph is not None and ph.steps:
        n_dec = sum(1 for st in ph.steps if st.phase == "decode")
        n_pre = sum(1 for st in ph.steps if st.phase == "prefill")
        line = f"Phases ({ph.source}): {len(ph.steps)} steps, {n_pre} prefill-like, {n_dec} decode-like"
        if ph.decode_batch is not None:
            line += f"; decode batch {ph.decode_batch:.1f}"
        if ph.prefill_frac is not None:
            line += f"; prefill {_pct(ph.prefill_frac)} of step time"
        out.append(line)
        if ph.attention_frac is not None:
            out.append(f"  attention {_pct(ph.attention_frac)} of step time")
        if ph.context_growth is not None:
            (kv0, f0), (kv1, f1) = ph.context_growth
            out.append(f"  as context grows from {kv0} to {kv1} tokens, attention goes from {_pct(f0)} to "
                       f"{_pct(f1)} of a decode step")
    if s.ranks:
        out.append("Ranks:          busy  compute     comm  exposed  idle (largest cause)         step p50")
        for r in s.ranks:
            top_cause = max(r.idle_frac_by_cause.items(), key=lambda kv: kv[1], default=("", 0.0))
            step = f"{r.step_ms_p50:.1f} ms" if r.step_ms_p50 is not None else "-"
            name = f"rank {r.rank}" if r.rank is not None else r.path[:10]
            out.append(f"  {name:<10} {_pct(r.gpu_busy_frac):>7} {_pct(r.compute_frac):>8} {_pct(r.comm_frac):>8} "
                       f"{_pct(r.comm_exposed_frac):>8}  {_pct(top_cause[1]):>6} {top_cause[0]:<20} {step:>9}"
                       + ("  <- straggler" if r.straggler else ""))
        if s.straggler:
            out.append(f"  straggler: {s.straggler}")
    decode = [r.decode for r in a.ranks] if a.ranks else [a.decode]
    read = [d for d in decode if d is not None and d.bytes_json]
    if read:
        out.append(f"Read {sum(d.events for d in read)} events, {sum(d.bytes_json for d in read) / 1e6:.1f} MB of "
                   "JSON.")
    for note in s.skipped:
        out.append(f"  skipped: {note}")
    return out
