"""compare as an instrument (issue 42): rates from the counters' change over each window, not a mean of irregular
rate samples; a window whose load ended inside it not graded; every quantile inside a bucket shown as its bucket."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnoser import signals as S
from diagnoser.capture import Capture, CounterTrack, Series, dumps, load, loads
from diagnoser.compare import compare, window_rate
from diagnoser.diagnosis import FixKind
from diagnoser.pipeline import diagnose_capture
from diagnoser.reports.compare import terminal_lines
from tests.test_server_metrics import Endpoint, scrapes

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
VLLM = Path(__file__).resolve().parent / "fixtures" / "vllm"
B1, FP8 = (GPU / f"nvidia-h100-80gb-hbm3-{n}.dgc" for n in ("decode-b1", "decode-fp8"))


def _bursty(c: Capture, times: list[float], totals: list[float], *, counters: bool = True) -> Capture:
    """The generated-token counter read at irregular scrapes, updated in bursts: the rate series is each interval's
    increase over its length (as the collector records it); Capture.counters holds the totals."""
    rates = [(b - a) / (t1 - t0) for a, b, t0, t1 in zip(totals, totals[1:], times, times[1:], strict=False)]
    c.series = [s for s in c.series if s.name != S.SERVER_GEN_TOKENS_PER_S]
    c.series.append(Series(name=S.SERVER_GEN_TOKENS_PER_S, unit="tokens/s", source="server", times=times[1:],
                           values=rates))
    if counters:
        c.counters = [CounterTrack(name=S.SERVER_GEN_TOKENS_PER_S, times=times, values=totals,
                                   fetch_s=[0.01] * len(times))]
    return c


# 236 tokens/s over 8 s (1888 tokens), read at irregular scrapes: most tokens land in short intervals (a burst
# just after a slow scrape), so the mean of the per-interval rates reads 3x the window's rate.
TIMES = [0.0, 0.2, 2.0, 2.2, 4.0, 4.2, 6.0, 6.2, 8.0]
TOTALS = [0.0, 400.0, 472.0, 872.0, 944.0, 1344.0, 1416.0, 1816.0, 1888.0]


def test_the_realised_gain_is_the_counters_change_over_the_window_not_a_mean_of_rate_samples() -> None:
    before = diagnose_capture(load(B1))
    after_capture = _bursty(load(FP8), TIMES, TOTALS)
    rates = after_capture.series_named(S.SERVER_GEN_TOKENS_PER_S)[0].values
    assert sum(rates) / len(rates) > 2.5 * 236  # what a mean of the samples read (x3.6, "under-predicted")
    c = compare(before, diagnose_capture(after_capture))
    gen = next(m for m in c.rates if m.signal == S.SERVER_GEN_TOKENS_PER_S)
    assert gen.method.endswith("/ counter delta") and gen.after == pytest.approx(1888 / 8)  # BEFORE: an older capture
    (p,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert p.realised == pytest.approx(236.0 / 209.75, rel=0.02) and p.verdict == "held"
    # its error comes from the scrapes: the bursts make each interval stray far from the window's rate
    assert gen.ratio_error is not None and 0.05 < gen.ratio_error < 0.5
    # an older capture with only the rate series gives the same rate, from the series' intervals
    old = compare(before, diagnose_capture(_bursty(load(FP8), TIMES, TOTALS, counters=False)))
    gen_old = next(m for m in old.rates if m.signal == S.SERVER_GEN_TOKENS_PER_S)
    assert gen_old.after == pytest.approx((1888 - 400) / 7.8) and gen_old.method.startswith("counter delta")


def test_a_window_whose_load_ended_inside_it_is_not_graded() -> None:
    """The counter moved in the first 3 s of 8 and then not at all (the load ended): its one burst, as a rate,
    printed x8.23 "realised" on a real vLLM. No realised gain is graded, and the note says why."""
    before = diagnose_capture(load(B1))
    times = [float(t) for t in range(9)]
    totals = [0.0, 700.0, 1400.0, 1888.0, 1888.0, 1888.0, 1888.0, 1888.0, 1888.0]
    c = compare(before, diagnose_capture(_bursty(load(FP8), times, totals)))
    gen = next(m for m in c.rates if m.signal == S.SERVER_GEN_TOKENS_PER_S)
    assert "AFTER: the load stopped 3.0 s into the window" in gen.ungraded
    (p,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert p.applied and not p.graded and p.verdict.startswith("not graded: AFTER: the load stopped")
    assert any(n.startswith("No realised gain: AFTER: the load stopped") for n in c.notes)
    # a load that ran to the end is graded
    w = window_rate(diagnose_capture(_bursty(load(FP8), TIMES, TOTALS)), S.SERVER_GEN_TOKENS_PER_S)
    assert w is not None and w.ended == ""


def test_counters_kept_in_the_capture_round_trip_and_an_older_capture_reads_without_them() -> None:
    c = _bursty(load(FP8), TIMES, TOTALS)
    back = loads(dumps(c))
    assert back.counters == c.counters
    plain = load(B1)
    assert plain.counters == []


def test_the_collector_keeps_each_rates_counter_at_every_scrape() -> None:
    ep = Endpoint()
    try:
        pages = [f"vllm:generation_tokens_total{{model_name=\"m\"}} {n}\nvllm:num_requests_running{{model_name=\"m\"}} 2\n"
                 for n in (100.0, 150.0, 400.0)]
        capture, _ = scrapes(ep, "vllm", pages, [0.5, 1.5, 4.0])
    finally:
        ep.close()
    (track,) = [t for t in capture.counters if t.name == S.SERVER_GEN_TOKENS_PER_S]
    assert track.times == [0.5, 1.5, 4.0] and track.values == [100.0, 150.0, 400.0]
    assert len(track.fetch_s) == 3 and all(f >= 0 for f in track.fetch_s)


def test_every_quantile_inside_a_bucket_is_its_bucket_in_compare() -> None:
    """kv-capped against its fix (a real vLLM): TTFT p50 sits in the 10-20 s bucket before and 2.5-5 s after. It
    printed "15.00 s -> 3.52 s x0.23" while a p99 in one bucket said "not resolved": a p50 is no more measured."""
    before, after = (diagnose_capture(load(VLLM / f"{n}.dgc")) for n in ("kv-capped", "kv-capped-fixed"))
    c = compare(before, after)
    p50 = next(m for m in c.latencies if m.signal == S.SERVER_TTFT_P50_S)
    assert p50.ratio is None and p50.before_bucket == (10.0, 20.0) and p50.after_bucket == (2.5, 5.0)
    assert p50.ratio_low == pytest.approx(2.5 / 20) and p50.ratio_high == pytest.approx(5.0 / 10)
    text = "\n".join(terminal_lines(c))
    assert "server.ttft_p50_s: 10.00 s to 20.00 s (histogram bucket) -> 2.50 s to 5.00 s (histogram bucket)  " \
           "x0.12 to x0.50 (from the buckets)" in text
    assert "15.00 s" not in text


def test_attach_says_where_its_window_lay_and_that_the_load_ended_inside_it() -> None:
    """A host that stalls new processes began `attach --duration 15`'s window 16-34 s after the command; the user
    read it as "the last 15 s". attach says when the window began and ended, and warns of a load that ended."""
    from diagnoser.cli.attach import window_said

    capture = _bursty(load(FP8), [float(t) for t in range(9)],
                      [0.0, 700.0, 1400.0, 1888.0, 1888.0, 1888.0, 1888.0, 1888.0, 1888.0])
    capture.duration_s = 8.0
    line, note = window_said(capture, capture.started_at - 16.0)
    assert line.startswith("diagnoser: the window ran from 16.0 s to 24.0 s after the command started (8.0 s "
                           "observed); the load ended inside it: the load stopped 3.0 s into the window")
    assert "began 16.0 s after the command" in note and "The load ended inside the window" in note
    on_time = _bursty(load(FP8), TIMES, TOTALS)
    on_time.duration_s = 8.0
    line, note = window_said(on_time, on_time.started_at - 0.3)
    assert "from 0.3 s to 8.3 s after the command started" in line and "ended inside" not in line and note == ""


def _flight(c: Capture, running: list[float], waiting: list[float]) -> Capture:
    c.series = [s for s in c.series if s.name not in (S.SERVER_RUNNING, S.SERVER_WAITING)]
    times = [float(i) for i in range(len(running))]
    c.series.append(Series(name=S.SERVER_RUNNING, unit="requests", source="server", times=times, values=running))
    c.series.append(Series(name=S.SERVER_WAITING, unit="requests", source="server", times=times, values=waiting))
    return c


def test_a_closed_loop_is_graded_where_the_running_batch_moves_with_the_fix() -> None:
    """4 closed-loop clients: a faster server ends each request sooner and its client's own time becomes more of
    the loop, so fewer are in flight (3.4 -> 1.9). compare refused: "the running batch changed with no fix that moves
    it". In a closed loop of the same clients that is the fix's effect: the throughput is graded."""
    before = _flight(load(B1), [4, 3, 4, 3, 4, 3, 4, 3, 3, 3], [0.0] * 10)
    after = _flight(load(FP8), [2, 1, 2, 4, 2, 1, 4, 2, 1, 2], [0.0] * 10)
    c = compare(diagnose_capture(before), diagnose_capture(after))
    assert not any("running batch" in x for x in c.confounders), c.confounders
    assert c.loop == "closed (4 clients)" and any("closed loop of the same 4 clients" in n for n in c.notes)
    (p,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert p.graded and p.verdict == "held"
    # an open loop (in flight not capped at one number: arrivals set it) with the same batch move is still refused
    open_after = _flight(load(FP8), [2, 1, 2, 6, 2, 1, 2, 2, 1, 2], [0.0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    open_before = _flight(load(B1), [4, 3, 5, 3, 4, 3, 4, 3, 3, 3], [0.0] * 10)
    o = compare(diagnose_capture(open_before), diagnose_capture(open_after))
    assert o.loop == "" and any("running batch changed" in x for x in o.confounders)
