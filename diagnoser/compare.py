"""`diagnoser compare BEFORE AFTER`: did the physics hold?

A user applies the top fix, re-attaches, and compares. The comparison says what changed in the configuration, the
verdict before and after, the measured rates and latencies with their spread, and, for every fix the BEFORE
capture proposed, what it predicted against what was realised. Where the change made is not the change a fix
assumed (a batch of 16, not the 129 the fix aimed at), the physics is asked again for the change actually made, from
the BEFORE capture's own efficiency: that is the number the measurement checks.

Pure data: the CLI and the renderers (terminal, JSON, HTML) show a `Comparison`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from diagnoser import signals as S
from diagnoser.capture import Capture
from diagnoser.diagnosis import FixKind
from diagnoser.engines.knobs import Setting, direction_of
from diagnoser.engines.tables import knobs_of
from diagnoser.errors import InputError
from diagnoser.pipeline import Outcome
from diagnoser.rules import curve, gains
from diagnoser.units import fmt

# Rates that say how much work was done, in the order a reader looks for them.
RATES = (S.SERVER_GEN_TOKENS_PER_S, S.SERVER_PROMPT_TOKENS_PER_S, S.SERVER_REQUESTS_PER_S)
# The means come from the histograms' sums and counts and are exact; the quantiles are interpolated inside a bucket.
LATENCIES = (S.SERVER_TTFT_MEAN_S, S.SERVER_TTFT_P50_S, S.SERVER_TTFT_P99_S, S.SERVER_ITL_MEAN_S, S.SERVER_ITL_P50_S,
             S.SERVER_ITL_P99_S)
# Each quantile and the other quantile of its histogram (with the two ranks), to tell an all-in-one-bucket histogram
# in captures whose series do not carry their bucket.
_QUANTILE_PAIRS: dict[str, str] = {S.SERVER_TTFT_P50_S: S.SERVER_TTFT_P99_S, S.SERVER_TTFT_P99_S: S.SERVER_TTFT_P50_S,
                   S.SERVER_ITL_P50_S: S.SERVER_ITL_P99_S, S.SERVER_ITL_P99_S: S.SERVER_ITL_P50_S}
# A realised gain within this factor of the prediction counts as the physics holding (the published corpus's band).
AGREEMENT = 0.25
# A realised ratio under an upper bound but below x1 by more than the band is a loss, not a bound holding: a 49 %
# drop read "within the bound" and "held to the physics", in green.
LOSS = "a loss, not a gain"
# Over an upper bound by less than the measurement's noise (two standard errors of the ratio): not a graded outcome.
NOISY_BOUND = "over the bound by less than the measurement's noise"
GRADES = ("held", "over-predicted", "under-predicted", "within the bound", "beyond the bound", LOSS)


@dataclass(frozen=True)
class Measure:
    """One measured quantity before and after, with the spread of its samples."""

    signal: str
    unit: str
    before: float | None
    after: float | None
    before_sd: float | None = None  # standard deviation of the samples
    after_sd: float | None = None
    n_before: int = 0
    n_after: int = 0
    # Empty when the two values can be compared; else why not (both quantiles inside one histogram bucket).
    unresolved: str = ""
    # Set when the ratio is only a bound: one side's quantile lies inside the histogram's first bucket (0, b], the
    # other's above it, so that side is known only to be at most b. bound_op is "<=" or ">=", bound the ratio's limit.
    bound_op: str = ""
    bound: float | None = None
    bound_why: str = ""
    # A rate from the server's counters: their change from the first scrape to the last over the time between
    # (method "counter delta"), with each side's standard error from the scrape times and the counters' steps; a
    # mean of the per-interval rates only for a window with too few scrapes ("mean of the samples").
    method: str = ""
    before_se: float | None = None
    after_se: float | None = None
    # Why the ratio is no measurement of the fix: the load ended (or stopped) inside a window.
    ungraded: str = ""
    # A quantile interpolated inside a histogram bucket is no measurement: each side is its bucket (low, high), shown
    # as such, and the ratio only the range the two buckets allow (ratio_low, ratio_high; high None when unbounded).
    before_bucket: tuple[float, float] | None = None
    after_bucket: tuple[float, float] | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None

    @property
    def ratio(self) -> float | None:
        """after / before, when the two are measured well enough to divide (see bound for a ratio that is a limit)."""
        if self.before is None or self.after is None or self.before <= 0 or self.unresolved or self.bound_op \
                or self.before_bucket is not None or self.after_bucket is not None:
            return None
        return self.after / self.before

    @property
    def ratio_error(self) -> float | None:
        """The ratio's relative standard error, from each side's standard error of the mean."""
        if self.ratio is None or not self.before or not self.after:
            return None
        if self.before_se is not None and self.after_se is not None:
            return math.hypot(self.before_se / self.before, self.after_se / self.after)
        parts = []
        for mean, sd, n in ((self.before, self.before_sd, self.n_before), (self.after, self.after_sd, self.n_after)):
            if sd is None or n < 2:
                return None
            parts.append((sd / math.sqrt(n) / mean) ** 2)
        return math.sqrt(sum(parts))


@dataclass(frozen=True)
class Change:
    what: str  # a ServingConfig field, model.dtype, gpu, batch, trace.graph_kernel_frac, ...
    before: str
    after: str
    fix: FixKind | None = None  # the kind of fix this change applies, when it is one


@dataclass(frozen=True)
class Prediction:
    """A fix the BEFORE capture proposed, and what happened."""

    kind: FixKind
    title: str
    predicted: float | None  # as the diagnosis said, for the change the fix aimed at
    predicted_kind: str  # estimate or upper_bound
    benefit: str  # speed or capacity
    applied: bool  # the configuration changed the way this fix says
    for_change: float | None = None  # the physics asked again, for the change actually made
    for_change_basis: str = ""
    realised: float | None = None  # the measured ratio of the rate that fix moves
    verdict: str = ""  # a GRADES entry / not applied / not measurable / not checked
    for_change_kind: str = ""  # estimate or upper_bound: how the physics' answer for the change made is graded
    # The range of the estimate graded (for the change made, else as predicted), where it has one: the engine's own
    # step-time curve over the BEFORE window (rules/curve.py). None for a bound or an estimate without a range.
    low: float | None = None
    high: float | None = None

    @property
    def graded(self) -> bool:
        """Whether the measurement checked the prediction (held, over- or under-predicted, within or beyond the
        bound)."""
        return self.verdict in GRADES

    @property
    def in_range(self) -> bool | None:
        """Whether the realised gain lies inside the estimate's range (None where there is no range or no gain)."""
        if self.low is None or self.high is None or self.realised is None:
            return None
        return self.low <= self.realised <= self.high

    @property
    def error(self) -> float | None:
        reference = self.for_change if self.for_change is not None else self.predicted
        if reference is None or self.realised is None or reference <= 0:
            return None
        return self.realised / reference - 1.0


