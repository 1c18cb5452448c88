"""KV-cache layouts GQA sizing gets wrong (MLA, sliding windows, Falcon's KV heads), and the GPU table's newer rows
and matching rules. Expectations come from the configs' public values and the vendors' datasheets, not the code."""

from __future__ import annotations

import math
from typing import Any

import pytest

from diagnoser.errors import InputError
from diagnoser.physics import (
    GPUS,
    AttentionModelInfo,
    attention_flops_per_token,
    compute_dtype,
    decode_step_bytes,
    get_gpu,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_bundled_model,
    match_gpu,
    max_concurrent_sequences,
    model_from_hf_dict,
    weight_bytes,
    weights_read_bytes,
)
from diagnoser.physics.gpus import resolve_gpu

GIB = 1024**3

# deepseek-ai/DeepSeek-V3 config.json (the values that size it).
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                            "activation_scheme": "dynamic"},
}
# deepseek-ai/DeepSeek-V2-Lite: no q_lora_rank (q is one matrix).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "vocab_size": 102400, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# --- MLA ---------------------------------------------------------------------------------------------------------

def test_deepseek_v3_kv_cache_is_the_latent_not_heads_times_head_dim() -> None:
    """MLA caches kv_lora_rank + qk_rope_head_dim elements a layer and token: 61 x (512 + 64) x 2 B = 70,272 B in
    bf16 (DeepSeek-V2 paper, section 2.1). Read as 128 KV heads of hidden / heads = 56 it was 1,748,992 B, 25x."""
    model = model_from_hf_dict(DEEPSEEK_V3)
    assert isinstance(model, AttentionModelInfo)
    assert kv_bytes_per_token(model, "bf16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(model, "fp8") == 35_136
    # The latent is shared by all heads, so every tensor-parallel GPU keeps the whole of it.
    assert kv_bytes_per_token(model, "bf16", tp=8) == 70_272
    # The plain-ModelInfo fields give the same bytes where only they survive (a saved capture).
    assert 2 * (model.layers or 0) * (model.kv_heads or 0) * (model.head_dim or 0) * 2 == 70_272


def test_deepseek_v3_parameters_match_the_published_671b_and_37b_active() -> None:
    """DeepSeek-V3 technical report: 671B total parameters, 37B activated per token (the MTP module apart). MLA's
    low-rank projections are counted as they are, not as 128 heads of 56."""
    model = model_from_hf_dict(DEEPSEEK_V3)
    assert model.params == pytest.approx(671e9, rel=1e-3)
    assert model.active_params == pytest.approx(37e9, rel=0.025)
    assert model.dtype == "fp8"


def test_deepseek_v2_lite_without_q_lora_rank() -> None:
    """DeepSeek-V2 paper: V2-Lite has 15.7B parameters; its cache is 27 x 576 x 2 B a token."""
    model = model_from_hf_dict(DEEPSEEK_V2_LITE)
    assert model.params == pytest.approx(15.7e9, rel=2e-3)
    assert kv_bytes_per_token(model, "bf16") == 27 * 576 * 2


@pytest.mark.parametrize("drop", ["kv_lora_rank", "qk_rope_head_dim"])
def test_an_mla_config_missing_its_latent_is_refused(drop: str) -> None:
    cfg = {k: v for k, v in DEEPSEEK_V3.items() if k != drop}
    with pytest.raises(InputError, match="kv_lora_rank" if drop == "kv_lora_rank" else drop):
        model_from_hf_dict(cfg)


def test_mla_decode_attention_runs_against_the_latent() -> None:
    """Absorbed MLA (how servers decode it): each head scores against 576 cached elements and sums 512-element
    latent rows: 2 x (576 + 512) FLOP per head, key and layer."""
    model = model_from_hf_dict(DEEPSEEK_V3)
    assert attention_flops_per_token(model, 1000) == 2 * 128 * (576 + 512) * 61 * 1000


def test_mla_step_reads_the_latent() -> None:
    model = model_from_hf_dict(DEEPSEEK_V3)
    kv = decode_step_bytes(model, 8, 4096) - decode_step_bytes(model, 8, 0)
    assert kv == pytest.approx(8 * 4096 * 70_272)


# --- sliding windows ---------------------------------------------------------------------------------------------

# mistralai/Mistral-7B-v0.1: 32 layers, 8 KV heads of 128, sliding_window 4096 on every layer: 4,096 B a layer and
# token in bf16, 131,072 B a token.
MISTRAL_LAYER_BYTES = 2 * 8 * 128 * 2


def test_mistral_7b_v0_1_holds_its_window_not_the_whole_context() -> None:
    mistral = load_bundled_model("mistral-7b-v0.1")
    assert isinstance(mistral, AttentionModelInfo)
    assert (mistral.sliding_window, mistral.sliding_layers) == (4096, 32)
    assert kv_bytes_per_token(mistral) == 32 * MISTRAL_LAYER_BYTES == 131_072
    # KV per sequence = full layers x c + sliding layers x min(c, window), times bytes a layer and token
    assert kv_bytes_per_sequence(mistral, 32768) == 32 * 4096 * MISTRAL_LAYER_BYTES == 536_870_912
    assert kv_bytes_per_sequence(mistral, 2048) == 32 * 2048 * MISTRAL_LAYER_BYTES


def test_mistral_7b_v0_1_capacity_at_32k() -> None:
    """On an H100 at 90 %: 77.3 GB less 14.5 GB of weights holds 117 sequences of 32K at 0.5 GB each; sized over
    the whole context (4.3 GB each) it said 14."""
    mistral = load_bundled_model("mistral-7b-v0.1")
    h100 = GPUS["h100-sxm"]
    free = 0.9 * 80 * GIB - weight_bytes(mistral)
    assert max_concurrent_sequences(mistral, h100, 32768) == math.floor(free / 536_870_912) == 117
    # Within the window nothing changes.
    assert max_concurrent_sequences(mistral, h100, 4096) == math.floor(free / (4096 * 131_072))
    # A decode step reads each sequence's window, not its whole context.
    read = decode_step_bytes(mistral, 4, 32768)
    assert read == pytest.approx(weights_read_bytes(mistral, 4) + 4 * 536_870_912)


def test_gemma_2_alternates_sliding_and_full_layers() -> None:
    """google/gemma-2-9b: 42 layers, layer 0 sliding then alternating (transformers' Gemma2), window 4096, 8 KV
    heads of 256: 8,192 B a layer and token."""
    cfg = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
           "sliding_window": 4096, "torch_dtype": "bfloat16"}
    model = model_from_hf_dict(cfg)
    per_layer = 2 * 8 * 256 * 2
    assert model.params == pytest.approx(9.24e9, rel=2e-3)  # the published 9.24B
    assert kv_bytes_per_sequence(model, 8192) == (21 * 8192 + 21 * 4096) * per_layer


