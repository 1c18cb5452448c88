"""The report's pictures as data: which charts a capture can support, from its series, evidence and physics.

Each figure says what it shows and where its numbers came from. A chart the capture cannot support is not drawn; the
report lists it with the reason instead. Charts are ordered so that the one about the verdict comes first. The HTML
renderer draws the specs (reports/svg.py); nothing here draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diagnoser import physics
from diagnoser import signals as S
from diagnoser.capture import Capture, Series
from diagnoser.characterise import MIN_COSTED_SHARE, costed_share
from diagnoser.diagnosis import Diagnosis, Finding
from diagnoser.errors import DiagnoserError
from diagnoser.evidence import Evidence
from diagnoser.reports.figdata import (
    PALETTE,
    Band,
    Bars,
    Bullet,
    Figure,
    HLine,
    Line,
    Mark,
    NotDrawn,
    Roof,
    Roofline,
    RoofPoint,
    Segment,
    StackedBar,
    TimeSeries,
)
from diagnoser.reports.labels import idle_look, kernel_label
from diagnoser.reports.trace_figures import (
    collective_items,
    durations_figure,
    engine_steps_figure,
    ranks_figure,
    trace_window_figure,
    window_text,
)
from diagnoser.units import fmt

_OPS = {">=": "≥", "<=": "≤", "==": "=", "=": "="}


def op_symbol(op: str) -> str:
    return _OPS.get(op, op)

SOURCE_NAMES = {
    "nvml": "NVML", "gpm": "NVML GPM", "dcgm": "DCGM", "psutil": "host (psutil)", "server": "server metrics",
    "trace": "torch.profiler trace", "physics": "physics model", "user": "user input",
}

SIGNAL_LABELS: dict[str, str] = {
    S.GPU_BUSY: "GPU busy (kernel running)", S.GPU_SM_ACTIVE: "SM active", S.GPU_TENSOR_ACTIVE: "tensor pipes active",
    S.GPU_DRAM_ACTIVE: "DRAM active", S.GPU_MEM_BUSY: "memory controller busy", S.GPU_SM_OCCUPANCY: "SM occupancy",
    S.GPU_MEM_USED_BYTES: "device memory used", S.PROC_GPU_MEM_BYTES: "held by the target process",
    S.GPU_SM_CLOCK_FRAC: "SM clock / max", S.GPU_POWER_W: "board power", S.GPU_TEMP_C: "temperature",
    S.SERVER_RUNNING: "running (batch)", S.SERVER_WAITING: "waiting (queue)", S.SERVER_KV_USAGE: "KV cache used",
    S.SERVER_GEN_TOKENS_PER_S: "generated tokens/s", S.SERVER_PROMPT_TOKENS_PER_S: "prompt tokens/s",
    S.HOST_TARGET_BUSIEST_THREAD: "busiest server thread (of one core)", S.HOST_CPU_FRAC: "whole host CPU",
    S.GPU_PCIE_RX_BPS: "PCIe to GPU", S.GPU_PCIE_TX_BPS: "PCIe from GPU", S.GPU_NVLINK_RX_BPS: "NVLink in",
    S.GPU_NVLINK_TX_BPS: "NVLink out",
}

BUSY_COLOR, UNATTRIBUTED_COLOR = "#009E73", "#B8BEC4"


_POINT_STATS = ("mean", "p50", "p90", "p99", "min", "max", "value")


def source_name(source: str) -> str:
    return " + ".join(SOURCE_NAMES.get(s, s) for s in source.split("+"))


# --- time series ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Panel:
    key: str
    title: str
    signals: tuple[str, ...]
    unit: str
    y_max: float | None = None


_PANELS = (
    _Panel("activity", "GPU activity over the window", (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_TENSOR_ACTIVE,
                                                        S.GPU_DRAM_ACTIVE), "ratio", 1.0),
    _Panel("memory", "Device memory used", (S.GPU_MEM_USED_BYTES, S.PROC_GPU_MEM_BYTES), "bytes"),
    _Panel("kv", "KV cache use", (S.SERVER_KV_USAGE,), "ratio", 1.0),
    _Panel("server", "Server: running batch and queue", (S.SERVER_RUNNING, S.SERVER_WAITING), "requests"),
    _Panel("tokens", "Server throughput", (S.SERVER_GEN_TOKENS_PER_S, S.SERVER_PROMPT_TOKENS_PER_S), "tokens/s"),
    _Panel("clocks", "SM clock (shaded: power or thermal throttling)", (S.GPU_SM_CLOCK_FRAC,), "ratio", 1.0),
    _Panel("power", "Board power", (S.GPU_POWER_W,), "W"),
    _Panel("host", "Host CPU", (S.HOST_TARGET_BUSIEST_THREAD, S.HOST_CPU_FRAC), "ratio", 1.0),
    _Panel("links", "PCIe and NVLink traffic", (S.GPU_PCIE_RX_BPS, S.GPU_PCIE_TX_BPS, S.GPU_NVLINK_RX_BPS,
                                                S.GPU_NVLINK_TX_BPS), "B/s"),
)

_MAX_LINES = 8


def _series_lines(capture: Capture, panel: _Panel) -> tuple[list[Line], list[str], dict[str, str]]:
    members: list[tuple[str, Series]] = [(n, s) for n in panel.signals for s in capture.series_named(n) if s.values]
    gpus = {s.labels.get("gpu", "") for _, s in members}
    lines: list[Line] = []
    sources: list[str] = []
    color_of: dict[str, str] = {}
    for i, (name, s) in enumerate(members[:_MAX_LINES]):
        color = color_of.setdefault(name, PALETTE[len(color_of) % len(PALETTE)])
        label = SIGNAL_LABELS.get(name, name)
        if len(gpus) > 1:
            label += f" (gpu {s.labels.get('gpu', '?')})"
        same_name_before = sum(1 for n, _ in members[:i] if n == name)
        lines.append(Line(label, s.times, s.values, color=color, dashed=same_name_before % 2 == 1))
        sources.append(f"{name} from {source_name(s.source)}")
    return lines, sorted(set(sources)), color_of


def _threshold_lines(findings: Sequence[Finding], signals: Sequence[str], named: bool,
                     scale: float = 1.0) -> list[HLine]:
    """The thresholds the rules compared a statistic of these signals with, as reference lines; `named` puts the
    signal in the label, for charts of several signals."""
    codes: dict[tuple[str, str, str, float, str], list[str]] = {}
    for f in findings:
        for c in f.citations:
            if c.signal not in signals or c.threshold is None or not c.op or c.stat not in _POINT_STATS:
                continue
            rules = codes.setdefault((c.signal, c.stat, c.op, c.threshold, c.unit), [])
            if f.code not in rules:
                rules.append(f.code)  # rules testing the same thing share one line
    out = []
    for (signal, stat, op, threshold, unit), rules in codes.items():
        what = f"{SIGNAL_LABELS.get(signal, signal)} " if named else ""
        out.append(HLine(threshold * scale,
                         f"{', '.join(rules)}: {what}{stat} {op_symbol(op)} {fmt(threshold, unit)}"))
    return out


def _throttle_bands(capture: Capture) -> list[Band]:
    bands: list[Band] = []
    for name, label in ((S.GPU_THROTTLE_POWER, "power cap"), (S.GPU_THROTTLE_THERMAL, "thermal slowdown")):
        for s in capture.series_named(name):
            start = None
            step = (s.times[-1] - s.times[0]) / max(1, len(s.times) - 1) if len(s.times) > 1 else 1.0
            for t, v in zip(s.times, s.values, strict=True):
                if v >= 0.5 and start is None:
                    start = t
                elif v < 0.5 and start is not None:
                    bands.append(Band(start, t, label))
                    start = None
            if start is not None:
                bands.append(Band(start, s.times[-1] + step, label))
    return bands


def _memory_total(capture: Capture, ev: Evidence) -> float | None:
    total = ev.get(S.GPU_MEM_TOTAL_BYTES)
    return total.max if total is not None else None


def _power_lines(capture: Capture, ev: Evidence) -> list[HLine]:
    """The power limit in force and, where it differs, the board's default."""
    out = []
    limit = ev.get(S.GPU_POWER_LIMIT_W)
    value = limit.max if limit is not None else next((g.power_limit_w for g in capture.gpus if g.power_limit_w), None)
    if value:
        out.append(HLine(value, f"power limit {value:.0f} W"))
    default = ev.value(S.GPU_POWER_DEFAULT_LIMIT_W)
    if default and (not value or abs(default - value) > 1.0):
        out.append(HLine(default, f"board default {default:.0f} W"))
    return out


