"""SGLang 0.5.23's /metrics page (tests/fixtures/sglang/metrics-0.5.23.prom: two scrapes 10 s apart, made by SGLang's
own collector classes) served over HTTP on 127.0.0.1 and read by the collector: the page is SGLang's, the families
the table maps from 0.5.23 land in their signals as per-second rates over the window (the comments show the
arithmetic from the fixture's increases), every family on the page is read or listed with the reason it is not, and
the older pages (tests/fixtures/serving/sglang*.prom, the older ITL name) read as before."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diagnoser.capture import Capture
from diagnoser.collectors.server_maps import SGLANG_MAP, SGLANG_NOT_READ, detect_kind
from diagnoser.collectors.server_metrics import ServerMetricsCollector
from tests.serving_pages import FIXTURES, one, scrapes, values
from tests.serving_pages import read_two_pages as read_pages

PAGE = Path(__file__).resolve().parent / "fixtures" / "sglang" / "metrics-0.5.23.prom"


def families(page: str) -> dict[str, str]:
    """Family name -> type, from the page's # TYPE lines."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, flags=re.M))


@pytest.fixture(scope="module")
def read_0523() -> tuple[Capture, ServerMetricsCollector]:
    return read_pages(scrapes(PAGE))


def test_the_0523_page_is_sglang(read_0523: tuple[Capture, ServerMetricsCollector]) -> None:
    capture, c = read_0523
    assert c.kind == "sglang" and capture.server is not None and capture.server.kind == "sglang"
    assert detect_kind(families(scrapes(PAGE)[0])) == "sglang"


def test_0523_families_land_in_their_signals(read_0523: tuple[Capture, ServerMetricsCollector]) -> None:
    capture, _ = read_0523
    # retract_decode's retractions are SGLang's preemptions: 8 -> 28 in 10 s, read as both signals
    assert values(capture, "server.preemptions_per_s") == [pytest.approx(2.0)]
    assert values(capture, "server.retractions_per_s") == [pytest.approx(2.0)]
    assert values(capture, "server.retracted") == [8.0, 20.0]
    # num_aborted_requests_total: 14 -> 20
    assert values(capture, "server.aborts_per_s") == [pytest.approx(0.6)]
    # the scheduler's per-GPU estimates: 2.8e16 -> 2.94e16 FLOP, 1.5e14 -> 1.575e14 B read, 4e12 -> 4.2e12 B written
    assert values(capture, "server.est_flops_per_s") == [pytest.approx(1.4e14)]
    assert values(capture, "server.est_read_bytes_per_s") == [pytest.approx(7.5e11)]
    assert values(capture, "server.est_write_bytes_per_s") == [pytest.approx(2e10)]
    # cached_tokens_total{cache_source="total"}: 60 requests x 800 cached tokens
    assert values(capture, "server.prompt_tokens_cached_per_s") == [pytest.approx(4800.0)]
    # inter_token_latency_seconds: 18600 tokens observed, 10 at a time, 0.022 s each
    assert one(capture, "server.itl_mean_s") == pytest.approx(0.022)
    assert 0.02 < one(capture, "server.itl_p50_s") <= 0.025 and 0.02 < one(capture, "server.itl_p99_s") <= 0.025
    # the KV pool: num_used_tokens (kv_used_tokens the same on this model) of max_total_num_tokens 100000
    assert values(capture, "server.kv_used_tokens") == [88000.0, 96000.0]
    assert values(capture, "server.kv_usage") == [pytest.approx(0.88), pytest.approx(0.96)]
    # and what was read before 0.5.23, now with is_streaming and cache_source labels (summed over them)
    assert values(capture, "server.running") == [46.0, 48.0] and values(capture, "server.waiting") == [3.0, 5.0]
    assert values(capture, "server.requests_per_s") == [pytest.approx(6.0)]
    assert values(capture, "server.prompt_tokens_per_s") == [pytest.approx(11400.0)]  # 60 x 1900
    assert values(capture, "server.gen_tokens_per_s") == [pytest.approx(1860.0)]  # 60 x 310
    assert one(capture, "server.prefix_cache_hit_rate") == pytest.approx(48000 / 114000)
    assert 0.2 < one(capture, "server.ttft_p50_s") <= 0.4
    assert one(capture, "server.queue_time_mean_s") == pytest.approx(0.15)
    assert one(capture, "server.tpot_mean_s") == pytest.approx(0.0223)
    assert one(capture, "server.e2e_mean_s") == pytest.approx(7.2)
    assert one(capture, "server.prompt_len_mean") == pytest.approx(1900.0)
    assert one(capture, "server.gen_len_mean") == pytest.approx(310.0)
    assert not values(capture, "server.spec_acceptance_rate")  # 0 without a draft model: not in use
    assert dict(capture.serving.items()) == {"engine": "sglang", "block_size": 1, "kv_cache_tokens": 100000,
                                             "max_model_len": 131072}
    whys = {u.what: u.reason for u in capture.unavailable}
    assert "server.preemptions_per_s" not in whys
    assert "per-iteration batch" in whys["server.batch_size"]


