"""`diagnoser analyze TRACE`: analyse a torch.profiler (Kineto) trace a user already has and diagnose it.

TRACE is a .json or .json.gz file, or a folder of per-rank files. The trace analysis is printed first (window,
GPU busy/idle and why, kernel classes, launches, FLOPs and intensity against the ridge point, serving phases,
what was skipped), then the diagnosis the rules draw from it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.capture import save as save_capture
from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.textsafe import printable
from diagnoser.traces import TraceAnalysis, analyze_trace, capture_from_trace
from diagnoser.traces.analysis import WINDOWS
from diagnoser.traces.timeline import IDLE_CAUSES

_CAUSE_TEXT = {
    "host": "host had not launched yet",
    "sync": "host synchronisation",
    "pageable_memcpy": "pageable-memory copy",
    "queue_dry": "nothing to do (queue dry)",
    "kernel_overhead": "kernel-to-kernel overhead",
}


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    @handles_errors
    def analyze_cmd(
        trace: Path = typer.Argument(..., help="A torch.profiler trace (.json or .json.gz) or a folder of per-rank "
                                     "traces."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON; the trace analysis is in "
                                     "its context.trace."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        save: Path | None = typer.Option(None, "--save", help="Also save the capture built from the trace (.dgc)."),
        gpu: str | None = typer.Option(None, "--gpu", help="The GPU the trace ran on (e.g. H100), when its "
                                       "deviceProperties are missing or wrong."),
        model: str | None = typer.Option(None, "--model", help="The served model: a config.json, a folder with "
                                         "one, or a bundled model name."),
        window: str = typer.Option("auto", "--window", help="Analysed window: " + ", ".join(WINDOWS) +
                                   " (auto: profiler steps if any, else the span of GPU activity)."),
        rules_config: Path | None = typer.Option(None, "--rules-config", help="TOML file overriding rule "
                                                 "thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
    ) -> None:
        """Analyse a torch.profiler trace: idle causes, kernel classes, intensity, phases, then the verdict."""
        from diagnoser import physics
        from diagnoser.rules import diagnose as run_diagnosis
        from diagnoser.rules import load_thresholds

        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(rules_config) if rules_config else None
        model_info = physics.resolve_model(model) if model else None
        if gpu:
            physics.get_gpu(gpu)  # an unknown name is a bad option, before the (long) analysis
        analysis = analyze_trace(trace, window=window, gpu_name=gpu)
        capture = capture_from_trace(analysis, model=model_info, gpu_name=gpu)
        if save is not None:
            save_capture(capture, save)
        diagnosis = run_diagnosis(capture, overrides)
        if as_json:
            diagnosis.context["trace"] = analysis.to_dict()
        else:
            for line in render_analysis(analysis):
                typer.echo(printable(line))  # kernel and op names come from the trace file
            if save is not None:
                typer.echo(f"Capture saved to {save}.")
            typer.echo("")
        show(diagnosis, as_json=as_json, fail_on=wanted, verbose=verbose)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _us(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} µs"


def render_analysis(a: TraceAnalysis) -> list[str]:  # noqa: C901 - a flat list of sections
    """The trace analysis as lines of text."""
    s = a.summary
    out = [f"Trace {a.path}"]
    if a.ranks:
        out.append(f"  {len(a.ranks)} rank files: " + ", ".join(r.path.name for r in a.ranks))
    gpus = ", ".join(sorted({d.name for d in a.devices})) or "no deviceProperties"
    out.append(f"  window {s.window_s * 1e3:.1f} ms ({a.window_policy}); GPUs: {gpus}")
    if s.gpu_busy_frac is not None:
        out.append(f"GPU busy {_pct(s.gpu_busy_frac)}, idle {_pct(1 - s.gpu_busy_frac)} of the window"
                   + (f" (mean over devices {', '.join(map(str, s.devices))})" if len(s.devices) > 1 else ""))
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
    k = a.kernels
    if k is not None:
        for name, cls, us, n in k.top_kernels[:5]:
            out.append(f"  {_us(us):>10} {n:>6}x  {cls:<16} {name[:90]}")
        if k.memcpy_us_by_direction:
            out.append("  copies: " + ", ".join(f"{d} {_us(v)}" for d, v in sorted(k.memcpy_us_by_direction.items())))
        if a.comm_us:
            out.append(f"  communication {_us(a.comm_us)}, {a.comm_overlapped_us / a.comm_us:.0%} of it overlapped "
                       "by compute")
    if s.launch_call_us_p50 is not None:
        out.append(f"Launches: {k.launched if k else 0} kernels launched one by one, launch call p50 "
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
        covered = s.extra.get("costed_gpu_frac")
        share = f" launching {covered:.0%} of the GEMM/attention kernel time" if covered is not None else ""
        out.append(f"FLOPs: {len(ops.runs)} matmul/conv/attention ops{share}, {ops.total_flops / 1e9:.3g} GFLOP, "
                   f"{ops.total_bytes / 1e6:.3g} MB; {intensity}")
        below = s.extra.get("time_frac_below_ridge")
        if below is not None:
            out.append(f"  {below:.0%} of that time is in ops below the ridge point (memory-bound)")
        for name, agg in sorted(ops.by_op.items(), key=lambda kv: -kv[1]["time_us"])[:4]:
            ai = agg["flops"] / agg["bytes"] if agg["bytes"] else 0.0
            out.append(f"  {name:<40} {int(agg['count']):>6}x  {agg['flops'] / 1e9:10.3g} GFLOP  {ai:8.1f} FLOP/B  "
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
    if a.decode is not None and a.decode.bytes_json:
        out.append(f"Read {a.decode.events} events, {a.decode.bytes_json / 1e6:.1f} MB of JSON.")
    for note in s.skipped:
        out.append(f"  skipped: {note}")
    return out
