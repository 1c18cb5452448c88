"""First-principles limits of LLM inference on a GPU: bytes moved and FLOPs done per step, against the roofs.

Every function is pure and takes a diagnoser.capture.ModelInfo and, where the hardware matters, a GpuSpec. The
numbers are upper bounds on speed (lower bounds on time): datasheet peaks, no kernel overheads. See docs/physics.md
for the formulas and their sources.

Conventions: `dtype` is the weight precision (default: the model's, else bf16); `kv_dtype` the KV-cache precision
(default: the model's, else 16-bit activations, as serving engines keep for quantised weights); `tp` the tensor-
parallel degree, which splits weights and KV heads across GPUs and adds its all-reduces to each step (`link`: the
interconnect, default from the GPU table, see physics.parallel); byte and time figures are per GPU.
"""

from __future__ import annotations

import math

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.attention import (
    decode_attention_flops,
    held_tokens,
    kv_elements_per_layer,
    mla_dims,
    prefill_attention_flops,
)
from diagnoser.physics.gpus import GpuSpec, peak_flops
from diagnoser.physics.parallel import Interconnect, interconnect, tp_comm_s
from diagnoser.physics.precision import (
    activation_dtype,
    bytes_per_element,
    normalise_dtype,
)
from diagnoser.physics.quant import param_split, weight_breakdown

DEFAULT_MEM_FRACTION = 0.9  # vLLM's default gpu_memory_utilization


# --- inputs ----------------------------------------------------------------------------------------------

def weight_dtype(model: ModelInfo, dtype: str | None = None) -> str:
    """The weight precision in use: `dtype`, else the model's, else bf16."""
    return normalise_dtype(dtype or model.dtype or "bf16")


def kv_cache_dtype(model: ModelInfo, kv_dtype: str | None = None, dtype: str | None = None) -> str:
    """The KV-cache precision: `kv_dtype`, else the model's, else the activation precision of the weights (FP8 or
    INT4 weights keep a 16-bit KV cache unless told otherwise)."""
    return normalise_dtype(kv_dtype or model.kv_dtype or activation_dtype(weight_dtype(model, dtype)))


def _params(model: ModelInfo) -> float:
    if not model.params or model.params <= 0:
        raise InputError("the model's parameter count is unknown.")
    return model.params


def _active(model: ModelInfo) -> float:
    """Parameters used per token: all of them for a dense model."""
    return min(model.active_params or _params(model), _params(model))


def _check(batch: float = 1, context: float = 0, tp: int = 1) -> None:
    if batch < 1:
        raise InputError(f"the batch must be at least 1, not {batch}.")
    if context < 0:
        raise InputError(f"the context must not be negative, not {context}.")
    if tp < 1:
        raise InputError(f"the tensor-parallel degree must be at least 1, not {tp}.")


def has_kv_shape(model: ModelInfo) -> bool:
    """Whether the model's layers, KV heads and head size are known, so its KV cache can be sized (an MLA model's
    base fields are set so, physics.attention)."""
    return bool(model.layers and model.kv_heads and model.head_dim)


def _link(gpu: GpuSpec, tp: int, link: Interconnect | None) -> Interconnect:
    return link or interconnect(gpu, tp)


# --- bytes ---------------------------------------------------------------------------------------------

def weight_bytes(model: ModelInfo, dtype: str | None = None) -> float:
    """Bytes of all weights as stored: quantised matrices with their group scales, and the embedding, lm_head and
    norms a quantised checkpoint keeps at 16 bits (physics.quant.weight_breakdown)."""
    _params(model)
    return weight_breakdown(model, weight_dtype(model, dtype)).total


def kv_bytes_per_token(model: ModelInfo, kv_dtype: str | None = None, *, tp: int = 1) -> float:
    """KV-cache bytes one token adds (to every layer that keeps it): 2 (K and V) x layers x kv_heads x head_dim x
    bytes per element; for MLA (DeepSeek-V2/V3) layers x (kv_lora_rank + qk_rope_head_dim) x bytes, the latent
    every head shares (physics.attention).

    With tensor parallelism each GPU holds kv_heads / tp heads, or one when there are fewer heads than GPUs (they
    are replicated then), and this returns the per-GPU figure; an MLA latent is whole on every GPU. An FP8 or INT8
    cache halves it. A sliding-window layer stops adding once it holds its window: kv_bytes_per_sequence.
    Source: the standard KV-cache size formula, e.g. Pope et al., "Efficiently Scaling Transformer Inference" (2022).
    """
    _check(tp=tp)
    if not has_kv_shape(model):
        raise InputError("sizing the KV cache needs the model's layers, KV heads and head size.")
    assert model.layers
    element = bytes_per_element(kv_cache_dtype(model, kv_dtype))
    return model.layers * kv_elements_per_layer(model, tp) * element


