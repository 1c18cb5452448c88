"""Predicted gains of fixes, from the physics module, the observed batch and the measured time split.

A gain is a promise to a user, so each one here is bounded by what was measured and says which kind it is:
- an *estimate* is what the physics predicts this capture would get (a ceiling ratio, realised at the measured
  efficiency: the time beyond the floor stays);
- an *upper bound* is the most a fix could give, e.g. all of a measured idle share removed: 1 / (1 - share)
  (Amdahl's law: a fix that speeds up a share s of the time by k gives 1 / (1 - s + s / k));
- a gain that only helps if more load is offered is a *capacity* gain, not a speed-up of this traffic.
- a larger batch stops at the server's configured sequence limit (--max-num-seqs, TGI's token budget) unless the
  fix is to raise it; the basis then names the limit as the next fix.
Rules call these; none reads NVML or the capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnoser import physics
from diagnoser import signals as S
from diagnoser.capture import ModelInfo
from diagnoser.diagnosis import GainKind, Regime
from diagnoser.engines.tables import flag_of
from diagnoser.errors import InputError
from diagnoser.evidence import Evidence
from diagnoser.physics import GpuSpec
from diagnoser.rules.base import Gain

# When the serving context is unknown, gains assume this many tokens per sequence, so the KV cache both costs
# bandwidth and caps how many sequences fit; the basis text says so.
ASSUMED_CONTEXT = 1024
# What tuned decode paths reach at small batch (fused norms and attention, CUDA graphs, GEMV kernels tuned for one
# row): about 70 % of the bandwidth floor (e.g. published vLLM and TensorRT-LLM batch-1 decode rates).
REACHABLE_EFFICIENCY = 0.70
# No fix is predicted to give more than this; a larger figure is capped and says so.
MAX_GAIN = 20.0


def amdahl(share: float, speedup: float) -> float:
    """Whole-run gain when `share` of the time gets `speedup` times faster (math.inf: removed entirely)."""
    share = min(max(share, 0.0), 1.0)
    rest = 0.0 if math.isinf(speedup) else share / speedup
    return 1.0 / max(1e-9, 1.0 - share + rest)


def token_budget_target(prompt: float, running: float, waiting: float = 0.0) -> int:
    """The per-step token budget a load needs: two mean prompts beside the running decodes and a token for each
    waiting request, in whole 256-token steps (one number for every rule that advises raising it)."""
    return int(math.ceil((2 * prompt + running + waiting) / 256) * 256)


def removal(share: float, what: str) -> Gain:
    """The upper bound of removing `share` of the time (an idle cause, host work): 1 / (1 - share), the measured
    share as measured, and capped at MAX_GAIN with the cap said (98 % idle is 50x before the cap)."""
    share = min(max(share, 0.0), 1.0)
    shown = f"{share:.1%}" if 0.99 < share < 1.0 else f"{share:.0%}"
    if share >= 1.0:
        return Gain(MAX_GAIN, f"{what}: all of the time; removing it has no finite bound", GainKind.UPPER_BOUND,
                    capped=f"capped at {MAX_GAIN:g}x (from no finite bound)")
    return capped(Gain(1.0 / (1.0 - share), f"{what}: {shown} of the time removed entirely, 1 / (1 - {share:.3g})",
                       GainKind.UPPER_BOUND))


def overlap(share: float, what: str) -> Gain:
    """The upper bound of overlapping `share` of a step with the rest of it, instead of removing it: a step is never
    shorter than that part nor than everything else, so 1 / max(share, 1 - share). Communication exposed 58 % of a
    step with 42 % of other work: at most 1.72x, not the 2.4x of removing the 58 % outright."""
    share = min(max(share, 0.0), 1.0)
    if share <= 0.5:
        return removal(share, f"{what}, hidden behind the rest of the step")
    return capped(Gain(1.0 / share, f"{what}: {share:.0%} of the step, longer than all the rest ({1 - share:.0%}); "
                       f"overlapped, the step still lasts as long as it, 1 / {share:.2f}", GainKind.UPPER_BOUND))


def kept_busy(busy: float) -> Gain:
    """The upper bound of keeping a GPU busy `busy` of the time busy all the time: 1 / busy, capped with the cap
    said."""
    busy = min(max(busy, 1e-6), 1.0)
    shown = f"{busy:.1%}" if busy < 0.01 else f"{busy:.0%}"
    return capped(Gain(1.0 / busy, f"if the GPU were kept busy: 1 / {shown} busy", GainKind.UPPER_BOUND))


def capped(g: Gain) -> Gain:
    return g.bounded(MAX_GAIN, f"capped at {MAX_GAIN:g}x")


# --- the model and the GPU ------------------------------------------------------------------------------------

def _model_and_gpu(ev: Evidence) -> tuple[ModelInfo, GpuSpec] | None:
    model = ev.model
    if ev.gpu_spec is None or model is None or not model.params:
        return None
    return model, ev.gpu_spec


def _dtype(ev: Evidence) -> str:
    return ev.weights_dtype() or "bf16"


def _context(ev: Evidence) -> tuple[int, str]:
    if ev.context_tokens > 0:
        return ev.context_tokens, f"context {ev.context_tokens} tokens"
    return ASSUMED_CONTEXT, f"assumed context {ASSUMED_CONTEXT} tokens"


def _mem_fraction(ev: Evidence) -> tuple[float, str]:
    """The share of GPU memory the server may fill (weights + KV cache): its flag, else vLLM's default."""
    for value, flag in ((ev.serving.gpu_memory_utilization, "--gpu-memory-utilization"),
                        (ev.serving.mem_fraction_static, "--mem-fraction-static")):
        if value is not None and 0 < value <= 1:
            return float(value), f" in {value:.0%} of memory ({flag})"
    return physics.DEFAULT_MEM_FRACTION, ""


