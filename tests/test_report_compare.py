"""The before/after page of `diagnoser compare`, in the report's visual language: the verdict pair, the outcome,
predicted against realised per fix as a chart with its agreement band, and the measured ratios with their spread
(real H100 recordings: bf16 weights against FP8 weights, batch 1 against batch 16)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from markupsafe import escape

from diagnoser.capture import load
from diagnoser.compare import AGREEMENT, compare
from diagnoser.pipeline import diagnose_capture
from diagnoser.reports.compare import build_compare_view, render_html
from diagnoser.reports.figdata import Figure, GainPairs, NotDrawn, Ratios
from tests.test_report_cases import SECRETS, XSS_IMG, XSS_SCRIPT

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"


@pytest.fixture(scope="module")
def outcomes():  # type: ignore[no-untyped-def]
    return {n: diagnose_capture(load(GPU / f"nvidia-h100-80gb-hbm3-{n}.dgc"))
            for n in ("decode-b1", "decode-b16", "decode-fp8")}


def test_fp8_pair_draws_prediction_against_realisation(outcomes) -> None:  # type: ignore[no-untyped-def]
    c = compare(outcomes["decode-b1"], outcomes["decode-fp8"])
    view = build_compare_view(c)
    assert [s.name for s in view.sides] == ["Before", "After"]
    assert view.sides[0].verdict_key == c.before_verdict and not view.sides[0].headline.lower().startswith(
        view.sides[0].verdict.lower() + ":")
    assert isinstance(view.gains, Figure) and isinstance(view.gains.spec, GainPairs)
    (pair,) = view.gains.spec.pairs
    fp8 = next(p for p in c.predictions if p.applied)
    assert pair.label == fp8.title and pair.realised == fp8.realised and pair.verdict == "held"
    assert pair.predicted == (fp8.for_change if fp8.for_change is not None else fp8.predicted)
    assert view.gains.spec.band == AGREEMENT
    assert isinstance(view.ratios, Figure) and isinstance(view.ratios.spec, Ratios)
    gen = next(i for i in view.ratios.spec.items if i.label == "generated tokens/s")
    rate = next(m for m in c.rates if m.signal == "server.gen_tokens_per_s")
    assert gen.ratio == rate.ratio and gen.error == rate.ratio_error and gen.better == "higher"
    assert any("1 of 1 fix applied held" in line for line in view.summary)


def test_page_draws_both_charts_at_both_widths(outcomes) -> None:  # type: ignore[no-untyped-def]
    page = render_html(compare(outcomes["decode-b1"], outcomes["decode-b16"]))
    for key in ("gains", "ratios"):
        fig = page[page.index(f'data-chart="{key}"'):]
        fig = fig[:fig.index("</figure>")]
        assert 'class="chart wide"' in fig and 'class="chart narrow"' in fig
    assert "Batch more sequences per step: held" in page  # 12.3x measured against about 15x for batch 16
    assert re.search(r'id="side-before".*?data-verdict="latency"', page, re.DOTALL)
    assert ' style="' not in page and page.count("<script") == 1


def test_nothing_applied_says_why_not_drawn(outcomes) -> None:  # type: ignore[no-untyped-def]
    c = compare(outcomes["decode-b1"], outcomes["decode-b1"])
    view = build_compare_view(c)
    assert isinstance(view.gains, NotDrawn) and "no proposed fix was applied" in view.gains.why
    assert "Nothing the captures record changed" in render_html(c)


def test_hostile_targets_are_escaped_and_redacted(outcomes) -> None:  # type: ignore[no-untyped-def]
    c = compare(outcomes["decode-b1"], outcomes["decode-fp8"])
    c = replace(c, before_target=f"pid 1 {XSS_SCRIPT} --api-key {SECRETS['sk']}", after_target=XSS_IMG,
                before_headline=XSS_IMG)
    page = render_html(c)
    assert page.count("<script") == 1 and "<img" not in page
    assert str(escape(XSS_SCRIPT)) in page and SECRETS["sk"] not in page