def time_series_figures(capture: Capture, ev: Evidence, d: Diagnosis) -> tuple[list[Figure], list[NotDrawn]]:
    figures, missing = [], []
    for panel in _PANELS:
        lines, sources, color_of = _series_lines(capture, panel)
        if not lines:
            if panel.key in ("activity", "memory", "server"):
                missing.append(NotDrawn(panel.title, _why_absent(ev, panel.signals)))
            continue
        hlines = _threshold_lines(d.findings, panel.signals, named=len(color_of) > 1)
        bands: list[Band] = []
        notes: list[str] = []
        y_max = panel.y_max
        if panel.key == "memory":
            total = _memory_total(capture, ev)
            if total:
                hlines.append(HLine(total, f"device total {fmt(total, 'bytes')}"))
                y_max = total
                hlines += _threshold_lines(d.findings, (S.GPU_MEM_USED_FRAC,), named=False, scale=total)
        if panel.key == "clocks":
            bands = _throttle_bands(capture)
            if bands:
                notes.append("shaded: clock event reason power cap or thermal slowdown active")
        if panel.key == "power":
            hlines += _power_lines(capture, ev)
        if panel.key == "links" and ev.gpu_spec is not None:
            link = ev.gpu_spec.pcie_bytes_per_s
            if link:
                hlines.append(HLine(link, f"PCIe link {fmt(link, 'B/s')} (both directions)"))
        if len([s for n in panel.signals for s in capture.series_named(n) if s.values]) > _MAX_LINES:
            notes.append(f"first {_MAX_LINES} series shown")
        chart = TimeSeries(panel.title, lines, unit=panel.unit, x_max=capture.duration_s, y_max=y_max,
                           hlines=hlines, bands=bands)
        caption = "Source: " + "; ".join(sources) + "."
        if hlines:
            caption += " Dashed lines: the thresholds the rules compared these signals with, and hardware limits."
        if notes:
            caption += " " + "; ".join(notes).capitalize() + "."
        figures.append(Figure(panel.key, panel.title, chart, caption))
    return figures, missing


