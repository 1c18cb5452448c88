"""llama.cpp's server (issue 47): its /metrics page told apart and every family mapped, /props and /slots read for the
configuration in force, its command line parsed, its knob table read through the one reader, and a fix naming its own
flag. Pages are written as build 11434's tools/server/server-task.cpp `to_metrics` writes them (each value through a
C++ stream: 6 significant digits) and served over real HTTP on 127.0.0.1; where real pages captured from the built
server are kept (tests/fixtures/llamacpp/), they are read too."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from diagnoser import signals as S
from diagnoser.capture import Capture, ServerInfo, ServingConfig, new_capture
from diagnoser.collectors.server_maps import LLAMACPP_MAP, SERVER_MAPS, detect_kind
from diagnoser.collectors.server_metrics import ServerMetricsCollector, parse_samples
from diagnoser.collectors.target import llamacpp_config, llamacpp_state, resolve_target, serving_from_cmdline
from diagnoser.engines import llamacpp
from diagnoser.engines.knobs import CONFIGURED, parse_version
from diagnoser.engines.tables import in_force, knobs_of
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import diagnose
from tests.factories import make_capture
from tests.serving_pages import values

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llamacpp"

# Build 11434's families (server-task.cpp to_metrics, as its tools/server/tests/unit/test_metrics.py expects them):
# counters, then gauges, then the labelled per-position counter.
COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total")
GAUGES = ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
          "n_busy_slots_per_decode")
# Read for no signal, and why (docs/attach.md says the same).
NOT_MAPPED = {"prompt_tokens_seconds": "busy throughput between scrapes", "predicted_tokens_seconds": "the same",
              "spec_decode_num_accepted_tokens_per_pos_total": "per draft position"}


def page(values: dict[str, float], per_pos: tuple[float, ...] = ()) -> str:
    """A page as llama-server writes it: HELP, TYPE, then `llamacpp:name value` with the value as `std::stringstream
    << double` prints it (%g: 6 significant digits, 1.23457e+07 past a million)."""
    out = []
    for names, kind in ((COUNTERS, "counter"), (GAUGES, "gauge")):
        for n in names:
            out += [f"# HELP llamacpp:{n} .", f"# TYPE llamacpp:{n} {kind}", f"llamacpp:{n} {values.get(n, 0.0):g}"]
    if per_pos:
        out += ["# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position",
                "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter"]
        out += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v:g}'
                for i, v in enumerate(per_pos)]
    return "\n".join(out) + "\n"


# Two slots, eight clients, 10 s apart: 2 processing, 6 deferred; 400 decode calls with 2 busy slots each (the
# average since start moves from 1.5 over 1000 calls to 1.642857 over 1400), 800 tokens generated in 64 s of slot
# time (two slots x 10 s x 3.2 requests' worth), 2000 prompt tokens in 4 s, 500 cached.
FIRST = {"prompt_tokens_total": 10000, "prompt_tokens_cached_total": 1500, "prompt_seconds_total": 20.0,
         "tokens_predicted_total": 3000, "tokens_predicted_seconds_total": 240.0, "n_decode_total": 1000,
         "n_tokens_max": 900, "requests_processing": 2, "requests_deferred": 6, "n_busy_slots_per_decode": 1.5,
         "prompt_tokens_seconds": 500.0, "predicted_tokens_seconds": 12.5}
SECOND = {**FIRST, "prompt_tokens_total": 12000, "prompt_tokens_cached_total": 2000, "prompt_seconds_total": 24.0,
          "tokens_predicted_total": 3800, "tokens_predicted_seconds_total": 304.0, "n_decode_total": 1400,
          "n_busy_slots_per_decode": 2300 / 1400}


class Server:
    """llama-server's endpoints on 127.0.0.1: /metrics from `pages` in turn (the last one kept), /props and /slots
    as given (None: 404, as a server started with --no-slots answers 501; a function: its answer at each read)."""

    def __init__(self, pages: list[str], props: Any = None, slots: Any = None) -> None:
        self.pages, self.hits = pages, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body = owner.pages[min(owner.hits, len(owner.pages) - 1)].encode()
                    owner.hits += 1
                elif path in ("/props", "/slots") and (props if path == "/props" else slots) is not None:
                    answer = props if path == "/props" else slots
                    body = json.dumps(answer() if callable(answer) else answer).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served() -> Iterator[Any]:
    made: list[Server] = []

    def make(pages: list[str], props: Any = None, slots: Any = None) -> Server:
        made.append(Server(pages, props, slots))
        return made[-1]

    yield make
    for s in made:
        s.close()


def read(url: str) -> Capture:
    """Scrapes at t=0 and t=10, then the end of the window (no extra scrape)."""
    capture = new_capture("test")
    capture.server = ServerInfo(kind="unknown", url=url)
    collector = ServerMetricsCollector(url)
    collector.start(capture)
    collector.sample(0.0)
    collector.sample(10.0)
    collector.stop(10.0)
    return capture


def scrape_window(cap: Capture, url: str) -> None:
    """A 10 s window of the server at `url` into `cap`, one scrape a second, as attach makes it."""
    collector = ServerMetricsCollector(url)
    collector.start(cap)
    for t in range(11):
        collector.sample(float(t))
    collector.stop(10.0)
    cap.duration_s = 10.0


def reason(capture: Capture, what: str) -> str:
    return next((u.reason for u in capture.unavailable if u.what == what), "")


# --- the page ----------------------------------------------------------------------------------------------------

def test_the_page_is_told_apart_by_its_prefix() -> None:
    samples = parse_samples(page(FIRST))
    assert detect_kind(samples.keys()) == "llamacpp"
    assert SERVER_MAPS["llamacpp"] is LLAMACPP_MAP and LLAMACPP_MAP.label == "llama.cpp"
    # a vLLM page is still vLLM's
    assert detect_kind(["vllm:num_requests_running", "vllm:generation_tokens_total"]) == "vllm"


def test_every_family_of_build_11434_is_read_or_said_why_not() -> None:
    read_names = set(LLAMACPP_MAP.names())
    for family in (*COUNTERS, *GAUGES, "spec_decode_num_accepted_tokens_per_pos_total"):
        assert ("llamacpp:" + family in read_names) != (family in NOT_MAPPED), family
    doc = (Path(__file__).resolve().parents[1] / "docs" / "attach.md").read_text()
    for family in NOT_MAPPED:
        assert family in doc, f"docs/attach.md does not say why {family} is not mapped"


def test_the_window_from_two_scrapes(served: Any) -> None:
    server = served([page(FIRST), page(SECOND, per_pos=(40.0, 20.0))])
    cap = read(server.url)
    assert cap.server is not None and cap.server.kind == "llamacpp" and cap.serving.engine == "llamacpp"
    assert values(cap, S.SERVER_RUNNING) == [2.0, 2.0] and values(cap, S.SERVER_WAITING) == [6.0, 6.0]
    assert values(cap, S.SERVER_PROMPT_TOKENS_PER_S) == [pytest.approx(200.0)]  # 2000 tokens in 10 s
    assert values(cap, S.SERVER_GEN_TOKENS_PER_S) == [pytest.approx(80.0)]
    assert values(cap, S.SERVER_PROMPT_TOKENS_CACHED_PER_S) == [pytest.approx(50.0)]
    # the window's busy slots per decode call: (2300 - 1500) / (1400 - 1000), not the average since start (1.64)
    assert values(cap, S.SERVER_BATCH_SIZE) == [pytest.approx(2.0, abs=0.01)]
    assert values(cap, S.SERVER_TPOT_MEAN_S) == [pytest.approx(64.0 / 800)]
    assert values(cap, S.SERVER_PREFILL_TIME_PER_TOKEN_MEAN_S) == [pytest.approx(4.0 / 2000)]
    assert values(cap, S.SERVER_PREFIX_CACHE_HIT_RATE) == [pytest.approx(500 / 2500)]
    assert not values(cap, S.SERVER_SPEC_ACCEPTANCE_RATE)  # no drafts: no ratio, not a zero
    assert "no KV-cache use" in reason(cap, S.SERVER_KV_USAGE)
    assert "no latency histograms" in reason(cap, S.SERVER_TTFT_P50_S)
    assert "counts tokens, not requests" in reason(cap, S.SERVER_REQUESTS_PER_S)
    assert cap.serving.extra.get("longest_sequence_tokens") == "900"


def test_speculative_counters_and_a_long_running_servers_rounded_counters(served: Any) -> None:
    spec1 = {**FIRST, "spec_decode_num_draft_tokens_total": 3000, "spec_decode_num_accepted_tokens_total": 1800,
             "spec_decode_num_drafts_total": 1000, "prompt_tokens_total": 12_345_678}
    spec2 = {**SECOND, "spec_decode_num_draft_tokens_total": 3600, "spec_decode_num_accepted_tokens_total": 2100,
             "spec_decode_num_drafts_total": 1200, "prompt_tokens_total": 12_365_678}
    assert "1.23457e+07" in page(spec1)  # as the C++ stream writes it
    cap = read(served([page(spec1), page(spec2)]).url)
    assert values(cap, S.SERVER_SPEC_ACCEPTANCE_RATE) == [pytest.approx(300 / 600)]
    assert values(cap, S.SERVER_SPEC_MEAN_ACCEPT_LEN) == [pytest.approx(1 + 300 / 200)]
    assert values(cap, S.SERVER_SPEC_DRAFT_LEN) == [pytest.approx(600 / 200)]
    assert values(cap, S.SERVER_SPEC_DRAFTS_PER_TOKEN) == [pytest.approx(200 / 800)]
    # 12,345,678 -> 12,365,678 is printed 1.23457e+07 -> 1.23657e+07: the rate is good to the printed digits
    assert values(cap, S.SERVER_PROMPT_TOKENS_PER_S) == [pytest.approx(2000.0)]
    assert any("6 significant digits: server.prompt_tokens_per_s" in n for n in cap.notes), cap.notes


def test_an_older_builds_kv_gauges_are_read_where_present(served: Any) -> None:
    old = "llamacpp:kv_cache_usage_ratio 0.75\nllamacpp:kv_cache_tokens 3072\n"
    cap = read(served([page(FIRST) + old, page(SECOND) + old]).url)
    assert values(cap, S.SERVER_KV_USAGE) == [0.75, 0.75] and values(cap, S.SERVER_KV_USED_TOKENS) == [3072.0] * 2
    assert not reason(cap, S.SERVER_KV_USAGE)


# --- /props and /slots ---------------------------------------------------------------------------------------------

PROPS = {"default_generation_settings": {"params": {"temperature": 0.8, "speculative.types": "none"}, "n_ctx": 4096},
         "total_slots": 2, "model_alias": "m", "model_path": "/models/m.gguf", "endpoint_slots": True,
         "endpoint_metrics": True, "build_info": "b11434-1a2b3c4", "is_sleeping": False}
SLOTS = [{"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": True, "id_task": 7},
         {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": False}]


def test_props_and_slots_give_the_configuration_in_force(served: Any) -> None:
    server = served([page(FIRST)], PROPS, SLOTS)
    command_line = serving_from_cmdline(["llama-server", "-m", "/models/m.gguf", "-np", "8", "--metrics"])
    version, serving = llamacpp_state(server.url, command_line, 2.0)
    assert version == "b11434-1a2b3c4" and parse_version(version) == (11434,)
    assert serving.engine == "llamacpp" and serving.max_num_seqs == 2 and serving.max_model_len == 4096  # in force
    assert serving.extra["slots_busy_at_attach"] == "1" and serving.extra["slots_speculative"] == "0"
    assert serving.extra["speculative_types"] == "none"


def test_attach_by_url_reads_the_build_and_the_slots(served: Any) -> None:
    server = served([page(FIRST)], PROPS, SLOTS)
    target = resolve_target(metrics_url=server.url, probe_timeout=2.0)
    assert target.server_kind == "llamacpp" and target.engine_version == "b11434-1a2b3c4"
    assert target.serving.max_num_seqs == 2 and target.serving.max_model_len == 4096


def test_a_missing_endpoint_or_field_is_not_known_never_a_crash(served: Any) -> None:
    server = served([page(FIRST)], {"total_slots": "two", "default_generation_settings": [], "build_info": 7}, None)
    before = serving_from_cmdline(["llama-server", "-np", "2", "-c", "8192"])
    version, serving = llamacpp_state(server.url, before, 2.0)
    assert version == "" and serving.max_num_seqs == 2 and serving.max_model_len == 4096  # the command line stands
    assert "slots_busy_at_attach" not in serving.extra
    assert llamacpp_config(None, None) == {}
    # only the slots that are objects count; one without its fields is one slot, neither busy nor speculating
    assert llamacpp_config({}, [None, "x", {}]) == {"max_num_seqs": 1, "slots_busy_at_attach": 0,
                                                   "slots_speculative": 0}
    nothing = "http://127.0.0.1:9/metrics"  # nothing listens on the discard port
    assert llamacpp_state(nothing, ServingConfig(), 0.5) == ("", ServingConfig(engine="llamacpp"))


# --- the command line ----------------------------------------------------------------------------------------------

def test_llama_servers_command_line() -> None:
    s = serving_from_cmdline(["/opt/llama/bin/llama-server", "-m", "/models/m.gguf", "-np", "2", "-c", "8192", "-b",
                              "1024", "-ub=256", "--cache-reuse", "256", "-md", "/models/draft.gguf",
                              "--spec-draft-n-max", "8", "--no-cont-batching", "--metrics", "--port", "8080"])
    assert s.engine == "llamacpp" and s.max_num_seqs == 2 and s.max_num_batched_tokens == 1024
    assert s.max_model_len == 4096  # -c 8192 over 2 slots, no unified buffer
    assert s.extra["ctx_size"] == "8192" and s.extra["ubatch_size"] == "256" and s.extra["cache_reuse"] == "256"
    assert s.extra["speculative_config"] == "draft.gguf" and s.extra["draft_max"] == "8"  # the file, not its path
    assert s.extra["continuous_batching"] == "false" and s.extra["kv_unified"] == "false"  # -np N: split buffer
    unified = serving_from_cmdline(["llama-server", "-c", "8192", "-np", "2", "-kvu", "--no-cache-prompt", "-cb"])
    assert unified.max_model_len == 8192 and unified.extra["kv_unified"] == "true" and unified.prefix_caching is False
    assert unified.extra["continuous_batching"] == "true"
    auto = serving_from_cmdline(["llama-server", "--ctx-size=16384", "--parallel", "-1"])  # auto: 4, unified
    assert auto.max_num_seqs is None and auto.max_model_len == 16384 and auto.extra["kv_unified"] == "true"
    # vLLM's command line is read as before
    assert serving_from_cmdline(["vllm", "serve", "m", "--max-num-seqs", "8"]).max_num_seqs == 8


# --- the knob table through the one reader ---------------------------------------------------------------------------

def llama_capture(signals: dict[str, Any], *, serving: dict[str, Any] | None = None,
                  version: str = "b11434-1a2b3c4") -> Capture:
    cap = make_capture(signals, gpu=None)
    cap.server = ServerInfo(kind="llamacpp", version=version)
    typed = {k: v for k, v in (serving or {}).items() if k in ServingConfig.__struct_fields__}
    extra = {k: str(v) for k, v in (serving or {}).items() if k not in typed}
    cap.serving = msgspec.structs.replace(cap.serving, engine="llamacpp", **typed, extra=extra)
    cap.cpu_only = True
    return cap


def test_the_knob_table_read_through_evidence() -> None:
    assert set(knobs_of("llamacpp")) >= {"max_num_seqs", "max_model_len", "max_num_batched_tokens", "ubatch_size",
                                         "prefix_caching", "cache_reuse", "speculative_config"}
    for k in llamacpp.KNOBS:
        assert k.flags and all(f.startswith("-") for f in k.flags), k.name
        if k.relieves is not None and k.fixes:
            assert k.relieves in k.fixes, k.name
    ev = build_evidence(llama_capture({"server.running": 2.0}, serving={"max_num_seqs": 2, "ubatch_size": 256}))
    seqs = ev.knob("max_num_seqs")
    assert seqs is not None and seqs.value == 2 and seqs.source == CONFIGURED and seqs.knob.flag == "--parallel"
    batch = ev.knob("max_num_batched_tokens")
    assert batch is not None and batch.value == 2048 and "b11434" in batch.source and batch.knob.flag == "--batch-size"
    ub = ev.knob("ubatch_size")
    assert ub is not None and ub.value == 256
    assert ev.knob("long_prefill_token_threshold") is None  # vLLM's, not llama.cpp's
    default = in_force("llamacpp", "max_num_seqs", ServingConfig(engine="llamacpp"), "b11434-1a2b3c4", None)
    assert default is not None and default.value == 4 and default.is_default
    older = in_force("llamacpp", "max_num_seqs", ServingConfig(engine="llamacpp"), "b6000-abc", None)
    assert older is not None and not older.known and "before version 11434" in older.why_unknown
    unknown = in_force("llamacpp", "max_num_seqs", ServingConfig(engine="llamacpp"), "", None)
    assert unknown is not None and not unknown.known and "version is unknown" in unknown.why_unknown


def test_a_fix_for_a_llama_cpp_capture_names_parallel() -> None:
    """Two slots, eight clients: both slots busy all window, six requests deferred."""
    signals = {"server.running": 2.0, "server.waiting": [6.0] * 10, "server.gen_tokens_per_s": 40.0}
    d = diagnose(llama_capture(signals, serving={"max_num_seqs": 2}))
    assert d.verdict != "inconclusive", [(f.code, f.message) for f in d.findings]
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "--parallel" in fix.action and "--max-num-seqs" not in fix.action, fix.action
    assert "llama.cpp --parallel" in fix.action
    # the same at the default of 4 slots, not on the command line
    d = diagnose(llama_capture({**signals, "server.running": 4.0}))
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "from 4" in fix.action and "--parallel" in fix.action
    # the page has no KV use: the finding does not claim the cache has room
    (finding,) = [f for f in d.findings if f.code == "BAT005"]
    assert "KV cache has room" not in finding.message and "no KV use" in finding.message, finding.message


def test_more_slots_from_a_split_context_say_what_each_slot_keeps() -> None:
    """The neighbour of the slot-limit fix: -np 2 -c 2048 without a unified KV buffer gives each slot 1024 tokens;
    8 slots from the same --ctx-size would leave each 256. The fix raises --ctx-size with --parallel (or names -kvu),
    and where the buffer is unified it says nothing of the kind."""
    signals = {"server.running": 2.0, "server.waiting": [6.0] * 10, "server.gen_tokens_per_s": 40.0}
    split = {"max_num_seqs": 2, "max_model_len": 1024, "kv_unified": "false"}
    (fix,) = [f for f in diagnose(llama_capture(signals, serving=split)).fixes if "BAT005" in f.rules]
    assert "--parallel 8" in fix.action and "--ctx-size with it to about 8192" in fix.action, fix.action
    assert "--kv-unified" in fix.action and "about 256 tokens" in fix.action, fix.action
    shared = {**split, "kv_unified": "true"}
    (fix,) = [f for f in diagnose(llama_capture(signals, serving=shared)).fixes if "BAT005" in f.rules]
    assert "--ctx-size" not in fix.action, fix.action


def test_two_slots_and_eight_clients_read_off_the_pages_is_the_slot_limit(served: Any) -> None:
    """Issue 47's server: 2 slots, 8 clients, read off its pages over 10 s (one scrape a second) with /props and
    /slots, as attach does. It was "Inconclusive", server kind "unknown"."""
    pages = []
    for i in range(11):
        w = {**FIRST, **{k: FIRST[k] + (SECOND[k] - FIRST[k]) * i / 10 for k in (
            "prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total")}}
        w["n_busy_slots_per_decode"] = (1500 + 2 * (w["n_decode_total"] - 1000)) / w["n_decode_total"]
        pages.append(page(w))
    server = served(pages, PROPS, SLOTS)
    cap = new_capture("llama-server")
    version, serving = llamacpp_state(server.url, cap.serving, 2.0)
    cap.server, cap.serving, cap.cpu_only = ServerInfo(kind="llamacpp", url=server.url, version=version), serving, True
    scrape_window(cap, server.url)
    d = diagnose(cap)
    assert d.verdict == "batching" and "BAT005" in [f.code for f in d.findings]
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "llama.cpp --parallel 8" in fix.action, fix.action


# --- real pages (tests/fixtures/llamacpp: llama-server built from build 11434's tree, -np 2 -c 2048, 8 clients) -----

def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_real_pages_every_family_read_or_said_why_not() -> None:
    for name in ("metrics-idle.txt", "metrics-deferred.txt"):
        samples = parse_samples(fixture(name))
        assert detect_kind(samples.keys()) == "llamacpp", name
        families = {f[len("llamacpp:"):] for f in samples if f.startswith("llamacpp:")}
        assert families >= set(COUNTERS) | set(GAUGES), name
        for family in families:
            assert "llamacpp:" + family in LLAMACPP_MAP.names() or family in NOT_MAPPED, f"{name}: {family}"


def test_real_pages_idle_then_eight_clients_on_two_slots(served: Any) -> None:
    cap = read(served([fixture("metrics-idle.txt"), fixture("metrics-deferred.txt")]).url)
    assert cap.server is not None and cap.server.kind == "llamacpp"
    assert values(cap, S.SERVER_RUNNING) == [0.0, 2.0] and values(cap, S.SERVER_WAITING) == [0.0, 6.0]
    assert values(cap, S.SERVER_PROMPT_TOKENS_PER_S) == [pytest.approx((710 - 5) / 10)]
    assert values(cap, S.SERVER_GEN_TOKENS_PER_S) == [pytest.approx((1408 - 64) / 10)]
    assert values(cap, S.SERVER_PROMPT_TOKENS_CACHED_PER_S) == [pytest.approx(22 / 10)]
    # busy slots per decode call over the window: (1.91536 x 768 - 1 x 64) / (768 - 64), both slots nearly always
    (batch,) = values(cap, S.SERVER_BATCH_SIZE)
    assert batch == pytest.approx((round(1.91536 * 768) - 64) / (768 - 64)) and 1.9 < batch <= 2.0
    assert values(cap, S.SERVER_TPOT_MEAN_S) == [pytest.approx((11.0806 - 0.3199) / (1408 - 64))]
    assert values(cap, S.SERVER_PREFILL_TIME_PER_TOKEN_MEAN_S) == [pytest.approx((0.706011 - 0.011123) / 705)]
    assert values(cap, S.SERVER_PREFIX_CACHE_HIT_RATE) == [pytest.approx(22 / (22 + 705))]
    assert not values(cap, S.SERVER_SPEC_ACCEPTANCE_RATE)  # speculation off: no drafts, no ratio
    assert "no KV-cache use" in reason(cap, S.SERVER_KV_USAGE)
    assert cap.serving.extra.get("longest_sequence_tokens") == "96"


def test_real_props_and_slots(served: Any) -> None:
    props, slots = json.loads(fixture("props-deferred.json")), json.loads(fixture("slots-deferred.json"))
    got = llamacpp_config(props, slots)
    assert got["build"] == "b0-unknown" and parse_version(got["build"]) is None  # built outside git: no build number
    assert got["max_num_seqs"] == 2 and got["max_model_len"] == 1024  # -np 2 -c 2048: 1024 a slot
    assert got["slots_busy_at_attach"] == 2 and got["slots_speculative"] == 0 and got["speculative_types"] == "none"
    idle = llamacpp_config(json.loads(fixture("props-idle.json")), json.loads(fixture("slots-idle.json")))
    assert idle["slots_busy_at_attach"] == 0 and idle["max_num_seqs"] == 2
    # the command line it was started with says the same
    s = serving_from_cmdline(["llama-server", "-m", "model/tiny-llama.gguf", "--host", "127.0.0.1", "--port", "8080",
                              "-np", "2", "-c", "2048", "-t", "2", "--metrics", "--slots", "--alias", "tiny-llama"])
    assert (s.max_num_seqs, s.max_model_len) == (2, 1024)


def test_real_server_two_slots_eight_clients_is_the_slot_limit_by_its_own_flag(served: Any) -> None:
    """Issue 47's server as captured: one idle page, then ten seconds of 2 processing and 6 deferred. Its build
    says 0 (no version), so the defaults are unknown; the slots come from /props."""
    server = served([fixture("metrics-idle.txt")] + [fixture("metrics-deferred.txt")] * 10,
                    json.loads(fixture("props-deferred.json")), json.loads(fixture("slots-deferred.json")))
    target = resolve_target(metrics_url=server.url, probe_timeout=2.0)
    assert target.server_kind == "llamacpp" and target.engine_version == "b0-unknown"
    cap = new_capture("llama-server")
    cap.server = ServerInfo(kind="llamacpp", url=server.url, version=target.engine_version)
    cap.serving, cap.cpu_only = target.serving, True
    server.hits = 0
    scrape_window(cap, server.url)
    d = diagnose(cap)
    assert d.verdict == "batching", [(f.code, f.message) for f in d.findings]
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "llama.cpp --parallel" in fix.action and "--max-num-seqs" not in fix.action, fix.action
    ev = build_evidence(cap)
    batch = ev.knob("max_num_batched_tokens")
    assert batch is not None and not batch.known and "version is unknown" in batch.why_unknown


def test_real_refusals_show_only_on_slots_never_on_metrics() -> None:
    """-np 4 -c 1024 (256 tokens a slot) under 301-token prompts: every request refused (HTTP 400), /metrics all 0."""
    samples = parse_samples(fixture("metrics-refused.txt"))
    assert all(v == 0.0 for f, found in samples.items() if f.startswith("llamacpp:") for _, v in found)
    got = llamacpp_config(None, json.loads(fixture("slots-refused.json")))
    assert got["max_num_seqs"] == 4 and got["max_model_len"] == 256 and got["slots_busy_at_attach"] == 0


def _slots_taking(tasks: list[int]) -> Any:
    """/slots whose last task id is the next of `tasks` at each read (four slots of 256 tokens, none processing)."""
    reads = iter(tasks)

    def answer() -> list[dict[str, Any]]:
        last = next(reads)
        return [{"id": i, "n_ctx": 256, "is_processing": False, "id_task": last - i, "n_prompt_tokens": 0}
                for i in range(4)]
    return answer


def test_requests_refused_for_a_short_context_are_read_off_the_slots_task_ids(served: Any) -> None:
    """The tier's short-context set-up as llama.cpp shows it: /metrics counts nothing at all (every request refused
    as a slot takes it), while the slots' last task id climbs from 100 to 300. Three of those tasks were this
    collector's own reads (two more /metrics pages, and the first /slots read): 197 refusals, the API's every
    answer. SRV010 then names the refusals and --ctx-size, not an idle server's right-sizing."""
    refused = fixture("metrics-refused.txt")
    cap = read(served([refused, refused, refused], slots=_slots_taking([100, 300])).url)
    http, rejected = values(cap, S.SERVER_HTTP_REQUESTS_PER_S), values(cap, S.SERVER_HTTP_REJECTED_PER_S)
    assert len(http) == 1 and http == rejected and http[0] > 0
    assert any("about 197 tasks" in n for n in cap.notes), cap.notes
    cap.serving = msgspec.structs.replace(cap.serving, max_num_seqs=4, max_model_len=256)
    cap.cpu_only = True
    d = diagnose(cap)
    assert "SRV010" in [f.code for f in d.findings], [(f.code, f.message) for f in d.findings]
    first = d.fixes[0]
    assert first.kind.value == "context_length" and "--ctx-size" in first.action, [(f.kind, f.action) for f in d.fixes]


