"""Property-based fuzzing, with a fixed budget, of what reads untrusted bytes on the DCGM paths: the exporter page
parser and the Prometheus answer decoder. Whatever comes in: one sentence (SourceUnavailable / PromError) or a result
whose values are finite and whose labels carry no control characters; never another exception."""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from diagnoser.collectors.dcgm import CLOCK_EVENT_POWER, parse_exporter_lines  # noqa: E402
from diagnoser.collectors.prom_client import PromClient, PromError  # noqa: E402
from diagnoser.collectors.prom_stats import bit_shares  # noqa: E402
from diagnoser.errors import SourceUnavailable  # noqa: E402

BUDGET = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["DCGM_FI_PROF_GR_ENGINE_ACTIVE", "dcgm_fi_prof_dram_active", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
         "DCGM_FI_DEV_FB_USED", "DCGM_FI_UNKNOWN", "node_load1", "DCGM_FI_DEV_POWER_VIOLATION_total"]
LABELS = ["gpu", "UUID", "uuid", "GPU_I_ID", "pod", "pod_name", "modelName", "Hostname", "namespace", "x"]
label_value = st.text(alphabet=st.characters(codec="utf-8", exclude_characters='"\\\n'), max_size=20)
value = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["NaN", "+Inf", "x", ""]),
                  st.integers(-2**70, 2**70).map(str))


@st.composite
def exposition_line(draw: st.DrawFn) -> bytes:
    """A line that is nearly the text format: real names and labels, values and quoting that may be off."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    labels = ",".join(f'{draw(st.sampled_from(LABELS))}="{draw(label_value)}"'
                      for _ in range(draw(st.integers(0, 5))))
    brace = draw(st.sampled_from(["{%s}", "{%s", "%s}", "{%s,}"])) % labels if labels or draw(st.booleans()) else ""
    line = f"{draw(st.sampled_from(NAMES))}{brace} {draw(value)}"
    return line.encode("utf-8", "replace")[: draw(st.integers(1, 200))]


@BUDGET
@given(st.lists(exposition_line(), max_size=30))
def test_the_exporter_parser_never_fails_otherwise(lines: list[bytes]) -> None:
    try:
        scrape = parse_exporter_lines(lines, 0.0)
    except SourceUnavailable as exc:
        assert str(exc).endswith(".") and "\n" not in str(exc)
        return
    for per_gpu in scrape.values.values():
        assert all(math.isfinite(v) for v in per_gpu.values())
    for g in scrape.gpus.values():
        for text in (g.uuid, g.node, g.model, *g.pod_names, *g.containers):
            assert text.isprintable() or not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)


answer = st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=10),
                 lambda children: st.lists(children, max_size=4) | st.dictionaries(
                     st.sampled_from(["status", "data", "result", "resultType", "metric", "value", "values", "UUID",
                                      "error", "errorType", "warnings"]), children, max_size=5),
                 max_leaves=20).map(lambda doc: __import__("json").dumps(doc).encode()),
)


class _Canned(PromClient):
    """The real decoding of a canned answer body, without a server."""

    def __init__(self, body: bytes) -> None:
        super().__init__("http://127.0.0.1:9")
        self.body = body
        self._exporter_checked = True  # no probing of the URL for an exporter page: there is no server

    def _call(self, endpoint: str, params: dict[str, str], method: str = "POST") -> bytes:
        return self.body


@BUDGET
@given(answer)
def test_the_prometheus_answer_decoder_never_fails_otherwise(body: bytes) -> None:
    for read in (lambda c: c.instant("up", 0.0), lambda c: c.instant_points("up", 0.0),
                 lambda c: c.range_points("up", 0.0, 1.0, 1.0), lambda c: c.label_values("__name__", 0.0, 1.0)):
        try:
            result = read(_Canned(body))
        except PromError as exc:
            assert "\n" not in str(exc)
            continue
        assert isinstance(result, list)


@BUDGET
@given(st.integers(0, 511), st.integers(0, 511), st.floats(0, 1))
def test_bit_shares_stay_a_share(a: int, b: int, t: float) -> None:
    low, high = min(a, b), max(a, b)
    share = bit_shares(low, high, low + t * (high - low), CLOCK_EVENT_POWER)
    assert 0.0 <= share <= 1.0