def _why_absent(ev: Evidence, names: Sequence[str]) -> str:
    return f"needs {' or '.join(names[:2])} ({ev.why_missing(names[0])})"


# --- time share and kernel classes ---------------------------------------------------------------------------

def timeline_figure(capture: Capture, ev: Evidence) -> Figure | NotDrawn:
    title = "Where the GPU's time went"
    trace = capture.trace
    if trace is not None and trace.gpu_busy_frac is not None:
        # The trace's busy share is of its own window; the counter's (said in the caption) is of the whole capture.
        segments = [Segment("busy in the trace", trace.gpu_busy_frac, BUSY_COLOR, "kernels or copies running")]
        attributed = 0.0
        for cause, frac in sorted(trace.idle_frac_by_cause.items(), key=lambda kv: -kv[1]):
            look = idle_look(cause)
            segments.append(Segment(f"idle: {look.label}", frac, look.color))
            attributed += frac
        rest = 1.0 - trace.gpu_busy_frac - attributed
        if rest > 0.0005:
            segments.append(Segment("idle: not attributed", rest, UNATTRIBUTED_COLOR))
        window = f" of the {window_text(trace.window_s)} traced window" if trace.window_s else ""
        chart = StackedBar(title, segments)
        return Figure("timeline", title, chart, f"Share{window}, from the torch.profiler trace"
                      + (f" ({trace.path})" if trace.path else "") + ": idle time split by what the GPU was waiting "
                      "for." + _counter_busy_note(ev))
    busy = ev.get(S.GPU_BUSY)
    if busy is not None:
        segments = [Segment("busy", busy.mean, BUSY_COLOR, "a kernel was running"),
                    Segment("idle", max(0.0, 1.0 - busy.mean), UNATTRIBUTED_COLOR, "cause needs a trace")]
        chart = StackedBar(title, segments)
        return Figure("timeline", title, chart, f"Mean of gpu.busy from {source_name(busy.source)} over "
                      f"{busy.n} samples. A torch.profiler trace (attach --trace 5) splits the idle time by cause.")
    return NotDrawn(title, "needs gpu.busy or a torch.profiler trace: " + ev.why_missing(S.GPU_BUSY))