def kv_bytes_per_sequence(model: ModelInfo, context: float, kv_dtype: str | None = None, *, tp: int = 1) -> float:
    """KV-cache bytes a sequence of `context` tokens holds, per GPU: KV bytes per token x context, where a sliding
    layer holds at most its window: per layer and token x (full layers x context + sliding layers x min(context,
    window)) (physics.attention.held_tokens)."""
    _check(context=context, tp=tp)
    return kv_bytes_per_token(model, kv_dtype, tp=tp) * held_tokens(model, context)


def weights_read_bytes(model: ModelInfo, tokens: float = 1, dtype: str | None = None) -> float:
    """Expected weight bytes one forward pass over `tokens` tokens reads (all GPUs together).

    The lm_head and norms are read whole; the input embedding only one row per token. Of the linear layers, a dense
    model reads all; an MoE token uses a share a of them (its active linear parameters over all linear ones) and
    routing is assumed uniform, so the pass reads linear x (1 - (1 - a)^tokens): the routed experts for one token,
    all of them once tokens >> 1/a. (Attention is treated like the experts here: exact at both ends, a few percent
    high in between.)
    """
    parts = weight_breakdown(model, weight_dtype(model, dtype))
    split = param_split(model)
    share = (_active(model) - (_params(model) - split.linear)) / split.linear
    share = min(1.0, max(share, 0.0))
    read_share = 1.0 if share >= 1.0 else 1.0 - (1.0 - share) ** max(tokens, 1)
    rows = parts.embedding * min(1.0, max(tokens, 1) / model.vocab) if parts.embedding and model.vocab else 0.0
    return parts.linear * read_share + parts.lm_head + parts.norms + rows


def decode_step_bytes(
    model: ModelInfo,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> float:
    """Bytes one GPU reads per decode step: weights read / tp + batch x context x KV bytes per token (per GPU).

    Each step generates one token for each of `batch` sequences, reading every weight once (the weights are shared by
    the batch) and each sequence's whole KV cache of `context` tokens (a sliding layer's window of them). `batch`
    and `context` may be observed means. When the model's KV shape is unknown (see has_kv_shape) the KV term is left
    out, which keeps every speed derived from this an upper bound.
    """
    _check(batch, context, tp)
    weights = weights_read_bytes(model, batch, dtype) / tp
    if context == 0 or not has_kv_shape(model):
        return weights
    return weights + batch * kv_bytes_per_sequence(model, context, kv_cache_dtype(model, kv_dtype, dtype), tp=tp)


# --- FLOPs ---------------------------------------------------------------------------------------------

def _matmul_params(model: ModelInfo) -> float:
    """Active parameters that multiply: the input embedding is a lookup, not a matrix product."""
    return _active(model) - param_split(model).embedding


def attention_flops_per_token(model: ModelInfo, context: float) -> float:
    """FLOPs of one new token attending to `context` earlier ones: QK^T and PV each cost 2 x head_dim per key and
    query head, so 4 x layers x heads x head_dim x context (0 when the shape is unknown). A sliding layer attends to
    at most its window; MLA decodes against the latent (physics.attention.decode_attention_flops)."""
    return decode_attention_flops(model, context)


def _attention_rate(gpu: GpuSpec, model: ModelInfo, dtype: str | None) -> float:
    """Attention runs at the activation precision's rate (16-bit for quantised weights)."""
    return peak_flops(gpu, activation_dtype(weight_dtype(model, dtype)))


# --- time ----------------------------------------------------------------------------------------------

def decode_floor_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> float:
    """Memory time of one decode step, a floor on time per output token: decode_step_bytes / memory bandwidth."""
    return decode_step_bytes(model, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp) / gpu.hbm_bytes_per_s


def decode_compute_s(
    model: ModelInfo, gpu: GpuSpec, batch: float = 1, *, dtype: str | None = None, tp: int = 1, context: float = 0
) -> float:
    """Compute time of one decode step: 2 x active matrix parameters x batch / (tp x peak FLOP/s at the weights'
    precision) + batch x attention FLOPs over `context` / (tp x peak at the activations' precision).

    A matrix-vector product costs 2 FLOP (multiply, add) per weight per token (Kaplan et al., "Scaling Laws for
    Neural Language Models", 2020, section 2.1); attention adds 4 x layers x heads x head_dim per token of context.
    """
    _check(batch, context, tp)
    linear = 2.0 * _matmul_params(model) * batch / (tp * peak_flops(gpu, weight_dtype(model, dtype)))
    attention = batch * attention_flops_per_token(model, context) / (tp * _attention_rate(gpu, model, dtype))
    return linear + attention


def decode_comm_s(
    model: ModelInfo, gpu: GpuSpec, batch: float = 1, *, tp: int = 1, link: Interconnect | None = None
) -> float:
    """Tensor-parallel collective time of one decode step (physics.parallel.tp_comm_s); 0 at tp 1."""
    _check(batch, 0, tp)
    return tp_comm_s(model, batch, tp, _link(gpu, tp, link)) if tp > 1 else 0.0


def decode_step_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | None = None,
) -> float:
    """Roofline time of one decode step: max(memory time, compute time) + tensor-parallel collectives (they wait
    on one layer's output and the next layer waits on them, so they add)."""
    memory = decode_floor_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp)
    compute = decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp, context=context)
    return max(memory, compute) + decode_comm_s(model, gpu, batch, tp=tp, link=link)


