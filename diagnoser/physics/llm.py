"""First-principles limits of LLM inference on a GPU: bytes moved and FLOPs done per step, against the roofs.

Every function is pure and takes a diagnoser.capture.ModelInfo and, where the hardware matters, a GpuSpec. The
numbers are upper bounds on speed (lower bounds on time): datasheet peaks, no kernel overheads, no tensor-parallel
communication, no attention FLOPs. See docs/physics.md for the formulas and their sources.

Conventions: `dtype` is the weight precision (default: the model's, else bf16); `kv_dtype` the KV-cache precision
(default: the model's, else 16-bit activations, as serving engines keep for quantised weights); `tp` the tensor-
parallel degree, which splits weights and KV heads across GPUs; byte and time figures are per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.gpus import GpuSpec, peak_flops
from diagnoser.physics.precision import activation_dtype, bytes_per_element, normalise_dtype

DEFAULT_MEM_FRACTION = 0.9  # vLLM's default gpu_memory_utilization


# --- inputs ----------------------------------------------------------------------------------------------

def weight_dtype(model: ModelInfo, dtype: str | None = None) -> str:
    """The weight precision in use: `dtype`, else the model's, else bf16."""
    return normalise_dtype(dtype or model.dtype or "bf16")


def kv_cache_dtype(model: ModelInfo, kv_dtype: str | None = None, dtype: str | None = None) -> str:
    """The KV-cache precision: `kv_dtype`, else the model's, else the activation precision of the weights."""
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
    """Whether the model's layers, KV heads and head size are known, so its KV cache can be sized."""
    return bool(model.layers and model.kv_heads and model.head_dim)


# --- bytes ---------------------------------------------------------------------------------------------

def weight_bytes(model: ModelInfo, dtype: str | None = None) -> float:
    """Bytes of all weights: params x bytes per element (int4 without its group scales)."""
    return _params(model) * bytes_per_element(weight_dtype(model, dtype))


def kv_bytes_per_token(model: ModelInfo, kv_dtype: str | None = None, *, tp: int = 1) -> float:
    """KV-cache bytes one token adds: 2 (K and V) x layers x kv_heads x head_dim x bytes per element.

    With tensor parallelism each GPU holds kv_heads / tp heads, or one when there are fewer heads than GPUs (they
    are replicated then), and this returns the per-GPU figure.
    Source: the standard KV-cache size formula, e.g. Pope et al., "Efficiently Scaling Transformer Inference" (2022).
    """
    _check(tp=tp)
    layers, kv_heads, head_dim = model.layers, model.kv_heads, model.head_dim
    if not (layers and kv_heads and head_dim):
        raise InputError("sizing the KV cache needs the model's layers, KV heads and head size.")
    heads_per_gpu = max(1, math.ceil(kv_heads / tp))
    return 2.0 * layers * heads_per_gpu * head_dim * bytes_per_element(kv_cache_dtype(model, kv_dtype))


def weights_read_bytes(model: ModelInfo, tokens: float = 1, dtype: str | None = None) -> float:
    """Expected weight bytes one forward pass over `tokens` tokens reads (all GPUs together).

    Dense: all weights. MoE: a token uses a share a = active/params of the weights, and routing is assumed uniform,
    so the pass reads weight_bytes x (1 - (1 - a)^tokens): the active weights for one token, all of them once
    tokens >> params/active. (Shared layers are treated like experts here: exact at both ends, a few percent high
    in between.)
    """
    total = weight_bytes(model, dtype)
    share = _active(model) / _params(model)
    if share >= 1.0:
        return total
    return total * (1.0 - (1.0 - share) ** max(tokens, 1))


def decode_step_bytes(
    model: ModelInfo,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> float:
    """Bytes one GPU reads per decode step: weights / tp + batch x context x KV bytes per token (per GPU).

    Each step generates one token for each of `batch` sequences, reading every weight once (the weights are shared by
    the batch) and each sequence's whole KV cache of `context` tokens. `batch` and `context` may be observed means.
    When the model's KV shape is unknown (see has_kv_shape) the KV term is left out, which keeps every speed derived
    from this an upper bound.
    """
    _check(batch, context, tp)
    weights = weights_read_bytes(model, batch, dtype) / tp
    if context == 0 or not has_kv_shape(model):
        return weights
    return weights + batch * context * kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, dtype), tp=tp)


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
    model: ModelInfo, gpu: GpuSpec, batch: float = 1, *, dtype: str | None = None, tp: int = 1
) -> float:
    """Compute time of one decode step: 2 x active params x batch / (tp x peak FLOP/s).

    A matrix-vector product costs 2 FLOP (multiply, add) per weight per token (Kaplan et al., "Scaling Laws for
    Neural Language Models", 2020, section 2.1); attention's own FLOPs are left out, so this stays a lower bound.
    """
    _check(batch, 0, tp)
    return 2.0 * _active(model) * batch / (tp * peak_flops(gpu, weight_dtype(model, dtype)))


