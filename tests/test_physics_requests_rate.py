"""Issue 44, item 3: a rate measured over whole requests (each prompt prefilled, then the output generated: what
vLLM's benchmark_latency and TensorRT-LLM's throughput tables report) is not a decode rate. `theory
--tokens-per-s-of requests` takes it against the requests' ceiling, prefill priced, and turns it into the decode
step's share; read as decode tokens/s, the prefill's time is taken for per-step overhead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from diagnoser.cli import theory
from diagnoser.physics import (
    decode_efficiency,
    decode_workload,
    generation_ceiling_tokens_per_s,
    generation_workload,
    get_gpu,
    load_bundled_model,
)

MODELS = Path(__file__).parent / "fixtures" / "published" / "models"


def _theory(*args: str) -> dict[str, Any]:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    result = CliRunner().invoke(app, ["theory", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_decode_efficiency_keeps_the_time_beyond_the_roofline_per_decode_step() -> None:
    model, h100 = load_bundled_model("llama-2-70b"), get_gpu("h100-sxm")
    requests = generation_workload(model, h100, 96, 2048, 128, dtype="fp8", kv_dtype="fp8", tp=2)
    step = decode_workload(model, h100, 96, 2048, dtype="fp8", kv_dtype="fp8", tp=2)
    share = 0.5
    overhead = (requests.ceiling_s / share - requests.attained_s) / requests.steps
    assert decode_efficiency(requests, share, step) == pytest.approx(step.ceiling_s / (step.attained_s + overhead))


def test_a_whole_request_rate_prices_its_prefill() -> None:
    # TensorRT-LLM's Llama-2-70B FP8 on 2 H100s: 612 tokens/s at batch 96, 2,048 in / 128 out (results.json
    # trt-h100-l70b-b96-2048-128), a whole-request rate. Read as decode tokens/s it is 11 % of the decode ceiling;
    # over whole requests it is 52 % of theirs, the prefill of 96 x 2,048 tokens priced, and the decode steps run at
    # about 21 %: twice the share, so half the overhead a batch what-if would keep.
    args = ["--model", "llama-2-70b", "--gpu", "h100-sxm", "--tp", "2", "--dtype", "fp8", "--kv-dtype", "fp8",
            "--batch", "96", "--context", "2048", "--gen-tokens", "128", "--tokens-per-s", "612", "--vs-batch", "48"]
    as_decode = _theory(*args)
    as_requests = _theory(*args, "--tokens-per-s-of", "requests")
    assert as_decode["measured"]["efficiency"] == pytest.approx(0.105, abs=0.005)
    ceiling = generation_ceiling_tokens_per_s(load_bundled_model("llama-2-70b"), get_gpu("h100-sxm"), 96, 2048, 128,
                                              dtype="fp8", kv_dtype="fp8", tp=2)
    share = 612 / ceiling
    assert f"{share:.0%} of their ceiling" in as_requests["measured"]["from"]
    assert "whole requests" in as_requests["measured"]["from"]
    assert as_requests["measured"]["efficiency"] == pytest.approx(0.21, abs=0.01)
    (before,), (after,) = as_decode["what_ifs"], as_requests["what_ifs"]
    assert after["realised_speedup"] > before["realised_speedup"]  # halving the batch loses less overhead share


def test_a_batch_what_if_over_whole_requests_on_the_oracle_rows() -> None:
    # Oracle's Llama 3.1 405B on 8 MI300X (results.json oci-405b-mi300x-*): 468 tokens/s at batch 16 and 798 at 32,
    # whole requests of 128 in / 128 out: x1.71 measured.
    data = _theory("--model", str(MODELS / "llama-3.1-405b.json"), "--gpu", "mi300x", "--tp", "8", "--dtype", "fp8",
                   "--batch", "16", "--context", "128", "--gen-tokens", "128", "--tokens-per-s", "468",
                   "--tokens-per-s-of", "requests", "--vs-batch", "32")
    (what_if,) = data["what_ifs"]
    assert what_if["realised_speedup"] == pytest.approx(798 / 468, rel=0.25)


def test_a_rate_above_the_requests_ceiling_is_refused() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    result = CliRunner().invoke(app, ["theory", "--model", "llama-2-7b", "--batch", "8", "--context", "2048",
                                      "--tokens-per-s", "1e6", "--tokens-per-s-of", "requests"])
    assert result.exit_code == 2 and "--gen-tokens" in result.output
    bad = CliRunner().invoke(app, ["theory", "--model", "llama-2-7b", "--tokens-per-s", "10", "--tokens-per-s-of",
                                   "prefill"])
    assert bad.exit_code == 2 and "decode or requests" in bad.output
