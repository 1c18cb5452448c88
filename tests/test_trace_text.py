"""The trace analysis as text (reports/trace_text.py): words that match the numbers they stand beside."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnoser.capture import TraceSummary
from diagnoser.reports.trace_text import _phases
from diagnoser.traces.phases import Phases, Step
from diagnoser.traces.result import TraceAnalysis


def _analysis(first: int, last: int) -> TraceAnalysis:
    steps = [Step("s", 0.0, 1.0, tokens=4, batch=4, q_len=1, kv_len=first, time_us=100.0, phase="decode"),
             Step("s", 1.0, 2.0, tokens=4, batch=4, q_len=1, kv_len=last, time_us=100.0, phase="decode")]
    ph = Phases(steps=steps, source="GEMM runs", decode_batch=4.0, attention_frac=0.2,
                context_growth=((first, 0.2), (last, 0.21)))
    return TraceAnalysis(path=Path("t.json"), summary=TraceSummary(decode_batch=4.0), phases=ph)


@pytest.mark.parametrize("first, last, said", [
    (210, 222, "as context grows from 210 to 222 tokens"),
    (222, 210, "as context falls from 222 to 210 tokens"),  # it read "grows from 222 to 210"
    (222, 222, "as context stays at 222 tokens"),
])
def test_the_context_line_says_which_way_it_moved(first: int, last: int, said: str) -> None:
    assert any(said in line for line in _phases(_analysis(first, last))), _phases(_analysis(first, last))
