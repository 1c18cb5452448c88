"""The physics package: GPU table and matching, model shapes from configs, and the roofline formulas."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import msgspec
import pytest

from diagnoser.capture import ModelInfo, ServingConfig
from diagnoser.errors import InputError
from diagnoser.physics import (
    GPUS,
    bundled_models,
    bytes_per_element,
    compute_dtype,
    cost_per_million_tokens,
    decode_bound,
    decode_ceiling_tokens_per_s,
    decode_compute_s,
    decode_floor_s,
    decode_step_bytes,
    fits,
    get_gpu,
    kv_bytes_per_token,
    load_bundled_model,
    load_hf_config,
    match_gpu,
    max_concurrent_sequences,
    model_from_params,
    normalise_dtype,
    parse_param_count,
    peak_flops,
    prefill_time_s,
    resolve_model,
    ridge_batch,
    ridge_point,
    tokens_per_joule,
    weight_bytes,
    weights_read_bytes,
    what_if,
    with_measured,
)

GIB = 1024**3


def gpu_with_bandwidth(key: str, bytes_per_s: float):
    return dataclasses.replace(get_gpu(key), hbm_bytes_per_s=bytes_per_s)


# --- GPU table -----------------------------------------------------------------------------------------------

def test_every_entry_is_complete_and_dense() -> None:
    allowed = {"fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4"}
    for key, spec in GPUS.items():
        assert spec.key == key
        assert set(spec.flops) <= allowed, key
        assert spec.memory_bytes >= 16 * GIB and spec.hbm_bytes_per_s > 1e11 and spec.tdp_w > 0
        assert spec.source and spec.arch and spec.interconnect and spec.pcie_bytes_per_s > 0
        # tensor-core 16-bit beats plain FP32 everywhere; dense, so no 2:4-sparse doubling of the datasheet
        assert spec.flops.get("fp16", 0) > spec.flops["fp32"]


@pytest.mark.parametrize(
    ("key", "memory_gib", "bandwidth", "flops"),
    [
        ("h100-sxm", 80, 3.35e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 67e12}),
        ("a100-80gb-sxm", 80, 2.039e12, {"bf16": 312e12, "tf32": 156e12, "int8": 624e12}),
        ("a100-40gb-sxm", 40, 1.555e12, {"bf16": 312e12}),
        ("a100-80gb-pcie", 80, 1.935e12, {"fp16": 312e12}),
        ("h200", 141, 4.8e12, {"bf16": 989.4e12}),
        ("b200", 180, 8e12, {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15}),  # HGX B200: FP4 144 PF sparse / 8 / 2
        ("l4", 24, 300e9, {"bf16": 121e12, "fp8": 242.5e12}),
        ("t4", 16, 320e9, {"fp16": 65e12}),
        ("a10g", 24, 600e9, {"bf16": 70e12}),
        ("l40s", 48, 864e9, {"bf16": 362.05e12}),
    ],
)
def test_datasheet_numbers(key: str, memory_gib: int, bandwidth: float, flops: dict[str, float]) -> None:
    spec = GPUS[key]
    assert spec.memory_bytes == memory_gib * GIB
    assert spec.hbm_bytes_per_s == pytest.approx(bandwidth)
    for dtype, value in flops.items():
        assert spec.flops[dtype] == pytest.approx(value)


def test_precisions_a_gpu_lacks_are_absent() -> None:
    assert "fp8" not in GPUS["a100-80gb-sxm"].flops
    assert "bf16" not in GPUS["t4"].flops and "tf32" not in GPUS["t4"].flops


def test_spec_is_frozen_and_its_flops_read_only() -> None:
    spec = GPUS["h100-sxm"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tdp_w = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.flops["bf16"] = 1.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("nvml_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100-sxm-mig-1g.10gb"),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "a100-40gb-sxm-mig-3g.20gb"),
    ],
)
def test_match_gpu_on_real_nvml_names(nvml_name: str, key: str) -> None:
    spec = match_gpu(nvml_name)
    assert spec is not None and spec.key == key


def test_match_gpu_unknown_names() -> None:
    assert match_gpu("Tesla P100-PCIE-16GB") is None  # (V100 has rows since the table grew)
    assert match_gpu("NVIDIA GeForce GTX 1080") is None
    assert match_gpu("") is None


def test_memory_picks_between_sizes_but_not_for_a_mig_slice() -> None:
    assert match_gpu("NVIDIA A100-SXM4", 40 * GIB).key == "a100-40gb-sxm"  # type: ignore[union-attr]
    assert match_gpu("NVIDIA A100-SXM4", 81920 * 1024**2).key == "a100-80gb-sxm"  # type: ignore[union-attr]
    # a MIG slice reports its own 10 GB; the parent is still the 80 GB part, scaled to the slice
    mig = match_gpu("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10 * GIB)
    assert mig is not None and mig.key == "a100-80gb-sxm-mig-1g.10gb"
    assert mig.hbm_bytes_per_s == pytest.approx(GPUS["a100-80gb-sxm"].hbm_bytes_per_s / 8)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("H100", "h100-sxm"),
        ("h100-sxm", "h100-sxm"),
        ("H100 PCIe", "h100-pcie"),
        ("A100-80GB", "a100-80gb-sxm"),
        ("a100", "a100-80gb-sxm"),
        ("A100_40GB", "a100-40gb-sxm"),
        ("a100-pcie", "a100-80gb-pcie"),
        ("4090", "rtx-4090"),
        ("NVIDIA L40S", "l40s"),
    ],
)
def test_get_gpu_user_spellings(text: str, key: str) -> None:
    assert get_gpu(text).key == key


def test_get_gpu_unknown_lists_known_keys() -> None:
    with pytest.raises(InputError) as err:
        get_gpu("P100")
    assert "h100-sxm" in str(err.value) and "t4" in str(err.value)
    assert str(err.value).endswith(".")


def test_ridge_point_h100_bf16_is_about_300() -> None:
    assert ridge_point(GPUS["h100-sxm"], "bf16") == pytest.approx(989.4e12 / 3.35e12)
    assert 290 < ridge_point(GPUS["h100-sxm"], "bf16") < 300
    assert ridge_point(GPUS["h100-sxm"], "fp8") == pytest.approx(2 * ridge_point(GPUS["h100-sxm"], "bf16"), rel=1e-3)


def test_compute_precision_falls_back_for_weight_only_quantisation() -> None:
    assert compute_dtype(GPUS["h100-sxm"], "int4") == "bf16"
    assert compute_dtype(GPUS["a100-80gb-sxm"], "fp8") == "bf16"  # no FP8 units on Ampere
    assert compute_dtype(GPUS["t4"], "int4") == "fp16"
    assert compute_dtype(GPUS["t4"], "bf16") == "fp32"
    assert compute_dtype(GPUS["h100-sxm"], "tf32") == "tf32"
    assert peak_flops(GPUS["h100-sxm"], "int4") == GPUS["h100-sxm"].flops["bf16"]


def test_with_measured_replaces_roofs() -> None:
    spec = with_measured(GPUS["h100-sxm"], {"hbm_bytes_per_s": 2.9e12, "bf16_flops": 700e12})
    assert spec.hbm_bytes_per_s == 2.9e12 and spec.flops["bf16"] == 700e12
    assert spec.flops["fp8"] == GPUS["h100-sxm"].flops["fp8"]
    assert GPUS["h100-sxm"].flops["bf16"] == 989.4e12  # the table entry is untouched


# --- precisions ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "dtype"),
    [("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("fp16", "fp16"), ("float16", "fp16"),
     ("half", "fp16"), ("fp8", "fp8"), ("e4m3", "fp8"), ("float8_e4m3fn", "fp8"), ("int8", "int8"),
     ("int4", "int4"), ("fp32", "fp32"), ("float32", "fp32"), ("tf32", "tf32"), ("FP16", "fp16")],
)
def test_normalise_dtype(text: str, dtype: str) -> None:
    assert normalise_dtype(text) == dtype


def test_unknown_dtype_is_input_error() -> None:
    with pytest.raises(InputError, match="unknown precision"):
        normalise_dtype("fp5")


def test_bytes_per_element() -> None:
    assert [bytes_per_element(d) for d in ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4", "fp4")] == [
        4, 4, 2, 2, 1, 1, 0.5, 0.5]
    assert [normalise_dtype(d) for d in ("nvfp4", "mxfp4", "e2m1")] == ["fp4"] * 3


# --- model shapes --------------------------------------------------------------------------------------------

def test_bundled_models_are_the_expected_ones() -> None:
    assert set(bundled_models()) == {"llama-2-7b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b-v0.1",
                                     "mixtral-8x7b-v0.1", "qwen2.5-0.5b", "qwen3-8b-base", "gpt-j-6b"}


@pytest.mark.parametrize(
    ("name", "params", "active"),
    [
        # exact counts from the shape; they equal the published sizes (6.74B, 69.0B, 8.03B, 7.24B, 46.7B/12.9B, 0.49B)
        ("llama-2-7b", 6_738_415_616, 6_738_415_616),
        ("llama-2-70b", 68_976_648_192, 68_976_648_192),
        ("llama-3.1-8b", 8_030_261_248, 8_030_261_248),
        ("mistral-7b-v0.1", 7_241_732_096, 7_241_732_096),
        ("mixtral-8x7b-v0.1", 46_702_792_704, 12_879_925_248),
        ("qwen2.5-0.5b", 494_032_768, 494_032_768),
        ("llama-3.1-70b", 70_553_706_496, 70_553_706_496),
        # Qwen3 adds an RMSNorm of head_dim weights on q and on k in every layer: 36 x 2 x 128 = 9,216 more.
        ("qwen3-8b-base", 8_190_735_360, 8_190_735_360),
        # GPT-J: one LayerNorm (weight and bias) per layer, biased MLP and lm_head, no q/k/v/o bias:
        # 28 x (4 x 4096^2 + 2 x 4096 x 16384 + 16384 + 4096 + 2 x 4096) + 2 x 50400 x 4096 + 50400 + 2 x 4096
        # = 6,050,882,784 (the model card says 6,053,381,344, 0.04 % more).
        ("gpt-j-6b", 6_050_882_784, 6_050_882_784),
    ],
)
def test_parameter_counts_from_bundled_configs(name: str, params: int, active: int) -> None:
    model = load_bundled_model(name)
    assert model.params == params and model.active_params == active


def test_bundled_shapes_and_dtypes() -> None:
    llama = load_bundled_model("llama-2-7b")
    assert llama.params == pytest.approx(6.74e9, rel=1e-3)
    assert (llama.layers, llama.heads, llama.kv_heads, llama.head_dim, llama.dtype) == (32, 32, 32, 128, "fp16")
    mixtral = load_bundled_model("mixtral-8x7b-v0.1")
    assert mixtral.params == pytest.approx(46.7e9, rel=1e-3)
    assert mixtral.active_params == pytest.approx(12.9e9, rel=2e-3)
    assert (mixtral.kv_heads, mixtral.dtype, mixtral.max_context) == (8, "bf16", 32768)


def test_gpt2_style_config_counts_biases_and_positions(tmp_path: Path) -> None:
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
           "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert load_hf_config(tmp_path).params == 124_439_808  # GPT-2 small, "124M"


def _write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


LLAMA_LIKE = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False}


def test_missing_kv_heads_and_head_dim_default_from_heads(tmp_path: Path) -> None:
    model = load_hf_config(_write(tmp_path, LLAMA_LIKE))
    assert model.kv_heads == 32 and model.head_dim == 128
    assert model.params == 6_738_415_616  # same shape as Llama-2-7b
    assert model.dtype == ""


def test_dtype_from_torch_dtype_dtype_and_quantization(tmp_path: Path) -> None:
    assert load_hf_config(_write(tmp_path, {**LLAMA_LIKE, "dtype": "bfloat16"})).dtype == "bf16"
    awq = {**LLAMA_LIKE, "torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4}}
    assert load_hf_config(_write(tmp_path, awq)).dtype == "int4"
    fp8 = {**LLAMA_LIKE, "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}
    assert load_hf_config(_write(tmp_path, fp8)).dtype == "fp8"


@pytest.mark.parametrize(("quant", "dtype"), [
    # compressed-tensors (llm-compressor / RedHatAI checkpoints): the weights' num_bits and type say it.
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}, "fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}, "int8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, "int4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "int4"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8"),
    ({"quant_method": "mxfp4"}, "fp4"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "int8"),
    # A config that names no stored precision leaves torch_dtype in charge.
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"]}}}, "bf16"),
])
def test_dtype_from_every_quantization_config_spelling(tmp_path: Path, quant: dict, dtype: str) -> None:
    cfg = {**LLAMA_LIKE, "torch_dtype": "bfloat16", "quantization_config": quant}
    assert load_hf_config(_write(tmp_path, cfg)).dtype == dtype


def test_tied_embeddings_count_once(tmp_path: Path) -> None:
    untied = load_hf_config(_write(tmp_path, LLAMA_LIKE)).params
    tied = load_hf_config(_write(tmp_path, {**LLAMA_LIKE, "tie_word_embeddings": True})).params
    assert untied - tied == 32000 * 4096  # the lm_head


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"), ('{"hidden_size": 4096}', "no num_hidden"),
     ('{"hidden_size": -1, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10}', "positive")],
)
def test_bad_config_files_are_input_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_hf_config(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no config file"):
        load_hf_config(tmp_path / "absent.json")
    with pytest.raises(InputError, match="no config file"):
        load_hf_config(tmp_path)  # a folder without config.json


def test_resolve_model_by_name_id_prefix_and_path(tmp_path: Path) -> None:
    assert resolve_model("Llama-2-7b").params == 6_738_415_616
    assert resolve_model("meta-llama/Llama-2-7b-hf").params == 6_738_415_616
    assert resolve_model("mixtral-8x7b").name == "mistralai/Mixtral-8x7B-v0.1"
    assert resolve_model(str(_write(tmp_path, LLAMA_LIKE))).params == 6_738_415_616
    with pytest.raises(InputError, match="bundled"):
        resolve_model("llama")  # ambiguous prefix
    with pytest.raises(InputError, match="no config file"):
        resolve_model(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(("text", "value"), [("7e9", 7e9), ("7B", 7e9), ("70b", 70e9), ("500M", 5e8),
                                             ("1.5T", 1.5e12), ("405000000000", 405e9)])
def test_parse_param_count(text: str, value: float) -> None:
    assert parse_param_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "7x", "-7e9", "0"])
def test_parse_param_count_rejects(text: str) -> None:
    with pytest.raises(InputError):
        parse_param_count(text)


def test_model_from_params() -> None:
    model = model_from_params(7e9, layers=32, heads=32, hidden=4096)
    assert (model.kv_heads, model.head_dim, model.active_params) == (32, 128, 7e9)
    with pytest.raises(InputError):
        model_from_params(7e9, active_params=8e9)
    with pytest.raises(InputError):
        model_from_params(7e9, layers=0)


# --- formulas ------------------------------------------------------------------------------------------------

SEVEN_B = model_from_params(7e9, dtype="fp16")
SEVENTY_B = model_from_params(70e9, dtype="fp16")


def test_7b_fp16_on_a100_decodes_about_143_tokens_per_s() -> None:
    a100 = gpu_with_bandwidth("a100-80gb-sxm", 2.0e12)
    assert weight_bytes(SEVEN_B) == 14e9
    assert decode_floor_s(SEVEN_B, a100) == pytest.approx(7e-3)
    assert decode_ceiling_tokens_per_s(SEVEN_B, a100) == pytest.approx(142.9, rel=1e-3)
    # with the datasheet's 2.039 TB/s
    assert decode_ceiling_tokens_per_s(SEVEN_B, GPUS["a100-80gb-sxm"]) == pytest.approx(145.6, rel=1e-3)


def test_70b_fp16_on_h100_bandwidth_gives_about_24_tokens_per_s() -> None:
    h100 = GPUS["h100-sxm"]
    assert weight_bytes(SEVENTY_B) == 140e9
    assert h100.hbm_bytes_per_s / weight_bytes(SEVENTY_B) == pytest.approx(23.9, rel=2e-3)
    assert decode_ceiling_tokens_per_s(SEVENTY_B, h100) == pytest.approx(23.9, rel=2e-3)
    # tensor parallel splits the bytes, so bandwidth adds up across GPUs
    assert decode_ceiling_tokens_per_s(SEVENTY_B, h100, tp=2) == pytest.approx(2 * 23.93, rel=2e-3)


def test_405b_fp16_fits_no_single_gpu() -> None:
    model = model_from_params(405e9, dtype="fp16")
    for key in ("a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "h100-nvl", "h200", "b200"):
        assert not fits(model, GPUS[key]), key
    assert fits(model, GPUS["h200"], tp=8)


def test_fits_follows_memory_fraction_and_tp() -> None:
    h100 = GPUS["h100-sxm"]
    assert fits(SEVEN_B, h100)
    assert not fits(SEVENTY_B, h100)
    assert fits(SEVENTY_B, h100, tp=2)
    assert fits(SEVENTY_B, h100, "fp8")
    assert not fits(model_from_params(70e9), GPUS["h200"], "fp16", mem_fraction=0.9)  # 140 GB > 0.9 x 141 GiB
    assert fits(model_from_params(70e9), GPUS["h200"], "fp16", mem_fraction=0.95)


def test_kv_bytes_per_token_llama_2_70b() -> None:
    llama70 = load_bundled_model("llama-2-70b")
    assert kv_bytes_per_token(llama70) == 2 * 80 * 8 * 128 * 2 == 327_680
    flags = model_from_params(70e9, layers=80, kv_heads=8, head_dim=128, dtype="fp16")
    assert kv_bytes_per_token(flags) == 327_680
    assert kv_bytes_per_token(llama70, "fp8") == 163_840
    # per GPU: 8 heads over 8 GPUs is one each; over 16 GPUs heads are replicated, still one each
    assert kv_bytes_per_token(llama70, tp=8) == 40_960
    assert kv_bytes_per_token(llama70, tp=16) == 40_960
    assert kv_bytes_per_token(load_bundled_model("llama-2-7b")) == 524_288


def test_kv_without_shape() -> None:
    with pytest.raises(InputError, match="KV cache"):
        kv_bytes_per_token(SEVEN_B)
    with pytest.raises(InputError, match="KV cache"):
        max_concurrent_sequences(SEVEN_B, GPUS["h100-sxm"], 2048)
    # the ceilings leave the unknown KV reads out, so they stay upper bounds
    assert decode_step_bytes(SEVEN_B, 1, 2048) == decode_step_bytes(SEVEN_B, 1, 0) == 14e9
    assert ridge_batch(SEVEN_B, GPUS["h100-sxm"], context=2048) == ridge_batch(SEVEN_B, GPUS["h100-sxm"])


def test_observed_mean_batch_and_context_are_accepted() -> None:
    llama = load_bundled_model("llama-2-7b")
    h100 = GPUS["h100-sxm"]
    low, mid, high = (decode_ceiling_tokens_per_s(llama, h100, b, 1500.5) for b in (12.0, 12.4, 13.0))
    assert low < mid < high


# Llama-2-7b by part: the embedding table and lm_head are 32000 x 4096 = 131,072,000 each, the norms
# 4096 x (2 x 32 + 1) = 266,240, and the linear layers the rest: 6,738,415,616 - 2 x 131,072,000 - 266,240.
L7_TABLE, L7_NORMS = 131_072_000, 266_240
L7_LINEAR = 6_738_415_616 - 2 * L7_TABLE - L7_NORMS  # 6,476,005,376
# A decode step reads the linear layers, lm_head and norms whole, and one embedding row (4096) per sequence.
L7_READ_FP16 = (L7_LINEAR + L7_TABLE + L7_NORMS) * 2  # 13,214,687,232 bytes, plus 8,192 a sequence


def test_kv_dtype_defaults_to_16_bits_for_quantised_weights() -> None:
    llama = load_bundled_model("llama-2-7b")
    # INT4 at the default group of 128 with an FP16 scale: 0.5 + 2 / 128 bytes a linear weight; lm_head, the
    # embedding and norms stay 16-bit; the KV cache stays 16-bit: 2 x 32 x 32 x 128 x 2 = 524,288 bytes a token.
    int4_read = L7_LINEAR * (0.5 + 2 / 128) + (L7_TABLE + L7_NORMS) * 2 + 4096 * 2
    assert decode_step_bytes(llama, 1, 1000, dtype="int4") == pytest.approx(int4_read + 1000 * 524_288)


def test_decode_step_bytes_adds_kv_per_sequence() -> None:
    llama = load_bundled_model("llama-2-7b")
    assert weights_read_bytes(llama, 4) == L7_READ_FP16 + 4 * 8192
    assert decode_step_bytes(llama, 4, 2048) == pytest.approx(L7_READ_FP16 + 4 * 8192 + 4 * 2048 * 524_288)
    assert decode_step_bytes(llama, 4, 2048, tp=2) == pytest.approx(
        (L7_READ_FP16 + 4 * 8192) / 2 + 4 * 2048 * 524_288 / 2)


def test_max_concurrent_sequences() -> None:
    llama = load_bundled_model("llama-2-7b")
    h100 = GPUS["h100-sxm"]
    expected = math.floor((0.9 * 80 * GIB - 6_738_415_616 * 2) / (2048 * 524_288))
    assert max_concurrent_sequences(llama, h100, 2048) == expected == 59
    assert max_concurrent_sequences(llama, h100, 4096) == math.floor((0.9 * 80 * GIB - 6_738_415_616 * 2)
                                                                     / (4096 * 524_288))
    assert max_concurrent_sequences(llama, h100, 2048, tp=2) > 2 * expected  # weights halve as well
    assert max_concurrent_sequences(load_bundled_model("llama-2-70b"), h100, 2048) == 0  # weights do not fit
    with pytest.raises(InputError):
        max_concurrent_sequences(llama, h100, 0)


def test_what_if_fp16_to_fp8_doubles_batch_1_decode() -> None:
    result = what_if(SEVEN_B, GPUS["h100-sxm"], "fp16", 1, 0, 1, new_dtype="fp8")
    assert result.speedup == pytest.approx(2.0, rel=1e-6)
    assert result.after_tokens_per_s == pytest.approx(2 * result.before_tokens_per_s)
    assert "memory-bound" in result.explanation and "fp16 -> fp8" in result.explanation


def test_what_if_less_than_double_with_a_kv_cache() -> None:
    llama = load_bundled_model("llama-2-7b")
    result = what_if(llama, GPUS["h100-sxm"], "fp16", 1, 2048, 1, new_dtype="fp8")
    assert result.speedup is not None and 1.5 < result.speedup < 2.0  # the 16-bit KV cache still has to be read


def test_what_if_gpu_batch_tp_and_not_fitting() -> None:
    llama = load_bundled_model("llama-2-7b")
    h100 = GPUS["h100-sxm"]
    to_h200 = what_if(llama, h100, "fp16", 1, 0, 1, new_gpu=GPUS["h200"])
    assert to_h200.speedup == pytest.approx(4.8 / 3.35)
    # TP 2 halves the bytes but adds 2 x 32 all-reduces of 4096 x 2 bytes (5 us + 2 x 1/2 x 8192 B at 450 GB/s
    # each way over NVLink 4) and one gather of 32000 x 2 bytes of logits (5 us + 1/2 x 64000 B / 450 GB/s).
    step = (L7_READ_FP16 + 8192) / 3.35e12
    comm = 64 * (5e-6 + 8192 / 450e9) + (5e-6 + 32_000 / 450e9)
    to_tp2 = what_if(llama, h100, "fp16", 1, 0, 1, new_tp=2)
    assert to_tp2.speedup == pytest.approx(step / (step / 2 + comm))  # 1.716: sublinear
    assert any("NVLink 4" in a and "all-reduces" in a for a in to_tp2.assumptions)
    assert what_if(llama, h100, "fp16", 1, 0, 1, new_batch=8).speedup == pytest.approx(8.0, rel=1e-3)
    too_big = what_if(llama, h100, "fp16", 1, 2048, 1, new_batch=64)  # KV for 64 x 2048 tokens is 68.7 GB
    assert too_big.after_tokens_per_s == 0 and "KV cache" in too_big.explanation
    rescued = what_if(load_bundled_model("llama-2-70b"), h100, "fp16", 1, 0, 1, new_tp=2)
    assert rescued.speedup is None and rescued.after_tokens_per_s > 0 and "fits" in rescued.explanation


def test_ridge_batch_formula() -> None:
    h100 = GPUS["h100-sxm"]
    ridge = ridge_point(h100, "bf16")
    dense = load_bundled_model("llama-3.1-8b")
    # 16-bit dense: B* = R x 2 x M / (2 x M), M the matrix parameters (all but the embedding lookup)
    assert ridge_batch(dense, h100) == pytest.approx(ridge)
    # INT4 (0.5 + 2/128 bytes a linear weight; lm_head 128256 x 4096 and norms 4096 x 65 stay 16-bit), 16-bit math
    table, norms = 128_256 * 4096, 4096 * 65
    linear = 8_030_261_248 - 2 * table - norms
    int4_bytes = linear * (0.5 + 2 / 128) + (table + norms) * 2
    assert ridge_batch(dense, h100, "int4") == pytest.approx(ridge * int4_bytes / (2 * (linear + table + norms)))
    moe = load_bundled_model("mixtral-8x7b-v0.1")
    table = 32_000 * 4096
    assert ridge_batch(moe, h100) == pytest.approx(ridge * 2 * (moe.params - table) / (2 * (moe.active_params - table)))


def test_ridge_batch_with_context_matches_the_ridge_intensity() -> None:
    h100 = GPUS["h100-sxm"]
    llama = load_bundled_model("llama-3.1-8b")
    b = ridge_batch(llama, h100, context=256)
    table = 128_256 * 4096
    # per sequence: 2 FLOP per matrix weight, and attention 4 x 32 layers x 32 heads x 128 x 256 tokens
    flops = b * (2 * (llama.active_params - table) + 4 * 32 * 32 * 128 * 256)
    moved = weight_bytes(llama) - 2 * table + b * 256 * kv_bytes_per_token(llama)
    assert flops / moved == pytest.approx(ridge_point(h100, "bf16"))
    # at a long context the KV bytes grow with the batch as fast as the FLOPs: never compute-bound
    assert ridge_batch(llama, h100, context=4096) == math.inf


def test_ceiling_grows_with_batch_then_flattens_past_the_ridge() -> None:
    h100 = GPUS["h100-sxm"]
    b_star = ridge_batch(SEVEN_B, h100)
    plateau = h100.flops["fp16"] / (2 * 7e9)

    def at(batch: float) -> float:
        return decode_ceiling_tokens_per_s(SEVEN_B, h100, int(batch))

    assert at(b_star / 8) == pytest.approx(2 * at(b_star / 16), rel=0.02)  # linear below the ridge
    assert at(2 * b_star) == pytest.approx(plateau)
    assert at(8 * b_star) == pytest.approx(plateau)  # flat above it
    assert at(b_star / 2) < 0.55 * plateau
    assert decode_bound(SEVEN_B, h100, int(b_star / 2)) == "memory"
    assert decode_bound(SEVEN_B, h100, int(2 * b_star)) == "compute"


def test_decode_compute_time() -> None:
    h100 = GPUS["h100-sxm"]
    assert decode_compute_s(SEVEN_B, h100, 10) == pytest.approx(2 * 7e9 * 10 / 989.4e12)
    assert decode_compute_s(SEVEN_B, h100, 10, dtype="fp8") == pytest.approx(2 * 7e9 * 10 / 1978.9e12)


def test_moe_reads_routed_experts_at_small_batch() -> None:
    moe = load_bundled_model("mixtral-8x7b-v0.1")
    # one token: its routed experts, attention, lm_head and norms, and one embedding row (not the whole table)
    assert weights_read_bytes(moe, 1) == pytest.approx((moe.active_params - 32_000 * 4096 + 4096) * 2)
    assert weights_read_bytes(moe, 32_000) == pytest.approx(weight_bytes(moe))
    assert weights_read_bytes(moe, 1) < weights_read_bytes(moe, 2) < weights_read_bytes(moe, 8)
    # dense models read everything, whatever the batch
    assert weights_read_bytes(SEVEN_B, 1) == weight_bytes(SEVEN_B)


def test_prefill_time() -> None:
    h100 = GPUS["h100-sxm"]
    llama = load_bundled_model("llama-2-7b")
    # 2 FLOP per matrix weight per token, plus causal attention: 4 x 32 x 32 x 128 FLOP per key, s(s+1)/2 pairs
    matmul = 2 * (6_738_415_616 - L7_TABLE) * 2048
    attention = 4 * 32 * 32 * 128 * 2048 * 2049 / 2
    assert prefill_time_s(llama, h100, 2048) == pytest.approx((matmul + attention) / 989.4e12)
    # four prompts of 512: the same matrix work, a quarter of the attention of one 2048-token prompt (about)
    assert prefill_time_s(llama, h100, 2048, sequence_tokens=512) == pytest.approx(
        (matmul + 4 * 4 * 32 * 32 * 128 * 512 * 513 / 2) / 989.4e12)
    # one token cannot be faster than reading the weights once and writing its KV cache
    assert prefill_time_s(llama, h100, 1) == pytest.approx((L7_READ_FP16 + 8192 + 524_288) / 3.35e12)
    # TP 2: half the work each, plus 2 x 32 all-reduces of 2048 x 4096 x 2 bytes and a gather of 2048 x 32000 x 2
    comm = 64 * (5e-6 + 2048 * 4096 * 2 / 450e9) + (5e-6 + 2048 * 32_000 * 2 / 2 / 450e9)
    assert prefill_time_s(llama, h100, 2048, tp=2) == pytest.approx((matmul + attention) / 989.4e12 / 2 + comm)
    with pytest.raises(InputError):
        prefill_time_s(llama, h100, 0)


def test_bad_arguments_are_input_errors() -> None:
    h100 = GPUS["h100-sxm"]
    with pytest.raises(InputError):
        decode_ceiling_tokens_per_s(SEVEN_B, h100, batch=0)
    with pytest.raises(InputError):
        decode_ceiling_tokens_per_s(SEVEN_B, h100, tp=0)
    with pytest.raises(InputError, match="parameter count"):
        weight_bytes(ModelInfo())


def test_energy_and_cost() -> None:
    assert tokens_per_joule(1000, 500) == 2.0
    assert cost_per_million_tokens(1000, 3.6) == pytest.approx(1.0)  # 3.6 M tokens per hour for $3.60
    assert cost_per_million_tokens(1000, 3.6, gpus=2) == pytest.approx(2.0)
    assert cost_per_million_tokens(0, 3.6) == math.inf
    with pytest.raises(InputError):
        tokens_per_joule(1000, 0)


def test_serving_flags_set_the_precision_and_sharding_the_server_runs() -> None:
    from diagnoser.capture import new_capture
    from diagnoser.cli.attach import add_model
    from diagnoser.collectors.target import AttachTarget, serving_from_cmdline
    from diagnoser.physics import decode_ceiling_tokens_per_s, get_gpu
    from diagnoser.physics.models import with_serving_flags

    cmd = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama", "--quantization", "fp8",
           "--kv-cache-dtype=fp8_e5m2", "-tp", "2", "--dtype", "auto"]
    serving = serving_from_cmdline(cmd)
    assert serving.quantization == "fp8" and serving.kv_cache_dtype == "fp8_e5m2"
    assert serving.tensor_parallel_size == 2
    assert serving_from_cmdline(["text-generation-launcher", "--quantize", "bitsandbytes-nf4"]).quantization \
        == "bitsandbytes-nf4"
    assert serving_from_cmdline(["vllm", "serve", "m", "-q", "awq"]).quantization == "awq"

    llama = load_bundled_model("llama-2-7b")  # float16 checkpoint
    served, notes = with_serving_flags(llama, serving)
    assert (served.dtype, served.kv_dtype, served.tensor_parallel) == ("fp8", "fp8", 2)
    assert len(notes) == 3 and "--quantization fp8" in notes[0]
    h100 = get_gpu("h100-sxm")
    # Half the bytes per linear weight (lm_head, embedding and norms stay 16-bit), half the weights and KV per GPU,
    # plus TP 2's collectives: 2 x 32 all-reduces of 8192 bytes and a 64,000-byte logits gather over NVLink 4.
    before = decode_ceiling_tokens_per_s(llama, h100, batch=1, context=1024)
    after = decode_ceiling_tokens_per_s(served, h100, batch=1, context=1024, tp=served.tensor_parallel)
    before_s = (L7_READ_FP16 + 8192 + 1024 * 524_288) / 3.35e12
    fp8_read = L7_LINEAR * 1 + (L7_TABLE + L7_NORMS) * 2 + 8192
    after_s = (fp8_read / 2 + 1024 * 262_144 / 2) / 3.35e12 + 64 * (5e-6 + 8192 / 450e9) + 5e-6 + 32_000 / 450e9
    assert before == pytest.approx(1 / before_s) and after == pytest.approx(1 / after_s)
    assert after / before == pytest.approx(2.99, abs=0.01)  # not 4: the collectives and the 16-bit lm_head
    # What the flags do not change stays: a quantised checkpoint is not "upgraded" to FP8, auto means nothing.
    int4 = msgspec.structs.replace(llama, dtype="int4")
    assert with_serving_flags(int4, ServingConfig(quantization="fp8")) == (int4, [])
    assert with_serving_flags(llama, ServingConfig(dtype="auto", kv_cache_dtype="auto")) == (llama, [])
    assert with_serving_flags(llama, ServingConfig(quantization="awq")) == (llama, [])  # the checkpoint's config says the bits
    bare = msgspec.structs.replace(llama, dtype="")
    assert with_serving_flags(bare, ServingConfig(dtype="bfloat16"))[0].dtype == "bf16"
    sharded = msgspec.structs.replace(llama, tensor_parallel=4)
    assert with_serving_flags(sharded, ServingConfig(tensor_parallel_size=2))[0].tensor_parallel == 4  # --model said so

    # attach: the model from the server's command line, then its flags, with a note saying so.
    capture = new_capture("pid 1", started_at=0.0, duration_s=10.0)
    capture.serving = msgspec.structs.replace(serving)
    config = Path(__file__).resolve().parents[1] / "diagnoser" / "data" / "models" / "llama-2-7b.json"
    add_model(capture, None, AttachTarget(pid=1, model_config=config, serving=serving))
    assert capture.model is not None and capture.model.dtype == "fp8" and capture.model.tensor_parallel == 2
    assert any(n.startswith("From the server's command line: weights served as fp8") for n in capture.notes)
