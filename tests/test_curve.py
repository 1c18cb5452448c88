"""The engine's own step-time curve (rules/curve.py): fitted over the window's samples, it prices a change of batch
where the device's roofs are unknown, with a range, and refuses (saying why) where the window cannot tell."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from diagnoser import signals as S
from diagnoser.capture import load
from diagnoser.compare import AGREEMENT, compare
from diagnoser.diagnosis import FixKind, GainKind
from diagnoser.evidence import Evidence, Signal
from diagnoser.pipeline import diagnose_capture
from diagnoser.rules import curve

VLLM = Path(__file__).parent / "fixtures" / "vllm"
A, B = 0.030, 0.002  # 30 ms a step, 2 ms a token


def _intervals(per_step: list[tuple[float, float]], noise: float = 0.0, seed: int = 1) -> list[curve.Interval]:
    """One-second intervals of a busy engine: (generated, prompt) tokens a step -> steps that fill the second."""
    rng = random.Random(seed)
    out = []
    for gen, prompt in per_step:
        step = A + B * (gen + prompt)
        steps = 1.0 / step
        out.append(curve.Interval(1.0 * (1 + rng.gauss(0, noise)), steps, steps * (gen + prompt), steps * gen))
    return out


def test_a_varying_batch_gives_back_the_curve_it_was_made_from() -> None:
    fitted = curve.fit(_intervals([(b, 0.0) for b in (1, 2, 3, 4, 6, 8, 2, 5)]))
    assert isinstance(fitted, curve.StepCurve)
    assert fitted.fixed_s == pytest.approx(A, rel=1e-6) and fitted.per_token_s == pytest.approx(B, rel=1e-6)
    value, low, high = fitted.gain(16.0, 2.0)
    # time per generated token: a / batch + b (no prompts)
    assert value == pytest.approx((A / 2 + B) / (A / 16 + B), rel=1e-6)
    assert low == pytest.approx(value, rel=1e-3) and high == pytest.approx(value, rel=1e-3)  # no residuals


def test_a_noisy_window_gives_a_range_that_holds_the_true_gain() -> None:
    fitted = curve.fit(_intervals([(b, p) for b, p in ((2, 0), (2, 64), (3, 0), (4, 0), (2, 32), (6, 0), (5, 64),
                                                       (3, 0), (8, 0), (4, 16))], noise=0.05))
    assert isinstance(fitted, curve.StepCurve)
    true = (A / 2 + B * fitted.tokens_per_generated) / (A / 12 + B * fitted.tokens_per_generated)
    value, low, high = fitted.gain(12.0, 2.0)
    assert low < value < high and low <= true <= high
    assert abs(value / true - 1) < AGREEMENT


def test_prefill_beside_a_pinned_batch_still_tells_the_step_cost_from_the_token_cost() -> None:
    """The batch never moves, but the prompts chunked into some steps do: tokens per step varies, and the fit holds."""
    fitted = curve.fit(_intervals([(2, p) for p in (0, 64, 0, 0, 128, 0, 32, 0)]))
    assert isinstance(fitted, curve.StepCurve)
    assert fitted.fixed_s == pytest.approx(A, rel=1e-6) and fitted.per_token_s == pytest.approx(B, rel=1e-6)
    # ...on the assumption that a generated token costs what a prompt token does, which the basis says
    assert fitted.batch_pinned and "the batch itself never varied" in fitted.describe()
    # ...and a decode token's own cost is unmeasured: the range reaches no gain at all (step time linear in batch)
    value, low, high = fitted.gain(8.0, 2.0)
    assert low == 1.0 and value == pytest.approx((A / 2 + B * fitted.tokens_per_generated)
                                                 / (A / 8 + B * fitted.tokens_per_generated), rel=1e-6)
    varied = curve.fit(_intervals([(b, 0.0) for b in (1, 2, 3, 4, 6, 8, 2, 5)]))
    assert isinstance(varied, curve.StepCurve) and not varied.batch_pinned


def test_a_pinned_batch_with_nothing_beside_it_is_refused_with_the_reason() -> None:
    refused = curve.fit(_intervals([(2, 0.0)] * 10, noise=0.02))
    assert isinstance(refused, curve.Refused) and "batch did not vary" in refused.why


def test_too_few_intervals_and_a_curve_that_falls_are_refused() -> None:
    few = curve.fit(_intervals([(1, 0), (4, 0), (8, 0)]))
    assert isinstance(few, curve.Refused) and "only 3 intervals" in few.why
    # Longer steps at the smaller batch: a negative cost per token, no curve.
    falling = [curve.Interval(1.0, 1.0 / (0.2 - 0.01 * b), b / (0.2 - 0.01 * b), b / (0.2 - 0.01 * b))
               for b in (1, 2, 4, 8, 12, 16)]
    refused = curve.fit(falling)
    assert isinstance(refused, curve.Refused) and "no curve" in refused.why


def _evidence(per_step: list[tuple[float, float]], waiting: float = 6.0) -> Evidence:
    """The signals a server's scrapes give, one a second: generated and prompt tokens/s and sequences per step over
    each interval, running and waiting at each scrape."""
    ev = Evidence()
    times = tuple(float(t) for t in range(1, len(per_step) + 1))
    gen, prompt, batch = [], [], []
    for b, p in per_step:
        steps = 1.0 / (A + B * (b + p))
        gen.append(steps * b)
        prompt.append(steps * p)
        batch.append(b)
    for name, unit, values, at in ((S.SERVER_GEN_TOKENS_PER_S, "tokens/s", gen, times),
                                   (S.SERVER_PROMPT_TOKENS_PER_S, "tokens/s", prompt, times),
                                   (S.SERVER_BATCH_SIZE, "sequences", batch, times),
                                   (S.SERVER_RUNNING, "requests", [2.0] * (len(times) + 1), (0.0, *times)),
                                   (S.SERVER_WAITING, "requests", [waiting] * (len(times) + 1), (0.0, *times))):
        ev.add(Signal(name, unit, ("server",), tuple(values), at))
    return ev


def test_the_window_curve_reads_the_servers_samples() -> None:
    ev = _evidence([(b, 0.0) for b in (1, 2, 3, 4, 6, 8, 2, 5)])
    got = curve.window_curve(ev)
    assert isinstance(got, curve.StepCurve) and got.per_token_s == pytest.approx(B, rel=1e-6)
    g = curve.batch_gain(ev, 16.0)
    assert not isinstance(g, curve.Refused)
    assert g.kind is GainKind.ESTIMATE and g.value is not None and g.low is not None and g.high is not None
    assert g.low <= g.value <= g.high
    assert "busy intervals of the window" in g.basis


def test_an_idle_window_and_statistics_without_samples_are_refused() -> None:
    idle = _evidence([(b, 0.0) for b in (1, 2, 3, 4, 6, 8, 2, 5)], waiting=0.0)
    for s in (S.SERVER_RUNNING,):
        old = idle[s]
        idle.add(Signal(s, old.unit, old.sources, tuple(0.0 for _ in old.values), old.times))
    refused = curve.window_curve(idle)
    assert isinstance(refused, curve.Refused) and "only 0 intervals" in refused.why
    ev = _evidence([(b, 0.0) for b in (1, 2, 3, 4, 6, 8)])
    ev.add(Signal.from_stats(S.SERVER_BATCH_SIZE, "sequences", ("prometheus",), mean=3.0, n=6))
    refused = curve.window_curve(ev)
    assert isinstance(refused, curve.Refused) and "no samples" in refused.why


def test_bat005_on_the_recorded_vllm_cpu_window_carries_an_estimate_with_its_range() -> None:
    """batch-capped.dgc: vLLM's CPU build pinned at --max-num-seqs 2 with 10 waiting, no device roofs. The batch
    never moves, but 64-token prompts go through some steps: the window's curve prices 2 -> 11 sequences."""
    d = diagnose_capture(load(VLLM / "batch-capped.dgc")).diagnosis
    fix = next(f for f in d.fixes if f.kind is FixKind.BATCH_MORE)
    assert fix.gain is not None and fix.gain_kind is GainKind.ESTIMATE
    assert fix.gain_low is not None and fix.gain_high is not None and fix.gain_low < fix.gain < fix.gain_high
    assert "the engine's step time over" in fix.basis