@dataclass
class Comparison:
    before_target: str
    after_target: str
    before_verdict: str
    after_verdict: str
    before_headline: str
    after_headline: str
    changes: list[Change] = field(default_factory=list)
    rates: list[Measure] = field(default_factory=list)
    latencies: list[Measure] = field(default_factory=list)
    activity: list[Measure] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    confounders: list[str] = field(default_factory=list)  # what else changed: no prediction is graded
    loop: str = ""  # "closed (N clients)" where both windows are one closed loop; "" for open or unknown

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p, out in zip(self.predictions, d["predictions"], strict=True):
            out["kind"] = p.kind.value
            out["error"] = p.error
            out["graded"] = p.graded
            out["in_range"] = p.in_range
        for c, out in zip(self.changes, d["changes"], strict=True):
            out["fix"] = c.fix.value if c.fix is not None else None
        for group in ("rates", "latencies", "activity"):
            for m, out in zip(getattr(self, group), d[group], strict=True):
                out["ratio"] = m.ratio
                out["ratio_error"] = m.ratio_error
        return d


def _bucket(name: str, outcome: Outcome) -> tuple[float, float] | None:
    """The histogram bucket a quantile was interpolated in, from its series' labels. A capture that predates them
    still shows the first bucket (0, b]: with both quantiles inside it, each is b x q x total / in-bucket, so p99 is
    1.98 x p50 exactly, and p50 / 0.5 is b or a little more (then the bound returned is that estimate)."""
    series = [s for s in outcome.capture.series if s.name == name]
    if len(series) == 1 and (found := series[0].bucket()) is not None:
        return found
    other = _QUANTILE_PAIRS[name]
    p50_name, p99_name = (name, other) if name.endswith("p50_s") else (other, name)
    p50, p99 = outcome.evidence.value(p50_name), outcome.evidence.value(p99_name)
    if p50 and p99 and p50 > 0 and math.isclose(p99 / p50, 0.99 / 0.5, rel_tol=1e-6):
        return 0.0, p50 / 0.5
    return None


def _same_server(before: Outcome, after: Outcome) -> bool:
    sa, sb = before.capture.server, after.capture.server
    return sa is not None and sb is not None and sa.kind == sb.kind


def _unresolved(name: str, unit: str, before: Outcome, after: Outcome) -> str:
    """Why two quantiles cannot be compared, or "" when they can: both were interpolated inside the same bucket."""
    if name not in _QUANTILE_PAIRS:
        return ""
    a, b = _bucket(name, before), _bucket(name, after)
    if (a is None) != (b is None) and _same_server(before, after):
        # One side's quantiles sit in the first bucket (0, b]; a value of the other side under 0.99 b lies in it too
        # (the estimate of b is at most 1 % high when p99 is inside it), as one server kind has one set of buckets.
        known = a or b
        other = after if a is not None else before
        value = other.evidence.value(name)
        if known is not None and known[0] == 0.0 and value is not None and value <= 0.99 * known[1]:
            a = b = known
    if a is None or b is None or math.isinf(a[1]) or math.isinf(b[1]):
        return ""
    first = a[0] == b[0] == 0.0 and math.isclose(a[1], b[1], rel_tol=0.05)  # an estimated first bound is close
    if a != b and not first:
        return ""
    high = fmt(min(a[1], b[1]), unit)
    bucket = f"first bucket (up to {high})" if a[0] == 0.0 else f"{fmt(a[0], unit)} to {high} bucket"
    return (f"both inside the histogram's {bucket}: a quantile interpolated there says where its rank falls, not "
            "the latency; the mean is exact")