def test_every_family_on_the_0523_page_is_read_or_listed_with_a_reason() -> None:
    read = set(SGLANG_MAP.names())
    on_page = families(scrapes(PAGE)[0]) | families(scrapes(PAGE)[1])
    assert len(on_page) > 80
    unaccounted = sorted(n for n in on_page if n not in read and n not in SGLANG_NOT_READ)
    assert not unaccounted
    # the families the table newly reads are on the page as SGLang types them
    for name, kind in (("sglang:num_retracted_requests_total", "counter"),
                       ("sglang:num_aborted_requests_total", "counter"),
                       ("sglang:estimated_flops_per_gpu_total", "counter"),
                       ("sglang:estimated_read_bytes_per_gpu_total", "counter"),
                       ("sglang:estimated_write_bytes_per_gpu_total", "counter"),
                       ("sglang:inter_token_latency_seconds", "histogram"),
                       ("sglang:kv_used_tokens", "gauge")):
        assert on_page[name] == kind and name in read


def test_the_not_read_list_is_sglang_names_with_reasons_none_of_them_read() -> None:
    read = set(SGLANG_MAP.names())
    for name, why in SGLANG_NOT_READ.items():
        assert name.startswith("sglang:") and name not in read, name
        assert len(why) > 20, name
    # the ones the issue names, each with its reason
    for name in ("sglang:kv_available_tokens", "sglang:kv_evictable_tokens", "sglang:evicted_tokens_total",
                 "sglang:num_retracted_input_tokens_total", "sglang:num_retracted_output_tokens_total"):
        assert name in SGLANG_NOT_READ


def test_the_older_pages_read_as_before() -> None:
    capture, c = read_pages(scrapes(FIXTURES / "sglang.prom"))
    assert c.kind == "sglang"
    assert values(capture, "server.running") == [44.0, 48.0]
    assert values(capture, "server.retractions_per_s") == [2.0]
    assert values(capture, "server.preemptions_per_s") == [2.0]  # the same counter, read as SGLang's preemptions
    assert values(capture, "server.gen_tokens_per_s") == [2000.0]
    assert one(capture, "server.prefix_cache_hit_rate") == pytest.approx(60000 / 100000)
    assert not values(capture, "server.aborts_per_s") and not values(capture, "server.est_flops_per_s")
    underscore, c = read_pages(scrapes(FIXTURES / "sglang_underscore.prom"))
    assert c.kind == "sglang"
    assert values(underscore, "server.running") == [44.0, 48.0]
    assert values(underscore, "server.prefix_cache_hit_rate") == [0.55, 0.58]


def test_the_older_itl_name_reads_the_same_as_the_newer() -> None:
    pages = scrapes(FIXTURES / "sglang.prom")
    assert "sglang:inter_token_latency_seconds" in pages[0]
    older = [p.replace("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds") for p in pages]
    new, _ = read_pages(pages)
    old, c = read_pages(older)
    assert c.kind == "sglang"
    for stat in ("server.itl_p50_s", "server.itl_p99_s", "server.itl_mean_s"):
        assert values(old, stat) and values(old, stat) == values(new, stat), stat