def decode_bound(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> str:
    """"memory" or "compute": which roof limits a decode step at this batch and context."""
    memory = decode_floor_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp)
    compute = decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp, context=context)
    return "compute" if compute > memory else "memory"


def decode_ceiling_tokens_per_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    dtype: str | None = None,
    tp: int = 1,
    *,
    kv_dtype: str | None = None,
    link: Interconnect | None = None,
) -> float:
    """Most output tokens/s the `tp` GPUs can generate: batch / decode_step_s.

    It rises linearly with batch while memory-bound and flattens at tp x peak / (2 x active params) past the ridge
    batch; tensor parallelism divides the bytes by tp but adds its collectives, so it scales sublinearly.
    """
    return batch / decode_step_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp, link=link)


def prefill_cost(
    model: ModelInfo,
    gpu: GpuSpec,
    tokens: int,
    dtype: str | None = None,
    tp: int = 1,
    *,
    sequence_tokens: int | None = None,
    kv_dtype: str | None = None,
    link: Interconnect | None = None,
) -> tuple[float, float, float]:
    """(memory, compute, collectives) seconds of prefilling `tokens` prompt tokens in prompts of `sequence_tokens`
    each (default: one prompt), per GPU. Compute: 2 x active matrix params x tokens at the weights' rate, plus causal
    attention, 2 x layers x heads x head_dim x s(s+1) per prompt of s tokens (physics.attention for sliding windows
    and MLA), at the activations' rate. Memory: the
    weights read once plus the KV cache written. Collectives: tp_comm_s over the tokens."""
    if tokens < 1:
        raise InputError(f"the prompt must have at least 1 token, not {tokens}.")
    _check(1, 0, tp)
    per_prompt = sequence_tokens or tokens
    if per_prompt < 1 or per_prompt > tokens:
        raise InputError(f"a prompt of {per_prompt} tokens does not fit in {tokens} prompt tokens.")
    prompts = tokens / per_prompt
    attention = prompts * prefill_attention_flops(model, per_prompt)
    compute = (2.0 * _matmul_params(model) * tokens / peak_flops(gpu, weight_dtype(model, dtype))
               + attention / _attention_rate(gpu, model, dtype)) / tp
    written = tokens * kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, dtype)) if has_kv_shape(model) \
        else 0.0
    memory = (weights_read_bytes(model, tokens, dtype) + written) / (tp * gpu.hbm_bytes_per_s)
    comm = tp_comm_s(model, tokens, tp, _link(gpu, tp, link)) if tp > 1 else 0.0
    return memory, compute, comm


def prefill_time_s(
    model: ModelInfo,
    gpu: GpuSpec,
    tokens: int,
    dtype: str | None = None,
    tp: int = 1,
    *,
    sequence_tokens: int | None = None,
    kv_dtype: str | None = None,
    link: Interconnect | None = None,
) -> float:
    """Least time to prefill `tokens` prompt tokens: max(memory, compute) + collectives (prefill_cost).
    Compute-bound for any real prompt."""
    memory, compute, comm = prefill_cost(model, gpu, tokens, dtype, tp, sequence_tokens=sequence_tokens,
                                         kv_dtype=kv_dtype, link=link)
    return max(memory, compute) + comm


