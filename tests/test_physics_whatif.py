"""Quantised weight bytes, tensor and pipeline parallelism, KV precision, and realised gains, each against a value
computed by hand in the test (docs/physics.md has the formulas)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics import (
    ATTAINABLE_BANDWIDTH,
    GPUS,
    PER_SEQUENCE_HOST_S,
    allgather_s,
    allreduce_s,
    attainable_shares,
    decode_ceiling_tokens_per_s,
    decode_compute_s,
    decode_step_bytes,
    decode_workload,
    generation_ceiling_tokens_per_s,
    interconnect,
    kv_capacity_tokens,
    kv_dtype_what_if,
    load_bundled_model,
    load_hf_config,
    max_concurrent_sequences,
    model_from_params,
    param_split,
    pipeline_decode,
    quant_scheme,
    realised_gain,
    realised_speedup,
    tp_comm_s,
    tp_what_if,
    weight_breakdown,
    weight_bytes,
    what_if,
    with_measured,
)

H100 = GPUS["h100-sxm"]
# Llama-2-7b by part: embedding and lm_head 32000 x 4096, norms 4096 x (2 x 32 + 1), linear the rest.
TABLE, NORMS = 131_072_000, 266_240
LINEAR = 6_738_415_616 - 2 * TABLE - NORMS
LLAMA_LIKE: dict[str, Any] = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
                              "tie_word_embeddings": False, "torch_dtype": "float16"}


def config(tmp_path: Path, quant: dict[str, Any]) -> ModelInfo:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_LIKE, "quantization_config": quant}))
    return load_hf_config(path)


def sixteen_bit(head_quantised: bool = False) -> float:
    return (TABLE + NORMS + (0 if head_quantised else TABLE)) * 2


# --- quantised weight bytes ----------------------------------------------------------------------------------

def test_param_split_untied_and_tied() -> None:
    split = param_split(load_bundled_model("llama-2-7b"))
    assert (split.linear, split.lm_head, split.embedding, split.norms) == (LINEAR, TABLE, TABLE, NORMS)
    assert LINEAR == 6_476_005_376
    # Qwen2.5-0.5B ties lm_head to the embedding: the table (151936 x 896) counts once, as lm_head
    tied = param_split(load_bundled_model("qwen2.5-0.5b"))
    assert (tied.lm_head, tied.embedding, tied.norms) == (151_936 * 896, 0, 896 * 49)
    # without vocab and hidden every parameter is a quantisable matrix
    assert param_split(model_from_params(7e9)).linear == 7e9


@pytest.mark.parametrize(("quant", "dtype", "per_weight", "head_quantised"), [
    # GPTQ, symmetric: an FP16 scale per 128 weights
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}, "int4", 0.5 + 2 / 128, False),
    # GPTQ asymmetric, lm_head quantised: scale + 4-bit zero point per group
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "lm_head": True}, "int4", 0.5 + 2.5 / 32,
     True),
    # GPTQ 3-bit (32 weights in three 32-bit words), symmetric: 3/8 byte a weight and an FP16 scale per 128
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}, "int3", 0.375 + 2 / 128, False),
    # GPTQ 2-bit, asymmetric: a quarter byte, and an FP16 scale + 2-bit zero point per 64
    ({"quant_method": "gptq", "bits": 2, "group_size": 64, "sym": False}, "int2", 0.25 + 2.25 / 64, False),
    # GPTQ per channel (group_size -1): one FP16 scale per row of 4096 weights
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, "int8", 1 + 2 / 4096, False),
    # AWQ: always a zero point; q_group_size is AutoAWQ's spelling
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True}, "int4", 0.5 + 2.5 / 64, False),
    # compressed-tensors NVFP4: E2M1 values, an FP8 scale per 16, lm_head ignored
    ({"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}, "fp4", 0.5 + 1 / 16, False),
    # compressed-tensors W4A16, asymmetric groups of 128
    ({"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}}}}, "int4",
     0.5 + 2.5 / 128, False),
    # compressed-tensors FP8 per channel with no ignore list: lm_head is a Linear target too
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}, "fp8", 1 + 2 / 4096, True),
    # FP8 with DeepSeek-style 128 x 128 blocks, an FP32 scale each
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", 1 + 4 / 16384, False),
    # vLLM/transformers FP8 without blocks: one scale per tensor
    ({"quant_method": "fp8"}, "fp8", 1.0, False),
    # OCP MXFP4: an E8M0 scale per 32
    ({"quant_method": "mxfp4"}, "fp4", 0.5 + 1 / 32, False),
    # bitsandbytes NF4: blocks of 64 with an FP32 absmax; double quantisation stores it in 8 bits (+ FP32 per 256)
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "int4", 0.5 + 4 / 64, False),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_use_double_quant": True}, "int4",
     0.5 + (1 + 4 / 256) / 64, False),
    # NVIDIA ModelOpt NVFP4
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "fp4", 0.5 + 1 / 16, False),
])
def test_weight_bytes_from_the_quantization_config(tmp_path: Path, quant: dict[str, Any], dtype: str,
                                                   per_weight: float, head_quantised: bool) -> None:
    model = config(tmp_path, quant)
    assert model.dtype == dtype
    head = TABLE * per_weight if head_quantised else 0.0
    assert weight_bytes(model) == pytest.approx(LINEAR * per_weight + head + sixteen_bit(head_quantised))
    assert quant_scheme(model).from_config


def test_defaults_when_the_config_does_not_say() -> None:
    llama = load_bundled_model("llama-2-7b")  # a 16-bit checkpoint: a what-if's precision gets its defaults
    assert weight_bytes(llama) == 6_738_415_616 * 2
    assert weight_bytes(llama, "int4") == pytest.approx(LINEAR * (0.5 + 2 / 128) + sixteen_bit())
    assert weight_bytes(llama, "int8") == pytest.approx(LINEAR * (1 + 2 / 4096) + sixteen_bit())
    assert weight_bytes(llama, "fp8") == pytest.approx(LINEAR + sixteen_bit())
    assert weight_bytes(llama, "fp4") == pytest.approx(LINEAR * (0.5 + 1 / 16) + sixteen_bit())  # NVFP4
    parts = weight_breakdown(llama, "int4")
    assert parts.sixteen_bit == pytest.approx(sixteen_bit()) and not parts.scheme.from_config
    # a model without vocab and hidden quantises every parameter, scales included
    assert weight_bytes(model_from_params(7e9), "int4") == pytest.approx(7e9 * (0.5 + 2 / 128))


def test_a_checkpoints_own_scheme_applies_only_at_its_precision(tmp_path: Path) -> None:
    awq = config(tmp_path, {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True})
    assert quant_scheme(awq).group_size == 64
    fp8 = quant_scheme(awq, "fp8")  # a what-if to FP8: FP8's defaults, not AWQ's groups
    assert (fp8.group_size, fp8.scale_bytes, fp8.lm_head) == (0, 0.0, False)


def test_fp8_weights_with_a_16_bit_kv_cache_read_16_bit_kv() -> None:
    llama = load_bundled_model("llama-2-7b")
    fp8 = msgspec.structs.replace(llama, dtype="fp8")
    # 2 x 32 layers x 32 heads x 128 x 2 bytes = 524,288 a token, not 262,144
    assert decode_step_bytes(fp8, 1, 1000) == pytest.approx(LINEAR + sixteen_bit() - TABLE * 2 + 8192
                                                            + 1000 * 524_288)
    assert decode_step_bytes(fp8, 1, 1000, kv_dtype="fp8") == pytest.approx(
        LINEAR + sixteen_bit() - TABLE * 2 + 8192 + 1000 * 262_144)


def test_quantisation_fields_survive_a_capture_round_trip() -> None:
    model = ModelInfo(name="m", params=7e9, dtype="int4", quant_method="awq", quant_group_size=64,
                      quant_scale_bytes=2.5, quant_lm_head=True, tied_embeddings=True)
    assert msgspec.json.decode(msgspec.json.encode(model), type=ModelInfo) == model
    # a capture written before these fields existed reads with their defaults
    old = msgspec.json.decode(b'{"name": "m", "params": 7e9, "dtype": "int4"}', type=ModelInfo)
    assert (old.quant_group_size, old.quant_lm_head, old.tied_embeddings) == (None, False, False)


# --- tensor parallelism --------------------------------------------------------------------------------------

def test_interconnect_from_the_gpu_table_and_overrides() -> None:
    nvlink = interconnect(H100, 8)
    assert (nvlink.name, nvlink.bytes_per_s, nvlink.latency_s) == ("NVLink 4", 450e9, 5e-6)  # 900 GB/s both ways
    pcie = interconnect(GPUS["l40s"], 2)
    assert (pcie.name, pcie.bytes_per_s, pcie.latency_s) == ("PCIe Gen4", 32e9, 10e-6)
    # an A100 PCIe's NVLink bridge joins two cards; four talk over PCIe
    assert interconnect(GPUS["a100-80gb-pcie"], 2).name == "NVLink bridge"
    assert interconnect(GPUS["a100-80gb-pcie"], 4).name == "PCIe Gen4"
    assert interconnect(H100, 8, "pcie").bytes_per_s == 64e9  # Gen5 x16: 128 GB/s both ways
    with pytest.raises(InputError, match="no NVLink"):
        interconnect(GPUS["l4"], 2, "nvlink")
    with pytest.raises(InputError, match="unknown interconnect"):
        interconnect(H100, 2, "infiniband")


def test_ring_collectives() -> None:
    link = interconnect(H100, 4)
    # all-reduce of 1 MB over 4 GPUs: each sends 2 x 3/4 of it
    assert allreduce_s(1e6, 4, link) == pytest.approx(5e-6 + 1.5e6 / 450e9)
    assert allgather_s(1e6, 4, link) == pytest.approx(5e-6 + 0.75e6 / 450e9)
    assert allreduce_s(1e6, 1, link) == 0.0


def test_tp_comm_per_decode_step_llama_70b() -> None:
    llama70 = load_bundled_model("llama-2-70b")
    link = interconnect(H100, 8)
    # batch 16: 2 x 80 all-reduces of 16 x 8192 x 2 bytes (2 x 7/8 of it each way) and a gather of 16 x 32000 x 2
    per_allreduce = 5e-6 + 2 * 7 / 8 * 16 * 8192 * 2 / 450e9
    gather = 5e-6 + 7 / 8 * 16 * 32_000 * 2 / 450e9
    assert tp_comm_s(llama70, 16, 8, link) == pytest.approx(160 * per_allreduce + gather)
    assert tp_comm_s(llama70, 16, 1, link) == 0.0
    assert tp_comm_s(model_from_params(70e9), 16, 8, link) == 0.0  # shape unknown: not counted


def test_tp_what_if_is_sublinear_and_says_why() -> None:
    llama70 = load_bundled_model("llama-2-70b")
    result = tp_what_if(llama70, H100, 1, 0, 4, tp=2)
    read = (68_976_648_192 - 32_000 * 8192) * 2 + 8192 * 2
    comm = [160 * (5e-6 + 2 * (n - 1) / n * 8192 * 2 / 450e9) + 5e-6 + (n - 1) / n * 32_000 * 2 / 450e9
            for n in (2, 4)]
    assert result.speedup == pytest.approx((read / 2 / 3.35e12 + comm[0]) / (read / 4 / 3.35e12 + comm[1]))
    assert 1.9 < result.speedup < 1.95  # twice the GPUs, not twice the speed
    assert sum("all-reduces" in a for a in result.assumptions) == 2


# --- pipeline parallelism ------------------------------------------------------------------------------------

def test_pipeline_bubble_and_rate() -> None:
    link = interconnect(H100, 2)
    # one sequence through 4 stages: each waits 3 of every 4 stage times
    one = pipeline_decode(2e-3, 1e-4, 1, 4, 1, stage_weight_bytes=1e9, hidden=4096, link=link)
    handoff = 5e-6 + 1 * 4096 * 2 / 450e9
    assert one.bubble == pytest.approx(0.75) and one.handoff_s == pytest.approx(handoff)
    assert one.tokens_per_s == pytest.approx(1 / (4 * (2e-3 + handoff)))
    # 8 sequences in 4 micro-batches of 2 fill the pipe: no bubble, 8 tokens every 4 stage times
    full = pipeline_decode(2e-3, 1e-4, 8, 4, 4, stage_weight_bytes=1e9, hidden=4096, link=link)
    assert full.bubble == 0.0
    assert full.tokens_per_s == pytest.approx(8 / (4 * (2e-3 + 5e-6 + 2 * 4096 * 2 / 450e9)))
    with pytest.raises(InputError):
        pipeline_decode(2e-3, 0, 2, 4, 4, stage_weight_bytes=1e9, hidden=4096, link=link)


# --- KV precision ---------------------------------------------------------------------------------------------

def test_fp8_kv_doubles_capacity() -> None:
    llama = load_bundled_model("llama-3.1-8b")
    free = 0.9 * 80 * 1024**3 - 8_030_261_248 * 2
    assert kv_capacity_tokens(llama, H100) == pytest.approx(free / 131_072)  # 2 x 32 x 8 x 128 x 2 bytes
    assert kv_capacity_tokens(llama, H100, kv_dtype="fp8") == pytest.approx(2 * free / 131_072)
    assert max_concurrent_sequences(llama, H100, 4096, kv_dtype="fp8") == math.floor(2 * free / 131_072 / 4096)


def test_kv_dtype_what_if_halves_kv_bytes_where_kv_dominates() -> None:
    # Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 x 2 x 2 bytes = 12,288 a token; at batch 64 x 16,000 tokens the KV
    # cache is 12.6 GB a step against 0.99 GB of weights, 93 % of the bytes.
    qwen = load_bundled_model("qwen2.5-0.5b")
    weights = 494_032_768 * 2  # tied: the table is lm_head and read whole
    kv = 64 * 16_000 * 12_288
    assert weights / 1e9 == pytest.approx(0.988, abs=1e-3) and kv / (weights + kv) == pytest.approx(0.927, abs=1e-3)
    plain = kv_dtype_what_if(qwen, H100, 64, 16_000)
    bytes_fp8 = weights + kv / 2
    compute = [decode_compute_s(qwen, H100, 64, context=16_000)]
    assert max(bytes_fp8 / 3.35e12, compute[0]) == bytes_fp8 / 3.35e12  # still memory-bound
    assert plain.speedup == pytest.approx((weights + kv) / bytes_fp8)  # x1.86, not +0.4 %
    assert plain.after_batch == 64 and "KV fp16" not in plain.change and "KV bf16 -> fp8" in plain.change
    assert any("12 -> 6 KiB a token" in a for a in plain.assumptions)
    # a full cache with 1000 sequences wanting to run: twice the capacity, twice the batch
    room = [max_concurrent_sequences(qwen, H100, 16_000, kv_dtype=k) for k in ("bf16", "fp8")]
    assert room == [388, 776]  # (0.9 x 80 GiB - 988,065,536) / (16,000 x 12,288), and twice that
    grown = kv_dtype_what_if(qwen, H100, room[0], 16_000, demand=1000)
    assert grown.after_batch == 776 and kv_dtype_what_if(qwen, H100, room[0], 16_000, demand=500).after_batch == 500
    before = decode_ceiling_tokens_per_s(qwen, H100, room[0], 16_000)
    after = decode_ceiling_tokens_per_s(qwen, H100, grown.after_batch, 16_000, kv_dtype="fp8")
    assert grown.speedup == pytest.approx(after / before)


def test_theory_and_what_if_agree_on_the_kv_dtype() -> None:
    llama = load_bundled_model("llama-3.1-8b")
    direct = decode_ceiling_tokens_per_s(llama, H100, 16, 8192, kv_dtype="fp8")
    assert what_if(llama, H100, None, 16, 8192, new_kv_dtype="fp8").after_tokens_per_s == pytest.approx(direct)


# --- realised gains ---------------------------------------------------------------------------------------

def test_realised_gain_of_a_pure_bytes_change() -> None:
    # FP8 weights halve the bytes; at 33 % of the ceiling the time beyond the floor stays: 1 / (0.67 + 0.165)
    assert realised_gain(2.0, 0.33) == pytest.approx(1 / (0.67 + 0.165)) == pytest.approx(1.1976, abs=1e-4)
    assert realised_gain(2.0, 1.0) == 2.0
    for bad in (0.0, 1.2):
        with pytest.raises(InputError):
            realised_gain(2.0, bad)


def test_realised_speedup_with_measured_roofs_is_the_bytes_formula() -> None:
    seven = model_from_params(7e9, dtype="fp16")
    measured = with_measured(H100, {"hbm_bytes_per_s": 3.0e12, "fp16_flops": 700e12})
    assert attainable_shares(measured, "fp16") == (1.0, 1.0)
    assert attainable_shares(H100, "fp16") == (ATTAINABLE_BANDWIDTH, 0.8)
    before = decode_workload(seven, measured, 1, 0)
    after = decode_workload(seven, measured, 1, 0, dtype="fp8")
    assert realised_speedup(before, after, 0.4, per_sequence=False) == pytest.approx(realised_gain(2.0, 0.4))
    # counting the part that grows with the batch moves a batch-1 bytes change by the FP8 GEMMs' hidden arithmetic
    # (a batch-1 step's FLOPs at twice the rate): well under 1 %
    assert realised_speedup(before, after, 0.4) == pytest.approx(realised_gain(2.0, 0.4), rel=5e-3)


def test_realised_speedup_keeps_the_time_beyond_the_roofline_per_step() -> None:
    seven = model_from_params(7e9, dtype="fp16")
    # datasheet roofs: streaming reaches 90 % of 3.35 TB/s. At 50 % of the ceiling a batch-1 step takes
    # 2 x 4.179 ms = 8.358 ms; the attained roofline is 4.179 / 0.9 = 4.643 ms, so 3.715 ms stays per step.
    floor = 14e9 / 3.35e12
    overhead = 2 * floor - floor / 0.9
    before = decode_workload(seven, H100, 1, 0)
    # FP8: half the bytes, the same per-step time
    assert realised_speedup(before, decode_workload(seven, H100, 1, 0, dtype="fp8"), 0.5,
                            per_sequence=False) == pytest.approx(2 * floor / (floor / 2 / 0.9 + overhead))
    # batch 8: the weights still read once, 8 tokens a step, the per-step time amortised over them
    eight = decode_workload(seven, H100, 8, 0)
    assert realised_speedup(before, eight, 0.5, per_sequence=False) == pytest.approx(
        8 * 2 * floor / (floor / 0.9 + overhead))
    # ... less what grows with the sequences: each one's arithmetic, which the roofline hides under the weight
    # reads (a step's FLOPs at 80 % of the peak; this shape has no layers, so no activation traffic), and the
    # engine's host work per sequence (vLLM V0: 0.1 ms)
    flops = decode_compute_s(seven, H100, 1) / 0.8
    assert realised_speedup(before, eight, 0.5) == pytest.approx(8 * 2 * floor / (floor / 0.9 + overhead + 7 * flops))
    host = PER_SEQUENCE_HOST_S["vllm-v0"]
    assert host == pytest.approx(1e-4)
    assert realised_speedup(before, eight, 0.5, host_per_sequence_s=host) == pytest.approx(
        8 * 2 * floor / (floor / 0.9 + overhead + 7 * (flops + host)))
    # a step measured above the attainable estimate has no time to keep: the attained times scale to it
    assert realised_speedup(before, decode_workload(seven, H100, 1, 0, dtype="fp8"), 0.95) == pytest.approx(2.0)


def test_what_if_reports_the_realised_gain_beside_the_ceiling_ratio() -> None:
    llama = load_bundled_model("llama-2-7b")
    result = what_if(llama, H100, "fp16", 1, 1024, new_dtype="int4", efficiency=0.4)
    assert result.speedup is not None and result.realised_speedup is not None
    assert 1 < result.realised_speedup < result.speedup and result.expected_speedup == result.realised_speedup
    assert "at the ceiling" in result.explanation and "realised at 40%" in result.explanation
    assert what_if(llama, H100, "fp16", 1, 1024, new_dtype="int4").realised_speedup is None


# --- long context ---------------------------------------------------------------------------------------

def test_attention_flops_in_decode() -> None:
    llama = load_bundled_model("llama-2-7b")
    matmul = 2 * (6_738_415_616 - TABLE) * 8 / 989.4e12
    attention = 8 * 4 * 32 * 32 * 128 * 32_000 / 989.4e12  # 8 sequences attending to 32k tokens each
    assert decode_compute_s(llama, H100, 8, context=32_000) == pytest.approx(matmul + attention)


def test_generation_ceiling_counts_prefill_and_decode() -> None:
    seven = model_from_params(7e9, layers=32, heads=32, kv_heads=32, head_dim=128, dtype="fp16")
    # 4 prompts of 100 tokens: prefill is compute-bound; 49 decode steps at the mean context 100 + 50 / 2 = 125
    prefill = (2 * 7e9 * 400 + 4 * 4 * 32 * 32 * 128 * 100 * 101 / 2) / 989.4e12
    step = (14e9 + 4 * 125 * 524_288) / 3.35e12
    assert generation_ceiling_tokens_per_s(seven, H100, 4, 100, 50) == pytest.approx(4 * 50 / (prefill + 49 * step))


def test_tensor_parallelism_beyond_one_hgx_board_crosses_the_network() -> None:
    """An HGX board's NVLink joins 8 GPUs: tp 16 all-reduces over the nodes' 400 Gb/s NICs (50 GB/s each way, 20 us
    a collective), so 70B at tp 16 is priced with the network, not NVLink (it read x6.3 over tp 2)."""
    assert interconnect(H100, 8).bytes_per_s == 450e9
    net = interconnect(H100, 16)
    assert net.bytes_per_s == 50e9 and net.latency_s == 20e-6 and "network" in net.name
    with pytest.raises(InputError, match="cannot stay on NVLink"):
        interconnect(H100, 16, "nvlink")
    llama70 = load_bundled_model("llama-3.1-70b")
    assert tp_what_if(llama70, H100, 1, 2048, 16, tp=2).speedup < 4.0


def test_one_tensor_parallel_note_for_a_batch_what_if_on_the_same_gpus() -> None:
    """A batch what-if at tp 8 said 'assumes tp 8: ...' twice, once per batch: one note, both batches' times."""
    from diagnoser.physics import what_if

    w = what_if(load_bundled_model("llama-2-70b"), H100, "bf16", 1, 1024, 8, new_batch=16)
    tp_notes = [a for a in w.assumptions if a.startswith("tp 8")]
    assert len(tp_notes) == 1 and "at batch 1" in tp_notes[0] and "at batch 16" in tp_notes[0], w.assumptions
    moved = what_if(load_bundled_model("llama-2-70b"), H100, "bf16", 1, 1024, 8, new_tp=4)
    assert sum(a.startswith(("tp 8", "tp 4")) for a in moved.assumptions) == 2  # two setups, two notes
