"""Issue 48: a sampled trace never decides a verdict on a share it cannot measure.

Ranks 0 and 1 of a 128-rank recommendation-model job (tests/fixtures/traces/recsys-sampled-2of128), files holding
about 4 % of their events. Communication kernels hold 57-65 % of the GPU time the sample kept on either rank: a share
of the kernels present, an estimate the sample can make. Which gaps the host left idle it cannot tell (a launch
missing from the sample reads as the host late, a kernel missing as idle), so rank 1's host-gap share (0.771 against
communication 0.768) cannot name its verdict: each rank alone reads as the pair does, interconnect."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import msgspec
import pytest

from diagnoser.capture import Capture, TraceSummary
from diagnoser.diagnosis import Citation, Diagnosis, Finding, Limiter, Verdict
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import diagnose
from diagnoser.rules.engine import unmeasured
from diagnoser.traces import analyze_trace, capture_from_trace
from tests.factories import make_capture

SAMPLED = Path(__file__).resolve().parent / "fixtures" / "traces" / "recsys-sampled-2of128"


@cache
def _capture(name: str) -> Capture:
    return capture_from_trace(analyze_trace(SAMPLED / name if name else SAMPLED))


@cache
def _diagnosis(name: str) -> Diagnosis:
    return diagnose(_capture(name))


@pytest.mark.parametrize("name", ["rank-0.json.gz", "rank-1.json.gz", ""])
def test_each_sampled_rank_alone_and_the_pair_read_interconnect(name: str) -> None:
    d = _diagnosis(name)
    assert d.verdict is Verdict.INTERCONNECT, d.headline
    # the host finding is still reported, its fixes unsized, but it neither names the verdict nor ties with it
    assert "HOST002" in {f.code for f in d.findings}
    assert "HOST002" not in d.near_tie


def test_rank_1_says_why_its_host_gaps_do_not_decide() -> None:
    d = _diagnosis("rank-1.json.gz")
    note = next(n for n in d.notes if "does not decide" in n or "do not decide" in n)
    assert "HOST002" in note and "trace.idle.host_frac" in note and "sample of its events" in note


def test_the_same_numbers_from_a_whole_trace_still_read_host() -> None:
    # Only the sampling sets the host gaps aside: rank 1's numbers from a trace holding every event keep the host
    # finding's lead (a near tie).
    capture = _capture("rank-1.json.gz")
    assert capture.trace is not None
    whole = msgspec.structs.replace(capture, trace=msgspec.structs.replace(capture.trace, sampled=False,
                                                                           sampled_reason=""))
    d = diagnose(whole)
    assert d.verdict is Verdict.HOST_LAUNCH and "NET001" in d.near_tie
    assert not any("decide the verdict" in n for n in d.notes)


def test_a_finding_read_from_idle_gaps_is_unmeasured_only_in_a_sample() -> None:
    cited = (Citation("trace.idle.host_frac", "value", 0.3, "ratio", "trace", ">=", 0.15),)
    host = Finding("T001", "t", Limiter.HOST_LAUNCH, 0.8, "m", citations=cited)
    shares = Finding("T002", "t", Limiter.INTERCONNECT, 0.8, "m",
                     citations=(Citation("trace.share.comm", "value", 0.6, "ratio", "trace", ">=", 0.3),))
    context = Finding("T003", "t", Limiter.INTERCONNECT, 0.8, "m",
                      citations=(Citation("trace.idle.host_frac", "value", 0.3, "ratio", "trace"),))
    sampled = build_evidence(make_capture({}, trace=TraceSummary(kernel_count=1000, sampled=True)))
    whole = build_evidence(make_capture({}, trace=TraceSummary(kernel_count=1000)))
    assert unmeasured(host, sampled) == "trace.idle.host_frac"
    assert unmeasured(host, whole) == ""
    assert unmeasured(shares, sampled) == ""
    assert unmeasured(context, sampled) == ""  # a number cited for context decides nothing