def generation_ceiling_tokens_per_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float,
    input_tokens: int,
    output_tokens: int,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | None = None,
) -> float:
    """Most output tokens/s of a static batch: `batch` prompts of `input_tokens` prefilled together, then
    `output_tokens` generated each (the first by the prefill). batch x output / (prefill + (output - 1) decode steps
    at the mean context input + output / 2). A step's time is convex in its context, so the step at the mean
    context is no longer than the mean step and the figure stays an upper bound."""
    if output_tokens < 1 or input_tokens < 1:
        raise InputError("a generation needs at least one input and one output token.")
    _check(batch, 0, tp)
    prefill = prefill_time_s(model, gpu, round(batch * input_tokens), dtype, tp, sequence_tokens=input_tokens,
                             kv_dtype=kv_dtype, link=link)
    context = input_tokens + output_tokens / 2 if has_kv_shape(model) else 0.0
    step = decode_step_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp, link=link)
    return batch * output_tokens / (prefill + (output_tokens - 1) * step)


# --- memory capacity ----------------------------------------------------------------------------------------

def usable_memory_bytes(gpu: GpuSpec, mem_fraction: float = DEFAULT_MEM_FRACTION) -> float:
    """The part of one GPU's memory the server may use for weights and KV cache."""
    if not 0 < mem_fraction <= 1:
        raise InputError(f"the memory fraction must be in (0, 1], not {mem_fraction}.")
    return gpu.memory_bytes * mem_fraction


def fits(
    model: ModelInfo,
    gpu: GpuSpec,
    dtype: str | None = None,
    tp: int = 1,
    *,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
) -> bool:
    """Whether the weights fit: weight_bytes / tp <= memory x mem_fraction (every expert of an MoE is resident)."""
    _check(tp=tp)
    return weight_bytes(model, dtype) / tp <= usable_memory_bytes(gpu, mem_fraction)


def max_concurrent_sequences(
    model: ModelInfo,
    gpu: GpuSpec,
    context: int,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    tp: int = 1,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    pp: int = 1,
) -> int:
    """Sequences of `context` tokens whose KV cache fits beside the weights, per tensor-parallel group (of `pp`
    pipeline stages): floor(kv_capacity_tokens / context); 0 if the weights do not fit. An FP8 or INT8 KV cache
    doubles it; a sliding layer holds at most its window of each sequence (held_tokens). Activation workspace and
    fragmentation are ignored, so this is an upper bound."""
    if context < 1:
        raise InputError(f"the context must be at least 1 token, not {context}.")
    capacity = kv_capacity_tokens(model, gpu, mem_fraction, tp, dtype=dtype, kv_dtype=kv_dtype, pp=pp)
    return int(capacity // held_tokens(model, context))


def kv_capacity_tokens(
    model: ModelInfo,
    gpu: GpuSpec,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    tp: int = 1,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    pp: int = 1,
) -> float:
    """Tokens of KV cache that fit beside the weights: (memory x mem_fraction - weights / (tp x pp)) / (KV bytes per
    token per GPU / pp), each of `pp` pipeline stages holding its share of the layers; 0 if the weights do not fit.
    Tokens at every layer: a sliding-window model's sequences each hold fewer (max_concurrent_sequences).
    An upper bound on a server's KV pool (it also keeps activations)."""
    _check(tp=tp)
    if pp < 1:
        raise InputError(f"the pipeline needs at least one stage, not {pp}.")
    free = usable_memory_bytes(gpu, mem_fraction) - weight_bytes(model, dtype) / (tp * pp)
    if free <= 0:
        return 0.0
    return free * pp / kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, dtype), tp=tp)


def attention_weight_bytes(model: ModelInfo, dtype: str | None = None) -> float | None:
    """Bytes of attention's projections over all layers at the weights' precision: an MLA config's own count
    (AttentionModelInfo.attention_params), else q, k, v and o of a grouped-query layer (hidden x (heads + 2 x
    kv_heads) x head_dim + heads x head_dim x hidden) x layers; None without the shape."""
    params = getattr(model, "attention_params", None)
    if params is None:
        if not (model.layers and model.hidden and model.heads and model.kv_heads and model.head_dim):
            return None
        per_layer = model.hidden * (model.heads + 2 * model.kv_heads) * model.head_dim
        params = float(model.layers * (per_layer + model.heads * model.head_dim * model.hidden))
    linear = param_split(model).linear
    return params * weight_breakdown(model, dtype).linear / linear if linear > 0 else None


def dp_attention_gains(model: ModelInfo, tp: int) -> bool:
    """Whether data-parallel attention holds more sequences than tensor-parallel attention at `tp`: where tensor
    parallelism keeps a copy of the same KV on several GPUs (an MLA latent on all of them; KV heads fewer than the
    GPUs, replicated)."""
    if tp < 2 or not has_kv_shape(model):
        return False
    return mla_dims(model) is not None or bool(model.kv_heads and model.kv_heads < tp)


