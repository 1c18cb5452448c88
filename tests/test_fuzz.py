"""Property-based fuzzing of the decoders that read what others send or wrote: the Prometheus exposition parser
(a server's /metrics), the capture loader, the Kineto trace decoder and analysis, and the Prometheus query-answer
decoder. Whatever the input: no traceback, memory stays bounded, and a rejection is one sentence.

The budget is fixed for CI: derandomized (the same examples every run), a few hundred examples per target, a few
seconds each. Inputs are grammar-shaped (so they reach deep into each decoder) and then damaged (cut, flipped).
"""

from __future__ import annotations

import gzip
import json
import resource
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diagnoser.capture import loads
from diagnoser.collectors.prometheus_source import PromClient, _values_by_step
from diagnoser.collectors.server_metrics import detect_kind, parse_samples
from diagnoser.errors import DiagnoserError
from diagnoser.evidence_build import build_evidence
from diagnoser.rules.engine import diagnose_evidence
from diagnoser.traces import analyze_trace
from diagnoser.traces.decode import iter_event_chunks

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "nvidia-h100-80gb-hbm3-decode-b16.dgc"

FUZZ = settings(max_examples=250, derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
# What one fuzz target may add to this process's peak RSS: the inputs are kilobytes.
GROWTH_LIMIT_MIB = 256


def one_sentence(exc: BaseException) -> None:
    text = str(exc)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)
    assert text.rstrip().endswith((".", ")", "?")), repr(text)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture
def bounded_memory() -> Iterator[None]:
    before = _peak_mib()
    yield
    assert _peak_mib() - before < GROWTH_LIMIT_MIB, f"peak RSS grew by {_peak_mib() - before:.0f} MiB"


def damaged(data: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Bytes as made, or cut short, or with a byte flipped, or with junk spliced in."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        raw = draw(data)
        how = draw(st.sampled_from(["whole", "cut", "flip", "splice"]))
        if not raw or how == "whole":
            return raw
        i = draw(st.integers(0, len(raw) - 1))
        if how == "cut":
            return raw[:i]
        if how == "flip":
            return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
        return raw[:i] + draw(st.binary(max_size=16)) + raw[i:]

    return build()


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


# --- the exposition parser ------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                         "sglang:num_running_reqs", "tgi_queue_size", "nv_inference_pending_request_count", "x",
                         "a_b:c", "9bad", ""])
LABEL_VALUES = st.text(alphabet=st.characters(codec="utf-8"), max_size=10)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(
    ["NaN", "+Inf", "-Inf", "1e999", "0x10", "", "--1", "1_000", "1.5.2"]), st.text(max_size=6))


@st.composite
def exposition_line(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["sample", "type", "help", "junk", "blank"]))
    name = draw(NAMES)
    if kind == "type":
        return f"# TYPE {name} {draw(st.sampled_from(['gauge', 'counter', 'histogram', 'summary', 'untyped', 'x']))}"
    if kind == "help":
        return f"# HELP {name} {draw(st.text(max_size=20))}"
    if kind == "junk":
        return draw(st.text(max_size=30))
    if kind == "blank":
        return ""
    labels = draw(st.dictionaries(st.sampled_from(["model_name", "le", "quantile", "engine", "a b", ""]),
                                  LABEL_VALUES, max_size=3))
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    stamp = draw(st.one_of(st.just(""), st.integers(-10, 2**63).map(lambda n: f" {n}")))
    return f"{name}{{{body}}} {draw(VALUES)}{stamp}" if labels or draw(st.booleans()) else f"{name} {draw(VALUES)}"


EXPOSITION = st.lists(exposition_line(), max_size=12).map(lambda lines: "\n".join(lines) + "\n")


@FUZZ
@given(text=damaged(EXPOSITION.map(str.encode)).map(lambda b: b.decode("utf-8", "replace")),
       light=st.booleans())
def test_fuzz_exposition_parser(text: str, light: bool, bounded_memory: None) -> None:
    names = ("vllm:", "sglang:") if light else None
    try:
        samples = parse_samples(text, names, origin="http://127.0.0.1:8000/metrics")
    except DiagnoserError as exc:
        one_sentence(exc)
        return
    detect_kind(samples)
    for name, rows in samples.items():
        assert isinstance(name, str)
        for labels, value in rows:
            assert isinstance(labels, dict) and isinstance(value, float)