def _counter_busy_note(ev: Evidence) -> str:
    """The counter's busy share beside the trace's: a different window, so a different number, said as such (a
    fix's gain may quote either)."""
    busy = ev.get(S.GPU_BUSY)
    if busy is None:
        return ""
    return f" Over the whole capture window, gpu.busy from {source_name(busy.source)} reads {fmt(busy.mean, 'ratio')}."


def kernel_figure(capture: Capture) -> Figure | NotDrawn:
    title = "GPU busy time by kernel class"
    trace = capture.trace
    if trace is None or not trace.kernel_share:
        return NotDrawn(title, "needs a torch.profiler trace (attach --trace 5 or analyze TRACE)")
    items = [(kernel_label(k), v) for k, v in trace.kernel_share.items() if v > 0 and k != "comm"]
    items += collective_items(trace)
    chart = Bars(title, items)
    caption = (f"Share of GPU busy time over {trace.kernel_count:,} kernels in the trace"
               + (f" ({trace.path})" if trace.path else "") + "."
               + (" Communication is split by collective." if len(collective_items(trace)) > 1 else ""))
    return Figure("kernels", title, chart, caption)


# --- roofline ------------------------------------------------------------------------------------------------

def _weight_dtype(capture: Capture) -> str:
    model = capture.model
    try:
        return physics.normalise_dtype(model.dtype) if model and model.dtype else "bf16"
    except DiagnoserError:
        return "bf16"


def roofline_figure(capture: Capture, ev: Evidence) -> Figure | NotDrawn:
    """The workload against the roofs. Up to three points can place it, and they can disagree by 10-500x: the
    physics of the model at the observed batch, the trace's costed ops, and the counters' ratio. One is trusted, in
    that order when it describes the work; the others are drawn hollow with the reason they do not."""
    title = "Roofline: the workload against this GPU's roofs"
    gspec = ev.gpu_spec
    if gspec is None:
        return NotDrawn(title, "the GPU is not in the physics table, so its roofs are unknown"
                        if capture.gpus else "no GPU in this capture")
    dtype = _weight_dtype(capture)
    try:
        compute = physics.compute_dtype(gspec, dtype)
    except DiagnoserError:
        return NotDrawn(title, f"the {gspec.name} has no compute rate for {dtype}")
    bandwidth, flops = gspec.hbm_bytes_per_s, gspec.flops
    roofs = [Roof(f"{compute.upper()} dense", flops[compute], primary=True)]
    if "fp8" in flops and compute != "fp8":
        roofs.append(Roof("FP8 dense", flops["fp8"], primary=False))
    points: list[RoofPoint] = []
    sources: list[str] = []
    intensity = ev.value(S.THEORY_INTENSITY)
    if intensity is not None and intensity > 0:
        frac = ev.value(S.THEORY_COMPUTE_ROOF_FRAC)
        batch = ev.observed_batch()
        points.append(RoofPoint(f"decode at batch {fmt(batch)} (physics)" if batch else "decode (physics)", intensity,
                                frac * flops[compute] if frac else None, color=PALETTE[0]))
        sources.append("physics: 2 x active parameters x batch FLOP over the weight and KV bytes a decode step reads"
                       + (", achieved FLOP/s from the measured token rate" if frac else ""))
    trace = capture.trace
    if trace is not None:
        t_int = trace.intensity_flop_per_byte
        if t_int is None and trace.achieved_flops and trace.achieved_bytes_per_s:
            t_int = trace.achieved_flops / trace.achieved_bytes_per_s
        if t_int and t_int > 0:
            covered = costed_share(trace)
            good = covered is None or covered >= MIN_COSTED_SHARE
            note = "" if good else (f"the ops with known shapes cover only {covered:.0%} of the GPU time")
            if good and points:
                good, note = False, "the physics of the whole decode step describes the work better"
            points.append(RoofPoint("trace ops", t_int, trace.achieved_flops, color=PALETTE[5], trusted=good,
                                    note=note))
            sources.append("trace: time-weighted FLOP/byte of the ops with known shapes"
                           + (f" ({covered:.0%} of GPU time)" if covered is not None else ""))
    tensor, dram = ev.get(S.GPU_TENSOR_ACTIVE), ev.get(S.GPU_DRAM_ACTIVE)
    if tensor is not None and dram is not None and tensor.mean > 0 and dram.mean > 0:
        est_flops, est_bytes = tensor.mean * flops[compute], dram.mean * bandwidth
        better = any(p.trusted for p in points)
        good = not better and max(tensor.mean, dram.mean) >= 0.05
        if good:
            note = ""
        elif better:
            note = ("tensor-pipe activity counts the cycles the pipes run, padded tiles of small matmuls included, so "
                    "this ratio overstates intensity; the filled point is measured more directly")
        else:
            note = "both counters are under 5 %: their ratio is noise"
        points.append(RoofPoint("counters (est.)", est_flops / est_bytes, est_flops, color=PALETTE[3], trusted=good,
                                note=note))
        sources.append(f"counters: tensor active {tensor.mean:.0%} x peak over DRAM active {dram.mean:.0%} x "
                       f"bandwidth ({source_name(tensor.source)})")
    if not points:
        return NotDrawn(title, "no workload point: needs the model's shape and batch, a trace with FLOP/byte "
                        "intensity, or both tensor and DRAM activity counters (GPM on Hopper+, or DCGM profiling "
                        "fields)")
    trusted = next((p for p in points if p.trusted), None)
    chart = Roofline(title, bandwidth, roofs, points)
    roofs_from = "measured by diagnoser calibrate" if ev.meta.measured_roofs else gspec.source
    caption = (f"Roofs of the {gspec.name} ({roofs_from}): "
               f"{fmt(bandwidth, 'B/s')} memory, {fmt(flops[compute], 'FLOP/s')} {compute.upper()} dense tensor "
               f"peak; ridge {fmt(flops[compute] / bandwidth, 'FLOP/B')}. Left of the ridge work waits on memory, "
               f"right of it on math. Points: " + "; ".join(sources) + ". ")
    if trusted is not None:
        caption += f"The filled point ({trusted.label}) is the one that describes the workload"
        hollow = [p for p in points if not p.trusted]
        caption += ("; hollow points do not: " + "; ".join(f"{p.label}: {p.note}" for p in hollow) + "."
                    if hollow else ".")
    else:
        caption += "No point describes the whole workload (all hollow): " + "; ".join(
            f"{p.label}: {p.note}" for p in points) + "."
    return Figure("roofline", title, chart, caption)


