"""Server-metrics parsing and mapping: documented vLLM examples, old and new names, other servers, the demo's own
endpoint, and endpoints that fail. Scrapes go over real HTTP to real local servers."""

from __future__ import annotations

import contextlib
import math
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from diagnoser.capture import Capture, new_capture
from diagnoser.collectors.server_metrics import (
    MetricsError,
    ServerMetricsCollector,
    _buckets,
    _total,
    detect_kind,
    histogram_quantile,
    parse_samples,
    probe,
    quantile_in_bucket,
)
from diagnoser.collectors.session import Sampler, run_sampler
from diagnoser.demo.loadgen import run_load
from tests.reference import TRICKLE_SERVER
from tests.serving_pages import values

VLLM_DOC = Path(__file__).resolve().parent / "fixtures" / "serving" / "vllm_docs_metrics_example_excerpt.txt"


class Endpoint:
    """A real HTTP server on 127.0.0.1 that answers GET with whatever body (and status) it currently holds."""

    def __init__(self, body: str = "", status: int = 200) -> None:
        self.body, self.status, self.hits = body, status, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hits += 1
                data = owner.body.encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    ep = Endpoint()
    yield ep
    ep.close()


def scrapes(ep: Endpoint, kind: str | None, bodies: list[str], times: list[float]) -> tuple[Capture, ServerMetricsCollector]:
    """Drive a collector by hand: one scrape per (body, time), then the end of the window."""
    capture = new_capture("test")
    collector = ServerMetricsCollector(ep.url, kind)
    collector.start(capture)
    for body, t in zip(bodies, times, strict=True):
        ep.body = body
        collector.sample(t)
    collector.stop(times[-1])  # no extra scrape: the last sample is at the end
    return capture, collector


def _doc_blocks() -> list[str]:
    text = VLLM_DOC.read_text()
    blocks = re.split(r"^---- .*$", text, flags=re.M)
    return ["\n".join(l for l in b.splitlines() if l.strip() != "..." and not l.startswith("$ ")) for b in blocks]


def test_documented_vllm_example_parses_and_maps(endpoint):
    first, _, http_block = _doc_blocks()
    samples = parse_samples(first)
    assert detect_kind(samples) == "vllm"
    assert _total(samples, ("vllm:num_requests_running",)) == 8.0
    assert _total(samples, ("vllm:generation_tokens_total",)) == 27453.0
    assert _total(samples, ("vllm:request_success_total",)) == 132.0  # stop 1 + length 131 + abort 0
    base, buckets = _buckets(samples, ("vllm:time_to_first_token_seconds",))
    assert buckets[math.inf] == 140.0  # the excerpt elides le="+Inf"; _count stands in for it
    # p50: rank 70 falls in (0.02, 0.04] holding 13..97
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.02 + 0.02 * (70 - 13) / (97 - 13))
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.08 + 0.02 * (138.6 - 138) / (140 - 138))
    assert quantile_in_bucket(0.5, buckets) == (pytest.approx(0.02 + 0.02 * (70 - 13) / (97 - 13)), 0.02, 0.04)
    # All in the first bucket: p50 and p99 sit at 0.5 and 0.99 of its bound, whatever the observations were.
    assert quantile_in_bucket(0.5, {0.01: 7.0, 0.025: 7.0, math.inf: 7.0}) == (0.005, 0.0, 0.01)
    assert quantile_in_bucket(0.99, {0.01: 7.0, 0.025: 7.0, math.inf: 7.0}) == (pytest.approx(0.0099), 0.0, 0.01)
    # the HTTP middleware block has no TYPE lines: still parsed, as untyped samples
    assert _total(parse_samples(http_block), ("http_requests_total",)) == 201.0

    # The same scrape twice: gauges recorded, rates zero, and no latency claimed for a window with no requests.
    capture, _ = scrapes(endpoint, None, [first, first], [0.0, 1.0])
    assert values(capture, "server.running") == [8.0, 8.0]
    assert values(capture, "server.gen_tokens_per_s") == [0.0]
    assert values(capture, "server.ttft_p50_s") == []
    (ttft,) = [u for u in capture.unavailable if u.what == "server.ttft_p50_s"]
    assert "no request" in ttft.reason


