"""Model shapes: from a Hugging Face config.json, from a bundled config, or from a few numbers on the command line.

Parameter counts are computed from the shape, matrix by matrix, rather than read from a model card, so that any
config gives a count (Llama-2-7b comes to 6,738,415,616, its published size).
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from diagnoser.capture import Capture, ModelInfo, ServingConfig
from diagnoser.errors import InputError
from diagnoser.fileio import read_text_bounded
from diagnoser.physics.attention import AttentionModelInfo
from diagnoser.physics.precision import bytes_per_element, normalise_dtype

# Bundled configs (diagnoser/data/models/<stem>.json) and the Hugging Face repository each was copied from.
BUNDLED_SOURCES: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "mistral-7b-v0.1": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b-v0.1": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen3-8b-base": "Qwen/Qwen3-8B-Base",
    "gpt-j-6b": "EleutherAI/gpt-j-6b",
}

# Architectures with a gated MLP (gate, up, down: three matrices) whatever their activation is called.
_GATED_TYPES = frozenset({
    "llama", "llama4_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi3", "deepseek_v2", "deepseek_v3", "olmo", "olmo2", "granite", "cohere", "internlm2", "yi",
})
_GATED_ACTS = frozenset({"silu", "swish", "swiglu"})
# GPT-2 style: LayerNorm with bias, biases on every linear layer, learned position embeddings, 2-matrix MLP.
_CLASSIC_TYPES = frozenset({"gpt2", "gpt_bigcode", "opt"})
# Architectures with a bias on q, k and v only.
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})
# Architectures with an RMSNorm of head_dim weights on each head's q and on k.
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})
# GPT-J: attention and MLP in parallel after one LayerNorm (with bias), MLP and lm_head biases, rotary positions.
_PARALLEL_TYPES = frozenset({"gptj"})
# Falcon (transformers' FalconConfig; "RefinedWebModel" is the 7B's original name, "RefinedWeb" the 40B's): attention
# and MLP in parallel after one LayerNorm (with bias; two, ln_attn and ln_mlp, in the new decoder architecture),
# 4 x hidden GELU MLP, biases only where `bias` says.
_FALCON_TYPES = frozenset({"falcon", "refinedwebmodel", "refinedweb"})
# Multi-query attention (one KV head) unless the config says multi_query false: transformers' default for these.
_MULTI_QUERY_DEFAULT = frozenset({"falcon", "refinedwebmodel", "gpt_bigcode"})

# Sliding-window layouts (physics.attention), as transformers' modelling code reads the config. Every layer slides:
_ALL_LAYERS_SLIDE = frozenset({"mistral", "mixtral", "phi3", "phimoe", "starcoder2"})
# Gemma 2 alternates, layer 0 sliding (Gemma2DecoderLayer: is_sliding = not bool(layer_idx % 2)).
_ALTERNATE_SLIDE = frozenset({"gemma2"})
# Every sliding_window_pattern-th layer is full, the rest slide ((layer_idx + 1) % sliding_window_pattern != 0).
_PATTERN_SLIDE = frozenset({"gemma3", "gemma3_text", "cohere2"})
# Qwen's use_sliding_window with max_window_layers: transformers' docs and code have read it both ways (the bottom
# layers sliding, or those from max_window_layers up), so it is refused unless layer_types says; off by default.
_QWEN_SLIDE = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_5_vl"})
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
# Multi-head latent attention (physics.attention): sized from kv_lora_rank and qk_rope_head_dim, which these need.
_MLA_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
_MLA_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


# Keys of layouts diagnoser does not size: each says some layers differ from the rest (hybrid attention/Mamba
# stacks, MoE on some layers only, chunked attention, a dense MLP of another width), so a config holding one is
# refused by name rather than sized as a uniform stack (Jamba read that way has 92 B parameters for its 52 B, and
# 8x the KV per token; Llama 4 Scout misses its shared expert and its chunked attention).
_UNREAD_KEYS: dict[str, str] = {
    "attn_layer_period": "attention on every n-th layer only, Mamba on the rest",
    "attn_layer_offset": "attention on some layers only, Mamba on the rest",
    "expert_layer_period": "experts on every n-th layer only",
    "expert_layer_offset": "experts on some layers only",
    "layers_block_type": "a per-layer block type (attention or Mamba)",
    "hybrid_override_pattern": "a per-layer block pattern (attention, Mamba or MLP)",
    "interleave_moe_layer_step": "experts on every n-th layer, a shared expert and a dense MLP of another width",
    "moe_layers": "experts on the listed layers only",
    "intermediate_size_mlp": "a dense MLP of another width on the layers without experts",
    "attention_chunk_size": "chunked attention on some layers",
    "no_rope_layers": "a per-layer attention pattern (chunked or global)",
    "full_attn_idxs": "a per-layer attention pattern",
    "attn_layer_indices": "attention on the listed layers only",
}
# Llama 4 (transformers' Llama4TextConfig), read in full: experts on the layers interleave_moe_layer_step picks
# (or moe_layers lists), each MoE layer with one shared expert of intermediate_size beside the routed ones, a dense
# MLP of intermediate_size_mlp on the others, and chunked attention (attention_chunk_size) on the layers whose
# no_rope_layers entry is 1 (by default 3 of every 4: every 4th layer is global, without RoPE).
_LLAMA4_TYPES = frozenset({"llama4_text"})
_LLAMA4_KEYS = frozenset({"interleave_moe_layer_step", "moe_layers", "intermediate_size_mlp", "attention_chunk_size",
                          "no_rope_layers"})
# Any other key of this form names a per-layer pattern too, or a state-space (Mamba/SSM) block, and is refused.
_PATTERN_KEY = re.compile(r"(^|_)(mamba|ssm|linear_attn)(_|$)|layer_(period|offset|step|freq|pattern|indices|idxs)$"
                          r"|block_types?$|_pattern$")
# Pattern-like keys diagnoser reads (sliding-window layouts) or that do not change the shape.
_READ_PATTERN_KEYS = frozenset({"sliding_window_pattern"})


def _refuse_unread_layout(cfg: dict[str, Any], label: str) -> None:
    """Refuse a config with a layer pattern diagnoser does not size, naming its key (a null or an empty list is
    the uniform default and passes)."""
    read = _LLAMA4_KEYS if str(cfg.get("model_type", "")).lower() in _LLAMA4_TYPES else frozenset()
    for key, value in cfg.items():
        if value is None or value == [] or value is False or key in _READ_PATTERN_KEYS or key in read:
            continue
        what = _UNREAD_KEYS.get(key)
        if what is None and _PATTERN_KEY.search(key):
            what = "a per-layer pattern or state-space block"
        if what is not None:
            raise InputError(f"{label} has {key} ({what}), which diagnoser cannot size yet: read as a uniform "
                             "stack its parameters and KV cache would be wrong, so it is refused.")


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _positive_int(cfg: dict[str, Any], label: str, *keys: str, required: bool = True) -> int | None:
    value = _first(cfg, *keys)
    if value is None:
        if required:
            raise InputError(f"{label} has no {keys[0]}; expected a Hugging Face config.json for a language model.")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{label}: {keys[0]} must be a positive integer, not {value!r}.")
    return value


def _bits_dtype(bits: object, kind: str = "int") -> str:
    """The precision of `bits`-bit weights of `kind` int or float; "" for what is not one we size."""
    if isinstance(bits, bool):
        return ""
    if bits == 8:
        return "fp8" if kind == "float" else "int8"
    if bits == 4:
        return "fp4" if kind == "float" else "int4"
    if bits in (3, 2) and kind != "float":
        return f"int{bits}"
    return ""


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _group(value: object) -> int | None:
    """A config's group size: -1 (GPTQ's spelling) and 0 mean one scale per output channel."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else -1
    return None