# --- throughput against physics ------------------------------------------------------------------------------

# Each ceiling keeps its key and colour in every report (Okabe-Ito, apart from the achieved bar's blue).
MARK_COLORS = {"batch1": PALETTE[1], "observed": PALETTE[5], "ridge": PALETTE[3]}


def throughput_marks(capture: Capture, ev: Evidence) -> list[Mark]:
    """The decode ceilings a throughput is read against: one sequence, the observed batch, the ridge batch. Two that
    fall on the same value (a batch-1 decode) are one mark that says both."""
    model, gspec = capture.model, ev.gpu_spec
    ceiling = ev.get(S.THEORY_DECODE_CEILING_TOKENS_PER_S)
    if ceiling is None or model is None or gspec is None:
        return []
    dtype = _weight_dtype(capture)
    tp = max(1, model.tensor_parallel)
    context = ev.context_tokens
    batch = ev.observed_batch()

    def at(b: float) -> float | None:
        try:
            return physics.decode_ceiling_tokens_per_s(model, gspec, batch=b, context=context,
                                                       dtype=dtype, tp=tp)
        except DiagnoserError:
            return None

    marks: list[Mark] = []
    single = at(1.0)
    if single is not None:
        marks.append(Mark("ceiling for one sequence (batch 1)", single, "what a single stream can reach",
                          key="batch1", short="batch 1", color=MARK_COLORS["batch1"]))
    observed = ceiling.values[0]
    b = fmt(batch) if batch else ""  # the batch as every other view of the report writes it
    obs = Mark(f"ceiling at the observed batch {b}".rstrip(), observed,
               "each step reads the weights and KV cache at full bandwidth", key="observed",
               short=f"batch {b} (observed)" if b else "observed batch", color=MARK_COLORS["observed"])
    same = next((m for m in marks if abs(m.value - observed) <= 0.005 * observed), None)
    if same is not None:
        same.label, same.short = f"{same.label}, the observed batch", f"batch {b} (observed)"
        same.detail += "; the batch this capture ran at"
    else:
        marks.append(obs)
    ridge = ev.get(S.THEORY_RIDGE_BATCH)
    if ridge is not None and math.isfinite(ridge.values[0]) and ridge.values[0] >= 1:
        top = at(ridge.values[0])
        if top is not None and all(abs(m.value - top) > 0.005 * top for m in marks):
            r = fmt(ridge.values[0])
            marks.append(Mark(f"ceiling at the ridge batch {r}", top, "where decode turns compute-bound",
                              key="ridge", short=f"batch {r} (ridge)", color=MARK_COLORS["ridge"]))
    return marks


