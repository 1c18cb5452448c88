"""Attention layouts that change what the KV cache holds: multi-head latent attention (MLA) and sliding windows.

ModelInfo describes grouped-query attention: every layer keeps K and V of kv_heads x head_dim elements for every
token of the context. Two layouts keep less, and sizing them that way is off by up to 25x:

- MLA (DeepSeek-V2/V3): a layer keeps one compressed latent of kv_lora_rank elements and the decoupled rope key of
  qk_rope_head_dim elements a token, shared by all heads (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1; vLLM's
  and SGLang's MLA backends cache exactly these kv_lora_rank + qk_rope_head_dim elements). Under tensor parallelism
  every GPU keeps the whole latent: it is not split by heads.
- Sliding windows (Mistral 7B v0.1, Gemma 2/3, Phi-3): a sliding layer keeps at most `sliding_window` tokens, so a
  sequence of c tokens holds full layers x c + sliding layers x min(c, window) tokens of K and V.

AttentionModelInfo carries these fields; physics.models returns one for such a config, and plain ModelInfo
otherwise. Its MLA base fields are set so that the plain formula 2 x layers x kv_heads x head_dim still gives the
latent's size (kv_heads 1, head_dim (kv_lora_rank + qk_rope_head_dim) / 2) where only ModelInfo's fields survive (a
saved capture keeps those alone); a sliding window does not survive that way.
"""

from __future__ import annotations

import math

from diagnoser.capture import ModelInfo


class AttentionModelInfo(ModelInfo, kw_only=True):
    """A ModelInfo whose attention keeps less than K and V of every token in every layer (see the module doc)."""

    # MLA: the latent and the rope key a layer caches per token; the q/k (no rope part) and v head sizes.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Attention's parameters over all layers (projections and the latent's norm), where the config gives them
    # (MLA): what data-parallel attention replicates on every GPU (physics.llm.dp_attention_sequences).
    attention_params: float | None = None
    # Sliding windows: tokens a sliding layer keeps, and how many of the layers slide (the rest attend to all).
    sliding_window: int | None = None
    sliding_layers: int = 0


def mla_dims(model: ModelInfo) -> tuple[int, int, int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim) of an MLA model, else None."""
    if isinstance(model, AttentionModelInfo) and model.kv_lora_rank and model.qk_rope_head_dim is not None:
        return (model.kv_lora_rank, model.qk_rope_head_dim, model.qk_nope_head_dim or 0,
                model.v_head_dim or model.head_dim or 0)
    return None


def sliding(model: ModelInfo) -> tuple[int, int] | None:
    """(window, sliding layers) of a model some of whose layers slide, else None."""
    if isinstance(model, AttentionModelInfo) and model.sliding_window and model.sliding_layers > 0:
        return model.sliding_window, min(model.sliding_layers, model.layers or model.sliding_layers)
    return None


def kv_elements_per_layer(model: ModelInfo, tp: int = 1) -> float:
    """KV-cache elements one token adds to one layer on one GPU: kv_lora_rank + qk_rope_head_dim for MLA (kept
    whole on every GPU), else 2 (K and V) x max(1, ceil(kv_heads / tp)) x head_dim. Needs the shape (caller checks)."""
    found = mla_dims(model)
    if found is not None:
        return float(found[0] + found[1])
    assert model.kv_heads and model.head_dim
    return 2.0 * max(1, math.ceil(model.kv_heads / tp)) * model.head_dim


def held_tokens(model: ModelInfo, context: float) -> float:
    """Tokens of KV a sequence of `context` tokens holds, averaged over the layers: context, or for a model with
    sliding layers (full layers x context + sliding layers x min(context, window)) / layers."""
    found = sliding(model)
    if found is None or not model.layers:
        return context
    window, slid = found
    return ((model.layers - slid) * context + slid * min(context, window)) / model.layers


def _causal_pairs(tokens: float, window: float | None) -> float:
    """Query-key pairs of causal attention over a prompt of `tokens`: s(s+1)/2, or with a window of w keys
    w(w+1)/2 + (s - w) x w once s > w."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) / 2
    return window * (window + 1) / 2 + (tokens - window) * window


def _head_dims(model: ModelInfo, decode: bool) -> tuple[float, float] | None:
    """Per query head, the length of a query-key dot product and of a value row, or None without the shape.

    MLA decodes in the absorbed form (the up-projections folded into q and the output): each head scores against
    the cached latent and rope key (kv_lora_rank + qk_rope_head_dim) and sums latent rows (kv_lora_rank); prefill
    expands K and V per head (qk_nope + qk_rope, and v_head_dim). DeepSeek-V2 paper section 2.1.3; vLLM's MLA."""
    found = mla_dims(model)
    if found is not None:
        rank, rope, nope, v = found
        return (rank + rope, rank) if decode else (nope + rope, v)
    if not model.head_dim:
        return None
    return float(model.head_dim), float(model.head_dim)


def decode_attention_flops(model: ModelInfo, context: float) -> float:
    """FLOPs of one new token attending to `context` earlier ones: 2 x heads x (qk + v) per key and layer, over
    the keys each layer keeps (sliding layers at most the window); 0 when the shape is unknown."""
    dims = _head_dims(model, decode=True)
    if not (model.layers and model.heads and dims):
        return 0.0
    keys = held_tokens(model, context) * model.layers
    return 2.0 * model.heads * (dims[0] + dims[1]) * keys


def prefill_attention_flops(model: ModelInfo, tokens: float) -> float:
    """FLOPs of causal attention over one prompt of `tokens`: 2 x heads x (qk + v) per query-key pair and layer;
    a sliding layer's queries see at most the window. 0 when the shape is unknown."""
    dims = _head_dims(model, decode=False)
    if not (model.layers and model.heads and dims):
        return 0.0
    found = sliding(model)
    window, slid = found if found is not None else (None, 0)
    pairs = (model.layers - slid) * _causal_pairs(tokens, None) + slid * _causal_pairs(tokens, window)
    return 2.0 * model.heads * (dims[0] + dims[1]) * pairs


def describe(model: ModelInfo) -> str:
    """The attention layout in a few words, "" for plain grouped-query attention."""
    found = mla_dims(model)
    if found is not None:
        return f"MLA: {found[0]} latent + {found[1]} rope elements a layer"
    window = sliding(model)
    if window is not None:
        return f"sliding window of {window[0]:,} tokens on {window[1]} of {model.layers} layers"
    return ""