def dp_attention_sequences(
    model: ModelInfo,
    gpu: GpuSpec,
    context: int,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    tp: int = 1,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
) -> int | None:
    """Sequences of `context` tokens the `tp` GPUs hold together when attention runs data-parallel over them
    (SGLang's --enable-dp-attention with --dp equal to --tp; the MoE or MLP layers stay sharded): each GPU keeps
    the whole KV of its own sequences only, and a whole copy of attention's weights. Per GPU: (memory x
    mem_fraction - weights / tp - attention's weights x (1 - 1/tp)) / (KV bytes per token unsharded x held
    tokens), times tp. Under tensor parallelism an MLA latent is on every GPU (max_concurrent_sequences), so for
    DeepSeek-V3 this is close to tp times as many. None where the attention's weights cannot be sized.
    Source: SGLang's guide "DP, DPA and sgl-router" (docs.sglang.io/docs/advanced_features/dp_dpa_router_guide):
    under tensor parallelism an MLA model's one KV head is duplicated on every GPU; DP attention shards the
    requests instead. Attention's weights are whole on each GPU because its tensor-parallel size is tp / dp = 1
    (Ray Serve's "Data parallel attention": attention layers replicated, experts sharded)."""
    _check(tp=tp)
    if context < 1:
        raise InputError(f"the context must be at least 1 token, not {context}.")
    attention = attention_weight_bytes(model, dtype)
    if attention is None or not has_kv_shape(model):
        return None
    free = usable_memory_bytes(gpu, mem_fraction) - weight_bytes(model, dtype) / tp - attention * (1 - 1 / tp)
    if free <= 0:
        return 0
    per_token = kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, dtype), tp=1)
    return int(free / per_token // held_tokens(model, context)) * tp


# --- the ridge -------------------------------------------------------------------------------------------

def ridge_batch(
    model: ModelInfo,
    gpu: GpuSpec,
    dtype: str | None = None,
    *,
    context: float = 0,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> float:
    """The decode batch at which a step turns from memory-bound to compute-bound.

    A step at batch B does F = 2 x M x B FLOP (M: active matrix parameters) and reads W bytes of weights (all of
    them at large batch, scales included, the embedding's lookups left out), so its intensity is I(B) = 2 x M x B /
    W. Setting I(B) equal to the ridge point R (peak FLOP/s / bandwidth) gives

        B* = R x W / (2 x M)

    (for a dense 16-bit model, B* = R). With `context` > 0 each sequence also reads context x kv bytes and does
    attention FLOPs A (at the activations' rate P_a, counted as A x P / P_a), and B* = R x W / (2 x M + A x P / P_a
    - R x kv_per_sequence x tp) per tensor-parallel group (kv_per_sequence: context x kv_per_token, a sliding
    layer's window of it); it is infinite (decode never becomes
    compute-bound) when the denominator is not positive; an unknown KV shape counts as no KV. MoE weights count in
    full: by B* every expert is read in practice.
    """
    _check(1, context, tp)
    wdtype = weight_dtype(model, dtype)
    peak = peak_flops(gpu, wdtype)
    ridge = peak / gpu.hbm_bytes_per_s
    kv = kv_bytes_per_sequence(model, context, kv_cache_dtype(model, kv_dtype, wdtype), tp=tp) \
        if context and has_kv_shape(model) else 0.0
    attention = attention_flops_per_token(model, context) * peak / _attention_rate(gpu, model, wdtype) \
        if context and has_kv_shape(model) else 0.0
    denominator = 2.0 * _matmul_params(model) + attention - ridge * kv * tp
    if denominator <= 0:
        return math.inf
    parts = weight_breakdown(model, wdtype)
    return ridge * (parts.linear + parts.lm_head + parts.norms) / denominator


# --- energy and cost ---------------------------------------------------------------------------------------

def tokens_per_joule(tokens_per_s: float, power_w: float) -> float:
    """Tokens per joule: tokens/s / watts."""
    if power_w <= 0:
        raise InputError(f"the power must be positive, not {power_w} W.")
    return tokens_per_s / power_w


def cost_per_million_tokens(tokens_per_s: float, usd_per_gpu_hour: float, gpus: int = 1) -> float:
    """US dollars per million tokens: usd_per_gpu_hour x gpus / (tokens/s x 3600) x 1e6; infinite at 0 tokens/s."""
    if usd_per_gpu_hour < 0 or gpus < 1:
        raise InputError("the price per GPU hour must not be negative and the GPU count must be at least 1.")
    if tokens_per_s <= 0:
        return math.inf
    return usd_per_gpu_hour * gpus / (tokens_per_s * 3600.0) * 1e6