def decode_step_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
) -> float:
    """Roofline time of one decode step: max(memory time, compute time)."""
    memory = decode_floor_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp)
    return max(memory, decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp))


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
    return "compute" if decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp) > memory else "memory"


def decode_ceiling_tokens_per_s(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float = 1,
    context: float = 0,
    dtype: str | None = None,
    tp: int = 1,
    *,
    kv_dtype: str | None = None,
) -> float:
    """Most output tokens/s the `tp` GPUs can generate: batch / max(memory time, compute time) per step.

    It rises linearly with batch while memory-bound and flattens at tp x peak / (2 x active params) past the ridge
    batch.
    """
    return batch / decode_step_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp)


def prefill_time_s(model: ModelInfo, gpu: GpuSpec, tokens: int, dtype: str | None = None, tp: int = 1) -> float:
    """Least time to prefill `tokens` prompt tokens: max(2 x active params x tokens / (tp x peak FLOP/s),
    weights read / (tp x bandwidth)). Compute-bound for any real prompt; attention FLOPs are left out."""
    if tokens < 1:
        raise InputError(f"the prompt must have at least 1 token, not {tokens}.")
    _check(1, 0, tp)
    compute = 2.0 * _active(model) * tokens / (tp * peak_flops(gpu, weight_dtype(model, dtype)))
    memory = weights_read_bytes(model, tokens, dtype) / (tp * gpu.hbm_bytes_per_s)
    return max(compute, memory)


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
) -> int:
    """Sequences of `context` tokens whose KV cache fits beside the weights, per tensor-parallel group:
    floor((memory x mem_fraction - weights / tp) / (context x KV bytes per token per GPU)); 0 if the weights do not
    fit. Activation workspace and fragmentation are ignored, so this is an upper bound."""
    if context < 1:
        raise InputError(f"the context must be at least 1 token, not {context}.")
    _check(tp=tp)
    free = usable_memory_bytes(gpu, mem_fraction) - weight_bytes(model, dtype) / tp
    if free <= 0:
        return 0
    per_sequence = context * kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, dtype), tp=tp)
    return int(free // per_sequence)


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

    A step at batch B does F = 2 x active x B FLOP and reads W = params x bytes_per_element of weights, so its
    intensity is I(B) = 2 x active x B / (params x bytes_per_element). Setting I(B) equal to the ridge point R
    (peak FLOP/s / bandwidth) gives

        B* = R x bytes_per_element x params / (2 x active)

    (for a dense model at 16 bits, B* = R). With `context` > 0 each sequence also reads context x kv bytes, and
    B* = R x W / (2 x active - R x context x kv_per_token x tp) per tensor-parallel group; it is infinite (decode
    never becomes compute-bound) when the denominator is not positive; an unknown KV shape counts as no KV. MoE
    weights count in full: by B* every expert is read in practice.
    """
    _check(1, context, tp)
    wdtype = weight_dtype(model, dtype)
    ridge = peak_flops(gpu, wdtype) / gpu.hbm_bytes_per_s
    kv = kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, wdtype), tp=tp) \
        if context and has_kv_shape(model) else 0.0
    denominator = 2.0 * _active(model) - ridge * context * kv * tp
    if denominator <= 0:
        return math.inf
    return ridge * weight_bytes(model, wdtype) / denominator


# --- what if -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WhatIf:
    """Decode tokens/s ceiling before and after one or more changes, and why it moves."""

    change: str
    before_tokens_per_s: float
    after_tokens_per_s: float
    speedup: float | None  # None when the setup before does not fit, so there is nothing to compare with
    explanation: str


@dataclass(frozen=True)
class _Setup:
    gpu: GpuSpec
    dtype: str
    batch: float
    tp: int


def _memory_problem(model: ModelInfo, s: _Setup, context: float, kv_dtype: str | None, mem_fraction: float) -> str:
    """Why a setup does not fit in memory, or "" if it does."""
    usable = usable_memory_bytes(s.gpu, mem_fraction)
    weights = weight_bytes(model, s.dtype) / s.tp
    if weights > usable:
        return (f"{weights / 1e9:.1f} GB of weights per GPU exceed the {usable / 1e9:.1f} GB usable on one "
                f"{s.gpu.name}")
    if context and has_kv_shape(model):
        kv = s.batch * context * kv_bytes_per_token(model, kv_cache_dtype(model, kv_dtype, s.dtype), tp=s.tp)
        if weights + kv > usable:
            return (f"the KV cache of {s.batch:g} x {context:g} tokens ({kv / 1e9:.1f} GB per GPU) does not fit beside "
                    f"the weights on one {s.gpu.name}")
    return ""


def _tokens_per_s(model: ModelInfo, s: _Setup, context: float, kv_dtype: str | None, mem_fraction: float) -> float:
    if _memory_problem(model, s, context, kv_dtype, mem_fraction):
        return 0.0
    return decode_ceiling_tokens_per_s(model, s.gpu, s.batch, context, s.dtype, s.tp, kv_dtype=kv_dtype)


def _describe_change(before: _Setup, after: _Setup) -> str:
    parts = []
    if after.dtype != before.dtype:
        parts.append(f"{before.dtype} -> {after.dtype}")
    if after.gpu.key != before.gpu.key:
        parts.append(f"{before.gpu.name} -> {after.gpu.name}")
    if after.batch != before.batch:
        parts.append(f"batch {before.batch:g} -> {after.batch:g}")
    if after.tp != before.tp:
        parts.append(f"tp {before.tp} -> {after.tp}")
    return ", ".join(parts) or "no change"


def _why(model: ModelInfo, before: _Setup, after: _Setup, context: float, kv_dtype: str | None) -> str:
    """Which roof limits each side, and how the quantity behind that roof moves."""
    bounds = [decode_bound(model, s.gpu, s.batch, context, dtype=s.dtype, kv_dtype=kv_dtype, tp=s.tp)
              for s in (before, after)]
    if bounds[0] != bounds[1]:
        return f"decode goes from {bounds[0]}-bound to {bounds[1]}-bound"
    if bounds[0] == "memory":
        moved = [decode_step_bytes(model, s.batch, context, dtype=s.dtype, kv_dtype=kv_dtype, tp=s.tp) / s.batch
                 for s in (before, after)]
        why = (f"decode stays memory-bound; bytes read per GPU per token go {moved[0] / 1e9:.3g} -> "
               f"{moved[1] / 1e9:.3g} GB")
        if after.gpu.hbm_bytes_per_s != before.gpu.hbm_bytes_per_s:
            why += (f" and bandwidth {before.gpu.hbm_bytes_per_s / 1e12:.3g} -> "
                    f"{after.gpu.hbm_bytes_per_s / 1e12:.3g} TB/s")
        return why
    peaks = [s.tp * peak_flops(s.gpu, s.dtype) / 1e12 for s in (before, after)]
    return f"decode stays compute-bound; peak goes {peaks[0]:.4g} -> {peaks[1]:.4g} TFLOP/s over the group"


def what_if(
    model: ModelInfo,
    gpu: GpuSpec,
    dtype: str | None = None,
    batch: float = 1,
    context: float = 0,
    tp: int = 1,
    *,
    new_dtype: str | None = None,
    new_gpu: GpuSpec | None = None,
    new_batch: float | None = None,
    new_tp: int | None = None,
    kv_dtype: str | None = None,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
) -> WhatIf:
    """Compare the decode ceiling now with the ceiling after changing precision, GPU, batch and/or tensor parallel.

    A setup whose weights or KV cache do not fit gets 0 tokens/s. Ceilings ignore all-reduce time, so a tp change
    is an upper bound on its gain.
    """
    before = _Setup(gpu, weight_dtype(model, dtype), batch, tp)
    after = _Setup(new_gpu or gpu, weight_dtype(model, new_dtype or before.dtype),
                   new_batch if new_batch is not None else batch, new_tp if new_tp is not None else tp)
    _check(before.batch, context, before.tp)
    _check(after.batch, context, after.tp)
    change = _describe_change(before, after)
    rates = [_tokens_per_s(model, s, context, kv_dtype, mem_fraction) for s in (before, after)]
    problems = [_memory_problem(model, s, context, kv_dtype, mem_fraction) for s in (before, after)]
    if problems[1]:
        why = problems[1]
    elif problems[0]:
        why = f"it fits, whereas now {problems[0]}"
    else:
        why = _why(model, before, after, context, kv_dtype)
    speedup = rates[1] / rates[0] if rates[0] > 0 else None
    tail = f", so tokens/s x{speedup:.2f}" if speedup is not None and not problems[1] else ""
    if after.tp > before.tp and not problems[1]:
        tail += " (all-reduce time not counted)"
    return WhatIf(change, rates[0], rates[1], speedup, f"{change}: {why}{tail}.")


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
