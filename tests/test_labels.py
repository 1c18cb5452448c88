"""The one table of names and colours (reports/labels.py): every verdict, idle cause and kernel class the engine and
the trace analysis can produce has a label, a colour and (for a verdict) a terminal style, and the renderers read
that table rather than a copy of it."""

from __future__ import annotations

import re

from diagnoser.diagnosis import Limiter, Verdict
from diagnoser.reports import figures, html, model, terminal, trace_figures
from diagnoser.reports.labels import (
    COLLECTIVES,
    HOST_STYLE,
    IDLE_STYLE,
    KERNEL_STYLE,
    VERDICT_COLORS,
    VERDICTS,
    idle_look,
    kernel_label,
    limiter_label,
    verdict_color,
    verdict_term_style,
)
from diagnoser.traces.classify import KERNEL_CLASSES
from diagnoser.traces.timeline import IDLE_CAUSES

HEX = re.compile(r"#[0-9A-Fa-f]{6}")


def test_every_verdict_has_a_label_a_colour_and_a_terminal_style() -> None:
    assert list(VERDICTS) == [*(limiter.value for limiter in Limiter), Verdict.INCONCLUSIVE]
    for limiter in Limiter:
        look = VERDICTS[limiter.value]
        assert look.label == limiter.label  # the engine's label, which the headline starts with
        assert HEX.fullmatch(look.color) and look.term.startswith("bold")
        assert verdict_term_style(limiter.value) == look.term and verdict_color(limiter.value) == look.color
    # latency had no terminal style of its own before the table was one.
    assert verdict_term_style("latency") != verdict_term_style("no-such-verdict") == "bold"
    assert limiter_label("memory_bandwidth") == "memory-bandwidth-limited" and limiter_label("newer") == "newer"


def test_every_idle_cause_has_a_label_a_colour_and_a_sentence() -> None:
    assert tuple(IDLE_STYLE) == IDLE_CAUSES
    for cause in IDLE_CAUSES:
        look = IDLE_STYLE[cause]
        assert look.label and look.text and HEX.fullmatch(look.color)
    assert len({look.color for look in IDLE_STYLE.values()}) == len(IDLE_CAUSES)
    unknown = idle_look("newer_cause")
    assert unknown.label == unknown.text == "newer_cause" and HEX.fullmatch(unknown.color)


def test_every_kernel_class_has_a_label_and_a_colour_apart_from_the_idle_causes() -> None:
    assert set(KERNEL_STYLE) == set(KERNEL_CLASSES)
    for kind in KERNEL_CLASSES:
        assert kernel_label(kind) == KERNEL_STYLE[kind].label and HEX.fullmatch(KERNEL_STYLE[kind].color)
    kernel_colors = {look.color for look in KERNEL_STYLE.values()}
    assert not kernel_colors & {look.color for look in IDLE_STYLE.values()}
    assert len(kernel_colors) == len(KERNEL_CLASSES)
    assert kernel_label("newer_kind") == "newer_kind"
    assert all(COLLECTIVES.values()) and all(HEX.fullmatch(look.color) for look in HOST_STYLE.values())


def test_the_renderers_read_this_table_not_a_copy() -> None:
    assert model.VERDICT_COLORS is VERDICT_COLORS and html.VERDICT_COLORS is VERDICT_COLORS
    assert trace_figures.KERNEL_STYLE is KERNEL_STYLE and trace_figures.IDLE_STYLE is IDLE_STYLE
    for module in (figures, model, terminal, trace_figures):
        names = vars(module)
        assert not {"KERNEL_CLASSES", "IDLE_CAUSES", "_VERDICT_STYLE", "_CAUSE_TEXT"} & set(names), module.__name__