def vllm_text(*, prompt: float, gen: float, steps: float, ttft: dict[str, float], itl_name: str =
              "vllm:inter_token_latency_seconds", kv_name: str = "vllm:kv_cache_usage_perc",
              preempt: float = 0.0) -> str:
    """A vLLM exposition with two engines (label engine="0"/"1"), in the format prometheus_client writes."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 5.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
        f"# TYPE {kv_name} gauge",
        f'{kv_name}{{engine="0",model_name="m"}} 0.5',
        f'{kv_name}{{engine="1",model_name="m"}} 0.9',
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}',
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}',
        "# TYPE vllm:num_preemptions_total counter",
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempt}',
        "# TYPE vllm:iteration_tokens_total histogram",
        f'vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} {steps}',
        f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}',
        f'vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} {gen}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for le, count in ttft.items():
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {count}')
    lines.append(f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {ttft["+Inf"]}')
    lines += [f"# TYPE {itl_name} histogram",
              f'{itl_name}_bucket{{engine="0",le="0.05",model_name="m"}} {steps}',
              f'{itl_name}_bucket{{engine="0",le="+Inf",model_name="m"}} {steps}',
              f'{itl_name}_count{{engine="0",model_name="m"}} {steps}',
              "# TYPE python_gc_objects_collected_total counter",
              'python_gc_objects_collected_total{generation="0"} 12345.0']
    return "\n".join(lines) + "\n"


def test_counters_become_rates_and_histograms_give_window_quantiles(endpoint):
    bodies = [
        vllm_text(prompt=1000, gen=100, steps=10, ttft={"0.1": 5, "0.5": 5, "+Inf": 5}),
        vllm_text(prompt=1500, gen=300, steps=20, ttft={"0.1": 5, "0.5": 30, "+Inf": 55}, preempt=2),
        vllm_text(prompt=2500, gen=600, steps=40, ttft={"0.1": 5, "0.5": 55, "+Inf": 105}, preempt=2),
    ]
    capture, collector = scrapes(endpoint, "vllm", bodies, [0.0, 1.0, 2.0])
    assert collector.kind == "vllm"
    assert values(capture, "server.running") == [8.0] * 3  # summed over engines
    assert values(capture, "server.waiting") == [2.0] * 3
    assert values(capture, "server.kv_usage") == [pytest.approx(0.7)] * 3  # a ratio: averaged
    assert values(capture, "server.prompt_tokens_per_s") == [500.0, 1000.0]
    assert values(capture, "server.gen_tokens_per_s") == [200.0, 300.0]
    assert values(capture, "server.preemptions_per_s") == [2.0, 0.0]
    assert values(capture, "server.batch_size") == [20.0, 15.0]  # generated tokens per engine step
    # the window's 100 new first tokens: 50 in (0.1, 0.5], 50 above 0.5
    assert values(capture, "server.ttft_p50_s") == [pytest.approx(0.5)]
    assert values(capture, "server.ttft_p99_s") == [0.5]  # in +Inf: the highest finite bound, as Prometheus
    assert values(capture, "server.itl_p50_s") == [pytest.approx(0.025)]
    # Each quantile's series names the bucket it was interpolated in, for `compare` (a value inside one bucket
    # says where the rank falls, not the latency).
    bucket = {s.name: s.bucket() for s in capture.series if s.name.endswith(("_p50_s", "_p99_s"))}
    assert bucket["server.ttft_p50_s"] == (0.1, 0.5) and bucket["server.ttft_p99_s"] == (0.5, math.inf)
    assert {s.source for s in capture.series} == {"server"}
    # requests finished: neither vllm:request_success_total nor e2e latency in this scrape -> said, not zeroed
    (req,) = [u for u in capture.unavailable if u.what == "server.requests_per_s"]
    assert "vllm:request_success_total" in req.reason


def test_old_vllm_names_still_map(endpoint):
    body = vllm_text(prompt=1, gen=1, steps=1, ttft={"+Inf": 1}, itl_name="vllm:time_per_output_token_seconds",
                     kv_name="vllm:gpu_cache_usage_perc")
    later = vllm_text(prompt=2, gen=9, steps=5, ttft={"+Inf": 2}, itl_name="vllm:time_per_output_token_seconds",
                      kv_name="vllm:gpu_cache_usage_perc")
    capture, _ = scrapes(endpoint, None, [body, later], [0.0, 0.5])
    assert values(capture, "server.kv_usage") == [pytest.approx(0.7)] * 2
    assert values(capture, "server.itl_p50_s") == [pytest.approx(0.025)]
    assert values(capture, "server.gen_tokens_per_s") == [16.0]


def test_other_servers_by_their_documented_names(endpoint):
    sglang = ("sglang:num_running_reqs{tp_rank=\"0\"} 12\nsglang:num_queue_reqs{tp_rank=\"0\"} 4\n"
              "sglang:token_usage{tp_rank=\"0\"} 0.93\nsglang:generation_tokens_total{tp_rank=\"0\"} {g}\n")
    capture, c = scrapes(endpoint, None, [sglang.replace("{g}", "10"), sglang.replace("{g}", "40")], [0.0, 2.0])
    assert c.kind == "sglang"
    assert (values(capture, "server.running"), values(capture, "server.waiting")) == ([12.0] * 2, [4.0] * 2)
    assert values(capture, "server.kv_usage") == [0.93] * 2 and values(capture, "server.gen_tokens_per_s") == [15.0]

    tgi = "tgi_batch_current_size 6\ntgi_queue_size 9\ntgi_request_generated_tokens_sum {g}\n"
    capture, c = scrapes(endpoint, None, [tgi.replace("{g}", "0"), tgi.replace("{g}", "50")], [0.0, 1.0])
    assert c.kind == "tgi"
    assert values(capture, "server.batch_size") == [6.0, 6.0] and values(capture, "server.waiting") == [9.0] * 2
    (ttft,) = [u for u in capture.unavailable if u.what == "server.ttft_p50_s"]
    assert ttft.reason == "TGI exposes no time-to-first-token metric"

    triton = ('nv_inference_count{{model="m",version="1"}} {n}\nnv_inference_exec_count{{model="m",version="1"}} {e}\n'
              'nv_inference_request_success{{model="m",version="1"}} {n}\n')
    capture, c = scrapes(endpoint, None, [triton.format(n=100, e=10), triton.format(n=400, e=30)], [0.0, 1.0])
    assert c.kind == "triton"
    assert values(capture, "server.batch_size") == [15.0]  # inference count / execution count, per interval
    assert values(capture, "server.requests_per_s") == [300.0]


def test_counter_reset_skips_the_interval_and_says_so(endpoint):
    bodies = [vllm_text(prompt=1000, gen=10, steps=1, ttft={"+Inf": 1}),
              vllm_text(prompt=10, gen=20, steps=2, ttft={"+Inf": 2}),
              vllm_text(prompt=110, gen=30, steps=3, ttft={"+Inf": 3})]
    capture, _ = scrapes(endpoint, "vllm", bodies, [0.0, 1.0, 2.0])
    assert values(capture, "server.prompt_tokens_per_s") == [100.0]
    assert any("went backwards" in n and "server.prompt_tokens_per_s" in n for n in capture.notes)


def test_the_name_filter_keeps_only_mapped_families():
    text = vllm_text(prompt=1, gen=1, steps=1, ttft={"+Inf": 1})
    kept = parse_samples(text, ("vllm:num_requests_running", "vllm:time_to_first_token_seconds"))
    assert set(kept) == {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket",
                         "vllm:time_to_first_token_seconds_count"}
    assert "python_gc_objects_collected_total" in parse_samples(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoints_that_fail_give_one_sentence(endpoint):
    endpoint.body = "<html><body>Welcome to nginx!</body></html>\n"
    with pytest.raises(MetricsError, match=r"did not return Prometheus metrics \(invalid metric name"):
        probe(endpoint.url)
    endpoint.body, endpoint.status = "not found", 404
    with pytest.raises(MetricsError, match=r"answered HTTP 404"):
        probe(endpoint.url)
    endpoint.body, endpoint.status = "", 200
    with pytest.raises(MetricsError, match="returned no metrics"):
        probe(endpoint.url)
    refused = f"http://127.0.0.1:{_free_port()}/metrics"
    with pytest.raises(MetricsError, match=r"nothing answers at .* \(connection refused\)"):
        probe(refused)
    # Mid-window: three failed scrapes in a row and the endpoint is given up, with what was read before kept.
    endpoint.body = vllm_text(prompt=1, gen=1, steps=1, ttft={"+Inf": 1})
    capture, collector = scrapes(endpoint, None, [endpoint.body, "garbage here\n", "x y z\n", "<html>"],
                                 [0.0, 1.0, 2.0, 3.0])
    assert values(capture, "server.running") == [8.0]
    assert any("stopped answering 3.0 s into the window" in n for n in capture.notes)
    hits = endpoint.hits
    collector.sample(4.0)
    assert endpoint.hits == hits  # given up: no more scrapes


def test_metrics_of_an_unknown_program_are_not_server_signals(endpoint):
    endpoint.body = "process_cpu_seconds_total 12.5\nup 1\n"
    capture, collector = scrapes(endpoint, None, [endpoint.body, endpoint.body], [0.0, 1.0])
    assert not capture.series
    (u,) = capture.unavailable
    assert u.what == "server.*" and "none from vLLM, SGLang, TGI, Triton or NVIDIA NIM" in u.reason


@pytest.fixture(scope="module")
def demo_server() -> Iterator[tuple[subprocess.Popen, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "diagnoser.demo.server", "--port", "0", "--kv-tokens", "512"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"ready on (http://[\d.]+:\d+)", line)
    assert found, f"demo server did not start: {line!r}"
    yield proc, found.group(1)
    proc.terminate()
    proc.wait(30)


def test_demo_server_endpoint_maps_to_every_vllm_signal_it_has(demo_server):
    proc, url = demo_server
    kind, samples = probe(f"{url}/metrics")
    assert kind == "demo" and "vllm:kv_cache_usage_perc" in samples
    capture = new_capture("demo")
    collector = ServerMetricsCollector(f"{url}/metrics", kind, period_s=0.5)
    stop = threading.Event()
    load = threading.Thread(target=run_load, args=(url,),
                            kwargs={"concurrency": 8, "duration_s": 60, "max_tokens": (8, 24), "stop": stop})
    load.start()
    try:
        sampler = Sampler(capture, [collector], duration_s=3.0, interval_s=0.1)
        run_sampler(sampler)
    finally:
        stop.set()
        load.join(30)
    for name in ("server.running", "server.waiting", "server.kv_usage", "server.prompt_tokens_per_s",
                 "server.gen_tokens_per_s", "server.requests_per_s", "server.batch_size", "server.ttft_p50_s",
                 "server.ttft_p99_s", "server.itl_p50_s", "server.itl_p99_s", "server.preemptions_per_s"):
        assert values(capture, name), f"{name} missing; unavailable: {capture.unavailable}"
    assert max(values(capture, "server.gen_tokens_per_s")) > 0
    assert 0.0 <= min(values(capture, "server.kv_usage")) <= max(values(capture, "server.kv_usage")) <= 1.0
    assert values(capture, "server.ttft_p50_s")[0] <= values(capture, "server.ttft_p99_s")[0]
    assert capture.unavailable == []
    assert proc.poll() is None


def test_an_endpoint_that_trickles_is_cut_off_by_one_deadline():
    # Each byte arrives well inside the socket timeout (1 s), so only the deadline on the whole answer (5 x the
    # timeout) ends the read; without it `diagnoser attach --port` hung on such a server.
    from diagnoser.collectors.server_metrics import Fetcher, fetch_metrics

    server = subprocess.Popen([sys.executable, "-c", TRICKLE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}/metrics"
        with ThreadPoolExecutor(1) as pool:
            for call in (lambda: fetch_metrics(url, timeout=1.0), lambda: Fetcher(url, timeout=1.0).get(),
                         lambda: probe(url, timeout=1.0)):
                # A generous bound on a hang, not a speed check: without the deadline these never return.
                with pytest.raises(MetricsError, match=r"did not finish answering within 5 s"):
                    pool.submit(call).result(timeout=120)
    finally:
        server.kill()
        server.wait()


def test_trace_cost_compares_the_rate_while_tracing_with_the_window_before(endpoint):
    from diagnoser.tracing.cost import measure

    endpoint.body = vllm_text(prompt=1000, gen=5000, steps=100, ttft={"+Inf": 1})

    def trace() -> str:  # the server keeps serving while it is traced: its counters move on
        endpoint.body = vllm_text(prompt=1100, gen=5300, steps=110, ttft={"+Inf": 1})
        return "trace.json"

    result, spent = measure(trace, endpoint.url, {"gen_tokens": 400.0, "prompt_tokens": 100.0})
    assert result == "trace.json"
    assert spent.during["gen_tokens"] == pytest.approx(300 / spent.seconds)
    assert spent.during["prompt_tokens"] == pytest.approx(100 / spent.seconds)
    assert spent.loss("gen_tokens") == pytest.approx(1 - spent.during["gen_tokens"] / 400.0)
    assert spent.headline_rate() == "gen_tokens"
    assert "generated tokens/s" in spent.sentence() and "in the window before" in spent.sentence()
    assert spent.to_dict()["loss"]["gen_tokens"] == spent.loss("gen_tokens")


def test_trace_cost_says_why_it_could_not_compare(endpoint):
    from diagnoser.tracing.cost import measure

    _, no_url = measure(lambda: None, None, {"gen_tokens": 10.0})
    assert no_url.loss("gen_tokens") is None and "no /metrics" in no_url.sentence()
    refused = f"http://127.0.0.1:{_free_port()}/metrics"
    _, down = measure(lambda: None, refused, {"gen_tokens": 10.0})
    assert "connection refused" in down.why_not and "not measured" in down.sentence()
    endpoint.body = vllm_text(prompt=1, gen=1, steps=1, ttft={"+Inf": 1})
    _, idle = measure(lambda: None, endpoint.url, {})
    assert idle.loss("gen_tokens") is None and "served nothing in the window before" in idle.sentence()


class _Redirect(BaseHTTPRequestHandler):
    location = ""

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("relative", [False, True])
def test_a_redirect_is_refused_naming_where_it_points(endpoint, relative):
    # Followed, it read another host's or port's page and reported it as this server's.
    endpoint.body = vllm_text(prompt=1, gen=1, steps=1, ttft={"+Inf": 1})
    handler = type("Handler", (_Redirect,), {"location": "/elsewhere" if relative else endpoint.url})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    where = f"http://127.0.0.1:{httpd.server_address[1]}/elsewhere" if relative else endpoint.url
    try:
        from diagnoser.collectors.server_metrics import Fetcher, fetch_metrics

        for call in (lambda: fetch_metrics(url, timeout=5.0), lambda: Fetcher(url, timeout=5.0).get(),
                     lambda: probe(url, timeout=5.0)):
            with pytest.raises(MetricsError) as caught:
                call()
            assert str(caught.value) == (f"{url} redirects to {where}; diagnoser does not follow redirects: give "
                                         "that URL with --metrics-url if it is the server's.")
        assert endpoint.hits == 0
    finally:
        httpd.shutdown()
        httpd.server_close()


class _HeaderTrickle:
    """A real socket server on 127.0.0.1 that sends its status line and headers one byte at a time, each well inside
    the client's socket timeout, and never gets to the body."""

    HEAD = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: 1\r\n" * 10_000

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/metrics"
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            for i in range(len(self.HEAD)):
                if self.stop.wait(0.1):
                    return
                conn.sendall(self.HEAD[i:i + 1])
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.server.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


