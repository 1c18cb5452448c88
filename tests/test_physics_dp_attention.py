"""Issue 44, item 8: tensor-parallel attention keeps an MLA latent on every GPU, data-parallel attention (SGLang's
--enable-dp-attention; its guide "DP, DPA and sgl-router") keeps each sequence's latent on one GPU and a whole copy
of attention's weights on each. `theory` says both. DeepSeek-V3's config (tests/fixtures/published/models)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from diagnoser.cli import theory
from diagnoser.physics import (
    attention_weight_bytes,
    dp_attention_gains,
    dp_attention_sequences,
    get_gpu,
    load_hf_config,
    max_concurrent_sequences,
    usable_memory_bytes,
    weight_bytes,
)

MODELS = Path(__file__).parent / "fixtures" / "published" / "models"
V3 = MODELS / "deepseek-v3.json"


def _v3():  # type: ignore[no-untyped-def]
    return load_hf_config(V3)


def test_deepseek_v3_attention_weights_from_its_config() -> None:
    # q_a 7168 x 1536 (+ its norm), q_b 1536 x 128 x (128 + 64), kv_a 7168 x (512 + 64) (+ the latent's norm),
    # kv_b 512 x 128 x (128 + 128), o 128 x 128 x 7168; 61 layers: 11.4 B parameters, about 11.4 GB at fp8.
    per_layer = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168)
    model = _v3()
    assert model.attention_params == 61 * per_layer
    found = attention_weight_bytes(model, "fp8")
    assert found is not None and 11.4e9 < found < 11.5e9


def test_dp_attention_holds_about_tp_times_the_sequences_less_the_replicated_weights() -> None:
    model, h200 = _v3(), get_gpu("h200")
    tp_only = max_concurrent_sequences(model, h200, 4096, tp=8, dtype="fp8")
    assert tp_only == 181  # every GPU keeps every sequence's 70,272 B/token latent
    dp = dp_attention_sequences(model, h200, 4096, tp=8, dtype="fp8")
    # Each GPU: 90 % of 141 GiB, less 1/8 of the weights, less 7/8 of attention's weights it now holds whole,
    # over 70,272 B x 4,096 tokens a sequence; eight GPUs.
    attention = attention_weight_bytes(model, "fp8")
    assert attention is not None
    free = usable_memory_bytes(h200) - weight_bytes(model, "fp8") / 8 - attention * 7 / 8
    assert dp == 8 * int(free // (70272 * 4096))
    # 8 x 181 = 1,448 would forget the replicated attention weights (10 GB a GPU): about 1,170 fit.
    assert dp is not None and 1100 < dp < 8 * tp_only


def test_dp_attention_is_only_offered_where_tensor_parallelism_duplicates_kv() -> None:
    assert dp_attention_gains(_v3(), 8) and not dp_attention_gains(_v3(), 1)
    from diagnoser.physics import load_bundled_model

    assert not dp_attention_gains(load_bundled_model("llama-3.1-70b"), 8)  # 8 KV heads over 8 GPUs: no copy
    assert dp_attention_gains(load_bundled_model("llama-3.1-70b"), 16)  # 8 KV heads over 16 GPUs: each twice


def test_theory_says_both() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    args = ["theory", "--model", str(V3), "--gpu", "h200", "--tp", "8", "--context", "4096"]
    text = CliRunner().invoke(app, args, terminal_width=200)
    assert text.exit_code == 0, text.output
    flat = " ".join(text.output.split())
    assert "<= 181 of 4,096 tokens" in flat and "tensor-parallel attention" in flat
    assert "data-parallel attention" in flat and "--enable-dp-attention" in flat
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert data["max_concurrent_sequences"] == 181
    assert 1100 < data["max_concurrent_sequences_dp_attention"] < 1448
    plain = json.loads(CliRunner().invoke(app, ["theory", "--model", "llama-3.1-70b", "--tp", "8", "--json"]).stdout)
    assert plain["max_concurrent_sequences_dp_attention"] is None