def throughput_figure(capture: Capture, ev: Evidence) -> Figure | NotDrawn:
    title = "Generation throughput against its physical limits"
    achieved = ev.get(S.SERVER_GEN_TOKENS_PER_S)
    model, gspec = capture.model, ev.gpu_spec
    marks = throughput_marks(capture, ev)
    if not marks or model is None or gspec is None:
        why = []
        if gspec is None:
            why.append("a GPU in the physics table")
        if model is None or not model.params:
            why.append("the model's shape (--model)")
        if not why:
            why.append("an observed batch (server.running or a trace)")
        return NotDrawn(title, "needs " + " and ".join(why))
    dtype = _weight_dtype(capture)
    tp = max(1, model.tensor_parallel)
    context = ev.context_tokens
    chart = Bullet(title, achieved.mean if achieved is not None else None, marks)
    eff = ev.get(S.THEORY_EFFICIENCY)
    caption = (f"Decode ceilings for {model.name or 'the model'} ({dtype}, tensor parallel {tp}) on the "
               f"{gspec.name}"
               + (f" at a mean context of {context} tokens" if context else ", weights only (no context length "
                  "known, so the ceilings are optimistic)") + ": "
               + "; ".join(f"{m.short}: {m.detail}" for m in marks) + ". ")
    if achieved is not None:
        caption += f"Achieved: mean server.gen_tokens_per_s from {source_name(achieved.source)}"
        caption += f", {eff.values[0]:.0%} of the ceiling at this batch." if eff is not None else "."
    else:
        caption += "Achieved tokens/s not measured (needs server metrics: attach with --port)."
    return Figure("throughput", title, chart, caption)


# --- all of them, in the order a reader of this verdict needs ------------------------------------------------

_ORDER = {
    "memory_bandwidth": ("roofline", "activity", "throughput", "timeline", "kernels"),
    "compute": ("roofline", "activity", "kernels", "timeline", "throughput"),
    "latency": ("roofline", "kernels", "durations", "trace-window", "activity", "timeline", "throughput"),
    "vram": ("kv", "memory", "server", "throughput", "activity"),
    "batching": ("server", "timeline", "activity", "throughput", "roofline"),
    "host_launch": ("timeline", "trace-window", "host", "activity", "durations", "kernels"),
    "throttling": ("clocks", "power", "activity"),
    "interconnect": ("kernels", "ranks", "trace-window", "links", "timeline", "activity"),
    "idle": ("timeline", "activity", "server", "power"),
    "errors": ("activity", "clocks", "power"),
}
_DEFAULT = ("activity", "timeline", "roofline", "throughput", "kernels", "ranks", "engine-steps", "trace-window",
            "durations", "server", "kv", "memory", "tokens", "clocks", "power", "host", "links")


def build_figures(capture: Capture, ev: Evidence, d: Diagnosis) -> tuple[list[Figure], list[NotDrawn]]:
    figures, missing = time_series_figures(capture, ev, d)
    trace_views: tuple[Figure | NotDrawn, ...] = ()
    if capture.trace is not None:  # without a trace, the kernel chart's note already says to take one
        trace_views = (trace_window_figure(capture), durations_figure(capture))
        if len(capture.trace.ranks) > 1:
            trace_views += (ranks_figure(capture),)
        if capture.trace.engine_steps is not None and capture.trace.engine_steps.op_share:
            trace_views += (engine_steps_figure(capture),)
    for built in (timeline_figure(capture, ev), kernel_figure(capture), roofline_figure(capture, ev),
                  throughput_figure(capture, ev), *trace_views):
        if isinstance(built, Figure):
            figures.append(built)
        else:
            missing.append(built)
    order = list(_ORDER.get(d.verdict, ())) + [k for k in _DEFAULT if k not in _ORDER.get(d.verdict, ())]
    figures.sort(key=lambda f: order.index(f.key) if f.key in order else len(order))
    return figures, missing
