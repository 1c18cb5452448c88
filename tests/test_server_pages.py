"""Each engine's /metrics page (tests/fixtures/serving, two scrapes 10 s apart), served over real HTTP on 127.0.0.1
and read by the collector: every mapped signal, with rates, window ratios and histogram quantiles checked against
values computed by hand from the fixtures' increases (the comments show the arithmetic)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from diagnoser.capture import Capture, ServerInfo, new_capture
from diagnoser.collectors.server_metrics import (
    ServerMetricsCollector,
    histogram_quantile,
    histogram_series,
    parse_page,
    probe,
    window_histogram,
)
from tests.serving_pages import FIXTURES, PageServer, one, scrapes, values


def read(fixture: str, *, hint: str | None = None, path: str = "/metrics") -> tuple[Capture, ServerMetricsCollector]:
    """One scrape at t=0 (the fixture's first page) and one at t=10 (its second), then the end of the window."""
    server = PageServer(scrapes(FIXTURES / fixture), path=path, switch_after=1).serve_in_thread()
    try:
        capture = new_capture("test")
        capture.server = ServerInfo(kind=hint or "unknown", url=server.url)
        collector = ServerMetricsCollector(server.url, hint)
        collector.start(capture)
        collector.sample(0.0)
        collector.sample(10.0)
        collector.stop(10.0)  # the final scrape refreshes the histograms only (no duplicate points)
    finally:
        server.close()
    return capture, collector


def served(capture: Capture) -> dict[str, object]:
    """The capture's serving configuration as name -> value (extra keys flattened in)."""
    return dict(capture.serving.items())


def test_vllm_v1_two_engines_every_signal_and_hand_computed_quantiles():
    capture, c = read("vllm_v1_dp2.prom")
    assert c.kind == "vllm" and capture.server.kind == "vllm"
    assert values(capture, "server.running") == [64.0, 64.0]  # 30 + 34, then 32 + 32: engines summed
    assert values(capture, "server.waiting") == [12.0, 12.0]
    assert values(capture, "server.waiting_deferred") == [0.0, 2.0]
    assert values(capture, "server.kv_usage") == [pytest.approx(0.85), pytest.approx(0.9)]  # a ratio: averaged
    assert values(capture, "server.prompt_tokens_per_s") == [8000.0]  # 2 x 40,000 tokens in 10 s
    assert values(capture, "server.gen_tokens_per_s") == [2000.0]
    assert values(capture, "server.preemptions_per_s") == [1.0]  # (5 + 5) / 10 s
    assert values(capture, "server.requests_per_s") == [20.0]
    assert values(capture, "server.batch_size") == [10.0]  # 20,000 generated tokens / 2,000 engine steps
    assert one(capture, "server.prefix_cache_hit_rate") == pytest.approx(0.1)  # 8,000 hits / 80,000 queried
    # TTFT in the window: engine 0 has 50 in (0.1, 0.25] and 50 in (0.25, 0.5]; engine 1 has 100 in (0.5, 0.75].
    # The 2,000 first tokens before the window sit in (0.02, 0.04] and must not count.
    assert one(capture, "server.ttft_p50_s") == pytest.approx(0.5)  # rank 100 = top of (0.25, 0.5]
    assert one(capture, "server.ttft_p99_s") == pytest.approx(0.5 + 0.25 * 98 / 100)  # rank 198 in (0.5, 0.75]
    assert one(capture, "server.ttft_mean_s") == pytest.approx((30.0 + 62.5) / 200)
    # queue: 100 in (0, 0.3] (sum 20) and 100 in (0.3, 0.5] (sum 40)
    assert one(capture, "server.queue_time_p50_s") == pytest.approx(0.3)
    assert one(capture, "server.queue_time_p99_s") == pytest.approx(0.3 + 0.2 * 98 / 100)
    assert one(capture, "server.queue_time_mean_s") == pytest.approx(0.3)
    assert one(capture, "server.prefill_time_mean_s") == pytest.approx(0.1)
    assert one(capture, "server.prefill_time_p50_s") == pytest.approx(0.3 * 100 / 200)
    assert one(capture, "server.decode_time_p50_s") == pytest.approx(2.5 + 2.5 * 100 / 200)
    assert one(capture, "server.decode_time_mean_s") == pytest.approx(4.0)
    assert one(capture, "server.inference_time_mean_s") == pytest.approx(4.1)
    assert one(capture, "server.e2e_mean_s") == pytest.approx(4.4)
    # inter-token: 9,900 in (0.01, 0.025] and 9,900 in (0.025, 0.05]
    assert one(capture, "server.itl_p50_s") == pytest.approx(0.025)
    assert one(capture, "server.itl_p99_s") == pytest.approx(0.025 + 0.025 * (19602 - 9900) / 9900)
    assert one(capture, "server.itl_mean_s") == pytest.approx(594.0 / 19800)
    assert one(capture, "server.tpot_mean_s") == pytest.approx(0.03)
    assert one(capture, "server.prefill_time_per_token_mean_s") == pytest.approx(0.0005)
    # token histograms: prompts in (200, 500], generations in (50, 100], max_tokens in (1000, 2000]
    assert one(capture, "server.prompt_len_p50") == pytest.approx(200 + 300 * 100 / 200)
    assert one(capture, "server.prompt_len_mean") == pytest.approx(400.0)
    assert one(capture, "server.gen_len_p99") == pytest.approx(50 + 50 * 198 / 200)
    assert one(capture, "server.gen_len_mean") == pytest.approx(100.0)
    assert one(capture, "server.max_tokens_p50") == pytest.approx(1500.0)
    assert one(capture, "server.max_tokens_mean") == pytest.approx(2000.0)
    assert one(capture, "server.max_gen_len_mean") == pytest.approx(100.0)
    assert one(capture, "server.params_n_mean") == pytest.approx(1.0)
    # tokens per engine step: 1,500 steps in (32, 64], 500 in (64, 128]
    assert one(capture, "server.iteration_tokens_p50") == pytest.approx(32 + 32 * 1000 / 1500)
    assert one(capture, "server.iteration_tokens_p99") == pytest.approx(64 + 64 * 480 / 500)
    assert one(capture, "server.iteration_tokens_mean") == pytest.approx(50.0)
    # cache_config_info read as the serving configuration
    assert served(capture) == {"engine": "vllm", "block_size": 16, "kv_cache_dtype": "fp8_e4m3",
                               "gpu_memory_utilization": 0.92, "kv_cache_tokens": 262144, "prefix_caching": True,
                               "num_gpu_blocks": "16384", "data_parallel_engines": "2", "cpu_offload_gb": "0.0"}
    assert c.config.kv_cache_dtype == "fp8_e4m3" and c.config.kv_block_size == 16
    assert capture.unavailable == [] and capture.notes == []


def test_vllm_v1_lora_adapters_and_speculative_decoding():
    capture, _ = read("vllm_v1_lora_spec.prom")
    # 18,000 accepted of 30,000 drafted in 10,000 drafts of 3 tokens
    assert one(capture, "server.spec_acceptance_rate") == pytest.approx(0.6)
    assert one(capture, "server.spec_mean_accept_len") == pytest.approx(1 + 18000 / 10000)
    assert one(capture, "server.spec_draft_len") == pytest.approx(3.0)
    # lora_requests_info keeps one series per combination ever seen; the newest (largest timestamp) is now:
    # 4 adapters running (sql, chat, code, math) and 1 waiting (summ) at both scrapes
    assert values(capture, "server.lora_running_adapters") == [4.0, 4.0]
    assert values(capture, "server.lora_waiting_adapters") == [1.0, 1.0]
    assert capture.serving.extra["max_loras"] == "4" and capture.serving.extra["lora_adapters_seen"] == "5"
    assert capture.serving.prefix_caching is False
    assert capture.serving.kv_cache_dtype == ""  # cache_dtype="auto": the model's dtype, said by nobody here
    assert capture.serving.kv_cache_tokens == 27000 * 16


def test_vllm_v0_names_swapping_cpu_cache_and_gauges():
    capture, _ = read("vllm_v0.prom")
    assert values(capture, "server.kv_usage") == [0.97, 0.99]  # gpu_cache_usage_perc
    assert values(capture, "server.cpu_kv_usage") == [0.2, 0.4]
    assert values(capture, "server.swapped") == [1.0, 3.0]
    assert values(capture, "server.prefix_cache_hit_rate") == [0.33, 0.35]  # V0's own gauge, per scrape
    assert values(capture, "server.spec_acceptance_rate") == [0.55, 0.55]
    assert values(capture, "server.preemptions_per_s") == [3.0]
    # time_per_output_token_seconds is V0's inter-token histogram: 19,950 new in (0.025, 0.05], sum 700
    assert one(capture, "server.itl_mean_s") == pytest.approx(700.0 / 19950)
    assert one(capture, "server.ttft_p50_s") == pytest.approx(0.75 + 0.25 * 25 / 50)
    assert not values(capture, "server.lora_running_adapters")  # max_lora="0": LoRA is off
    assert capture.serving.extra["swap_space_bytes"] == "4294967296" and capture.serving.extra["num_cpu_blocks"] == "9362"
    assert "max_loras" not in capture.serving.extra


def test_sglang_colon_names_retractions_cache_hits_and_constants():
    capture, c = read("sglang.prom")
    assert c.kind == "sglang"
    assert values(capture, "server.running") == [44.0, 48.0] and values(capture, "server.waiting") == [9.0, 12.0]
    assert values(capture, "server.kv_used_tokens") == [110000.0, 120000.0]
    assert values(capture, "server.retracted") == [0.0, 3.0]
    assert values(capture, "server.retractions_per_s") == [2.0]  # 20 retractions in 10 s
    assert values(capture, "server.gen_tokens_per_s") == [2000.0]  # the counter wins over the gen_throughput gauge
    assert one(capture, "server.prefix_cache_hit_rate") == pytest.approx(60000 / 100000)  # cached / prompt tokens
    assert not values(capture, "server.spec_acceptance_rate")  # SGLang reports 0 without a draft model
    assert one(capture, "server.queue_time_mean_s") == pytest.approx(0.1)
    assert one(capture, "server.ttft_p50_s") == pytest.approx(0.1 * 50 / 60)  # 60 in (0, 0.1], 40 in (0.2, 0.4]
    assert one(capture, "server.prompt_len_mean") == pytest.approx(1000.0)
    assert served(capture) == {"engine": "sglang", "block_size": 1, "kv_cache_tokens": 144870, "max_model_len": 32768}
    # a retraction is SGLang's preemption: the same counter gives both signals
    assert values(capture, "server.preemptions_per_s") == [2.0]


def test_sglang_underscore_spelling_is_sglang():
    capture, c = read("sglang_underscore.prom")
    assert c.kind == "sglang"
    assert values(capture, "server.running") == [44.0, 48.0]
    assert values(capture, "server.gen_tokens_per_s") == [2000.0]
    # no cached-token counter on this build: the cache_hit_rate gauge stands in, per scrape
    assert values(capture, "server.prefix_cache_hit_rate") == [0.55, 0.58]
    assert one(capture, "server.ttft_mean_s") == pytest.approx(0.15)
    assert served(capture) == {"engine": "sglang", "kv_cache_tokens": 144870}


def test_tgi_histograms_with_method_labels_and_reserved_tokens():
    capture, c = read("tgi.prom")
    assert c.kind == "tgi"
    assert values(capture, "server.batch_reserved_tokens") == [90000.0, 96000.0]
    assert values(capture, "server.requests_per_s") == [10.0]  # tgi_request_success, no _total suffix
    assert one(capture, "server.prefill_step_mean_s") == pytest.approx(0.1)  # method="prefill" only
    assert one(capture, "server.decode_step_mean_s") == pytest.approx(0.02)
    assert one(capture, "server.itl_mean_s") == pytest.approx(0.2)
    assert one(capture, "server.queue_time_mean_s") == pytest.approx(2.0)
    assert one(capture, "server.max_tokens_mean") == pytest.approx(2000.0)
    assert one(capture, "server.gen_len_mean") == pytest.approx(80.0)


def test_triton_tensorrt_llm_counts_each_request_once_and_reads_kv_blocks():
    capture, c = read("triton_trtllm.prom")
    assert c.kind == "triton"
    assert values(capture, "server.running") == [46.0, 52.0] and values(capture, "server.waiting") == [6.0, 9.0]
    assert values(capture, "server.kv_usage") == [0.8335, 0.9457]
    assert values(capture, "server.paused") == [0.0, 4.0]
    assert values(capture, "server.batch_size") == [40.0, 44.0]  # scheduled requests, not inference/exec counts
    # four models of the ensemble each count the request; only tensorrt_llm's counter is read: 100 in 10 s
    assert values(capture, "server.requests_per_s") == [10.0]
    assert one(capture, "server.queue_time_mean_s") == pytest.approx(5.0e7 / 100 * 1e-6)  # tensorrt_llm only
    # first response (ms): 50 in (100, 500], 50 in (500, 2000]
    assert one(capture, "server.ttft_p50_s") == pytest.approx(0.5)
    assert one(capture, "server.ttft_mean_s") == pytest.approx(0.775)
    assert one(capture, "server.gen_tokens_per_s") == pytest.approx(2000.0)  # nv_llm_output_token_len_sum
    assert served(capture) == {"engine": "triton", "block_size": 64, "kv_cache_tokens": 64 * 6239,
                               "max_num_seqs": 64, "num_gpu_blocks": "6239"}


def test_nim_documented_names_on_v1_metrics():
    capture, c = read("nim.prom", path="/v1/metrics")
    assert c.kind == "nim"
    assert values(capture, "server.running") == [20.0, 24.0]
    assert values(capture, "server.kv_usage") == [0.41, 0.47]
    assert values(capture, "server.requests_per_s") == [10.0]
    assert one(capture, "server.ttft_mean_s") == pytest.approx(0.2)
    assert one(capture, "server.itl_mean_s") == pytest.approx(0.02)
    assert served(capture) == {"engine": "nim", "max_num_seqs": 64}


# --- histograms of several label sets --------------------------------------------------------------------------

TWO_LORAS = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{model_name="base",le="0.1"}} {b1}
vllm:time_to_first_token_seconds_bucket{{model_name="base",le="0.5"}} {b2}
vllm:time_to_first_token_seconds_bucket{{model_name="base",le="1.0"}} {b3}
vllm:time_to_first_token_seconds_bucket{{model_name="base",le="+Inf"}} {b3}
vllm:time_to_first_token_seconds_count{{model_name="base"}} {b3}
vllm:time_to_first_token_seconds_sum{{model_name="base"}} {bs}
vllm:time_to_first_token_seconds_bucket{{model_name="sql-lora",le="0.25"}} {l1}
vllm:time_to_first_token_seconds_bucket{{model_name="sql-lora",le="1.0"}} {l2}
vllm:time_to_first_token_seconds_bucket{{model_name="sql-lora",le="+Inf"}} {l2}
vllm:time_to_first_token_seconds_count{{model_name="sql-lora"}} {l2}
vllm:time_to_first_token_seconds_sum{{model_name="sql-lora"}} {ls}
"""


def test_label_sets_with_different_buckets_are_combined_on_shared_bounds():
    first = TWO_LORAS.format(b1=0, b2=0, b3=0, bs=0, l1=0, l2=0, ls=0)
    last = TWO_LORAS.format(b1=80, b2=90, b3=100, bs=20.0, l1=0, l2=100, ls=60.0)
    a = histogram_series(parse_page(first)[0], "vllm:time_to_first_token_seconds")
    b = histogram_series(parse_page(last)[0], "vllm:time_to_first_token_seconds")
    combined = window_histogram(a, b)
    # Summed per bound as before, le=0.1 held 80 and le=0.25 held 0: the "cumulative" series fell. Only 1.0 and
    # +Inf are bounds both label sets have: 200 observations, all <= 1.0.
    assert combined.buckets == {1.0: 200.0, math.inf: 200.0}
    assert combined.dropped_bounds == 3
    counts = [combined.buckets[k] for k in sorted(combined.buckets)]
    assert counts == sorted(counts)
    assert histogram_quantile(0.5, combined.buckets) == pytest.approx(0.5)  # rank 100 of 200 in (0, 1.0]
    assert combined.sum / combined.count == pytest.approx(0.4)


def test_a_falling_bucket_series_is_repaired_and_said(tmp_path):
    page = ("# TYPE vllm:inter_token_latency_seconds histogram\n"
            'vllm:inter_token_latency_seconds_bucket{le="0.1"} 50\n'
            'vllm:inter_token_latency_seconds_bucket{le="0.2"} 40\n'
            'vllm:inter_token_latency_seconds_bucket{le="+Inf"} 100\n')
    series = histogram_series(parse_page(page)[0], "vllm:inter_token_latency_seconds")
    (s,) = series.values()
    assert s.repaired and s.buckets == {0.1: 50.0, 0.2: 50.0, math.inf: 100.0}


# --- damaged and surprising pages ------------------------------------------------------------------------------

@pytest.fixture
def page_server() -> Iterator[PageServer]:
    server = PageServer(["", ""], switch_after=1).serve_in_thread()
    yield server
    server.close()


def test_one_malformed_line_is_skipped_and_noted_not_the_scrape(page_server):
    first, second = scrapes(FIXTURES / "vllm_v1_dp2.prom")
    # a truncated line and one carrying a terminal escape, in the middle of real pages
    bad = '\x1b]52;c;aGk=\x07 12\nvllm:num_requests_running{model_name="m",engine="0" 3\n'
    page_server.pages = [first.replace("# HELP vllm:kv_cache", bad + "# HELP vllm:kv_cache"),
                         second.replace("# HELP vllm:kv_cache", bad + "# HELP vllm:kv_cache")]
    capture = new_capture("test")
    collector = ServerMetricsCollector(page_server.url)
    collector.start(capture)
    collector.sample(0.0)
    collector.sample(10.0)
    collector.stop(10.0)
    assert values(capture, "server.running") == [64.0, 64.0]
    assert values(capture, "server.prompt_tokens_per_s") == [8000.0]
    (note,) = [n for n in capture.notes if "malformed" in n]
    assert "up to 2 malformed line(s) per scrape, skipped" in note
    assert "\x1b" not in note and "\\x1b" in note  # the escape is shown, not sent to the terminal
    kind, samples = probe(page_server.url)  # a probe reads the page too
    assert kind == "vllm" and "vllm:num_requests_running" in samples


def test_the_right_prefix_but_none_of_the_mapped_names_says_so(page_server):
    page = "# TYPE vllm:some_future_gauge gauge\nvllm:some_future_gauge 3\nvllm:other_new_total 7\n"
    page_server.pages = [page, page]
    capture = new_capture("test")
    collector = ServerMetricsCollector(page_server.url)
    collector.start(capture)
    for t in (0.0, 1.0, 2.0):
        collector.sample(t)
    collector.stop(2.0)
    assert collector.kind == "vllm" and collector.pages == 4
    whys = {u.what: u.reason for u in capture.unavailable}
    assert "serves vLLM metrics, but none of the names diagnoser reads" in whys["server.*"]
    assert not any("fewer than two scrapes" in r or "stopped answering" in r for r in whys.values())
    assert not any("stopped answering" in n for n in capture.notes)
    assert "vllm:num_requests_running" in whys["server.running"]


def test_the_page_decides_the_kind_not_the_hint(page_server):
    page_server.pages = scrapes(FIXTURES / "tgi.prom")
    capture = new_capture("test")
    capture.server = ServerInfo(kind="vllm", url=page_server.url)
    collector = ServerMetricsCollector(page_server.url, "vllm")  # the command line said vllm
    collector.start(capture)
    collector.sample(0.0)
    collector.sample(10.0)
    collector.stop(10.0)
    assert collector.kind == "tgi" and capture.server.kind == "tgi"
    assert values(capture, "server.waiting") == [11.0, 15.0]
    assert any("looked like vLLM" in n and "TGI" in n for n in capture.notes)