# --- the capture loader ---------------------------------------------------------------------------------------------

_BASE_CAPTURE = json.loads(gzip.decompress(FIXTURE.read_bytes()))


@st.composite
def mutated_capture(draw: st.DrawFn) -> bytes:
    """The real capture with a few of its values replaced by arbitrary JSON, at paths chosen anywhere in it."""
    doc = json.loads(json.dumps(_BASE_CAPTURE))
    for _ in range(draw(st.integers(1, 3))):
        node: Any = doc
        parent: Any = None
        key: Any = None
        for _ in range(draw(st.integers(1, 6))):
            if isinstance(node, dict) and node:
                parent, key = node, draw(st.sampled_from(sorted(node)))
            elif isinstance(node, list) and node:
                parent, key = node, draw(st.integers(0, len(node) - 1))
            else:
                break
            node = parent[key]
        if parent is not None:
            parent[key] = draw(JSON_VALUES)
    data = json.dumps(doc).encode()
    return gzip.compress(data, mtime=0) if draw(st.booleans()) else data


@FUZZ
@given(data=st.one_of(damaged(mutated_capture()), st.binary(max_size=64)))
def test_fuzz_capture_loader(data: bytes, bounded_memory: None) -> None:
    try:
        capture = loads(data, origin="fuzz.dgc")
    except DiagnoserError as exc:
        one_sentence(exc)
        return
    # What loads is diagnosable: a capture that decodes must never crash the evidence or the rules (exit 70).
    for s in capture.series:
        assert len(s.times) == len(s.values)
    diagnose_evidence(build_evidence(capture))


# --- the Kineto decoder ---------------------------------------------------------------------------------------------

CATS = st.sampled_from(["cpu_op", "kernel", "cuda_runtime", "gpu_memcpy", "gpu_memset", "user_annotation",
                        "python_function", "ac2g", "Trace", "whatever", ""])
PHASES = st.sampled_from(["X", "i", "f", "s", "M", "B", "E", "C", "?"])
TIMES = st.one_of(st.integers(-10**6, 10**13), st.floats(allow_nan=False, allow_infinity=False, width=32),
                  st.sampled_from(["NaN", "12", None]))


@st.composite
def kineto_event(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": draw(PHASES), "cat": draw(CATS), "name": draw(st.sampled_from(
        ["aten::mm", "cudaLaunchKernel", "ampere_sgemm_128x64", "Memcpy HtoD (Pageable -> Device)",
         "cudaDeviceSynchronize", "ProfilerStep#3", "flash_fwd_kernel", "x"])),
        "pid": draw(st.one_of(st.integers(-1, 8), st.text(max_size=3))),
        "tid": draw(st.one_of(st.integers(-1, 8), st.text(max_size=3))), "ts": draw(TIMES)}
    if draw(st.booleans()):
        event["dur"] = draw(TIMES)
    if draw(st.booleans()):
        event["args"] = draw(st.dictionaries(st.sampled_from(
            ["stream", "correlation", "device", "External id", "bytes", "Input Dims", "Input type",
             "Concrete Inputs", "cuda_sync_kind", "graph id", "dtype"]), JSON_VALUES, max_size=4))
    return event


@st.composite
def kineto_trace(draw: st.DrawFn) -> bytes:
    doc: dict[str, Any] = {"traceEvents": draw(st.lists(kineto_event(), max_size=25))}
    if draw(st.booleans()):
        doc["deviceProperties"] = draw(st.one_of(JSON_VALUES, st.just([{"id": 0, "name": "NVIDIA H100 80GB HBM3"}])))
    if draw(st.booleans()):
        doc["displayTimeUnit"] = draw(JSON_SCALARS)
    text = json.dumps(doc)
    # Torch writes NaN/Infinity as bare tokens (not JSON); so do some damaged traces.
    if draw(st.booleans()):
        text = text.replace('"NaN"', "NaN")
    return text.encode()


