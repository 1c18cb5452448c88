"""Configs whose layers differ from one another: Llama 4 (experts on some layers, a shared expert, chunked
attention) read in full; hybrid attention/Mamba stacks and unknown per-layer patterns refused by the key diagnoser
cannot size, never sized as a uniform stack. The configs are the published ones
(tests/fixtures/published/SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diagnoser.errors import InputError
from diagnoser.physics import (
    AttentionModelInfo,
    bundled_models,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_bundled_model,
    load_hf_config,
    model_from_hf_dict,
)

MODELS = Path(__file__).parent / "fixtures" / "published" / "models"
DENSE: dict[str, Any] = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                         "vocab_size": 32000}


@pytest.mark.parametrize(("fixture", "keys"), [
    # ai21labs/Jamba-v0.1: attention on 4 of 32 layers (the rest Mamba), experts on every second layer; read as a
    # uniform stack it came to 91.8 B parameters for the published 52 B, and 8x the KV per token.
    ("jamba-v0.1.json", {"attn_layer_offset", "attn_layer_period", "expert_layer_offset", "expert_layer_period"}),
])
def test_published_hybrid_configs_are_refused_naming_their_key(fixture: str, keys: set[str]) -> None:
    with pytest.raises(InputError) as err:
        load_hf_config(MODELS / fixture)
    message = str(err.value)
    assert any(f" has {key} (" in message for key in keys), message
    assert "cannot size" in message and message.endswith(".") and message.count(". ") == 0


def test_llama_4_scout_read_in_full() -> None:
    """meta-llama/Llama-4-Scout-17B-16E, published as 109 B total (the vision encoder included) and 17 B active:
    48 layers, each with 16 routed experts (top 1) and a shared expert of 8,192; read as a uniform stack it came to
    10.1 B active (the shared expert missed). KV: 2 x 8 heads x 128 x 2 bytes = 4,096 B a layer-token on all 48
    layers, but the 36 chunked layers (3 of every 4) hold at most a chunk of 8,192 tokens: at 128K, 12 x 131,072 +
    36 x 8,192 layer-tokens, 3.4x less than 48 x 131,072."""
    model = load_hf_config(MODELS / "llama-4-scout-17b-16e.json")
    assert model.params == pytest.approx(109e9, rel=0.02)
    assert model.active_params == pytest.approx(17e9, rel=0.03)
    # by hand: embeddings and lm_head, attention, norms, 48 x (17 MLPs of 3 x 5,120 x 8,192 + router) / top-1 + shared
    mlp = 3 * 5120 * 8192
    attention = 5120 * 40 * 128 * 2 + 2 * 5120 * 8 * 128
    base = 2 * 202048 * 5120 + 48 * (attention + 2 * 5120) + 5120
    assert model.params == base + 48 * (17 * mlp + 5120 * 16)
    assert model.active_params == base + 48 * (2 * mlp + 5120 * 16)
    assert isinstance(model, AttentionModelInfo) and (model.sliding_window, model.sliding_layers) == (8192, 36)
    assert kv_bytes_per_token(model) == 48 * 4096
    assert kv_bytes_per_sequence(model, 131072) == (12 * 131072 + 36 * 8192) * 4096
    assert 48 * 131072 * 4096 / kv_bytes_per_sequence(model, 131072) == pytest.approx(3.4, abs=0.05)


def test_llama_4_interleaved_experts_and_dense_width() -> None:
    """Maverick's pattern: experts on every second layer (interleave_moe_layer_step 2: layers 1, 3, ...), the
    others a dense MLP of intermediate_size_mlp; an explicit no_rope_layers sets the chunked layers."""
    cfg = json.loads((MODELS / "llama-4-scout-17b-16e.json").read_text())
    text = {**cfg["text_config"], "interleave_moe_layer_step": 2, "no_rope_layers": [1] * 40 + [0] * 8}
    model = model_from_hf_dict({**cfg, "text_config": text})
    scout = load_hf_config(MODELS / "llama-4-scout-17b-16e.json")
    mlp, dense = 3 * 5120 * 8192, 3 * 5120 * 16384
    assert scout.params - model.params == 24 * (17 * mlp + 5120 * 16) - 24 * dense
    assert model.sliding_layers == 40  # type: ignore[attr-defined]
    with pytest.raises(InputError, match="no_rope_layers"):
        model_from_hf_dict({**cfg, "text_config": {**text, "no_rope_layers": [1, 0]}})


@pytest.mark.parametrize("key", ["mamba_d_state", "ssm_state_size", "cross_attention_layer_step",
                                 "moe_layer_freq", "layers_block_type", "hybrid_override_pattern",
                                 "global_attn_layer_indices", "attention_chunk_size",
                                 "interleave_moe_layer_step"])
def test_an_unknown_layer_pattern_key_is_refused_by_name(key: str) -> None:
    with pytest.raises(InputError, match=f" has {key} \\(") as err:
        model_from_hf_dict({**DENSE, key: 2}, label="x.json")
    assert str(err.value).startswith("x.json has ")


@pytest.mark.parametrize("value", [None, [], False])
def test_a_uniform_default_passes(value: object) -> None:
    """A pattern key at its uniform default (null, an empty list) does not change the shape."""
    model = model_from_hf_dict({**DENSE, "no_rope_layers": value, "attention_chunk_size": value})
    assert model.params == model_from_hf_dict(DENSE).params


def test_bundled_and_published_configs_still_load() -> None:
    for name in bundled_models():
        assert load_bundled_model(name).params > 0
    for path in MODELS.glob("*.json"):
        if path.name == "jamba-v0.1.json":
            continue
        assert json.loads(path.read_text()) and load_hf_config(path).params > 0