def test_gemma_3_pattern_and_layer_types() -> None:
    """google/gemma-3-27b: every 6th of 62 layers is full (sliding_window_pattern 6), window 1024; newer configs
    list layer_types instead, which wins."""
    cfg: dict[str, Any] = {"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
                           "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                           "intermediate_size": 21504, "vocab_size": 262208, "sliding_window": 1024,
                           "sliding_window_pattern": 6}
    model = model_from_hf_dict(cfg)
    assert isinstance(model, AttentionModelInfo) and model.sliding_layers == 62 - 10
    per_layer = 2 * 16 * 128 * 2
    assert kv_bytes_per_sequence(model, 32768, "bf16") == (10 * 32768 + 52 * 1024) * per_layer
    listed = {**cfg, "sliding_window_pattern": None,
              "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(62)]}
    assert model_from_hf_dict(listed).sliding_layers == 62 - 15  # type: ignore[attr-defined]


@pytest.mark.parametrize(("change", "fragment"), [
    # Qwen's max_window_layers has been read both ways by transformers: refused, not guessed.
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28},
     "use_sliding_window"),
    # A window on a model type whose layer pattern is not known.
    ({"model_type": "mystery", "sliding_window": 4096}, "no layer pattern"),
    ({"model_type": "gemma3_text", "sliding_window": 1024}, "no layer pattern"),
    ({"model_type": "gemma3_text", "sliding_window": 1024, "layer_types": ["sliding_attention"] * 3},
     "layer_types"),
    ({"model_type": "gpt_oss", "sliding_window": 128, "layer_types": ["chunked_attention"] * 32}, "layer_types"),
])
def test_an_unreadable_sliding_layout_is_refused(change: dict[str, Any], fragment: str) -> None:
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 32000, **change}
    with pytest.raises(InputError, match=fragment) as err:
        model_from_hf_dict(cfg)
    assert str(err.value).endswith(".")


def test_a_window_that_is_off_is_not_applied() -> None:
    qwen = load_bundled_model("qwen2.5-0.5b")  # sliding_window 32768 with use_sliding_window false
    assert not isinstance(qwen, AttentionModelInfo)
    assert kv_bytes_per_sequence(qwen, 65536) == 65536 * kv_bytes_per_token(qwen)


# --- Falcon and multi-query attention ---------------------------------------------------------------------------

