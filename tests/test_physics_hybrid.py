"""Configs whose layers differ from one another (hybrid attention/Mamba stacks, experts on some layers, chunked
attention) are refused by the key diagnoser cannot size, never sized as a uniform stack. The configs are the
published ones (tests/fixtures/published/SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diagnoser.errors import InputError
from diagnoser.physics import bundled_models, load_bundled_model, load_hf_config, model_from_hf_dict

MODELS = Path(__file__).parent / "fixtures" / "published" / "models"
DENSE: dict[str, Any] = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                         "vocab_size": 32000}


@pytest.mark.parametrize(("fixture", "keys"), [
    # ai21labs/Jamba-v0.1: attention on 4 of 32 layers (the rest Mamba), experts on every second layer; read as a
    # uniform stack it came to 91.8 B parameters for the published 52 B, and 8x the KV per token.
    ("jamba-v0.1.json", {"attn_layer_offset", "attn_layer_period", "expert_layer_offset", "expert_layer_period"}),
    # meta-llama/Llama-4-Scout-17B-16E: a shared expert and chunked attention; read as uniform it came to 10.1 B
    # active for the published 17 B, and 3.4x the KV at 128K.
    ("llama-4-scout-17b-16e.json", {"attention_chunk_size", "interleave_moe_layer_step", "intermediate_size_mlp"}),
])
def test_published_hybrid_configs_are_refused_naming_their_key(fixture: str, keys: set[str]) -> None:
    with pytest.raises(InputError) as err:
        load_hf_config(MODELS / fixture)
    message = str(err.value)
    assert any(f" has {key} (" in message for key in keys), message
    assert "cannot size" in message and message.endswith(".") and message.count(". ") == 0


@pytest.mark.parametrize("key", ["mamba_d_state", "ssm_state_size", "cross_attention_layer_step",
                                 "moe_layer_freq", "layers_block_type", "hybrid_override_pattern",
                                 "global_attn_layer_indices"])
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
        if path.name in {"jamba-v0.1.json", "llama-4-scout-17b-16e.json"}:
            continue
        assert json.loads(path.read_text()) and load_hf_config(path).params > 0
