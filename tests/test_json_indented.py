"""`jsonout.indented` (json's C encoder, then msgspec's re-layout of the whitespace) writes exactly what
`json.dumps(obj, indent=2)` writes: the published diagnosis keeps its bytes while it is written 3x faster (and
`python -m diagnoser.traces` its analysis, at indent=1)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnoser.diagnosis import Diagnosis, Verdict
from diagnoser.reports.jsonout import dumps, indented

_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0.0, -0.0, 1e-05, 1e16, 1.5e300, 5e-324, 0.1, 123456789.123])
           | st.text() | st.sampled_from(["", "é ∑ 😀", "a\"b\\c", "\x00\x1f\x7f", "</script>", "\u2028"]))
_JSON = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                          max_size=4), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_indented_is_json_dumps_with_indent_2(obj: object) -> None:
    assert indented(obj) == json.dumps(obj, indent=2, allow_nan=False)
    # `python -m diagnoser.traces` writes its analysis the same way with indent=1
    assert msgspec.json.format(json.dumps(obj), indent=1) == json.dumps(obj, indent=1)


def test_empty_and_nested_containers() -> None:
    for obj in ({}, [], {"a": {}}, {"a": []}, [[[]]], {"k": [{"x": 1.0, "y": None}], "z": "é"}):
        assert indented(obj) == json.dumps(obj, indent=2)


def test_publishing_a_diagnosis_builds_no_other_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite validates every Diagnosis a test builds (conftest): one built while publishing would be validated by
    # the next test, and its own publication would build another, so every later test would pay for them all.
    d = Diagnosis(verdict=Verdict.INCONCLUSIVE, confidence=0.1, headline="h", target="t",
                  context={"trace": {"kernels": [{"name": "k", "time_us": 1.0}]}})
    built: list[int] = []
    real = Diagnosis.__init__

    def counting(self: Diagnosis, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(Diagnosis, "__init__", counting)
    assert json.loads(dumps(d))["context"] == {"trace": {"kernels": [{"name": "k", "time_us": 1.0}]}}
    assert not built