FALCON = {"model_type": "falcon", "parallel_attn": True, "bias": False, "vocab_size": 65024,
          "torch_dtype": "bfloat16"}


def test_falcon_7b_is_multi_query() -> None:
    """tiiuae/falcon-7b: multi_query true, 71 heads of 64, 32 layers: one KV head (transformers' FalconAttention),
    2 x 32 x 64 x 2 = 8,192 B a token; 6,921,720,704 parameters (one LayerNorm a layer, tied embeddings)."""
    cfg = {**FALCON, "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32, "multi_query": True,
           "new_decoder_architecture": False}
    model = model_from_hf_dict(cfg)
    assert model.kv_heads == 1 and kv_bytes_per_token(model) == 8192
    assert model.params == 6_921_720_704


@pytest.mark.parametrize(("hidden", "heads", "layers", "kv_bytes"), [
    (8192, 128, 60, 2 * 60 * 8 * 64 * 2),  # tiiuae/falcon-40b
    (14848, 232, 80, 2 * 80 * 8 * 64 * 2),  # tiiuae/falcon-180B (232 KV heads read before: 29x)
])
def test_falcon_new_decoder_architecture_reads_num_kv_heads(hidden: int, heads: int, layers: int,
                                                             kv_bytes: int) -> None:
    cfg = {**FALCON, "hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": layers,
           "num_kv_heads": 8, "new_decoder_architecture": True, "multi_query": True}
    model = model_from_hf_dict(cfg)
    assert model.kv_heads == 8 and kv_bytes_per_token(model) == kv_bytes
    # The original RefinedWeb spelling of the 40B's config says the same with n_head_kv.
    old = {"model_type": "RefinedWeb", "hidden_size": hidden, "n_head": heads, "n_layer": layers, "n_head_kv": 8,
           "vocab_size": 65024, "bias": False}
    assert model_from_hf_dict(old).kv_heads == 8


def test_gpt_bigcode_is_multi_query_by_default() -> None:
    cfg = {"model_type": "gpt_bigcode", "n_embd": 6144, "n_layer": 40, "n_head": 48, "vocab_size": 49152,
           "n_positions": 8192}
    assert model_from_hf_dict(cfg).kv_heads == 1
    assert model_from_hf_dict({**cfg, "multi_query": False}).kv_heads == 48


# --- GPU table ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "memory_gib", "bandwidth", "flops", "tdp"), [
    # AMD MI300X data sheet: 192 GB HBM3, 5.3 TB/s, 1307.4 TFLOP/s FP16/BF16 dense (2614.9 with sparsity), FP8
    # 2614.9, 750 W
    ("mi300x", 192, 5.3e12, {"bf16": 1307.4e12, "fp8": 2614.9e12, "fp32": 163.4e12}, 750),
    # MI250X/MI250 data sheets, per card halved per GCD (ROCm's one GPU): 64 GB, 1.6384 TB/s
    ("mi250x", 64, 1.6384e12, {"bf16": 191.5e12}, 250),
    ("mi250", 64, 1.6384e12, {"bf16": 181.05e12}, 250),
    # GH200 datasheet: the H100's 989 TFLOP/s BF16 with 96 GB at 4 TB/s or 144 GB at 4.9 TB/s
    ("gh200-96gb", 96, 4.0e12, {"bf16": 989.4e12, "fp8": 1978.9e12}, 1000),
    ("gh200-144gb", 144, 4.9e12, {"bf16": 989.4e12}, 1000),
    ("h20", 96, 4.0e12, {"bf16": 148e12, "fp8": 296e12}, 400),
    # V100 datasheet: 125 TFLOP/s tensor (FP16) on SXM2, 112 on PCIe; 900 GB/s
    ("v100-sxm2-16gb", 16, 900e9, {"fp16": 125e12, "fp32": 15.7e12}, 300),
    ("v100-sxm2-32gb", 32, 900e9, {"fp16": 125e12}, 300),
    ("v100-pcie-32gb", 32, 900e9, {"fp16": 112e12}, 250),
    # GA102 whitepaper: RTX A6000 154.8 TFLOP/s BF16 dense; RTX 3090 71 (FP32 accumulate); 3090 Ti at its clocks
    ("rtx-a6000", 48, 768e9, {"bf16": 154.8e12, "tf32": 77.4e12}, 300),
    ("rtx-3090", 24, 936e9, {"bf16": 71e12, "fp32": 35.6e12}, 350),
    ("rtx-3090-ti", 24, 1008e9, {"bf16": 80e12}, 450),
    ("l40", 48, 864e9, {"bf16": 181.05e12}, 300),
    ("b200", 180, 8e12, {"bf16": 2.25e15}, 1000),
])
def test_new_rows_carry_their_datasheet_figures(key: str, memory_gib: int, bandwidth: float,
                                                flops: dict[str, float], tdp: float) -> None:
    spec = GPUS[key]
    assert spec.memory_bytes == memory_gib * GIB and spec.hbm_bytes_per_s == pytest.approx(bandwidth)
    assert spec.tdp_w == tdp and spec.source and spec.arch
    for dtype, value in flops.items():
        assert spec.flops[dtype] == pytest.approx(value)


