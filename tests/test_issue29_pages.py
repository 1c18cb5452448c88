"""Issue 29, the server pages: one request per scrape on a kept-alive connection, every spelling TensorRT-LLM's
Triton backend shipped, TGI's step histograms before 1.3.3, SGLang's paused requests, and histograms cut before their
+Inf bucket. Pages are served over real HTTP on 127.0.0.1 and read by the collector."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from diagnoser.capture import Capture
from diagnoser.collectors.server_metrics import histogram_series, parse_page
from diagnoser.collectors.session import collect
from diagnoser.collectors.target import AttachTarget
from tests.serving_pages import read_two_pages as read
from tests.serving_pages import values


def reason(capture: Capture, what: str) -> str:
    return next((u.reason for u in capture.unavailable if u.what == what), "")


# --- item 6: one request per scrape ---------------------------------------------------------------------------------

_VLLM_PAGE = (b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3\n'
              b'# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{model_name="m"} 100\n')


class _KeepAliveServer:
    """A /metrics server that keeps connections alive (HTTP/1.1, as vLLM's uvicorn) and counts requests and
    connections."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                with owner.lock:
                    owner.connections += 1
                super().setup()

            def do_GET(self) -> None:
                with owner.lock:
                    owner.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(_VLLM_PAGE)))
                self.end_headers()
                self.wfile.write(_VLLM_PAGE)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def keep_alive() -> Iterator[_KeepAliveServer]:
    server = _KeepAliveServer()
    yield server
    server.close()


def test_attach_asks_for_the_page_once_per_scrape_on_one_connection(keep_alive):
    target = AttachTarget(metrics_url=keep_alive.url, server_kind="vllm", description="keep-alive server")
    capture = collect(target, duration_s=2.0, interval_s=0.25, server_interval_s=0.25, gpu=False)
    scrapes = len(values(capture, "server.running"))
    assert scrapes >= 3, capture.notes
    # Each scrape records one running-requests point; the last one (the window's end) may only refresh the
    # histograms, so at most one request more than points. The old collector sent every scrape after the first twice.
    assert scrapes <= keep_alive.requests <= scrapes + 1
    assert keep_alive.connections == 1


# --- item 7: TensorRT-LLM backend 0.6 (*_statistics) ----------------------------------------------------------------

def _trtllm_06(active: int, used: int, scheduled: int, context: int, success: int) -> str:
    """A Triton 23.11/23.12 page with tensorrtllm_backend 0.6.x: the families and label layout of the backend's own
    README example of that release (nv_trt_llm_*_statistics; no waiting, fraction or paused label values yet; no
    nv_llm_* token histograms). Numbers are ours."""
    return f"""# HELP nv_trt_llm_request_statistics TRT LLM request metrics
# TYPE nv_trt_llm_request_statistics gauge
nv_trt_llm_request_statistics{{model="tensorrt_llm",request_type="context",version="1"}} {context}
nv_trt_llm_request_statistics{{model="tensorrt_llm",request_type="scheduled",version="1"}} {scheduled}
nv_trt_llm_request_statistics{{model="tensorrt_llm",request_type="max",version="1"}} 512
nv_trt_llm_request_statistics{{model="tensorrt_llm",request_type="active",version="1"}} {active}
# HELP nv_trt_llm_runtime_memory_statistics TRT LLM runtime memory metrics
# TYPE nv_trt_llm_runtime_memory_statistics gauge
nv_trt_llm_runtime_memory_statistics{{memory_type="pinned",model="tensorrt_llm",version="1"}} 0
nv_trt_llm_runtime_memory_statistics{{memory_type="gpu",model="tensorrt_llm",version="1"}} 1610236
nv_trt_llm_runtime_memory_statistics{{memory_type="cpu",model="tensorrt_llm",version="1"}} 0
# HELP nv_trt_llm_kv_cache_block_statistics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_statistics gauge
nv_trt_llm_kv_cache_block_statistics{{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"}} 64
nv_trt_llm_kv_cache_block_statistics{{kv_cache_block_type="used",model="tensorrt_llm",version="1"}} {used}
nv_trt_llm_kv_cache_block_statistics{{kv_cache_block_type="free",model="tensorrt_llm",version="1"}} {6000 - used}
nv_trt_llm_kv_cache_block_statistics{{kv_cache_block_type="max",model="tensorrt_llm",version="1"}} 6000
# HELP nv_trt_llm_inflight_batcher_statistics TRT LLM inflight_batcher-specific metrics
# TYPE nv_trt_llm_inflight_batcher_statistics gauge
nv_trt_llm_inflight_batcher_statistics{{inflight_batcher_specific_metric="micro_batch_id",model="tensorrt_llm",version="1"}} 0
nv_trt_llm_inflight_batcher_statistics{{inflight_batcher_specific_metric="generation_requests",model="tensorrt_llm",version="1"}} {scheduled - context}
nv_trt_llm_inflight_batcher_statistics{{inflight_batcher_specific_metric="total_context_tokens",model="tensorrt_llm",version="1"}} 900
# HELP nv_trt_llm_general_statistics General TRT LLM statistics
# TYPE nv_trt_llm_general_statistics gauge
nv_trt_llm_general_statistics{{general_type="iteration_counter",model="tensorrt_llm",version="1"}} 4000
nv_trt_llm_general_statistics{{general_type="timestamp",model="tensorrt_llm",version="1"}} 1700074049
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="tensorrt_llm",version="1"}} {success}
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{{model="tensorrt_llm",version="1"}} 3
"""