def _names_lm_head(modules: object) -> bool:
    return isinstance(modules, list) and any("lm_head" in str(m) for m in modules)


def _compressed_tensors(quant: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors (llm-compressor, RedHatAI checkpoints): config_groups.*.weights {num_bits, type, strategy,
    group_size, symmetric, block_structure}; lm_head is quantised unless `ignore` names it."""
    groups = quant.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            continue
        kind = str(weights.get("type", "int")).lower()
        dtype = _bits_dtype(weights.get("num_bits"), kind)
        if not dtype:
            continue
        found: dict[str, Any] = {"dtype": dtype, "quant_method": "compressed-tensors",
                                 "quant_lm_head": not _names_lm_head(quant.get("ignore"))}
        strategy = str(weights.get("strategy", "")).lower()
        wide = 2.0  # scales are stored at the checkpoint's 16-bit precision
        if strategy == "tensor":
            found.update(quant_group_size=0, quant_scale_bytes=0.0)
        elif strategy == "channel":
            found.update(quant_group_size=-1, quant_scale_bytes=wide)
        elif strategy in ("group", "tensor_group"):
            size = _positive(weights.get("group_size")) or 128
            scale = 1.0 if dtype == "fp4" else wide  # NVFP4 keeps FP8 scales per 16 weights
            zero = 0.0 if weights.get("symmetric", True) else bytes_per_element(dtype)
            found.update(quant_group_size=size, quant_scale_bytes=scale + zero,
                         quant_method="nvfp4" if dtype == "fp4" else "compressed-tensors")
        elif strategy == "block":
            block = weights.get("block_structure")
            if isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block):
                found.update(quant_group_size=block[0] * block[1], quant_scale_bytes=4.0)
        return found
    return {}


def _quant_fields(quant: dict[str, Any]) -> dict[str, Any]:
    """What a quantization_config says of the stored weights: their precision ("dtype") and the ModelInfo
    quantisation fields; {} when it names no stored precision.

    Spellings: `quant_method` fp8, with `weight_block_size` [128, 128] for block scales (DeepSeek-style, FP32 scale
    per block); `bits`/`w_bit` with `group_size`/`q_group_size`, `sym`, `zero_point` and `lm_head` (GPTQ, AWQ);
    bitsandbytes' `load_in_4bit`/`load_in_8bit`; compressed-tensors' `config_groups` (_compressed_tensors);
    ModelOpt's `quant_algo` (FP8, NVFP4, W4A16_AWQ); mxfp4 (OCP MX: 4-bit floats, an E8M0 scale per 32 weights)."""
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if "NVFP4" in algo:
            return {"dtype": "fp4", "quant_method": "nvfp4", "quant_group_size": _positive(quant.get("group_size"))}
        if "FP8" in algo:
            return {"dtype": "fp8", "quant_method": "fp8"}
        if "W4A" in algo:
            return {"dtype": "int4", "quant_method": "awq", "quant_group_size": _positive(quant.get("group_size"))}
        return {}
    if "fp8" in method:
        block = quant.get("weight_block_size")
        found: dict[str, Any] = {"dtype": "fp8", "quant_method": "fp8"}
        if isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block):
            found.update(quant_group_size=block[0] * block[1], quant_scale_bytes=4.0)
        return found
    if method == "mxfp4":
        return {"dtype": "fp4", "quant_method": "mxfp4"}
    if quant.get("load_in_4bit") is True:
        double = quant.get("bnb_4bit_use_double_quant") is True
        kind = "float" if str(quant.get("bnb_4bit_quant_type", "nf4")).lower() == "fp4" else "int"
        # NF4 is a 4-bit lookup code, sized like INT4; double quantisation stores the absmax in 8 bits
        return {"dtype": _bits_dtype(4, kind), "quant_method": "bitsandbytes", "quant_group_size": 64,
                "quant_scale_bytes": 1.0 + 4.0 / 256 if double else 4.0}
    if quant.get("load_in_8bit") is True:
        return {"dtype": "int8", "quant_method": "bitsandbytes", "quant_group_size": -1, "quant_scale_bytes": 4.0}
    bits = quant.get("bits") or quant.get("w_bit")
    dtype = _bits_dtype(bits)
    if not dtype:
        return {}
    found = {"dtype": dtype, "quant_method": method or "gptq", "quant_lm_head": quant.get("lm_head") is True}
    group = _group(quant.get("group_size", quant.get("q_group_size")))
    if group is not None:
        found["quant_group_size"] = group
    asymmetric = quant.get("sym") is False or quant.get("zero_point") is True
    if method == "awq" and quant.get("zero_point") is not False:
        asymmetric = True
    found["quant_scale_bytes"] = 2.0 + (bytes_per_element(dtype) if asymmetric else 0.0)
    return found