def test_slots_taking_tasks_while_tokens_flow_book_no_refusals(served: Any) -> None:
    """The same climb of task ids beside prompt and generated tokens counted: some requests were served, and the
    page cannot say how many were not. Nothing is booked."""
    cap = read(served([page(FIRST), page(SECOND)], slots=_slots_taking([100, 300])).url)
    assert values(cap, S.SERVER_HTTP_REJECTED_PER_S) == [] and values(cap, S.SERVER_HTTP_REQUESTS_PER_S) == []


# --- a draft model: one that does not pay, and its neighbour that does ------------------------------------------------

def _speculating(served: Any, accepted: float, drafted: float, drafts: float, tokens: float) -> Capture:
    """Two slots decoding with a draft model (-md draft.gguf --spec-type draft-simple, draft length 3) for a 10 s
    window, read off its pages as attach reads them, on a CPU build."""
    spec = {"spec_decode_num_draft_tokens_total": drafted, "spec_decode_num_accepted_tokens_total": accepted,
            "spec_decode_num_drafts_total": drafts, "tokens_predicted_total": FIRST["tokens_predicted_total"] + tokens,
            "requests_deferred": 0, "n_busy_slots_per_decode": 2.0}
    server = served([page({**FIRST, "requests_deferred": 0, "n_busy_slots_per_decode": 2.0}),
                     page({**SECOND, **spec})])
    cap = read(server.url)
    cap.server = ServerInfo(kind="llamacpp", version="b11434-1a2b3c4", url=server.url)
    cap.serving = msgspec.structs.replace(cap.serving, engine="llamacpp", max_num_seqs=2,
                                          extra={"speculative_config": "draft.gguf", "kv_unified": "false"})
    cap.cpu_only = True
    return cap