def test_tensorrt_llm_backend_0_6_statistics_names_are_read():
    capture, c = read([_trtllm_06(40, 3000, 32, 2, 100), _trtllm_06(44, 4500, 36, 4, 150)])
    assert c.kind == "triton"
    assert values(capture, "server.running") == [40.0, 44.0]
    assert values(capture, "server.kv_usage") == [0.5, 0.75]  # used / max: 0.6 has no "fraction" value yet
    assert values(capture, "server.batch_size") == [32.0, 36.0]  # scheduled requests per iteration
    assert values(capture, "server.prefill_requests") == [2.0, 4.0]
    assert values(capture, "server.waiting") == [3.0, 3.0]  # no "waiting" value before 0.7: Triton's pending count
    assert values(capture, "server.requests_per_s") == [5.0]
    serving = dict(capture.serving.items())
    assert serving["block_size"] == 64 and serving["kv_cache_tokens"] == 64 * 6000 and serving["max_num_seqs"] == 512
    # The page has the backend's metrics; what it lacks is its token histograms (they came later), and that is said.
    why = reason(capture, "server.gen_tokens_per_s")
    assert "nv_llm_output_token_len_sum" in why and "lacks" not in why, why


def test_triton_without_the_backend_still_says_it_lacks_nv_trt_llm():
    page = ("# TYPE nv_inference_request_success counter\n"
            'nv_inference_request_success{{model="resnet",version="1"}} {n}\n'
            "# TYPE nv_inference_pending_request_count gauge\n"
            'nv_inference_pending_request_count{{model="resnet",version="1"}} 1\n')
    capture, c = read([page.format(n=10), page.format(n=30)])
    assert c.kind == "triton"
    assert "nv_trt_llm_* metrics, which this page lacks" in reason(capture, "server.running")


# --- item 8: TGI before 1.3.3, SGLang's paused requests, histograms cut before +Inf --------------------------------

def _tgi_13(prefill: tuple[int, int, int, float], decode: tuple[int, int, int, float], success: int) -> str:
    """A TGI 1.0-1.3.2 router page: the step time only as tgi_batch_inference_duration{method} (the forward-only
    tgi_batch_forward_duration came in 1.3.3); counters without _total and no HELP text, as metrics-exporter-
    prometheus writes them. Each tuple: observations <= 0.05 s, <= 0.5 s, all, and their sum."""
    lines = ["# TYPE tgi_batch_current_size gauge", "tgi_batch_current_size 8",
             "# TYPE tgi_queue_size gauge", "tgi_queue_size 2",
             "# TYPE tgi_request_success counter", f"tgi_request_success {success}",
             "# TYPE tgi_batch_inference_duration histogram"]
    for method, (low, mid, total, sum_s) in (("prefill", prefill), ("decode", decode)):
        lines += [f'tgi_batch_inference_duration_bucket{{method="{method}",le="0.05"}} {low}',
                  f'tgi_batch_inference_duration_bucket{{method="{method}",le="0.5"}} {mid}',
                  f'tgi_batch_inference_duration_bucket{{method="{method}",le="+Inf"}} {total}',
                  f'tgi_batch_inference_duration_sum{{method="{method}"}} {sum_s}',
                  f'tgi_batch_inference_duration_count{{method="{method}"}} {total}']
    return "\n".join(lines) + "\n"