def demand(ev: Evidence) -> float | None:
    """Sequences the offered load would keep running: running + waiting, when the server says."""
    batch, waiting = ev.observed_batch(), ev.waiting()
    if batch is None or waiting is None:
        return None
    return batch + waiting


def _kv_dtype(ev: Evidence, model: ModelInfo) -> str:
    return physics.kv_cache_dtype(model, None, _dtype(ev))


def efficiency(ev: Evidence) -> float | None:
    """Measured tokens/s over the decode ceiling, when both are known (physics realises gains from it)."""
    eff = ev.value(S.THEORY_EFFICIENCY)
    return min(1.0, eff) if eff is not None and eff > 0 else None


def _from_what_if(w: physics.WhatIf, basis: str, *, bytes_only: bool) -> Gain:
    """A what-if's gain: realised at the measured efficiency (the time beyond the roofline stays) when there is one;
    else the ceiling ratio, which for a change of bytes alone is the most it could give."""
    if w.speedup is None:
        return Gain.unknown(f"{basis}: {w.explanation}")
    if w.realised_speedup is not None and w.realised_speedup > w.speedup + 1e-9:
        # Above the ratio of the ceilings: the step runs far below its ceiling, so its time is mostly the fixed time
        # beyond the roofline, which the change shares over more work. Said as that, not as a figure "at the ceiling"
        # that the estimate then exceeds.
        return Gain(w.realised_speedup, f"{basis}: the ceiling itself rises only x{w.speedup:.2f}, but the step runs "
                                        f"at {w.efficiency:.0%} of it: its time is mostly the fixed time beyond the "
                                        "roofline, which stays and is shared over more work, so about "
                                        f"x{w.realised_speedup:.2f}" + (
                                            ", still below the new ceiling" if w.efficiency is not None
                                            and w.realised_speedup * w.efficiency <= w.speedup else ""))
    if w.realised_speedup is not None:
        return Gain(w.realised_speedup, f"{basis}: x{w.speedup:.2f} at the ceiling; the step runs at "
                                        f"{w.efficiency:.0%} of it and the time beyond the roofline stays, so about "
                                        f"x{w.realised_speedup:.2f}")
    if bytes_only:
        return Gain(w.speedup, f"{basis}: x{w.speedup:.2f} at the floor (no measured token rate, so the time beyond "
                               "the floor is not known: an upper bound)", GainKind.UPPER_BOUND)
    return Gain(w.speedup, f"{basis}: x{w.speedup:.2f} between the ceilings (no measured token rate: the step is "
                           "assumed to keep its share of the ceiling)")