def test_the_kv_capped_pair_is_graded_against_the_windows_curve_and_holds() -> None:
    """kv-capped.dgc -> kv-capped-fixed.dgc: the KV pool freed, the batch grows about 3 -> 11 sequences a step. No
    device roofs, so the physics has no figure for the change; the BEFORE window's curve gives one with its range,
    and the realised gain lands within 25 % of it (recorded: x1.69 estimated, x1.28 to x2.47; x1.56 realised)."""
    c = compare(diagnose_capture(load(VLLM / "kv-capped.dgc")), diagnose_capture(load(VLLM / "kv-capped-fixed.dgc")))
    p = next(p for p in c.predictions if p.kind is FixKind.KV_MEMORY)
    assert p.predicted_kind == "upper_bound"  # the bound the rule gave stays a bound
    assert p.for_change is not None and p.for_change_kind == "estimate" and p.realised is not None
    assert p.low is not None and p.high is not None
    assert abs(p.realised / p.for_change - 1) <= AGREEMENT and p.verdict == "held", (p.for_change, p.realised)
    assert p.in_range is True
    assert c.to_dict()["predictions"][0]["in_range"] is True


def test_the_budget_capped_window_is_too_noisy_to_price_and_says_so() -> None:
    """budget-capped.dgc: a second a step at times on the shared host; the fit gives no curve, and nothing is
    invented for the token budget's fix."""
    refused = curve.window_curve(diagnose_capture(load(VLLM / "budget-capped.dgc")).evidence)
    assert isinstance(refused, curve.Refused) and "no curve" in refused.why