def test_a_draft_the_target_never_accepts_is_dropped_by_llama_cpps_own_flag(served: Any) -> None:
    """As the live tier's draft_not_paying measured it: 0 of 183 drafted tokens accepted in 62 drafts over 64
    generated (one token per verification step). The fix names --model-draft, and on a CPU build its gain is an
    estimate between verification at one step's cost (x1.3) and at k + 1 steps' (x4.3)."""
    cap = _speculating(served, accepted=0, drafted=183, drafts=62, tokens=64)
    assert values(cap, S.SERVER_SPEC_ACCEPTANCE_RATE) == [pytest.approx(0.0)]
    assert values(cap, S.SERVER_SPEC_DRAFT_LEN) == [pytest.approx(183 / 62)]
    ev = build_evidence(cap)
    knob = ev.knob("speculative_config")
    assert knob is not None and knob.known and knob.knob.flag == "--model-draft"
    d = diagnose(cap)
    (fix,) = [f for f in d.fixes if "SRV005" in f.rules]
    assert "llama.cpp: no --model-draft" in fix.action and "--speculative-config" not in fix.action, fix.action
    assert fix.gain_kind.value == "estimate" and fix.gain_low == pytest.approx(1.3)
    assert fix.gain is not None and fix.gain_high == pytest.approx(4.3)
    assert 1.3 < fix.gain < 4.3, fix