# --- batching -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SequenceLimit:
    """The most sequences the server's configuration lets run at once, and the setting that says so."""

    sequences: int
    setting: str  # e.g. "--max-num-seqs 16"

    def describe(self) -> str:
        return f"the server's limit of {self.sequences} running sequences ({self.setting})"


def sequence_limit(ev: Evidence) -> SequenceLimit | None:
    """The server's configured cap on the running batch, the tightest known: vLLM --max-num-seqs (SGLang
    --max-running-requests), or TGI's --max-batch-total-tokens over the tokens a sequence holds. None when the
    configuration names neither."""
    found: list[SequenceLimit] = []
    serving = ev.serving
    if serving.max_num_seqs and serving.max_num_seqs > 0:
        flag = "--max-running-requests" if serving.engine == "sglang" else \
            flag_of(serving.engine, "max_num_seqs", "--max-num-seqs")
        found.append(SequenceLimit(int(serving.max_num_seqs), f"{flag} {serving.max_num_seqs}"))
    total = serving.max_batch_total_tokens
    if total and total > 0:
        ctx, ctx_text = _context(ev)
        found.append(SequenceLimit(max(1, total // ctx), f"--max-batch-total-tokens {total} at {ctx_text}"))
    return min(found, key=lambda lim: lim.sequences) if found else None


def next_limit_text(ev: Evidence, want: float | None) -> str:
    """A sentence naming the configured limit a larger batch would meet next, when it caps below the demand (or any
    growth when the demand is unknown); "" when no limit is configured or it is not in the way."""
    limit = sequence_limit(ev)
    if limit is None or (want is not None and want <= limit.sequences):
        return ""
    toward = f" toward {want:.0f}" if want is not None else ""
    return (f" The batch then stops at {limit.describe()}: raising it{toward} is the next fix.")


def batch_gain(ev: Evidence, *, factor: float | None = None, target: float | None = None,
               raises_limit: bool = False) -> Gain:
    """Throughput multiplier of decoding at a larger batch (factor x the observed one, or a target), capped by the
    sequences whose KV cache fits and, unless the fix is to raise it (`raises_limit`), by the server's configured
    sequence limit (sequence_limit); realised at the measured efficiency (physics.what_if). A speed gain only when
    requests wait (and then bounded by running + waiting); else capacity."""
    mg = _model_and_gpu(ev)
    batch = ev.observed_batch()
    if mg is None or batch is None:
        return Gain.unknown("needs the model's shape and a recognised GPU to predict")
    model, gpu = mg
    new = target if target is not None else batch * (factor or 1.0)
    dtype, tp = _dtype(ev), max(1, model.tensor_parallel)
    ctx, ctx_text = _context(ev)
    fraction, where = _mem_fraction(ev)
    notes = ""
    if physics.has_kv_shape(model):
        room = physics.max_concurrent_sequences(model, gpu, ctx, fraction, tp=tp, dtype=dtype)
        if room < new:
            new, notes = float(room), f", capped by the {room} sequences whose KV cache fits{where}"
    want = demand(ev)
    speed = want is not None and want > batch + 0.5
    if speed and want is not None and want < new:
        new, notes = want, notes + f", capped by the demand ({batch:.0f} running + {want - batch:.0f} waiting)"
    limit = None if raises_limit else sequence_limit(ev)
    if limit is not None and limit.sequences < new:
        # The fix leaves the scheduler's cap as it is, so the batch stops there; raising it is another fix.
        if limit.sequences <= batch:
            return Gain.unknown(f"the batch ({batch:.1f}) is already at {limit.describe()}: raise it first")
        new, notes = float(limit.sequences), notes + f", capped by {limit.describe()}: raising it is the next fix"
    new = max(new, batch)
    if new <= batch:
        return Gain.unknown(f"no larger batch fits in memory at {ctx_text}")
    w = physics.what_if(model, gpu, dtype, max(1.0, batch), ctx, tp, new_batch=max(1.0, new),
                        efficiency=efficiency(ev), mem_fraction=fraction)
    g = capped(_from_what_if(w, f"batch {new:.0f} vs {batch:.1f} on {gpu.name}, {ctx_text}{notes}",
                             bytes_only=False))
    if speed:
        return g
    if want is None:
        return g.as_capacity("no queue metric: more throughput only if more load is offered")
    return g.as_capacity("nothing waits: this traffic gets no faster; the GPU could serve this much more load")


# --- precision of weights and KV --------------------------------------------------------------------------------

def dtype_gain(ev: Evidence, new_dtype: str) -> Gain:
    """Throughput multiplier of serving the weights in another precision at the observed batch.

    The ceilings' ratio is what a step running at its floor would gain. A step measured at efficiency e of its
    ceiling spends the time beyond the roofline (norms, casts, softmax, launch gaps) whatever the weights' bytes, so
    the realised gain is about 1 / (1 - e + e / ratio). Measured on an H100 (2.4B decoder, batch 1, CUDA graphs,
    e = 0.33): FP8 weights gave 1.12x against 1.18x predicted this way and 1.9x from the ceilings
    (tests/fixtures/gpu)."""
    mg = _model_and_gpu(ev)
    if mg is None:
        return Gain(None, f"needs the model's shape and a recognised GPU to predict; {new_dtype} weights halve or "
                          "quarter the bytes each step reads, which helps only as far as the step runs near its "
                          "bandwidth floor")
    model, gpu = mg
    batch = ev.observed_batch() or 1.0
    dtype, tp = _dtype(ev), max(1, model.tensor_parallel)
    ctx, ctx_text = _context(ev)
    if physics.bytes_per_element(new_dtype) >= physics.bytes_per_element(dtype):
        return Gain.unknown(f"weights are already {dtype}")
    w = physics.what_if(model, gpu, dtype, max(1.0, batch), ctx, tp, new_dtype=new_dtype, efficiency=efficiency(ev))
    return _from_what_if(w, f"decode ceiling with {new_dtype} weights vs {dtype} at batch {batch:.0f} on {gpu.name}, "
                            f"{ctx_text}", bytes_only=True)


def model_dtype_gain(ev: Evidence, new_dtype: str) -> Gain:
    """Throughput multiplier of running the whole model in a narrower float (fp32 -> bf16/fp16): weights,
    activations and, where it follows the model, the KV cache all take new/old the bytes.

    The promise is an upper bound: the GPU's work at the new precision's floor (its ceiling from the physics), the
    host's time between kernels kept: 1 / (idle + e / r) with e the step's measured share of its ceiling now and r
    the ceilings' ratio. The basis gives the estimate for kernels that keep their efficiency, 1 / (idle + busy x
    bytes ratio), which is no bound: FP32 kernels (SIMT FMA GEMMs, FP32 attention) are often far less efficient than
    the 16-bit tensor-core kernels that replace them. Measured on an H200 (2.4B Llama, transformers generate compiled):
    fp32 -> bf16 realised x1.75 at batch 1 (up to x2.6 this way, x1.60 kept-efficiency) and x3.09 at batch 16 (up to
    x5.0, x1.73 kept-efficiency) (tests/fixtures/gpu/hf/precision)."""
    old = _dtype(ev)
    try:
        ratio = physics.bytes_per_element(new_dtype) / physics.bytes_per_element(old)
    except InputError:
        return Gain.unknown(f"{new_dtype} is not a precision the physics knows")
    if ratio >= 1.0:
        return Gain.unknown(f"the model already runs in {old}")
    if ev.regime is not Regime.MEMORY:
        return Gain(None, f"{old} -> {new_dtype}: outside the memory-bound regime the matmuls' rates decide (the "
                          "FP32 matmul rule sizes that from the trace)")
    busy_sig, idle_sig = ev.get(S.GPU_BUSY), ev.value(S.TRACE_GPU_IDLE_FRAC)
    busy = busy_sig.mean if busy_sig is not None else (1.0 - idle_sig if idle_sig is not None else None)
    model = ev.model
    kv_own = model is None or not model.kv_dtype or model.kv_dtype == model.dtype
    what = f"{old} -> {new_dtype}: weights, activations{' and KV cache' if kv_own else ''} at {ratio:g}x the bytes"
    if busy is None:
        return Gain(1.0 / ratio, f"{what}: x{1 / ratio:.1f} at most for the GPU's work (how busy the GPU is was not "
                                 "measured, so the host's share is not known)", GainKind.UPPER_BOUND)
    busy = min(1.0, max(0.0, busy))
    kept = 1.0 / (1.0 - busy + busy * ratio)
    kept_text = (f"about x{kept:.2f} where the kernels keep their efficiency (1 / ({1 - busy:.2f} + {busy:.2f} x "
                 f"{ratio:g}); FP32 kernels are often less efficient than the 16-bit ones that replace them)")
    mg, eff = _model_and_gpu(ev), efficiency(ev)
    if mg is None or eff is None:
        return Gain(kept, f"{what}; the GPU {busy:.0%} busy: {kept_text}; no ceiling to bound it")
    m, gpu = mg
    ctx, ctx_text = _context(ev)
    kv_new = new_dtype if kv_own else None
    w = physics.what_if(m, gpu, old, max(1.0, ev.observed_batch() or 1.0), ctx, max(1, m.tensor_parallel),
                        new_dtype=new_dtype, new_kv_dtype=kv_new)
    if w.speedup is None:
        return Gain(kept, f"{what}; the GPU {busy:.0%} busy: {kept_text}; no ceiling to bound it ({w.explanation})")
    bound = 1.0 / (1.0 - busy + min(busy, eff / w.speedup))
    return Gain(bound, f"{what}, {ctx_text}: the GPU's work at the {new_dtype} floor (the step now at {eff:.0%} of its "
                       f"ceiling, the ceiling x{w.speedup:.2f}) with the GPU's idle {1 - busy:.0%} of the window "
                       f"(busy {busy:.0%}) kept: up to "
                       f"x{bound:.2f}; {kept_text}", GainKind.UPPER_BOUND)


def kv_dtype_gain(ev: Evidence, new_kv: str = "fp8") -> Gain:
    """An FP8 (or INT8) KV cache: half the KV bytes each step reads and twice the sequences that fit; with requests
    waiting the batch grows into the freed memory, up to the demand (physics.kv_dtype_what_if)."""
    mg = _model_and_gpu(ev)
    batch = ev.observed_batch()
    if mg is None or batch is None:
        return Gain(None, "needs the model's shape, a recognised GPU and the running batch to predict; an FP8 KV "
                          "cache halves the KV bytes per token and doubles the sequences that fit")
    model, gpu = mg
    if not physics.has_kv_shape(model):
        return Gain.unknown("needs the model's layers, KV heads and head size to size the KV cache")
    dtype, tp = _dtype(ev), max(1, model.tensor_parallel)
    old_kv = _kv_dtype(ev, model)
    if physics.bytes_per_element(new_kv) >= physics.bytes_per_element(old_kv):
        return Gain.unknown(f"the KV cache is already {old_kv}")
    ctx, ctx_text = _context(ev)
    fraction, _ = _mem_fraction(ev)
    want = demand(ev)
    grows = want is not None and want > batch + 0.5
    pool = ev.get(S.SERVER_KV_USAGE)
    if grows and want is not None and pool is not None and pool.p90 >= 0.9:
        # The server's KV pool is full at this batch: its size in bytes is what it is, so the smaller KV fits
        # bytes-ratio times the sequences in it, whatever else the GPU's memory holds.
        ratio = physics.bytes_per_element(old_kv) / physics.bytes_per_element(new_kv)
        want = min(want, max(1.0, batch) * ratio)
    limit, held = sequence_limit(ev), ""
    if grows and want is not None and limit is not None and want > limit.sequences:
        # The freed memory admits more sequences, but no more than the scheduler's cap lets run.
        held = f"; {limit.describe()} caps the batch: raising it is the next fix"
        want = float(limit.sequences)
        grows = want > batch + 0.5
    w = physics.kv_dtype_what_if(model, gpu, max(1.0, batch), ctx, new_kv_dtype=new_kv, dtype=dtype, tp=tp,
                                 demand=want if grows else None, efficiency=efficiency(ev), mem_fraction=fraction)
    kv_share = 1.0 - physics.decode_floor_s(model, gpu, max(1.0, batch), 0, dtype=dtype, tp=tp) / \
        physics.decode_floor_s(model, gpu, max(1.0, batch), ctx, dtype=dtype, tp=tp)
    grew = f"; the batch grows {w.before_batch:.0f} -> {w.after_batch:.0f}" if w.after_batch != w.before_batch else ""
    return capped(_from_what_if(w, f"KV is {kv_share:.0%} of the bytes a step reads at batch {batch:.0f}, {ctx_text}; "
                                   f"{new_kv} KV halves them and twice the sequences fit{grew}{held}",
                                bytes_only=not grows))


def tp_gain(ev: Evidence, new_tp: int) -> Gain:
    """Sharding over more GPUs: each reads its share of the weights and KV, plus two all-reduces a layer
    (physics.tp_what_if): sublinear, and realised at the measured efficiency."""
    mg = _model_and_gpu(ev)
    batch = ev.observed_batch()
    if mg is None or batch is None:
        return Gain.unknown("needs the model's shape, a recognised GPU and the running batch to predict")
    model, gpu = mg
    tp = max(1, model.tensor_parallel)
    ctx, ctx_text = _context(ev)
    w = physics.tp_what_if(model, gpu, max(1.0, batch), ctx, new_tp, tp=tp, dtype=_dtype(ev),
                           efficiency=efficiency(ev))
    note = "; ".join(a for a in w.assumptions if "all-reduce" in a or "collective" in a)
    return _from_what_if(w, f"tensor parallel {tp} -> {new_tp} on {gpu.name}, {ctx_text}"
                            + (f" ({note})" if note else ""), bytes_only=False)


# --- kernels and the floor ----------------------------------------------------------------------------------------

def floor_bound(ev: Evidence) -> tuple[float, str] | None:
    """1 / efficiency: nothing that keeps the bytes and the batch can beat the bandwidth (or compute) floor."""
    eff = ev.value(S.THEORY_EFFICIENCY)
    if eff is None or eff <= 0 or eff >= 1:
        return None
    return 1.0 / eff, f"the step at its floor: 1 / {eff:.0%} efficiency"


def tuned_engine_gain(ev: Evidence) -> Gain:
    bound = floor_bound(ev)
    if bound is None:
        return Gain.unknown("needs a measured token rate and the model's floor to predict")
    eff = ev.value(S.THEORY_EFFICIENCY) or 0.0
    target = REACHABLE_EFFICIENCY / eff
    if target <= 1.0:
        return Gain.unknown(f"the decode already reaches {eff:.0%} of its floor")
    return Gain(min(target, bound[0]), f"from {eff:.0%} to {REACHABLE_EFFICIENCY:.0%} of the bandwidth ceiling, "
                                       f"what tuned decode paths reach at small batch (at most {bound[0]:.2f}x: "
                                       f"{bound[1]})")


def elementwise_share(ev: Evidence) -> float | None:
    """Share of the window in norm/elementwise/reduction kernels (of busy time x the busy fraction)."""
    share = ev.value(S.TRACE_SHARE_ELEMENTWISE)
    if share is None:
        return None
    idle = ev.value(S.TRACE_GPU_IDLE_FRAC)
    return share * (1.0 - idle) if idle is not None else share


def fusion_gain(ev: Evidence) -> Gain:
    """Fusing the small kernels removes at most their time and the gaps between them (Amdahl)."""
    share = elementwise_share(ev)
    if share is None:
        return Gain.unknown("needs a trace to measure the time in small kernels (attach --trace 5)")
    gaps = ev.value(S.TRACE_IDLE_KERNEL_OVERHEAD_FRAC) or 0.0
    g = removal(share + gaps, f"norm/elementwise/reduction kernels {share:.0%} of the window"
                + (f" and kernel-to-kernel gaps {gaps:.0%}" if gaps else ""))
    bound = floor_bound(ev)
    return g.bounded(bound[0], bound[1]) if bound else g


def fp8_matmul_gain(ev: Evidence) -> Gain:
    """FP8 tensor cores double the peak, but only for the GEMM share of the time (Amdahl)."""
    gpu = ev.gpu_spec
    if gpu is None or "fp8" not in gpu.flops:
        return Gain.unknown("needs a GPU with FP8 tensor cores (Hopper, Ada, Blackwell)")
    dtype = _dtype(ev)
    # Counters alone do not say the dtype: the gain is for 16-bit matmuls, and the basis says it assumed that.
    assumed = "" if ev.weights_dtype() else (f"; assumes {dtype} matmuls now (the dtype is not known here: "
                                             "--model config.json names it): a server on FP8 already gains nothing")
    try:
        base = physics.peak_flops(gpu, dtype)
    except InputError:
        return Gain.unknown(f"no {dtype} rate for the {gpu.name}")
    ratio = gpu.flops["fp8"] / base
    if ratio <= 1.0:
        return Gain.unknown(f"the {gpu.name} computes {dtype} at its FP8 rate already")
    gemm = ev.value(S.TRACE_SHARE_GEMM)
    attention = ev.value(S.TRACE_SHARE_ATTENTION) or 0.0
    tensor = ev.value(S.GPU_TENSOR_ACTIVE)
    if gemm is None and tensor is not None:
        # No trace, but the counters say how much of the time the tensor pipes work: FP8 shortens those cycles only.
        t = min(1.0, max(0.0, tensor))
        return Gain(amdahl(t, ratio), f"FP8 over {dtype} tensor peak ({ratio:.2f}x) shortens only the cycles the "
                                      f"tensor pipes are active ({t:.0%}, counters): 1 / ({1 - t:.2f} + {t:.2f} / "
                                      f"{ratio:.2f}){assumed}", GainKind.UPPER_BOUND)
    if gemm is None:
        return Gain(ratio, f"FP8 over {dtype} tensor peak of the {gpu.name} ({ratio:.2f}x), if all the time were "
                           f"matmuls (no trace to measure the GEMM share: an upper bound){assumed}",
                    GainKind.UPPER_BOUND)
    share = min(1.0, gemm + attention)
    gain = amdahl(share, ratio)
    return Gain(gain, f"FP8 over {dtype} tensor peak ({ratio:.2f}x) applies to the {share:.0%} of GPU time in "
                      f"GEMMs and attention: 1 / ({1 - share:.2f} + {share:.2f} / {ratio:.2f}){assumed}",
                GainKind.UPPER_BOUND)


def host_bound(ev: Evidence) -> tuple[float, str] | None:
    """1 / busy: removing host work can at most keep the GPU busy all the time."""
    busy = ev.busy_fraction()
    if busy is None or busy <= 0 or busy >= 1:
        return None
    shown = f"{busy:.1%}" if busy < 0.01 else f"{busy:.0%}"
    return 1.0 / busy, f"the GPU busy all the time: 1 / {shown} busy"


def ridge_batch(ev: Evidence) -> float | None:
    return ev.value(S.THEORY_RIDGE_BATCH)