def test_beside_the_physics_the_curve_is_a_cross_check_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the physics prices the batch (a GPU with its roofs), its figure stays the fix's gain; the window's
    curve is said beside it in the basis, and gives no range."""
    from diagnoser.rules import gains
    from diagnoser.rules.base import Gain

    monkeypatch.setattr(gains, "batch_gain", lambda ev, **kw: Gain(3.0, "the physics at batch 11"))
    d = diagnose_capture(load(VLLM / "batch-capped.dgc")).diagnosis
    fix = next(f for f in d.fixes if f.kind is FixKind.BATCH_MORE)
    assert fix.gain == pytest.approx(3.0) and fix.gain_low is None and fix.gain_high is None
    assert fix.basis.startswith("the physics at batch 11; cross-check, the engine's own curve over the window: x")


def test_an_open_loop_is_priced_no_higher_than_its_offered_rate() -> None:
    """The queue grew all window: requests arrive at 10/s against 8/s served, so no batch gives more than x1.25,
    whatever the curve says of the larger batch."""
    ev = _evidence([(b, 0.0) for b in (1, 2, 3, 4, 6, 8, 2, 5)])
    free = curve.batch_gain(ev, 16.0)
    assert not isinstance(free, curve.Refused) and free.value is not None and free.value > 1.25
    ev.add(Signal(S.SERVER_REQUESTS_PER_S, "1/s", ("server",), (8.0,) * 8, tuple(float(t) for t in range(1, 9))))
    ev.add(Signal(S.SERVER_WAITING_GROWTH_PER_S, "1/s", ("server",), (2.0,)))
    g = curve.batch_gain(ev, 16.0)
    assert not isinstance(g, curve.Refused)
    assert g.value == pytest.approx(1.25) and g.high == pytest.approx(1.25) and "offered load" in g.basis


def test_without_an_iteration_histogram_the_running_count_is_the_batch() -> None:
    """An engine whose running count is its batch (no per-step histogram): sequences a step are the running gauge
    over each interval's two ends."""
    running = [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 3.0, 3.0, 6.0]
    ev = Evidence()
    gen, times = [], []
    for i in range(1, len(running)):
        seqs = (running[i - 1] + running[i]) / 2
        gen.append(seqs / (A + B * seqs))
        times.append(float(i))
    ev.add(Signal(S.SERVER_GEN_TOKENS_PER_S, "tokens/s", ("server",), tuple(gen), tuple(times)))
    ev.add(Signal(S.SERVER_RUNNING, "requests", ("server",), tuple(running), tuple(float(i) for i in range(len(running)))))
    got = curve.window_curve(ev)
    assert isinstance(got, curve.StepCurve), got
    assert got.fixed_s == pytest.approx(A, rel=1e-6) and got.per_token_s == pytest.approx(B, rel=1e-6)
    assert not got.batch_pinned
