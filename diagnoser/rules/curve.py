"""The engine's own step-time curve, fitted over the window's samples: what a knob change is worth where the device's
roofs are unknown (a CPU build), and a cross-check of the physics where they are known.

Each interval between two scrapes in which the engine was busy throughout (requests running or waiting at both
ends) is one equation: its duration is the steps it ran times a fixed cost per step, plus the tokens those steps
held (prompt and generated) times a cost per token:

    duration = a x steps + b x tokens

The steps come from the generated tokens over the sequences per step (vLLM's iteration histogram), the tokens from
the prompt and generation counters. A least-squares fit over the intervals gives a and b, their covariance from the
residuals, and so a range. The time per generated token at a batch of B sequences is a / B + b x (prompt + generated)
/ generated: raising the batch shares the fixed cost over more sequences, the cost per token stays. The gain of B0 ->
B1 is the ratio of the two, and its range the least and most it is over the fit's two-standard-error ellipse.

A window whose tokens per step never varied (the batch pinned, no prefill beside it) cannot tell a from b: refused,
with the reason, never guessed. Rules call this; it reads the evidence's samples, never the capture.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from diagnoser import signals as S
from diagnoser.diagnosis import GainKind
from diagnoser.evidence import Evidence, Signal
from diagnoser.rules.base import Gain

# Fewer busy intervals than this fit nothing.
MIN_INTERVALS = 6
# Tokens per step must span at least this ratio (most over least) across the intervals for a and b to be told apart.
MIN_SPREAD = 1.5
# The range is the fit at two standard errors either way.
SIGMAS = 2.0
# A fit whose range is wider than this (high over low gain) says too little to print as an estimate.
MAX_RANGE_RATIO = 3.0


@dataclass(frozen=True)
class Interval:
    """One interval between scrapes with the engine busy throughout."""

    duration_s: float
    steps: float
    tokens: float
    generated: float


@dataclass(frozen=True)
class Refused:
    """No curve from this window, and why (said in a fix's basis)."""

    why: str


@dataclass(frozen=True)
class Estimate:
    """A gain from the curve: the fit's value and the range it allows."""

    value: float
    low: float
    high: float
    basis: str


@dataclass(frozen=True)
class StepCurve:
    """step time = fixed_s + per_token_s x tokens in the step, fitted over `intervals` busy intervals."""

    fixed_s: float
    per_token_s: float
    var_fixed: float
    cov: float
    var_per_token: float
    intervals: int
    batch: float  # generated tokens per step over the fitted intervals: the batch the window ran
    tokens_per_generated: float  # (prompt + generated) / generated over the fitted intervals
    spread: tuple[float, float]  # the least and most tokens per step across the intervals
    # The batch itself never varied (generated tokens per step all alike): tokens per step moved only with the prompts
    # beside it, so a generated token is priced as a prompt token costs, which the window cannot check.
    batch_pinned: bool = False

    def time_per_token(self, batch: float, fixed_s: float | None = None, per_token_s: float | None = None) -> float:
        """Seconds per generated token at a batch of `batch` sequences."""
        a = self.fixed_s if fixed_s is None else fixed_s
        b = self.per_token_s if per_token_s is None else per_token_s
        return a / max(batch, 1e-9) + b * self.tokens_per_generated

    def gain(self, new_batch: float, old_batch: float | None = None) -> tuple[float, float, float]:
        """Generated tokens/s at `new_batch` over that at `old_batch` (the window's): the fit's value and its least
        and most over the two-standard-error ellipse of (a, b), neither clamped below 0."""
        old = self.batch if old_batch is None else old_batch

        def ratio(a: float, b: float) -> float:
            a, b = max(a, 0.0), max(b, 0.0)
            if a == 0.0 and b == 0.0:
                return 1.0
            return self.time_per_token(old, a, b) / self.time_per_token(new_batch, a, b)

        value = ratio(self.fixed_s, self.per_token_s)
        # The ellipse's points: centre + SIGMAS x L (cos t, sin t), L the covariance's Cholesky factor.
        l11 = math.sqrt(max(self.var_fixed, 0.0))
        l21 = self.cov / l11 if l11 > 0 else 0.0
        l22 = math.sqrt(max(self.var_per_token - l21 * l21, 0.0))
        seen = [value]
        for i in range(72):
            t = 2 * math.pi * i / 72
            u, v = math.cos(t), math.sin(t)
            seen.append(ratio(self.fixed_s + SIGMAS * l11 * u, self.per_token_s + SIGMAS * (l21 * u + l22 * v)))
        low = min(seen)
        if self.batch_pinned and new_batch > old:
            # The window never saw another batch, so a decode token's own cost is unmeasured: at the worst it carries
            # the whole step (time linear in the batch) and the change gains nothing. The range says so.
            low = min(low, 1.0)
        return value, low, max(seen)

    def describe(self) -> str:
        pinned = ("; the batch itself never varied, so a generated token is priced at what the prompts' tokens cost, "
                  "which the window cannot check: a decode token that costs more makes this over-predict (the range "
                  "reaches x1, a step whose time grows with its batch), one that costs less under-predict"
                  ) if self.batch_pinned else ""
        return (f"the engine's step time over {self.intervals} busy intervals of the window: "
                f"{self.fixed_s * 1e3:.3g} ms a step + {self.per_token_s * 1e3:.3g} ms a token (tokens per step "
                f"{self.spread[0]:.3g} to {self.spread[1]:.3g}{pinned})")


def fit(intervals: Sequence[Interval]) -> StepCurve | Refused:
    """Least squares of duration = a x steps + b x tokens over the intervals; Refused where they cannot tell a from
    b (too few, tokens per step all alike) or the fit is no curve (a cost below zero)."""
    pts = [p for p in intervals if p.steps > 0 and p.duration_s > 0 and p.generated > 0]
    if len(pts) < MIN_INTERVALS:
        return Refused(f"only {len(pts)} intervals of the window had the engine busy and generating (at least "
                       f"{MIN_INTERVALS} fit a curve)")
    per_step = [p.tokens / p.steps for p in pts]
    lo, hi = min(per_step), max(per_step)
    if hi < MIN_SPREAD * lo:
        return Refused(f"the window's batch did not vary: every interval ran {lo:.3g} to {hi:.3g} tokens a step, so "
                       "the step's fixed cost and its cost per token cannot be told apart")
    first = _solve(pts)
    if isinstance(first, Refused):
        return first
    a, b, _ = first
    # One interval the host stalled (a step of a second) would drag the fit: drop those far off it, once.
    res = [abs(p.duration_s - a * p.steps - b * p.tokens) for p in pts]
    scale = sorted(res)[len(res) // 2]
    kept = [p for p, r in zip(pts, res, strict=True) if r <= 4 * scale + 1e-12] if scale > 0 else pts
    if len(kept) >= MIN_INTERVALS and len(kept) < len(pts):
        again = _solve(kept)
        if not isinstance(again, Refused):
            pts, first = kept, again
    a, b, (va, cab, vb) = first
    if a <= 0 or b < 0:
        return Refused(f"the fit over the window gives no curve ({a * 1e3:.3g} ms a step, {b * 1e3:.3g} ms a token): "
                       "the intervals are too noisy to price a change of batch")
    generated = math.fsum(p.generated for p in pts)
    batches = [p.generated / p.steps for p in pts]
    return StepCurve(a, b, va, cab, vb, len(pts), generated / math.fsum(p.steps for p in pts),
                     math.fsum(p.tokens for p in pts) / generated, (lo, hi),
                     batch_pinned=max(batches) < MIN_SPREAD * min(batches))


def _solve(pts: Sequence[Interval]) -> tuple[float, float, tuple[float, float, float]] | Refused:
    """(a, b, (var a, cov ab, var b)) of duration = a x steps + b x tokens by least squares."""
    snn = math.fsum(p.steps * p.steps for p in pts)
    snt = math.fsum(p.steps * p.tokens for p in pts)
    stt = math.fsum(p.tokens * p.tokens for p in pts)
    sny = math.fsum(p.steps * p.duration_s for p in pts)
    sty = math.fsum(p.tokens * p.duration_s for p in pts)
    det = snn * stt - snt * snt
    if det <= 1e-12 * snn * stt:
        return Refused("the window's steps and tokens moved together: the step's fixed cost and its cost per token "
                       "cannot be told apart")
    a = (stt * sny - snt * sty) / det
    b = (snn * sty - snt * sny) / det
    dof = max(len(pts) - 2, 1)
    s2 = math.fsum((p.duration_s - a * p.steps - b * p.tokens) ** 2 for p in pts) / dof
    return a, b, (s2 * stt / det, -s2 * snt / det, s2 * snn / det)


def intervals(ev: Evidence) -> list[Interval] | Refused:
    """The window's busy intervals from the server's samples: generated and prompt tokens/s, sequences per step (the
    engine's iteration histogram, else the running gauge over the interval's two ends, for an engine whose running
    count is its batch), and the running and waiting gauges at each end."""
    gen, batch = ev.get(S.SERVER_GEN_TOKENS_PER_S), ev.get(S.SERVER_BATCH_SIZE)
    running, waiting, prompt = ev.get(S.SERVER_RUNNING), ev.get(S.SERVER_WAITING), ev.get(S.SERVER_PROMPT_TOKENS_PER_S)
    if gen is None or (batch is None and running is None):
        return Refused("needs the server's generated tokens/s and sequences per step (its iteration histogram or "
                       "running count) sample by sample")
    signals = [s for s in (gen, batch, running, waiting, prompt) if s is not None]
    if any(not s.from_samples or len(s.times) != len(s.values) for s in signals):
        return Refused("the window's statistics carry no samples to fit a curve over")
    per_batch = dict(zip(batch.times, batch.values, strict=True)) if batch is not None else None
    per_prompt = dict(zip(prompt.times, prompt.values, strict=True)) if prompt is not None else {}
    flight = _Gauge([s for s in (running, waiting) if s is not None])
    seqs_gauge = _Gauge([running]) if running is not None else None
    times = list(gen.times)
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    usual = gaps[len(gaps) // 2] if gaps else 0.0
    out = []
    for i, (t, g) in enumerate(zip(gen.times, gen.values, strict=True)):
        duration = t - times[i - 1] if i > 0 else usual
        if duration <= 0 or g <= 0:
            continue
        if per_batch is not None:
            seqs = per_batch.get(t)
        else:
            assert seqs_gauge is not None
            seqs = (seqs_gauge.near(t - duration) + seqs_gauge.near(t)) / 2
        if seqs is None or seqs <= 0:
            continue
        if flight.times and not (flight.near(t - duration) > 0 and flight.near(t) > 0):
            continue  # the engine may have idled in it: its time is not all steps
        p = per_prompt.get(t, 0.0)
        out.append(Interval(duration, g * duration / seqs, (g + p) * duration, g * duration))
    return out


class _Gauge:
    """Gauges summed at each reading time (running + waiting), read at the reading nearest a time."""

    def __init__(self, signals: Sequence[Signal]) -> None:
        summed: dict[float, float] = {}
        for s in signals:
            for t, v in zip(s.times, s.values, strict=True):
                summed[t] = summed.get(t, 0.0) + v
        self.times = sorted(summed)
        self.values = [summed[t] for t in self.times]

    def near(self, t: float) -> float:
        i = bisect.bisect_left(self.times, t)
        best = min((j for j in (i - 1, i) if 0 <= j < len(self.times)), key=lambda j: abs(self.times[j] - t))
        return self.values[best]


def window_curve(ev: Evidence) -> StepCurve | Refused:
    found = intervals(ev)
    return found if isinstance(found, Refused) else fit(found)


def batch_estimate(ev: Evidence, new_batch: float) -> Estimate | Refused:
    """The gain in generated tokens/s of running `new_batch` sequences a step instead of the window's, from the
    window's own curve, with its range; Refused (why) where the window cannot price it."""
    curve = window_curve(ev)
    if isinstance(curve, Refused):
        return curve
    if new_batch <= curve.batch:
        return Refused(f"the window already ran {curve.batch:.1f} sequences a step")
    value, low, high = curve.gain(new_batch)
    if high > MAX_RANGE_RATIO * low:
        return Refused(f"{curve.describe()}: x{low:.2f} to x{high:.2f} at {new_batch:.0f} sequences, too wide a "
                       "range to be an estimate")
    return Estimate(value, low, high, f"{curve.describe()}; at {new_batch:.0f} sequences a step instead of "
                                      f"{curve.batch:.2f}: x{value:.2f} (x{low:.2f} to x{high:.2f} at two standard "
                                      "errors)")


def batch_gain(ev: Evidence, new_batch: float) -> Gain | Refused:
    """batch_estimate as a fix's gain: an estimate with its range, a speed gain only when requests wait (else
    capacity)."""
    est = batch_estimate(ev, new_batch)
    if isinstance(est, Refused):
        return est
    g = Gain(est.value, est.basis, GainKind.ESTIMATE, low=est.low, high=est.high)
    served, growth = ev.value(S.SERVER_REQUESTS_PER_S), ev.value(S.SERVER_WAITING_GROWTH_PER_S)
    if served and served > 0 and growth is not None and growth > 0:
        # An open loop whose queue grew all window: requests arrive at served + growth a second, and no batch serves
        # more than arrives.
        most = 1.0 + growth / served
        if est.value > most:
            g = Gain(most, f"{est.basis}; no more than the offered load: {served + growth:.3g} requests/s arrive "
                           f"against {served:.3g}/s served, x{most:.2f}", GainKind.ESTIMATE,
                     low=min(est.low, most), high=most)
    waiting = ev.waiting()
    if waiting is None:
        return g.as_capacity("no queue metric: more throughput only if more load is offered")
    if waiting < 0.5:
        return g.as_capacity("nothing waits: this traffic gets no faster; the server could serve this much more load")
    return g


__all__ = ["Estimate", "Interval", "Refused", "StepCurve", "batch_estimate", "batch_gain", "fit", "intervals",
           "window_curve"]
