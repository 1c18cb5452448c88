"""`diagnoser attach --port` against each engine's recorded page, served by a real HTTP server process on 127.0.0.1:
the kind comes from the page, every signal the page carries is in the saved capture, and the window's histograms give
the hand-computed quantiles (the page server answers the first scrape and attach's probe with the fixture's first
page, then its second)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from diagnoser.capture import Capture, load
from tests.serving_pages import FIXTURES

PY = sys.executable


@contextmanager
def page_process(fixture: str, *extra: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([PY, "-m", "tests.serving_pages", str(FIXTURES / fixture), *extra],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())  # printed once it listens
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def attach(port: int, saved: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "diagnoser", "attach", "--port", str(port), "--duration", "2.5", "--save", saved,
                           "--json"], capture_output=True, text=True, timeout=180, env={**os.environ},
                          check=False)


def names(capture: Capture) -> set[str]:
    return {s.name for s in capture.series if s.values}


def last(capture: Capture, name: str) -> float:
    return capture.series_named(name)[0].values[-1]


CASES = {
    # fixture: (page path, kind, signals that must be read, one window value checked by hand)
    "vllm_v1_dp2.prom": ("/metrics", "vllm", {"server.running", "server.waiting", "server.kv_usage",
                         "server.prefix_cache_hit_rate", "server.queue_time_p50_s", "server.prefill_time_mean_s",
                         "server.ttft_p99_s", "server.itl_p50_s", "server.gen_len_mean", "server.max_tokens_mean",
                         "server.iteration_tokens_mean", "server.gen_tokens_per_s", "server.batch_size"},
                         ("server.ttft_p50_s", 0.5)),
    "vllm_v1_lora_spec.prom": ("/metrics", "vllm", {"server.spec_acceptance_rate", "server.spec_mean_accept_len",
                               "server.lora_running_adapters", "server.lora_waiting_adapters"},
                               ("server.spec_acceptance_rate", 0.6)),
    "vllm_v0.prom": ("/metrics", "vllm", {"server.swapped", "server.cpu_kv_usage", "server.kv_usage",
                     "server.prefix_cache_hit_rate", "server.itl_mean_s"}, ("server.ttft_mean_s", 0.8)),
    "sglang.prom": ("/metrics", "sglang", {"server.running", "server.retracted", "server.retractions_per_s",
                    "server.prefix_cache_hit_rate", "server.queue_time_mean_s", "server.kv_used_tokens"},
                    ("server.prefix_cache_hit_rate", 0.6)),
    "sglang_underscore.prom": ("/metrics", "sglang", {"server.running", "server.waiting", "server.kv_usage",
                               "server.prefix_cache_hit_rate"}, ("server.ttft_mean_s", 0.15)),
    "tgi.prom": ("/metrics", "tgi", {"server.batch_reserved_tokens", "server.prefill_step_mean_s",
                 "server.max_tokens_p50", "server.queue_time_p99_s"}, ("server.decode_step_mean_s", 0.02)),
    "triton_trtllm.prom": ("/metrics", "triton", {"server.running", "server.kv_usage", "server.paused",
                           "server.prefill_requests", "server.queue_time_mean_s"}, ("server.ttft_mean_s", 0.775)),
    "nim.prom": ("/v1/metrics", "nim", {"server.running", "server.kv_usage", "server.ttft_p50_s",
                 "server.prompt_len_mean"}, ("server.itl_mean_s", 0.02)),
}


@pytest.mark.slow
@pytest.mark.parametrize("fixture", sorted(CASES))
def test_attach_reads_every_engine_page(fixture, tmp_path):
    path, kind, expected, (checked, value) = CASES[fixture]
    with page_process(fixture, "--path", path) as (_proc, port):
        saved = tmp_path / "w.dgc"
        result = attach(port, str(saved))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    capture = load(saved)
    assert capture.server is not None and capture.server.kind == kind
    assert capture.server.url.endswith(f":{port}{path}")
    assert expected <= names(capture), expected - names(capture)
    assert last(capture, checked) == pytest.approx(value)
    assert not [n for n in capture.notes if "stopped answering" in n]


@pytest.mark.slow
def test_a_process_that_says_vllm_but_serves_tgi_is_read_as_tgi(tmp_path):
    with page_process("tgi.prom", "--pretend", "vllm") as (_proc, port):  # "vllm" on the command line
        saved = tmp_path / "w.dgc"
        result = attach(port, str(saved))
    assert result.returncode == 0, result.stderr
    capture = load(saved)
    assert "vllm" in " ".join(capture.process.cmdline)
    assert capture.server.kind == "tgi"
    assert {"server.waiting", "server.batch_size", "server.queue_time_mean_s"} <= names(capture)