def _first_bucket_bound(name: str, unit: str, before: Outcome, after: Outcome) -> tuple[str, float | None, str]:
    """(op, limit, why) when the ratio of two quantiles is only a bound: one side's lies inside the histogram's first
    bucket (0, b], where interpolation assumes the values spread evenly from 0, and the other's above b. That side is
    at most b, so the ratio is at least (before inside) or at most (after inside) the ratio to b."""
    if name not in _QUANTILE_PAIRS or not _same_server(before, after):
        return "", None, ""
    va, vb = before.evidence.value(name), after.evidence.value(name)
    if not va or not vb or va <= 0 or vb <= 0:
        return "", None, ""
    for side, outcome, value, other in (("BEFORE", before, va, vb), ("AFTER", after, vb, va)):
        found = _bucket(name, outcome)
        if found is None or found[0] != 0.0 or math.isinf(found[1]) or other <= 0.99 * found[1]:
            continue
        high = found[1]
        op, limit = (">=", vb / high) if side == "BEFORE" else ("<=", high / va)
        return op, limit, (f"{side}'s {fmt(value, unit)} is interpolated inside the histogram's first bucket: it is "
                           f"at most {fmt(high, unit)}, so the ratio is only a bound")
    return "", None, ""


ITL_FROM_RATES = "derived.itl_per_sequence_s"
LOOP_TIME = "derived.request_time_closed_loop_s"


def _itl_from_rates(before: Outcome, after: Outcome) -> Measure | None:
    """Each sequence's time per token by Little's law: the running batch over the generated tokens per second. Exact
    where the histograms are not (vLLM's first inter-token bucket is 10 ms: a 4-5 ms decode reads 5.0 ms at p50
    whatever it does)."""
    sides = []
    for o in (before, after):
        counted = window_rate(o, S.SERVER_GEN_TOKENS_PER_S)
        batch = o.evidence.observed_batch()
        gen = counted.value if counted is not None else o.evidence.value(S.SERVER_GEN_TOKENS_PER_S)
        sides.append(batch / gen if batch and gen and batch > 0 and gen > 0 else None)
    if sides[0] is None or sides[1] is None:
        return None
    return Measure(ITL_FROM_RATES, "s", sides[0], sides[1])


@dataclass(frozen=True)
class WindowRate:
    """A counter's rate over the window: its change from the first scrape to the last over their times."""

    value: float
    se: float  # standard error, in the rate's unit
    span_s: float
    scrapes: int
    method: str  # "counter delta" (Capture.counters) or "counter delta (from the rate series)"
    ended: str  # "" or how the load ended inside the window


# The share of the window's end over which a counter that stopped moving says the load ended inside it.
LOAD_END_SHARE = 0.25


def _stopped(times: list[float], totals: list[float]) -> str:
    """How the load ended inside the window, from a counter's totals at each scrape: it did not move over the last
    LOAD_END_SHARE of the window (and at least two scrape intervals), after it had moved; "" when it kept moving."""
    if len(times) < 3 or totals[-1] <= totals[0]:
        return ""
    last_move = next(i for i in range(len(totals) - 1, 0, -1) if totals[i] > totals[i - 1])
    quiet = times[-1] - times[last_move]
    span = times[-1] - times[0]
    if last_move <= len(times) - 3 and quiet >= LOAD_END_SHARE * span:
        return (f"the load stopped {times[last_move]:.1f} s into the window: its counters did not move over the last "
                f"{quiet:.1f} s of {span:.1f} s")
    return ""


def _idle_end(capture: Capture) -> str:
    """Most of the window's last half with nothing running, after something ran: the load ended inside it."""
    runs = [s for s in capture.series if s.name == S.SERVER_RUNNING and len(s.values) >= 6]
    if len(runs) != 1:
        return ""
    times, values = runs[0].times, runs[0].values
    half = [v for t, v in zip(times, values, strict=True) if t >= (times[0] + times[-1]) / 2]
    first = [v for t, v in zip(times, values, strict=True) if t < (times[0] + times[-1]) / 2]
    if len(half) >= 3 and all(v == 0 for v in half[-3:]) and sum(v == 0 for v in half) > 0.5 * len(half) \
            and sum(v > 0 for v in first) > 0.5 * len(first):
        return "nothing ran in most of the window's second half after requests ran in its first: the load ended"
    return ""


