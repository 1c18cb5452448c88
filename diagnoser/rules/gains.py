"""Predicted gains of fixes, from the physics module and the observed batch. Rules call these; none reads NVML."""

from __future__ import annotations

from diagnoser import physics
from diagnoser.evidence import Evidence


def observed_batch(ev: Evidence) -> float | None:
    return ev.observed_batch()


def _model_and_gpu(ev: Evidence):  # type: ignore[no-untyped-def]
    model = ev.capture.model
    if ev.gpu_spec is None or model is None or not model.params:
        return None
    return model, ev.gpu_spec


def _dtype(ev: Evidence) -> str:
    model = ev.capture.model
    return physics.normalise_dtype(model.dtype) if model and model.dtype else "bf16"


# When the serving context is unknown, gains assume this many tokens per sequence, so the KV cache both costs
# bandwidth and caps how many sequences fit; the basis text says so.
ASSUMED_CONTEXT = 1024


def _context(ev: Evidence) -> tuple[int, str]:
    value = ev.capture.serving.get("mean_context_tokens")
    if isinstance(value, (int, float)) and value > 0:
        return int(value), f"context {int(value)} tokens"
    return ASSUMED_CONTEXT, f"assumed context {ASSUMED_CONTEXT} tokens"


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
        room = physics.max_concurrent_sequences(model, gpu, ctx, tp=tp, dtype=dtype)
        if room < new:
            new, capped = float(room), f", capped by the {room} sequences whose KV cache fits"
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
    """Throughput multiplier of serving the weights in another precision at the observed batch."""
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
    return after / before, (f"decode ceiling with {new_dtype} weights vs {dtype} at batch {batch:.0f} on {gpu.name}, "
                            f"{ctx_text}")


def ridge_batch(ev: Evidence) -> float | None:
    s = ev.get("theory.ridge_batch")
    return s.values[0] if s is not None else None