def test_tgi_before_1_3_3_step_times_come_from_its_inference_duration():
    capture, c = read([_tgi_13((0, 10, 10, 2.0), (900, 1000, 1000, 30.0), 50),
                       _tgi_13((0, 30, 30, 6.0), (2900, 3000, 3000, 90.0), 70)])
    assert c.kind == "tgi"
    # prefill: 20 steps in (0.05, 0.5], 4.0 s in all; decode: 2000 steps, 60 s
    assert values(capture, "server.prefill_step_mean_s") == [pytest.approx(0.2)]
    assert values(capture, "server.decode_step_mean_s") == [pytest.approx(0.03)]
    assert values(capture, "server.prefill_step_p50_s") == [pytest.approx(0.05 + 0.45 * 0.5)]


def _sglang(paused: int, retracted: int) -> str:
    return ("# TYPE sglang:num_running_reqs gauge\n"
            'sglang:num_running_reqs{model_name="m"} 12\n'
            "# TYPE sglang:num_queue_reqs gauge\n"
            'sglang:num_queue_reqs{model_name="m"} 0\n'
            "# HELP sglang:num_paused_reqs The number of paused requests by async weight sync.\n"
            "# TYPE sglang:num_paused_reqs gauge\n"
            f'sglang:num_paused_reqs{{model_name="m"}} {paused}\n'
            "# TYPE sglang:num_retracted_reqs gauge\n"
            f'sglang:num_retracted_reqs{{model_name="m"}} {retracted}\n')


def test_sglang_paused_requests_are_read_apart_from_kv_pauses():
    capture, c = read([_sglang(0, 0), _sglang(6, 0)])
    assert c.kind == "sglang"
    assert values(capture, "server.paused_weight_sync") == [0.0, 6.0]
    # Paused for new weights, not for lack of KV blocks: not TensorRT-LLM's server.paused (a KV-churn rule reads it).
    assert values(capture, "server.paused") == []


_CUT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} 4
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{le="1.0",model_name="m"}} {a}
vllm:e2e_request_latency_seconds_bucket{{le="5.0",model_name="m"}} {b}
"""


def test_a_histogram_cut_before_its_inf_bucket_is_noted_by_name():
    page = _CUT.format(a=5, b=9)
    series = histogram_series(parse_page(page)[0], "vllm:e2e_request_latency_seconds")
    assert [s.cut for s in series.values()] == [True]
    capture, c = read([page, _CUT.format(a=15, b=29)])
    assert c.kind == "vllm"
    assert values(capture, "server.e2e_p50_s") == []  # no +Inf, no _count: the total is unknown
    said = [n for n in capture.notes if "vllm:e2e_request_latency_seconds" in n]
    assert len(said) == 1 and 'le="+Inf"' in said[0] and "server.e2e" in said[0], capture.notes


def test_a_histogram_with_count_but_no_inf_bucket_is_still_read_without_a_note():
    page = _CUT + 'vllm:e2e_request_latency_seconds_count{{model_name="m"}} {n}\n'
    capture, _ = read([page.format(a=5, b=9, n=10), page.format(a=15, b=29, n=30)])
    # 10 in (0, 1], 10 in (1, 5]: the median is the first bucket's top
    assert values(capture, "server.e2e_p50_s") == [pytest.approx(1.0)]
    assert not [n for n in capture.notes if 'le="+Inf"' in n]