def _may_keep_16_bit(quant: dict[str, Any]) -> bool:
    """A quantization_config that may keep 16-bit weights: bitsandbytes with neither load_in_4bit nor load_in_8bit,
    compressed-tensors whose schemes quantise only activations or the KV cache."""
    return str(quant.get("quant_method", "")).lower() in ("bitsandbytes", "compressed-tensors")


def _check_quant(quant: object, label: str) -> None:
    """Refuse a quantization_config whose bits or group size cannot be read: read as 16-bit weights it would
    triple the bytes of the int4 model it names, with nothing said."""
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise InputError(f"{label}: quantization_config must be a JSON object, not {type(quant).__name__}.")
    for key in ("bits", "w_bit"):
        value = quant.get(key)
        if value is not None and (value not in (2, 3, 4, 8) or isinstance(value, bool)):
            raise InputError(f"{label}: quantization_config {key} is {value!r:.40}; diagnoser sizes 2-, 3-, 4- and "
                             "8-bit weights (for another precision use --params with --dtype).")
    for key in ("group_size", "q_group_size"):
        value = quant.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -1):
            raise InputError(f"{label}: quantization_config {key} is {value!r:.40}; expected a positive group size or "
                             "-1 (one scale per output channel).")
    method = quant.get("quant_method")
    if method and not _quant_fields(quant) and not _may_keep_16_bit(quant):
        raise InputError(f"{label}: quantization_config names quant_method {str(method)!r:.40}, which diagnoser does "
                         "not size; read as 16-bit it would overstate the weights (use --params with --dtype).")