def window_rate(outcome: Outcome | Capture, name: str) -> WindowRate | None:
    """The window's rate of one of the server's counters: (last total - first total) / (last time - first time),
    never a mean of the per-interval rates (an engine that updates its counters in bursts on a busy host makes those
    irregular: a mean of 9-13 of them read x1.39 where the counters moved x0.93). Its standard error: each end's
    total is uncertain by up to the largest step the counter took between two scrapes (a burst on either side of the
    scrape: the spread of each interval's increase about the window's rate), each end's time by how long its answer
    took. From Capture.counters, else (older captures) from the rate
    series, whose points are each interval's increase over its length."""
    capture = outcome.capture if isinstance(outcome, Outcome) else outcome
    track = next((c for c in capture.counters if c.name == name and len(c.times) >= 2), None)
    if track is not None:
        times, totals = list(track.times), list(track.values)
        fetch = list(track.fetch_s) if len(track.fetch_s) == len(times) else [0.0] * len(times)
        # a counter reset (a restart) leaves the window from it on
        start = max((i for i in range(1, len(totals)) if totals[i] < totals[i - 1]), default=0)
        times, totals, fetch = times[start:], totals[start:], fetch[start:]
        method = "counter delta"
    else:
        series = [s for s in capture.series if s.name == name]
        if len(series) != 1 or len(series[0].values) < 3:
            return None
        pts = list(zip(series[0].times, series[0].values, strict=True))
        times, totals = [pts[0][0]], [0.0]
        for (t0, _), (t1, rate) in zip(pts, pts[1:], strict=False):
            times.append(t1)
            totals.append(totals[-1] + rate * (t1 - t0))
        fetch = [0.0] * len(times)
        method = "counter delta (from the rate series)"
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    span = times[-1] - times[0]
    delta = totals[-1] - totals[0]
    value = delta / span
    # How far each interval's increase strayed from the window's rate over it: a deviation is the two ends' errors
    # (a burst counted on one side of a scrape or the other) plus any real change of rate, so their spread is the
    # error of the two ends' totals together (at least). With one interval, a burst as large as the whole increase.
    devs = [(b - a) - value * (t1 - t0) for a, b, t0, t1 in zip(totals, totals[1:], times, times[1:], strict=False)]
    count_sd = math.sqrt(sum(d * d for d in devs) / (len(devs) - 1)) if len(devs) >= 2 else delta * math.sqrt(2 / 12)
    # Each end's time is known to within how long its answer took (uniform in it).
    time_sd = math.hypot(fetch[0], fetch[-1]) / math.sqrt(12)
    se = math.hypot(count_sd / span, value * time_sd / span)
    ended = _stopped(times, totals) or _idle_end(capture)
    return WindowRate(value, se, span, len(times), method, ended)


def load_ended(capture: Capture) -> str:
    """How the load visibly ended inside a capture's window (its counters stopped, or nothing ran in most of its
    end after requests ran), or "" when it did not or the capture has no server rate."""
    for name in RATES:
        w = window_rate(capture, name)
        if w is not None:
            return w.ended
    return ""


def _rate_measure(name: S.Sig, before: Outcome, after: Outcome) -> Measure | None:
    """A rate before and after, each from its counters over the window (window_rate); None when either side has
    too few scrapes (then the mean of the samples is all there is)."""
    a, b = window_rate(before, name), window_rate(after, name)
    if a is None or b is None:
        return None
    ended = "; ".join(f"{side}: {w.ended}" for side, w in (("BEFORE", a), ("AFTER", b)) if w.ended)
    return Measure(name, name.unit, a.value, b.value, n_before=a.scrapes, n_after=b.scrapes,
                   method=a.method if a.method == b.method else f"{a.method} / {b.method}", before_se=a.se,
                   after_se=b.se, ungraded=ended)


def _measure(name: S.Sig, before: Outcome, after: Outcome) -> Measure | None:
    a, b = before.evidence.get(name), after.evidence.get(name)
    if a is None and b is None:
        return None

    def sd(s: Any) -> float | None:
        if s is None or not s.from_samples or s.n < 2:
            return None
        mean = s.mean
        return math.sqrt(sum((v - mean) ** 2 for v in s.values) / (s.n - 1))

    unresolved = _unresolved(name, name.unit, before, after) if a and b else ""
    op, limit, why = _first_bucket_bound(name, name.unit, before, after) if a and b and not unresolved else \
        ("", None, "")
    buckets = (_bucket(name, before) if a else None, _bucket(name, after) if b else None) \
        if name in _QUANTILE_PAIRS else (None, None)
    low: float | None = None
    high: float | None = None
    first_side, second_side = buckets
    if first_side is not None and second_side is not None and not unresolved and not op:
        # One rule for every quantile (p50 as p99): inside a bucket it is only the bucket, so two in different
        # buckets give the range of ratios the buckets allow, never the ratio of the interpolated values.
        (la, ha), (lb, hb) = first_side, second_side
        low = lb / ha if not math.isinf(ha) and ha > 0 else None
        high = hb / la if la > 0 and not math.isinf(hb) else None
        if low is None and high is None:
            unresolved = "both quantiles lie in unbounded buckets: no ratio"
    return Measure(name, name.unit, a.mean if a else None, b.mean if b else None, sd(a), sd(b),
                   a.n if a else 0, b.n if b else 0, unresolved, op, limit, why, before_bucket=buckets[0],
                   after_bucket=buckets[1], ratio_low=low, ratio_high=high)