@FUZZ
@given(data=damaged(kineto_trace()), gz=st.booleans(), chunk=st.sampled_from([64, 512, 1 << 20]))
def test_fuzz_kineto_decoder(data: bytes, gz: bool, chunk: int, tmp_path_factory: pytest.TempPathFactory,
                             bounded_memory: None) -> None:
    path = tmp_path_factory.mktemp("trace") / ("t.json.gz" if gz else "t.json")
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    try:
        _, chunks = iter_event_chunks(path, chunk_bytes=chunk)
        for events in chunks:
            assert isinstance(events, list)
    except DiagnoserError as exc:
        one_sentence(exc)
    try:
        analyze_trace(path)
    except DiagnoserError as exc:
        one_sentence(exc)


# --- the Prometheus answer decoder ----------------------------------------------------------------------------------

class _Answering:
    """A real HTTP server that answers every request with the body the current example set."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


_PROM = _Answering()

POINT = st.tuples(st.one_of(st.floats(0, 200, allow_nan=False), st.text(max_size=4), st.none()),
                  st.one_of(st.floats(allow_nan=False).map(str), st.sampled_from(["NaN", "+Inf", "-Inf", "x"]),
                            st.floats(allow_nan=False), st.none())).map(list)
SERIES = st.fixed_dictionaries({"metric": st.one_of(st.dictionaries(
    st.sampled_from(["UUID", "uuid", "GPU_I_ID", "Hostname", "__name__"]), st.one_of(st.text(max_size=6), JSON_VALUES),
    max_size=3), JSON_VALUES)}, optional={"values": st.one_of(st.lists(POINT, max_size=5), JSON_VALUES),
                                          "value": st.one_of(POINT, JSON_VALUES)})


@st.composite
def prom_answer(draw: st.DrawFn) -> bytes:
    doc = {"status": draw(st.sampled_from(["success", "error", "", 3])),
           "data": draw(st.one_of(st.fixed_dictionaries({
               "resultType": st.sampled_from(["matrix", "vector", "scalar", "string"]),
               "result": st.one_of(st.lists(SERIES, max_size=4), JSON_VALUES)}), JSON_VALUES))}
    if draw(st.booleans()):
        doc["errorType"], doc["error"] = "bad_data", draw(st.text(max_size=20))
    return json.dumps(doc).encode()


@FUZZ
@given(body=damaged(prom_answer()), status=st.sampled_from([200, 200, 200, 400, 422, 503, 302]),
       instant=st.booleans())
def test_fuzz_prometheus_answer_decoder(body: bytes, status: int, instant: bool, bounded_memory: None) -> None:
    _PROM.body, _PROM.status = body, status
    client = PromClient(_PROM.url, timeout_s=10)
    try:
        series = client.instant_points("up", 60.0) if instant else client.range_points("up", 0.0, 60.0, 15.0)
    except DiagnoserError as exc:
        one_sentence(exc)
        return
    values = _values_by_step(series, 0.0, 15.0, 5)
    for key, column in values.items():
        assert isinstance(key, tuple) and len(column) == 5


# Bytes that are not UTF-8 inside a JSON string: msgspec raises UnicodeDecodeError, not its DecodeError.
NOT_UTF8 = (b'{"\xf3tatus": "success", "data": null}', b'{"status": "success", "data": {"result": ["\xff"]}}')


@pytest.mark.parametrize("body", NOT_UTF8)
def test_an_answer_that_is_not_utf8_is_one_sentence(body: bytes) -> None:
    _PROM.body, _PROM.status = body, 200
    for call in (lambda c: c.instant_points("up", 60.0), lambda c: c.range_points("up", 0.0, 60.0, 15.0),
                 lambda c: c.instant("up", 60.0)):
        with pytest.raises(DiagnoserError) as caught:
            call(PromClient(_PROM.url, timeout_s=10))
        one_sentence(caught.value)


@pytest.mark.parametrize("data", [b'{"format": "diagnoser-capture\xf3", "version": 1}',
                                  b'{"format": "diagnoser-capture", "version": 1, "capture": {"target": "\xff"}}'])
def test_a_capture_that_is_not_utf8_is_one_sentence(data: bytes) -> None:
    with pytest.raises(DiagnoserError) as caught:
        loads(data, origin="bad.dgc")
    one_sentence(caught.value)