def test_a_draft_the_target_mostly_accepts_is_kept(served: Any) -> None:
    """The neighbour: 2700 of 3000 drafted tokens accepted (3.7 tokens per verification step). Even with
    verification at k + 1 steps' cost it is not certainly slower than none: nothing says drop the draft."""
    cap = _speculating(served, accepted=2700, drafted=3000, drafts=1000, tokens=3700)
    assert values(cap, S.SERVER_SPEC_MEAN_ACCEPT_LEN) == [pytest.approx(3.7)]
    d = diagnose(cap)
    assert not [f for f in d.fixes if f.title == "Turn speculative decoding off"], d.fixes
    assert not d.fixes or d.fixes[0].title != "Turn speculative decoding off"
    # a longer draft may be proposed (the formula's best length at 90 %), by llama.cpp's own flag
    assert all("--spec-draft-n-max" in f.action for f in d.fixes if "SRV005" in f.rules), d.fixes


def test_real_pages_a_draft_the_target_never_accepts(served: Any) -> None:
    """Pages captured from the build that says its number (b11434-unknown): -np 2 -c 2048 with -md draft.gguf
    --spec-type draft-simple, two clients, 0 of 234 drafted tokens accepted in 84 drafts. Read from the idle page to
    this one as attach reads them: acceptance 0, draft length 234 / 84, the version known, so build 11434's
    defaults apply; the fix drops the draft by llama.cpp's own flag. /props says its speculative types are "none"
    (the default request settings'), /slots that both slots speculate."""
    server = served([fixture("metrics-idle.txt")] + [fixture("metrics-draft.txt")] * 10,
                    json.loads(fixture("props-draft.json")), json.loads(fixture("slots-draft.json")))
    target = resolve_target(metrics_url=server.url, probe_timeout=2.0)
    assert target.server_kind == "llamacpp" and parse_version(target.engine_version) == llamacpp.B11434
    assert target.serving.extra["slots_speculative"] == "2" and target.serving.extra["speculative_types"] == "none"
    cap = new_capture("llama-server")
    cap.server = ServerInfo(kind="llamacpp", url=server.url, version=target.engine_version)
    cap.serving = msgspec.structs.replace(target.serving, extra={**target.serving.extra,
                                                                 "speculative_config": "draft.gguf"})
    cap.cpu_only = True
    server.hits = 0
    scrape_window(cap, server.url)
    assert values(cap, S.SERVER_SPEC_ACCEPTANCE_RATE) == [pytest.approx(0.0)]
    assert values(cap, S.SERVER_SPEC_DRAFT_LEN) == [pytest.approx(234 / 84)]
    batch = build_evidence(cap).knob("max_num_batched_tokens")
    assert batch is not None and batch.known and batch.value == 2048
    d = diagnose(cap)
    (fix,) = [f for f in d.fixes if "SRV005" in f.rules]
    assert "llama.cpp: no --model-draft" in fix.action and fix.gain_low is not None and fix.gain_low > 1.0, fix