def _config_quant(cfg: dict[str, Any]) -> dict[str, Any]:
    quant = cfg.get("quantization_config")
    return _quant_fields(quant) if isinstance(quant, dict) else {}


def _config_kv_dtype(cfg: dict[str, Any]) -> str:
    """The KV cache's precision where the config says it: compressed-tensors' kv_cache_scheme (llm-compressor's FP8
    KV checkpoints: {"num_bits": 8, "type": "float"}); "" otherwise (the serving flag or the weights' dtype decide)."""
    quant = cfg.get("quantization_config")
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not isinstance(scheme, dict):
        return ""
    return _bits_dtype(scheme.get("num_bits"), "float" if str(scheme.get("type", "")).lower() == "float" else "int")


def _config_dtype(cfg: dict[str, Any]) -> str:
    """Weight precision: a quantisation_config wins over torch_dtype (newer configs spell it "dtype")."""
    found = str(_config_quant(cfg).get("dtype", ""))
    if found:
        return found
    raw = _first(cfg, "torch_dtype", "dtype")
    return _flag_dtype(raw) if isinstance(raw, str) else ""  # "" for e.g. float64: leave it to the user's --dtype


def _kv_heads(cfg: dict[str, Any], label: str, model_type: str, heads: int) -> int:
    """KV heads as transformers reads them: num_key_value_heads (Llama and most), num_kv_heads / n_head_kv
    (Falcon's new decoder architecture: 40B and 180B have 8), one for multi-query attention (Falcon-7B's and
    GPT-BigCode's multi_query, true by default there), else the attention heads."""
    explicit = _positive_int(cfg, label, "num_key_value_heads", "num_kv_heads", "n_head_kv", required=False)
    if model_type in _FALCON_TYPES:
        # FalconAttention: num_kv_heads if new_decoder_architecture or not multi_query, else 1
        new_arch = cfg.get("new_decoder_architecture") is True or model_type == "refinedweb"
        if new_arch or cfg.get("multi_query", True) is False:
            return explicit or heads
        return 1
    multi_query = cfg.get("multi_query", True if model_type in _MULTI_QUERY_DEFAULT else None)
    if multi_query is True:
        return 1
    return explicit or heads


def _sliding_layout(cfg: dict[str, Any], label: str, model_type: str, layers: int) -> tuple[int | None, int]:
    """(window, sliding layers) from `sliding_window` and the layer pattern: `layer_types` where the config lists
    it, else the model type's fixed pattern (see _ALL_LAYERS_SLIDE and the sets below it). A window whose layers
    cannot be told with certainty is refused: guessed, the KV cache would be sized several times wrong."""
    raw_types = cfg.get("layer_types")
    if raw_types is not None:
        if not isinstance(raw_types, list) or len(raw_types) != layers or any(t not in _LAYER_TYPES for t in raw_types):
            kinds = "', '".join(_LAYER_TYPES)
            raise InputError(f"{label}: layer_types must list '{kinds}' once for each of the {layers} layers; "
                             "diagnoser cannot size another layout's KV cache.")
        slid = sum(_LAYER_TYPES[t] for t in raw_types)
        if not slid:
            return None, 0
        return _positive_int(cfg, label, "sliding_window"), slid
    if cfg.get("sliding_window") is None:
        return None, 0
    enabled = cfg.get("use_sliding_window", model_type not in _QWEN_SLIDE)
    if enabled is False:
        return None, 0
    window = _positive_int(cfg, label, "sliding_window")
    if model_type in _ALL_LAYERS_SLIDE:
        return window, layers
    if model_type in _ALTERNATE_SLIDE:
        return window, (layers + 1) // 2
    pattern = cfg.get("sliding_window_pattern")
    if model_type in _PATTERN_SLIDE and isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return window, layers - layers // pattern
    if model_type in _QWEN_SLIDE:
        raise InputError(f"{label} turns on use_sliding_window, which transformers has read as sliding the layers "
                         "below max_window_layers and as sliding those above it; add layer_types to say which "
                         "layers slide.")
    raise InputError(f"{label} has a sliding_window of {window} but no layer pattern diagnoser can read for "
                     f"model_type {model_type or 'unset'!r:.40}; add layer_types to say which layers slide.")