def test_v100_has_no_bf16_tensor_rate() -> None:
    v100 = GPUS["v100-sxm2-32gb"]
    assert "bf16" not in v100.flops and "tf32" not in v100.flops
    assert compute_dtype(v100, "bf16") == "fp32" and compute_dtype(v100, "fp16") == "fp16"


@pytest.mark.parametrize(("name", "memory", "key"), [
    ("AMD Instinct MI300X", 192 * GIB, "mi300x"),
    ("AMD Instinct MI250X", 64 * GIB, "mi250x"),
    ("AMD Instinct MI250", 64 * GIB, "mi250"),
    ("NVIDIA GH200 480GB", 97871 * 1024**2, "gh200-96gb"),  # 480 GB is the LPDDR5X; the HBM is 96 GB
    ("NVIDIA GH200 144G HBM3e", None, "gh200-144gb"),
    ("NVIDIA H20", 97871 * 1024**2, "h20"),
    ("Tesla V100-SXM2-16GB", None, "v100-sxm2-16gb"),
    ("Tesla V100-SXM2-32GB", None, "v100-sxm2-32gb"),
    ("Tesla V100-PCIE-32GB", None, "v100-pcie-32gb"),
    ("Tesla V100S-PCIE-32GB", None, "v100s-pcie"),
    ("NVIDIA RTX A6000", None, "rtx-a6000"),
    ("NVIDIA GeForce RTX 3090", None, "rtx-3090"),
    ("NVIDIA GeForce RTX 3090 Ti", None, "rtx-3090-ti"),
    ("NVIDIA GeForce RTX 4090", None, "rtx-4090"),
])
def test_device_names_of_the_new_rows(name: str, memory: int | None, key: str) -> None:
    spec = match_gpu(name, memory)
    assert spec is not None and spec.key == key


@pytest.mark.parametrize("name", [
    "NVIDIA GeForce RTX 4090 Laptop GPU",  # 16 GB at 576 GB/s: 1.75x below the desktop card
    "NVIDIA GeForce RTX 3080 Ti Laptop GPU",
    "NVIDIA RTX A5000 Laptop GPU",
    "NVIDIA GeForce RTX 2080 with Max-Q Design",
    "NVIDIA GeForce RTX 4090 Mobile",
    "AMD Instinct MI250X/MI250",  # amd-smi's market name for either part
    "Tesla V100-SXM3-32GB",  # DGX-2's V100: clocks the table does not hold
])
def test_laptop_and_ambiguous_names_never_match_a_desktop_row(name: str) -> None:
    assert match_gpu(name) is None
    with pytest.raises(InputError, match="--gpu-spec"):
        get_gpu(name)


def test_a_variant_with_much_more_memory_than_its_row_is_not_matched() -> None:
    assert match_gpu("NVIDIA H20", 141 * GIB) is None  # the 141 GB HBM3e H20 is not the 96 GB row


@pytest.mark.parametrize(("text", "key", "others"), [
    ("A100", "a100-80gb-sxm", ("a100-40gb-sxm", "a100-80gb-pcie", "a100-40gb-pcie")),
    ("a100-40gb", "a100-40gb-sxm", ("a100-40gb-pcie",)),
    ("NVIDIA A100-SXM4", "a100-80gb-sxm", ("a100-40gb-sxm",)),
    ("H100", "h100-sxm", ("h100-pcie", "h100-nvl")),
    ("V100", "v100-sxm2-32gb", ("v100-sxm2-16gb",)),
    ("GH200", "gh200-96gb", ("gh200-144gb",)),
])
def test_a_family_name_says_which_part_it_took(text: str, key: str, others: tuple[str, ...]) -> None:
    spec, note = resolve_gpu(text)
    assert spec.key == key
    assert spec.name in note and all(other in note for other in others) and note.endswith(".")


@pytest.mark.parametrize("text", ["a100-80gb-sxm", "NVIDIA A100-SXM4-40GB", "mi300x", "h100-sxm", "RTX 3090"])
def test_an_exact_name_needs_no_note(text: str) -> None:
    assert resolve_gpu(text)[1] == ""
