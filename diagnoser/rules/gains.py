"""Predicted gains of fixes, from the physics module and the observed batch. Rules call these; none reads NVML."""

from __future__ import annotations

from diagnoser import physics
from diagnoser.errors import InputError
from diagnoser.evidence import Evidence


def observed_batch(ev: Evidence) -> float | None:
    return ev.observed_batch()


def _model_and_gpu(ev: Evidence):  # type: ignore[no-untyped-def]
    model = ev.capture.model
    if ev.gpu_spec is None or model is None or not model.params:
        return None
    return model, ev.gpu_spec


def weights_dtype(ev: Evidence) -> str | None:
    """The weights' precision when the model says it (and names a known one)."""
    model = ev.capture.model
    if model is None or not model.dtype:
        return None
    try:
        return physics.normalise_dtype(model.dtype)
    except InputError:
        return None


def _dtype(ev: Evidence) -> str:
    return weights_dtype(ev) or "bf16"


# When the serving context is unknown, gains assume this many tokens per sequence, so the KV cache both costs
# bandwidth and caps how many sequences fit; the basis text says so.
ASSUMED_CONTEXT = 1024


def _context(ev: Evidence) -> tuple[int, str]:
    value = ev.capture.serving.get("mean_context_tokens")
    if isinstance(value, (int, float)) and value > 0:
        return int(value), f"context {int(value)} tokens"
    return ASSUMED_CONTEXT, f"assumed context {ASSUMED_CONTEXT} tokens"


def _mem_fraction(ev: Evidence) -> tuple[float, str]:
    """The share of GPU memory the server may fill (weights + KV cache): its flag, else vLLM's default."""
    for key, flag in (("gpu_memory_utilization", "--gpu-memory-utilization"),
                      ("mem_fraction_static", "--mem-fraction-static")):
        value = ev.capture.serving.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
            return float(value), f" in {value:.0%} of memory ({flag})"
    return physics.DEFAULT_MEM_FRACTION, ""


def batch_gain(ev: Evidence, *, factor: float | None = None, target: float | None = None) -> tuple[float | None, str]:
    """Throughput multiplier of decoding at a larger batch (factor x the observed one, or a target), from the
    decode ceiling: batch / max(bytes / bandwidth, FLOPs / peak)."""
    mg = _model_and_gpu(ev)
    batch = observed_batch(ev)
    if mg is None or batch is None:
        return None, "needs the model's shape and a recognised GPU to predict"
    model, gpu = mg
    new = target if target is not None else batch * (factor or 1.0)
    dtype, tp = _dtype(ev), max(1, model.tensor_parallel)
    ctx, ctx_text = _context(ev)
    capped = ""
    if physics.has_kv_shape(model):
        fraction, where = _mem_fraction(ev)
        room = physics.max_concurrent_sequences(model, gpu, ctx, fraction, tp=tp, dtype=dtype)
        if room < new:
            new, capped = float(room), f", capped by the {room} sequences whose KV cache fits{where}"
    new = max(new, batch)
    if new <= batch:
        return None, f"no larger batch fits in memory at {ctx_text}"
    before = physics.decode_ceiling_tokens_per_s(model, gpu, batch=max(1.0, batch), context=ctx, dtype=dtype, tp=tp)
    after = physics.decode_ceiling_tokens_per_s(model, gpu, batch=max(1.0, new), context=ctx, dtype=dtype, tp=tp)
    if before <= 0:
        return None, "decode ceiling not computable"
    return after / before, (f"decode ceiling at batch {new:.0f} vs {batch:.1f} on {gpu.name}, {ctx_text}{capped} "
                            f"({after:.0f} vs {before:.0f} tokens/s)")


def dtype_gain(ev: Evidence, new_dtype: str) -> tuple[float | None, str]:
    """Throughput multiplier of serving the weights in another precision at the observed batch.

    The ceilings' ratio is what a step running at its floor would gain. A step measured at efficiency e of its
    ceiling spends (1 - e) of its time beyond the floor (norms, casts, softmax, launch gaps), which fewer weight
    bytes do not shorten, so the realised gain is 1 / (1 - e + e / ratio). Measured on an H100 (2.4B decoder, batch
    1, CUDA graphs, e = 0.33): FP8 weights gave 1.12x against 1.19x predicted this way and 1.97x from the ceilings
    (tests/fixtures/gpu)."""
    mg = _model_and_gpu(ev)
    if mg is None:
        return None, "needs the model's shape and a recognised GPU to predict"
    model, gpu = mg
    batch = observed_batch(ev) or 1.0
    dtype, tp = _dtype(ev), max(1, model.tensor_parallel)
    ctx, ctx_text = _context(ev)
    if physics.bytes_per_element(new_dtype) >= physics.bytes_per_element(dtype):
        return None, f"weights are already {dtype}"
    before = physics.decode_ceiling_tokens_per_s(model, gpu, batch=batch, context=ctx, dtype=dtype, tp=tp)
    after = physics.decode_ceiling_tokens_per_s(model, gpu, batch=batch, context=ctx, dtype=new_dtype, tp=tp)
    if before <= 0:
        return None, "decode ceiling not computable"
    ratio = after / before
    basis = f"decode ceiling with {new_dtype} weights vs {dtype} at batch {batch:.0f} on {gpu.name}, {ctx_text}"
    eff = ev.get("theory.efficiency")
    if eff is None or not eff.values or eff.values[0] <= 0:
        return ratio, basis
    e = min(1.0, eff.values[0])
    realised = 1.0 / (1.0 - e + e / ratio)
    return realised, (f"{basis}: {ratio:.2f}x at the floor; the step runs at {e:.0%} of its ceiling and the time "
                      f"beyond the floor stays, so about {realised:.2f}x")


def ridge_batch(ev: Evidence) -> float | None:
    s = ev.get("theory.ridge_batch")
    return s.values[0] if s is not None else None