class _Shape:
    """The numbers of a config the parameter count needs, validated once."""

    def __init__(self, cfg: dict[str, Any], label: str) -> None:
        self.model_type = str(cfg.get("model_type", "")).lower()
        self.hidden = _positive_int(cfg, label, "hidden_size", "n_embd", "d_model") or 0
        self.layers = _positive_int(cfg, label, "num_hidden_layers", "n_layer", "num_layers") or 0
        self.heads = _positive_int(cfg, label, "num_attention_heads", "n_head") or 0
        self.vocab = _positive_int(cfg, label, "vocab_size") or 0
        self.kv_heads = _kv_heads(cfg, label, self.model_type, self.heads)
        self.head_dim = _positive_int(cfg, label, "head_dim", required=False) or self.hidden // self.heads
        self.falcon = self.model_type in _FALCON_TYPES
        # GPT-2's n_inner=null means 4 x hidden
        self.intermediate: int = _positive_int(cfg, label, "intermediate_size", "n_inner", "ffn_dim",
                                               "ffn_hidden_size", required=False) or 4 * self.hidden
        self.classic = self.model_type in _CLASSIC_TYPES
        self.parallel = self.model_type in _PARALLEL_TYPES or self.falcon
        # Falcon's new decoder architecture normalises attention's and the MLP's inputs apart (ln_attn, ln_mlp)
        self.parallel_norms = 2 if self.falcon and (cfg.get("new_decoder_architecture") is True
                                                    or self.model_type == "refinedweb") else 1
        act = str(_first(cfg, "hidden_act", "activation_function", "hidden_activation") or "").lower()
        self.gated = not (self.classic or self.parallel) and (self.model_type in _GATED_TYPES or act in _GATED_ACTS)
        falcon_bias = self.falcon and cfg.get("bias") is True
        self.qkv_bias = self.classic or bool(cfg.get("attention_bias")) or self.model_type in _QKV_BIAS_TYPES \
            or falcon_bias
        self.o_bias = self.classic or bool(cfg.get("attention_bias")) or falcon_bias
        self.mlp_bias = self.classic or self.model_type in _PARALLEL_TYPES or bool(cfg.get("mlp_bias")) or falcon_bias
        self.head_bias = self.model_type in _PARALLEL_TYPES  # GPT-J's lm_head has a bias
        self.qk_norm = self.model_type in _QK_NORM_TYPES
        self.tied = bool(cfg.get("tie_word_embeddings", True))  # transformers' default is tied
        self.positions = _positive_int(cfg, label, "max_position_embeddings", "n_positions", required=False)
        self.experts = _positive_int(cfg, label, "num_local_experts", "num_experts", "n_routed_experts",
                                     required=False) or 0
        self.top_k = _positive_int(cfg, label, "num_experts_per_tok", required=False) or 0
        if self.experts > 1 and not self.top_k:
            raise InputError(f"{label} has {self.experts} experts but no num_experts_per_tok.")
        self.expert_width = _positive_int(cfg, label, "moe_intermediate_size", required=False) or self.intermediate
        shared_width = _positive_int(cfg, label, "shared_expert_intermediate_size", required=False)
        n_shared = _positive_int(cfg, label, "n_shared_experts", required=False) or 0
        self.shared_width = shared_width or n_shared * self.expert_width
        self.dense_layers = _positive_int(cfg, label, "first_k_dense_replace", required=False) or 0
        self.dense_layers = min(self.dense_layers, self.layers) if self.experts > 1 else self.layers
        self._mla(cfg, label)
        if self.model_type in _LLAMA4_TYPES:
            self._llama4(cfg, label)
        else:
            self.sliding_window, self.sliding_layers = _sliding_layout(cfg, label, self.model_type, self.layers)

    def _llama4(self, cfg: dict[str, Any], label: str) -> None:
        """Llama 4's layer pattern (see _LLAMA4_TYPES): which layers have experts, the shared expert, the dense
        MLP's own width, and the chunked layers, whose KV a sequence holds at most a chunk of (a sliding window of
        the chunk's size bounds it)."""
        step = _positive_int(cfg, label, "interleave_moe_layer_step", required=False) or 1
        listed = cfg.get("moe_layers")
        if listed is not None and not (isinstance(listed, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.layers for i in listed)):
            raise InputError(f"{label}: moe_layers must list layer indices below {self.layers}.")
        moe = len(set(listed)) if listed is not None else len(range(step - 1, self.layers, step))
        if self.experts > 1:
            self.dense_layers = self.layers - moe
            self.shared_width = self.intermediate  # Llama4TextMoe's shared_expert is an MLP of intermediate_size
            self.expert_width = self.intermediate
            self.intermediate = _positive_int(cfg, label, "intermediate_size_mlp", required=False) or self.intermediate
        self.qk_norm = False  # Llama 4's q/k norm is an L2 norm without weights
        chunk = _positive_int(cfg, label, "attention_chunk_size", required=False)
        rope = cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(self.layers)]
        if not (isinstance(rope, list) and len(rope) == self.layers and all(r in (0, 1) for r in rope)):
            raise InputError(f"{label}: no_rope_layers must hold a 0 or 1 for each of the {self.layers} layers.")
        chunked = sum(1 for r in rope if r == 1)
        self.sliding_window, self.sliding_layers = (chunk, chunked) if chunk and chunked else (None, 0)

    def _mla(self, cfg: dict[str, Any], label: str) -> None:
        """Multi-head latent attention (DeepSeek-V2/V3: kv_lora_rank in the config): its projections and the
        latent it caches (physics.attention)."""
        self.kv_lora_rank = _positive_int(cfg, label, "kv_lora_rank", required=False)
        if self.kv_lora_rank is None:
            archs = cfg.get("architectures")
            named = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
            if self.model_type in _MLA_TYPES or any(a in _MLA_ARCHITECTURES for a in named):
                raise InputError(f"{label} is a DeepSeek-V2/V3 model (multi-head latent attention) without "
                                 "kv_lora_rank, so its KV cache cannot be sized.")
            return
        self.q_lora_rank = _positive_int(cfg, label, "q_lora_rank", required=False)
        self.qk_rope = _positive_int(cfg, label, "qk_rope_head_dim") or 0
        self.qk_nope = _positive_int(cfg, label, "qk_nope_head_dim") or 0
        self.v_head = _positive_int(cfg, label, "v_head_dim") or 0
        # One latent "head" shared by every query head: 2 x kv_heads x head_dim elements equal the cached latent
        # and rope key (rounded up to an even count), for code that sees only ModelInfo's fields.
        self.kv_heads = 1
        self.head_dim = math.ceil((self.kv_lora_rank + self.qk_rope) / 2)

    def mlp(self, width: int) -> int:
        """One feed-forward block: 3 matrices for gated (SwiGLU) MLPs, 2 for GPT-2 style, plus biases."""
        matrices = 3 if self.gated else 2
        bias = (matrices - 1) * width + self.hidden if self.mlp_bias else 0
        return matrices * self.hidden * width + bias

    def attention(self) -> int:
        if self.kv_lora_rank is not None:
            return self._mla_attention()
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return q + kv + o + bias + (self.hidden if self.o_bias else 0) + qk_norm

    def _mla_attention(self) -> int:
        """DeepSeek-V2/V3 attention (transformers' DeepseekV3Attention): q through a rank-q_lora_rank bottleneck
        with its RMSNorm (or one hidden x heads x (nope + rope) matrix without q_lora_rank), kv_a_proj_with_mqa to
        the latent and rope key, the latent's RMSNorm, kv_b_proj to per-head k (nope) and v, and o_proj."""
        assert self.kv_lora_rank is not None
        q_head = self.qk_nope + self.qk_rope
        if self.q_lora_rank:
            q = self.hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * q_head
        else:
            q = self.hidden * self.heads * q_head
        kv_a = self.hidden * (self.kv_lora_rank + self.qk_rope) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * self.heads * (self.qk_nope + self.v_head)
        o = self.heads * self.v_head * self.hidden
        return q + kv_a + kv_b + o

    def norm(self) -> int:
        # LayerNorm has a bias, RMSNorm does not
        return 2 * self.hidden if self.classic or self.parallel else self.hidden

    def embeddings(self) -> int:
        tokens = self.vocab * self.hidden * (1 if self.tied else 2)  # input embedding, and lm_head unless tied
        positions = (self.positions or 0) * self.hidden if self.classic else 0
        head_bias = self.vocab if self.head_bias else 0
        return tokens + positions + head_bias + self.norm()  # the final norm rides along

    def counts(self) -> tuple[float, float]:
        """(total, active per token) parameters."""
        per_layer = self.attention() + (self.parallel_norms if self.parallel else 2) * self.norm()
        dense_mlp = self.mlp(self.intermediate)
        total = active = self.embeddings() + self.layers * per_layer + self.dense_layers * dense_mlp
        moe_layers = self.layers - self.dense_layers
        if moe_layers:
            expert = self.mlp(self.expert_width)
            shared = self.mlp(self.shared_width) if self.shared_width else 0
            router = self.hidden * self.experts
            total += moe_layers * (self.experts * expert + shared + router)
            active += moe_layers * (self.top_k * expert + shared + router)
        return float(total), float(active)