def _fmt(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _changes(before: Outcome, after: Outcome) -> list[Change]:
    out: list[Change] = []
    sa, sb = before.capture.serving, after.capture.serving
    kinds = {
        "max_num_seqs": FixKind.BATCH_MORE, "max_num_batched_tokens": FixKind.BATCH_MORE,
        "max_batch_total_tokens": FixKind.BATCH_MORE, "kv_cache_tokens": FixKind.KV_MEMORY,
        "gpu_memory_utilization": FixKind.KV_MEMORY, "mem_fraction_static": FixKind.KV_MEMORY,
        "kv_cache_dtype": FixKind.FP8_KV, "quantization": FixKind.FP8_WEIGHTS,
        "tensor_parallel_size": FixKind.ADD_GPUS, "enforce_eager": FixKind.CUDA_GRAPHS,
        "disable_cuda_graph": FixKind.CUDA_GRAPHS, "prefix_caching": FixKind.PREFIX_CACHING,
        "chunked_prefill": FixKind.SPLIT_PREFILL,
    }
    same_engine = bool(sa.engine) and sa.engine == sb.engine  # both command lines read, by one engine's flags
    tabled = _knob_changes(before, after, out) if same_engine else set()
    for name in type(sa).__struct_fields__:
        if name in ("trace_cost", "extra", "selftest_scenario") or name in tabled:
            continue
        x, y = getattr(sa, name), getattr(sb, name)
        if x != y:
            before_text = _fmt(x) if x is not None or not (same_engine and name in _KV_SIZE) else "engine default"
            out.append(Change(f"serving.{name}", before_text, _fmt(y),
                              _applied(kinds.get(name), x, y, from_default=same_engine and name in _KV_SIZE)))
    for key in sorted(set(sa.extra) | set(sb.extra)):
        if key not in tabled and sa.extra.get(key) != sb.extra.get(key):
            out.append(Change(f"serving.{key}", _fmt(sa.extra.get(key)), _fmt(sb.extra.get(key))))
    ma, mb = before.capture.model, after.capture.model
    if ma is not None and mb is not None:
        for name, kind in (("dtype", FixKind.FP8_WEIGHTS), ("kv_dtype", FixKind.FP8_KV),
                           ("tensor_parallel", FixKind.ADD_GPUS), ("name", None), ("params", None)):
            x, y = getattr(ma, name), getattr(mb, name)
            if x != y:
                if name == "dtype" and y and "int4" in str(y).lower():
                    kind = FixKind.INT4_WEIGHTS
                elif name == "dtype" and _float_narrowing(x, y):
                    kind = FixKind.MIXED_PRECISION  # the whole model in 16 bits, not a weight quantisation
                out.append(Change(f"model.{name}", _fmt(x), _fmt(y), _applied(kind, x, y)))
    ga = before.capture.gpus[0].name if before.capture.gpus else ""
    gb = after.capture.gpus[0].name if after.capture.gpus else ""
    if ga != gb:
        out.append(Change("gpu", ga or "-", gb or "-"))
    ba, bb = before.evidence.observed_batch(), after.evidence.observed_batch()
    if ba is not None and bb is not None and abs(bb - ba) > max(0.5, 0.1 * ba):
        out.append(Change(BATCH_CHANGE, f"{ba:.1f}", f"{bb:.1f}",
                          FixKind.BATCH_MORE if bb > ba else None))
    graphs = [o.evidence.value(S.TRACE_GRAPH_KERNEL_FRAC) for o in (before, after)]
    if graphs[0] is not None and graphs[1] is not None and graphs[1] - graphs[0] >= 0.3:
        out.append(Change("kernels in graph replays (trace)", f"{graphs[0]:.0%}", f"{graphs[1]:.0%}",
                          FixKind.CUDA_GRAPHS))
    small = [o.evidence.value(S.TRACE_SHARE_ELEMENTWISE) for o in (before, after)]
    if small[0] is not None and small[1] is not None and small[0] - small[1] >= 0.1:
        out.append(Change("norm/elementwise share of GPU time (trace)", f"{small[0]:.0%}", f"{small[1]:.0%}",
                          FixKind.FUSE_KERNELS))
    return out


# KV-size settings whose absence is the engine's default, not an unknown: the command line leaves them out until they
# are set, so "not given" before and a value after is the fix applied.
_KV_SIZE = ("kv_cache_tokens", "gpu_memory_utilization", "mem_fraction_static")


def _knob_changes(before: Outcome, after: Outcome, out: list[Change]) -> set[str]:
    """Every knob of the engine's table (engines/) that moved between the windows, each as it was in force
    (configured, or the default for the engine's version), mapped to the fix its direction applies; the names it
    looked at, so the generic comparison skips them."""
    engine = before.capture.serving.engine
    table = knobs_of(engine)
    for name, knob in table.items():
        x, y = before.evidence.knob(name), after.evidence.knob(name)
        if x is None or y is None or x.value == y.value:
            continue
        way = direction_of(knob, x.value, y.value)
        if way is None and not x.known and y.known and not y.is_default:
            way = knob.relieves  # set where the engine's (unknown) default ran: an operator sets it to relieve it
        elif way is None and x.known and not y.known and not knob.defaults:
            way = knob.relieves  # a limit with no default dropped (a pinned KV pool): lifting it relieves it
        out.append(Change(f"serving.{name}", _in_force_text(x), _in_force_text(y),
                          knob.fixes.get(way) if way is not None else None))
    return set(table)


def _in_force_text(s: Setting) -> str:
    if not s.known:
        return "engine default"
    return _fmt(s.value) + (" (default)" if s.is_default else "")


def _applied(kind: FixKind | None, before: Any, after: Any, *, from_default: bool = False) -> FixKind | None:
    """The fix a changed setting applies; none when either side is unknown (a capture that does not record the
    KV dtype has not changed it), except a setting set after where before ran on the engine's default
    (`from_default`)."""
    if from_default and _fmt(before) == "-" and _fmt(after) != "-":
        return kind
    return kind if _fmt(before) != "-" and _fmt(after) != "-" else None


# Prompt tokens per generated token moving by more than this factor: the traffic itself changed.
TRAFFIC_SHIFT = 8.0
# The host's load moving between the windows: other processes' CPU by this share of the host's cores. A starved
# tokenizer or scheduler thread moves the token rate as much as any fix (a 49 % drop was graded against a fix while
# the host's other load changed under it). The server's own run-queue wait is no such sign: a fix that lets it
# batch more keeps its threads busier and waiting more (on vLLM's CPU build its engine threads oversubscribe two
# cores on their own), so the wait moves with the fix itself.
HOST_LOAD_SHIFT = 0.25


def host_load(before: Outcome, after: Outcome) -> str:
    """How the host's load differed between the two windows, when it differed a lot; "" when it did not or a capture
    does not record it (host.others_cpu over host.cores)."""
    others = [o.evidence.value(S.HOST_OTHERS_CPU) for o in (before, after)]
    cores = [o.evidence.value(S.HOST_CORES) for o in (before, after)]
    if others[0] is None or others[1] is None or not cores[0] or not cores[1]:
        return ""
    shares = [others[0] / cores[0], others[1] / cores[1]]
    if abs(shares[1] - shares[0]) < HOST_LOAD_SHIFT:
        return ""
    of = f"{cores[0]:g}" if cores[0] == cores[1] else f"{cores[0]:g} and {cores[1]:g}"
    return f"the host's load changed (other processes used {others[0]:.1f} -> {others[1]:.1f} of the host's {of} cores)"


BATCH_CHANGE = "running batch (measured)"
# Fixes whose point is to change what runs each step: the batch moving with them is their effect, not a second
# change. Prefix caching is one: shared prefix blocks are stored once (more sequences fit) and prefill leaves the
# steps; the token budget and the prefill cap set how much of each prompt a step takes, and so how many requests are
# prefilling at once.
_RAISE_BATCH = frozenset({FixKind.KV_MEMORY, FixKind.FP8_KV, FixKind.BATCH_MORE, FixKind.PREFIX_CACHING,
                          FixKind.TOKEN_BUDGET, FixKind.CAP_PREFILL})


def clients_in_closed_loop(o: Outcome) -> int | None:
    """The number of clients when the window's load is a closed loop (each client waits for its answer before it
    sends the next): the load generator's concurrency where the capture records it, else the requests in flight
    (running + waiting) capped at the same most all window, reached more than once and never passed, with the queue
    not growing (arrivals keep pace with completions, the last third's queue no longer than the first's). None for
    an open loop or a window that cannot tell."""
    if o.capture.serving.load_concurrency:
        return int(o.capture.serving.load_concurrency)
    running = [s for s in o.capture.series if s.name == S.SERVER_RUNNING]
    waiting = [s for s in o.capture.series if s.name == S.SERVER_WAITING]
    if len(running) != 1 or len(waiting) != 1 or len(running[0].values) != len(waiting[0].values) \
            or len(running[0].values) < 6:
        return None
    flight = [r + w for r, w in zip(running[0].values, waiting[0].values, strict=True)]
    most = max(flight)
    third = len(flight) // 3
    queue = waiting[0].values
    if most < 1 or most != int(most) or sum(f == most for f in flight) < 2 \
            or sum(queue[-third:]) / third > sum(queue[:third]) / third + 0.5:
        return None
    return int(most)


def closed_loop(before: Outcome, after: Outcome) -> int | None:
    """The clients of a closed loop both windows share, or None (an open loop, or another number of clients)."""
    a, b = clients_in_closed_loop(before), clients_in_closed_loop(after)
    return a if a is not None and a == b else None


def _refused(o: Outcome) -> bool:
    refused = o.evidence.get(S.SERVER_HTTP_REJECTED_PER_S)
    return refused is not None and refused.mean > 0


def confounders(before: Outcome, after: Outcome, changes: list[Change] | None = None) -> list[str]:
    """What else changed between the captures, so that a measured ratio cannot be laid on a fix: another model,
    other GPUs, other traffic (a decode against a prefill, another context length), another host load, or two fixes
    at once."""
    out = []
    # A longer context length changes which requests are admitted, not how fast the admitted ones run: a second
    # change only where either window refused requests.
    idle = set() if _refused(before) or _refused(after) else {FixKind.CONTEXT_LENGTH}
    kinds = {ch.fix for ch in changes or [] if ch.fix is not None and ch.fix not in idle}
    if len(kinds) > 1 and not kinds <= _RAISE_BATCH:
        moved = [ch for ch in changes or [] if ch.fix is not None and ch.fix not in idle]
        out.append("several changes at once (" + "; ".join(f"{ch.what} {ch.before} -> {ch.after}" for ch in moved)
                   + ")")
    batch = next((ch for ch in changes or [] if ch.what == BATCH_CHANGE), None)
    # In a closed loop of the same clients a speed fix moves the batch itself: each request ends sooner, and the
    # clients' own time between requests becomes a larger share of the loop, so fewer are in flight at once.
    if batch is not None and not kinds & _RAISE_BATCH and not (kinds and closed_loop(before, after)):
        out.append(f"the running batch changed ({batch.before} -> {batch.after}) with no fix that moves it")
    ca, cb = before.capture.serving.mean_context_tokens, after.capture.serving.mean_context_tokens
    if ca and cb and max(ca / cb, cb / ca) > 1.5:
        out.append(f"the context changed ({ca:.0f} -> {cb:.0f} tokens per sequence)")
    ma, mb = before.capture.model, after.capture.model
    if ma is not None and mb is not None:
        if ma.name and mb.name and ma.name != mb.name:
            out.append(f"the model changed ({ma.name} -> {mb.name})")
        elif ma.params and mb.params and not math.isclose(ma.params, mb.params, rel_tol=0.05):
            out.append(f"the model's size changed ({ma.params / 1e9:.3g}B -> {mb.params / 1e9:.3g}B parameters)")
    ga = before.capture.gpus[0].name if before.capture.gpus else ""
    gb = after.capture.gpus[0].name if after.capture.gpus else ""
    if ga and gb and ga != gb:
        out.append(f"the GPUs changed ({ga} -> {gb})")
    mix = []
    for o in (before, after):
        gen, prompt = o.evidence.value(S.SERVER_GEN_TOKENS_PER_S), o.evidence.value(S.SERVER_PROMPT_TOKENS_PER_S)
        mix.append(prompt / gen if gen and prompt and gen > 0 and prompt > 0 else None)
    if mix[0] and mix[1] and max(mix[0] / mix[1], mix[1] / mix[0]) > TRAFFIC_SHIFT:
        out.append(f"the traffic changed ({mix[0]:.3g} -> {mix[1]:.3g} prompt tokens per generated token)")
    load = host_load(before, after)
    if load:
        out.append(load)
    return out


def _float_narrowing(before: Any, after: Any) -> bool:
    """fp32 -> bf16/fp16: the model's float type narrowed, weights, activations and KV together."""
    from diagnoser.physics import normalise_dtype

    try:
        return normalise_dtype(str(before)) == "fp32" and normalise_dtype(str(after)) in ("bf16", "fp16")
    except InputError:
        return False


def _for_change(kind: FixKind, before: Outcome, after: Outcome
                ) -> tuple[float | None, str, str, tuple[float, float] | None]:
    """The BEFORE evidence's prediction for the change actually made (None when the physics has no model of it), and
    the range of an estimate from the engine's own curve over the BEFORE window, where the physics has no answer (no
    device roofs: a CPU build) and the change moved the batch."""
    ev = before.evidence
    ma, mb = before.capture.model, after.capture.model
    ask: Callable[[], gains.Gain] | None = None
    if kind is FixKind.BATCH_MORE:
        batch = after.evidence.observed_batch()
        if batch is not None:
            ask = lambda: gains.batch_gain(ev, target=batch)  # noqa: E731
    elif kind in (FixKind.FP8_WEIGHTS, FixKind.INT4_WEIGHTS) and mb is not None and mb.dtype:
        ask = lambda: gains.dtype_gain(ev, mb.dtype)  # noqa: E731
    elif kind is FixKind.MIXED_PRECISION and mb is not None and mb.dtype:
        ask = lambda: gains.model_dtype_gain(ev, mb.dtype)  # noqa: E731
    elif kind is FixKind.FP8_KV and mb is not None and mb.kv_dtype:
        ask = lambda: gains.kv_dtype_gain(ev, mb.kv_dtype)  # noqa: E731
    elif kind is FixKind.ADD_GPUS and ma is not None and mb is not None and mb.tensor_parallel != ma.tensor_parallel:
        ask = lambda: gains.tp_gain(ev, mb.tensor_parallel)  # noqa: E731
    elif kind is FixKind.KV_MEMORY:
        batch = after.evidence.observed_batch()
        if batch is not None:
            ask = lambda: gains.batch_gain(ev, target=batch)  # noqa: E731
    if ask is None:
        return None, "", "", None
    try:
        g = ask()
    except Exception as exc:
        return None, f"the physics could not answer for this change ({exc})", "", None
    if g.capped:
        # A cap is a limit on what a fix promises, not the physics' figure: nothing to check a measurement against.
        return None, f"{g.basis} ({g.capped}: the figure for this change is not known)", "", None
    if g.value is None and kind in (FixKind.BATCH_MORE, FixKind.KV_MEMORY):
        # Sequences a step after the change, as the curve counts them (generated tokens per step), else the batch.
        new = after.evidence.value(S.SERVER_BATCH_SIZE) or after.evidence.observed_batch()
        est = curve.batch_gain(ev, new) if new else None
        if isinstance(est, gains.Gain) and est.value is not None and est.low is not None and est.high is not None:
            return est.value, est.basis, est.kind.value, (est.low, est.high)
        if isinstance(est, curve.Refused):
            return None, f"{g.basis}; the window's own curve: {est.why}", "", None
    return g.value, g.basis, g.kind.value, None


def _main_rate(comparison: Comparison) -> Measure | None:
    """The measured rate the fixes move: generated tokens/s, else prompt tokens/s, else requests/s."""
    for m in comparison.rates:
        if m.ratio is not None:
            return m
    return None


def _judge(p: Prediction, measure: Measure | None, confounded: list[str]) -> Prediction:
    if not p.applied:
        return p
    if measure is None or measure.ratio is None:
        return Prediction(**{**asdict(p), "kind": p.kind, "verdict": "not measurable: no rate in both captures"})
    realised = measure.ratio
    if measure.ungraded:
        return Prediction(**{**asdict(p), "kind": p.kind,
                             "verdict": f"not graded: {measure.ungraded}; the window's rate is not the server's"})
    if confounded:
        return Prediction(**{**asdict(p), "kind": p.kind, "realised": realised,
                             "verdict": "not checked: the captures differ in more than this fix (see the note)"})
    reference = p.for_change if p.for_change is not None else p.predicted
    if reference is None:
        verdict = "no prediction to check"
    elif realised < 1.0 - AGREEMENT and reference >= 1.0:
        verdict = LOSS  # under any bound, but the fix was to gain: graded as the loss it is, never as holding
    elif (p.predicted_kind == "upper_bound" and p.for_change is None) or p.for_change_kind == "upper_bound":
        verdict = _against_bound(realised, reference, measure.ratio_error)
    elif abs(realised / reference - 1.0) <= AGREEMENT:
        verdict = "held"
    else:
        verdict = "over-predicted" if realised < reference else "under-predicted"
    return Prediction(**{**asdict(p), "kind": p.kind, "realised": realised, "verdict": verdict})


def _against_bound(realised: float, bound: float, error: float | None) -> str:
    """A realised ratio against an upper bound: "beyond" only when the measurement shows it, its ratio more than
    two standard errors over the bound (with the 25 % band); a noisy window that only may have passed it says so."""
    limit = bound * (1 + AGREEMENT)
    if realised <= limit:
        return "within the bound"
    if error is not None and realised * (1 - 2 * error) <= limit:
        return NOISY_BOUND
    return "beyond the bound"


def compare(before: Outcome, after: Outcome) -> Comparison:
    db, da = before.diagnosis, after.diagnosis
    c = Comparison(before.capture.target, after.capture.target, db.verdict, da.verdict, db.headline, da.headline)
    c.changes = _changes(before, after)
    c.rates = [m for n in RATES if (m := _rate_measure(n, before, after) or _measure(n, before, after)) is not None]
    c.latencies = [m for n in LATENCIES if (m := _measure(n, before, after)) is not None]
    derived = _itl_from_rates(before, after)
    if derived is not None:
        c.latencies.insert(0, derived)
    c.activity = [m for n in (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_DRAM_ACTIVE, S.GPU_TENSOR_ACTIVE,
                              S.TRACE_GPU_IDLE_FRAC, S.THEORY_EFFICIENCY)
                  if (m := _measure(n, before, after)) is not None]
    clients = closed_loop(before, after)
    if clients is not None:
        c.loop = f"closed ({clients} clients)"
        requests = next((m for m in c.rates if m.signal == S.SERVER_REQUESTS_PER_S and m.ratio is not None), None)
        if requests is not None and requests.before and requests.after:
            # Little's law for the loop: each client's time per request is the clients over the requests per second.
            c.latencies.insert(0, Measure(LOOP_TIME, "s", clients / requests.before, clients / requests.after,
                                          method="closed loop: clients / requests per second"))
    applied = {ch.fix for ch in c.changes if ch.fix is not None}
    measure = _main_rate(c)
    confounded = c.confounders = confounders(before, after, c.changes)
    for fix in db.fixes:
        on = fix.kind in applied
        for_change, basis, for_kind, span = _for_change(fix.kind, before, after) if on else (None, "", "", None)
        if for_change is None and fix.gain_low is not None and fix.gain_high is not None:
            span = (fix.gain_low, fix.gain_high)
        p = Prediction(fix.kind, fix.title, fix.gain, fix.gain_kind.value, fix.benefit.value, on, for_change, basis,
                       verdict="" if on else "not applied", for_change_kind=for_kind,
                       low=span[0] if span else None, high=span[1] if span else None)
        c.predictions.append(_judge(p, measure, confounded))
    # A change that matches no proposed fix is still checked against the physics when it can be.
    proposed = {f.kind for f in db.fixes}
    for kind in sorted(applied - proposed, key=lambda k: k.value):
        for_change, basis, for_kind, span = _for_change(kind, before, after)
        p = Prediction(kind, f"(not proposed) {kind.value.replace('_', ' ')}", None, "estimate", "speed", True,
                       for_change, basis, for_change_kind=for_kind, low=span[0] if span else None,
                       high=span[1] if span else None)
        c.predictions.append(_judge(p, measure, confounded))
    if not c.changes:
        c.notes.append("No configuration change was found between the two captures: the difference is load, noise or "
                       "a change the captures do not record.")
    if not c.rates:
        c.notes.append("Neither capture has a server rate (tokens/s, requests/s): realised gains cannot be measured; "
                       "attach with --port to read the server's /metrics.")
    if clients is not None:
        c.notes.append(f"Both windows are a closed loop of the same {clients} clients (requests in flight capped at "
                       f"{clients}, the queue not growing): a faster server ends each request sooner and its client "
                       "sends the next at once, so the throughput measures the fix and the time per request moves as "
                       "its inverse (clients / requests per second); the running batch moving is the fix's effect.")
    if measure is not None and measure.ungraded:
        c.notes.append(f"No realised gain: {measure.ungraded}. Attach again while the load runs through the whole "
                       "window.")
    if confounded:
        c.notes.append("Not a test of the fixes: " + "; ".join(confounded) + ". A measured ratio mixes that change "
                       "with any fix, so no prediction is graded.")
    return c


__all__ = ["ITL_FROM_RATES", "AGREEMENT", "LOSS", "NOISY_BOUND", "Change", "Comparison", "Measure", "Prediction",
           "WindowRate", "clients_in_closed_loop", "closed_loop", "compare", "confounders", "host_load", "load_ended",
           "window_rate"]