def test_headers_that_trickle_are_cut_off_by_the_same_deadline():
    # The body's deadline did not cover the status line and headers: `attach` hung on such a server.
    import time

    from diagnoser.collectors.server_metrics import Fetcher, fetch_metrics

    server = _HeaderTrickle()
    pool = ThreadPoolExecutor(1)
    try:
        for call in (lambda: fetch_metrics(server.url, timeout=0.5), lambda: Fetcher(server.url, 0.5).get(),
                     lambda: probe(server.url, timeout=0.5)):
            start = time.monotonic()
            # Generous bounds on a hang, not a speed check: without the deadline these ran for minutes.
            with pytest.raises(MetricsError) as caught:
                pool.submit(call).result(timeout=60)
            assert str(caught.value) == f"{server.url} did not finish answering within 2.5 s."
            assert time.monotonic() - start < 30
    finally:
        server.close()  # first: a call still waiting on it (a regression) then ends
        pool.shutdown(wait=True)


def test_a_ratio_given_as_a_percent_is_read_as_one(endpoint):
    """An SGLang page gave cache_hit_rate 87.75 (a percent) where other releases give 0.8775: the HTML report showed
    an 8775 % prefix-cache hit rate. A ratio above 1 is a percent, and the capture says so."""
    page = ('sglang:num_running_reqs{tp_rank="0"} 12\nsglang:num_queue_reqs{tp_rank="0"} 4\n'
            'sglang:token_usage{tp_rank="0"} 93.0\nsglang:cache_hit_rate{tp_rank="0"} 87.75\n'
            'sglang:prompt_tokens_total{tp_rank="0"} 10\n')
    capture, _ = scrapes(endpoint, None, [page, page], [0.0, 2.0])
    assert values(capture, "server.kv_usage") == [0.93] * 2
    assert values(capture, "server.prefix_cache_hit_rate") == [pytest.approx(0.8775)] * 2
    assert any("server.prefix_cache_hit_rate: the page gives a percent" in n for n in capture.notes)
    ratio = page.replace("93.0", "0.93").replace("87.75", "0.8775")
    capture, _ = scrapes(endpoint, None, [ratio, ratio], [0.0, 2.0])
    assert values(capture, "server.kv_usage") == [0.93] * 2 and not any("percent" in n for n in capture.notes)