def model_from_hf_dict(cfg: dict[str, Any], name: str = "", label: str = "the config") -> ModelInfo:
    """A ModelInfo from a parsed config.json. Multimodal configs use their nested text_config."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    _refuse_unread_layout(cfg, label)
    shape = _Shape(cfg, label)
    _check_quant(cfg.get("quantization_config"), label)
    params, active = shape.counts()
    fields: dict[str, Any] = dict(
        name=name or str(cfg.get("_name_or_path") or ""),
        params=params,
        active_params=active,
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab=shape.vocab,
        dtype=_config_dtype(cfg),
        kv_dtype=_config_kv_dtype(cfg),
        max_context=shape.positions,
        tied_embeddings=shape.tied,
        **{k: v for k, v in _config_quant(cfg).items() if k != "dtype" and v is not None},
    )
    if shape.kv_lora_rank is None and not shape.sliding_layers:
        return ModelInfo(**fields)
    if shape.kv_lora_rank is not None:
        fields.update(kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope,
                      qk_nope_head_dim=shape.qk_nope, v_head_dim=shape.v_head,
                      attention_params=float(shape.layers * shape.attention()))
    if shape.sliding_layers:
        fields.update(sliding_window=shape.sliding_window, sliding_layers=shape.sliding_layers)
    return AttentionModelInfo(**fields)


def _name_from_path(path: Path) -> str:
    """A readable name for a config file: the repo of a Hugging Face cache path, else the folder's name."""
    for part in reversed(path.parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    # A checkpoint's config.json is named by its folder; any other file (llama-2-7b.json) by its own name.
    return (path.parent.name or path.stem) if path.name == "config.json" else path.stem


def load_hf_config(path: str | Path) -> ModelInfo:
    """Read a Hugging Face config.json (or a folder holding one) into a ModelInfo with computed parameter counts.

    Missing num_key_value_heads means multi-head attention (= heads), except where multi_query or Falcon's
    num_kv_heads say otherwise; missing head_dim means hidden / heads. MLA (kv_lora_rank) and sliding-window
    (sliding_window with the layer pattern) configs give an AttentionModelInfo (physics.attention).
    MoE configs (num_local_experts or num_experts, with num_experts_per_tok) count every expert in `params` and
    only the routed top-k (plus shared experts and the router) in `active_params`.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(f"no config file at {path}.")
    try:
        cfg = json.loads(read_text_bounded(path))  # bounded: a config path may be a huge or endless file
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}.") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path} is not a JSON object; expected a Hugging Face config.json.")
    name = str(cfg.get("_name_or_path") or "") or _name_from_path(path.resolve())
    return model_from_hf_dict(cfg, name=name, label=str(path))


def _bundled_dir() -> Path:
    return Path(str(resources.files("diagnoser").joinpath("data").joinpath("models")))


def bundled_models() -> list[str]:
    """Names of the bundled configs, e.g. "llama-2-7b"."""
    return sorted(p.stem for p in _bundled_dir().glob("*.json"))


def _bundled_key(name: str) -> str | None:
    """Match "Llama-2-7b", "meta-llama/Llama-2-7b-hf" or a unique prefix such as "mixtral-8x7b"."""
    key = name.strip().lower().rsplit("/", 1)[-1].removesuffix("-hf")
    names = bundled_models()
    if key in names:
        return key
    prefixed = [n for n in names if n.startswith(key)]
    return prefixed[0] if len(prefixed) == 1 else None


def load_bundled_model(name: str) -> ModelInfo:
    """A bundled config by name; unknown names raise InputError listing the bundled ones."""
    key = _bundled_key(name)
    if key is None:
        raise InputError(f"no bundled model named '{name}'; bundled: {', '.join(bundled_models())}.")
    model = load_hf_config(_bundled_dir() / f"{key}.json")
    model.name = BUNDLED_SOURCES.get(key, key)
    return model


def resolve_model(spec: str) -> ModelInfo:
    """`spec` is a config.json path, a folder holding one, or a bundled model's name."""
    path = Path(spec).expanduser()
    if path.exists():
        return load_hf_config(path)
    if _bundled_key(spec) is not None:
        return load_bundled_model(spec)
    if spec.endswith(".json") or "/" in spec or spec.startswith(("~", ".")):
        raise InputError(f"no config file at {spec}.")
    raise InputError(f"no config file or bundled model named '{spec}'; bundled: {', '.join(bundled_models())}.")


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_param_count(text: str) -> float:
    """"7e9", "7B", "70b", "500M", "1.5T" -> parameters."""
    found = _COUNT.match(text)
    value = float(found.group(1)) * _SUFFIX[found.group(2).lower()] if found else 0.0
    if not math.isfinite(value) or value < 1:
        raise InputError(f"cannot read '{text}' as a parameter count; write e.g. 7e9 or 7B.")
    if value > MAX_PARAMS:
        raise InputError(f"{text} parameters is more than {MAX_PARAMS:.0e}: no model that size exists to serve "
                         "(write e.g. 7e9 or 7B).")
    return value


# The largest parameter count taken: a hundred times the largest published models (about 2e12 in 2026).
MAX_PARAMS = 2e14


def model_from_params(
    params: float,
    *,
    active_params: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab: int | None = None,
    dtype: str = "",
    kv_dtype: str = "",
    name: str = "",
) -> ModelInfo:
    """A ModelInfo from numbers given as flags. KV-cache figures need layers, kv_heads and head_dim (or hidden and
    heads to derive head_dim; kv_heads defaults to heads)."""
    if params < 1 or (active_params is not None and not 1 <= active_params <= params):
        raise InputError("the parameter count must be at least 1, and active parameters at most the total.")
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("KV heads", kv_heads),
                         ("head size", head_dim), ("vocabulary", vocab)):
        if value is not None and value < 1:
            raise InputError(f"the {label} must be a positive integer, not {value}.")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    return ModelInfo(
        name=name or f"{params / 1e9:g}B-parameter model",
        params=float(params),
        active_params=float(active_params if active_params is not None else params),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads or heads,
        head_dim=head_dim,
        vocab=vocab,
        dtype=normalise_dtype(dtype) if dtype else "",
        kv_dtype=normalise_dtype(kv_dtype) if kv_dtype else "",
    )


# --quantization (vLLM, SGLang) and --quantize (TGI) values that fix the stored weight precision whatever the
# checkpoint says: the server quantises a 16-bit checkpoint as it loads it. AWQ/GPTQ/compressed-tensors name a
# checkpoint format whose config.json already says its bits, and plain "bitsandbytes" means 4 bits in vLLM and 8 in
# TGI, so those are left to the config.
_QUANTISING_FLAGS = {
    "fp8": "fp8", "fbgemm_fp8": "fp8", "ptpc_fp8": "fp8", "eetq": "int8", "bitsandbytes-nf4": "int4",
    "bitsandbytes-fp4": "int4", "mxfp4": "int4",
}


def _flag_dtype(value: object) -> str:
    """A dtype as configs and flags spell it (torch_dtype, --dtype, --kv-cache-dtype) as a precision name; "" for
    auto or what is not one."""
    text = str(value or "").strip().lower()
    if not text or text == "auto":
        return ""
    if text.startswith("fp8"):  # fp8, fp8_e4m3, fp8_e5m2, fp8_inc
        return "fp8"
    try:
        return normalise_dtype(text)
    except InputError:
        return ""


def with_serving_flags(model: ModelInfo, serving: ServingConfig) -> tuple[ModelInfo, list[str]]:
    """The model as the server runs it: the precision and tensor parallelism its command line sets (the keys of
    ServingConfig: quantization, dtype, kv_cache_dtype, tensor_parallel_size). A config.json describes the
    checkpoint; `vllm serve X --quantization fp8 --kv-cache-dtype fp8 -tp 2` reads a quarter of its bytes per GPU
    and step. Returns the model and a note per change."""
    changes: dict[str, Any] = {}
    notes: list[str] = []
    quant = str(serving.quantization or "").strip().lower()
    weights = _QUANTISING_FLAGS.get(quant, "")
    current = model.dtype
    if weights and (not current or bytes_per_element(current) > bytes_per_element(weights)):
        changes["dtype"] = weights
        notes.append(f"weights served as {weights} (--quantization {quant})")
    elif not current and _flag_dtype(serving.dtype):
        changes["dtype"] = _flag_dtype(serving.dtype)
        notes.append(f"weights served as {changes['dtype']} (--dtype)")
    kv = _flag_dtype(serving.kv_cache_dtype)
    if kv and kv != model.kv_dtype:
        changes["kv_dtype"] = kv
        notes.append(f"KV cache in {kv} (--kv-cache-dtype)")
    tp = serving.tensor_parallel_size
    if tp is not None and tp > 1 and model.tensor_parallel == 1:
        changes["tensor_parallel"] = tp
        notes.append(f"sharded over {tp} GPUs (tensor parallel)")
    return (msgspec.structs.replace(model, **changes) if changes else model), notes


def apply_serving_flags(capture: Capture) -> None:
    """Set the capture's model to what the server's command line makes of it (with_serving_flags), with a note."""
    if capture.model is None:
        return
    capture.model, changes = with_serving_flags(capture.model, capture.serving)
    if changes:
        capture.notes.append("From the server's command line: " + "; ".join(changes) + ".")
