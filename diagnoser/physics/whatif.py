"""What-ifs: the decode ceiling before and after a change of precision, KV-cache precision, GPU, batch or tensor
parallelism, and, where the efficiency against the ceiling is known, the gain a server would realise.

`speedup` is always the ratio of the ceilings; `realised_speedup` the gain with the time beyond the roofline kept
per step and its part that grows with the batch counted (physics.realised), with its range (`realised_low`,
`realised_high`, `realised_basis`). They say different things and both are reported, named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.gpus import GpuSpec, peak_flops
from diagnoser.physics.llm import (
    DEFAULT_MEM_FRACTION,
    _check,
    decode_bound,
    decode_ceiling_tokens_per_s,
    decode_comm_s,
    decode_step_bytes,
    has_kv_shape,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_cache_dtype,
    max_concurrent_sequences,
    usable_memory_bytes,
    weight_bytes,
    weight_dtype,
)
from diagnoser.physics.parallel import Interconnect, has_tp_shape, interconnect
from diagnoser.physics.quant import quant_scheme
from diagnoser.physics.realised import (
    ATTAINABLE_BANDWIDTH,
    attainable_shares,
    decode_workload,
    generation_workload,
    realised_range,
)

REALISED_PREFIX = "realised gain:"  # the assumption behind realised_speedup starts so


@dataclass(frozen=True)
class WhatIf:
    """Decode tokens/s ceiling before and after one or more changes, why it moves, and what it assumes.

    `speedup` is the ceiling ratio (None when the setup before does not fit, so there is nothing to compare with);
    `realised_speedup` the gain at the measured `efficiency` with the time beyond the roofline kept (None without an
    efficiency). `expected_speedup` is the realised one when there is one."""

    change: str
    before_tokens_per_s: float
    after_tokens_per_s: float
    speedup: float | None
    explanation: str
    realised_speedup: float | None = None
    efficiency: float | None = None
    assumptions: tuple[str, ...] = field(default=())
    before_batch: float = 1.0
    after_batch: float = 1.0
    realised_low: float | None = None
    realised_high: float | None = None
    realised_basis: str = ""

    @property
    def expected_speedup(self) -> float | None:
        return self.realised_speedup if self.realised_speedup is not None else self.speedup


@dataclass(frozen=True)
class _Setup:
    gpu: GpuSpec
    dtype: str
    kv_dtype: str
    batch: float
    tp: int
    link: Interconnect


def ratio_text(value: float) -> str:
    """An estimated ratio to two significant digits (x121.44 -> x120, x1.834 -> x1.8, x0.998 -> x1.0): the models
    behind it are not good to four."""
    if not (math.isfinite(value) and value > 0):
        return f"x{value:g}"
    digits = 1 - math.floor(math.log10(value))
    rounded = round(value, digits)
    if math.floor(math.log10(rounded)) > math.floor(math.log10(value)):  # 9.96 -> 10: one digit fewer after the point
        digits -= 1
        rounded = round(value, digits)
    return f"x{rounded:,.{max(digits, 0)}f}"


def range_text(low: float, high: float) -> str:
    """A realised gain's range as printed beside it: "x44 to x120" ("x1.5" where both ends print the same)."""
    ends = ratio_text(low), ratio_text(high)
    return ends[0] if ends[0] == ends[1] else f"{ends[0]} to {ends[1]}"


def _growth_text(low: float, high: float) -> str:
    """What the explanation adds where the batch's growth moves the realised gain: its range."""
    ends = ratio_text(low), ratio_text(high)
    return "" if ends[0] == ends[1] else f"; {ends[0]} to {ends[1]} as its part that grows with the batch is counted"


def _memory_problem(model: ModelInfo, s: _Setup, context: float, mem_fraction: float) -> str:
    """Why a setup does not fit in memory, or "" if it does."""
    usable = usable_memory_bytes(s.gpu, mem_fraction)
    weights = weight_bytes(model, s.dtype) / s.tp
    if weights > usable:
        return (f"{weights / 1e9:.1f} GB of weights per GPU exceed the {usable / 1e9:.1f} GB usable on one "
                f"{s.gpu.name} ({mem_fraction:.0%} of its memory assumed for the server)")
    if context and has_kv_shape(model):
        kv = s.batch * kv_bytes_per_sequence(model, context, s.kv_dtype, tp=s.tp)
        if weights + kv > usable:
            return (f"the KV cache of {s.batch:g} x {context:g} tokens ({kv / 1e9:.1f} GB per GPU) does not fit beside "
                    f"the weights in {mem_fraction:.0%} of one {s.gpu.name}'s memory (the share assumed for the "
                    "server)")
    return ""


def _tokens_per_s(model: ModelInfo, s: _Setup, context: float, mem_fraction: float) -> float:
    if _memory_problem(model, s, context, mem_fraction):
        return 0.0
    return decode_ceiling_tokens_per_s(model, s.gpu, s.batch, context, s.dtype, s.tp, kv_dtype=s.kv_dtype,
                                       link=s.link)


def _describe_change(before: _Setup, after: _Setup) -> str:
    parts = []
    if after.dtype != before.dtype:
        parts.append(f"{before.dtype} -> {after.dtype}")
    if after.kv_dtype != before.kv_dtype:
        parts.append(f"KV {before.kv_dtype} -> {after.kv_dtype}")
    if after.gpu.key != before.gpu.key:
        parts.append(f"{before.gpu.name} -> {after.gpu.name}")
    if after.batch != before.batch:
        parts.append(f"batch {before.batch:g} -> {after.batch:g}")
    if after.tp != before.tp:
        parts.append(f"tp {before.tp} -> {after.tp}")
    return ", ".join(parts) or "no change"


def _kv_share(model: ModelInfo, s: _Setup, context: float) -> float:
    total = decode_step_bytes(model, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp)
    weights = decode_step_bytes(model, s.batch, 0, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp)
    return (total - weights) / total if total > 0 else 0.0


def _why(model: ModelInfo, before: _Setup, after: _Setup, context: float) -> str:
    """Which roof limits each side, and how the quantity behind that roof moves."""
    bounds = [decode_bound(model, s.gpu, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp)
              for s in (before, after)]
    if bounds[0] != bounds[1]:
        return f"decode goes from {bounds[0]}-bound to {bounds[1]}-bound"
    if bounds[0] == "memory":
        moved = [decode_step_bytes(model, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp) / s.batch
                 for s in (before, after)]
        why = (f"decode stays memory-bound; bytes read per GPU per token go {moved[0] / 1e9:.3g} -> "
               f"{moved[1] / 1e9:.3g} GB")
        if after.kv_dtype != before.kv_dtype:
            why += f" (the KV cache is {_kv_share(model, before, context):.0%} of a step's bytes before)"
        if after.gpu.hbm_bytes_per_s != before.gpu.hbm_bytes_per_s:
            why += (f" and bandwidth {before.gpu.hbm_bytes_per_s / 1e12:.3g} -> "
                    f"{after.gpu.hbm_bytes_per_s / 1e12:.3g} TB/s")
        return why
    peaks = [s.tp * peak_flops(s.gpu, s.dtype) / 1e12 for s in (before, after)]
    return f"decode stays compute-bound; peak goes {peaks[0]:.4g} -> {peaks[1]:.4g} TFLOP/s over the group"


def _assumptions(model: ModelInfo, before: _Setup, after: _Setup, context: float, efficiency: float | None,
                 mem_fraction: float) -> list[str]:
    notes = []
    if after.kv_dtype != before.kv_dtype and context >= 1 and has_kv_shape(model):
        fit = [max_concurrent_sequences(model, s.gpu, int(context), mem_fraction, s.tp, dtype=s.dtype,
                                        kv_dtype=s.kv_dtype) for s in (before, after)]
        per_token = [kv_bytes_per_token(model, s.kv_dtype) for s in (before, after)]
        notes.append(f"KV cache {per_token[0] / 1024:,.0f} -> {per_token[1] / 1024:,.0f} KiB a token: "
                     f"{fit[0]:,} -> {fit[1]:,} sequences of {context:,.0f} tokens fit")
    # One line per tensor-parallel setup: before and after on the same GPUs and link differ only in the batch.
    same = after.tp == before.tp and after.gpu == before.gpu and after.link == before.link
    for s in (before,) if same else (before, after):
        if s.tp > 1:
            if has_tp_shape(model):
                times = [(x.batch, decode_comm_s(model, x.gpu, x.batch, tp=x.tp, link=x.link))
                         for x in ((before, after) if same and after.batch != before.batch else (s,))]
                per_step = ", ".join(f"{t * 1e3:.3g} ms a step" + (f" at batch {b:g}" if len(times) > 1 else "")
                                     for b, t in times)
                notes.append(f"tp {s.tp}: 2 all-reduces a layer of batch x hidden x 2 bytes (ring, 2(n-1)/n of it "
                             f"over {s.link.describe()}) and a logits gather: {per_step}")
            else:
                notes.append(f"tp {s.tp}: collectives not counted (the model's layers and hidden size are unknown)")
    for s in {before.dtype: before, after.dtype: after}.values():
        scheme = quant_scheme(model, s.dtype)
        if scheme.quantised:
            notes.append(f"{s.dtype} weights stored as {scheme.describe()}"
                         + ("" if scheme.from_config else " (default; the config does not say)"))
    if model.active_params and model.params and model.active_params < model.params:
        notes.append("MoE: a step reads the experts its tokens route to, routing assumed uniform")
    if efficiency is not None:
        shares = attainable_shares(before.gpu, before.dtype)
        roof = "at the measured roofs" if shares[0] == 1.0 else (f"taken at {ATTAINABLE_BANDWIDTH:.0%} of the "
                                                                 "datasheet bandwidth, what streaming kernels reach")
        notes.append(f"{REALISED_PREFIX} the step runs at {efficiency:.0%} of its ceiling; the time beyond the "
                     f"roofline ({roof}) is per-step work (launches, small kernels, host) that stays, and a part "
                     "that grows with the batch (the arithmetic the roofline hides under the weight reads, the "
                     "activations, the engine's host work per sequence)")
    return notes


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
    new_kv_dtype: str | None = None,
    demand: float | None = None,
    efficiency: float | None = None,
    link: Interconnect | None = None,
    new_link: Interconnect | None = None,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    engine: str | None = None,
) -> WhatIf:
    """Compare the decode ceiling now with the ceiling after changing precision, KV-cache precision, GPU, batch
    and/or tensor parallelism.

    `demand`: the sequences that want to run (running + waiting). With it, a change that frees memory (a smaller KV
    cache or weights, more GPUs, a larger GPU) runs min(demand, the sequences whose KV cache then fits) of them, and
    never fewer than now; it is how an FP8 KV cache doubles the batch of a server whose cache is full. `efficiency`:
    measured tokens/s over the ceiling now, for the realised gain. A setup whose weights or KV cache do not fit gets
    0 tokens/s. `link` and `new_link` override the interconnect (physics.parallel.interconnect). `engine` names the
    serving engine whose host work per sequence the realised gain counts (physics.realised.PER_SEQUENCE_HOST_S).
    """
    wdtype = weight_dtype(model, dtype)
    kv_now = kv_cache_dtype(model, kv_dtype, wdtype)
    after_dtype = weight_dtype(model, new_dtype or wdtype)
    after_gpu, after_tp = new_gpu or gpu, new_tp if new_tp is not None else tp
    # An explicit KV precision stays when only the weights change; an implicit one follows the weights' activations.
    if new_kv_dtype:
        kv_after = kv_cache_dtype(model, new_kv_dtype, after_dtype)
    else:
        kv_after = kv_now if kv_dtype else kv_cache_dtype(model, None, after_dtype)
    before = _Setup(gpu, wdtype, kv_now, batch, tp, link or interconnect(gpu, tp))
    same_link = new_gpu is None and after_tp == tp
    after = _Setup(after_gpu, after_dtype, kv_after, new_batch if new_batch is not None else batch, after_tp,
                   new_link or (before.link if same_link else interconnect(after_gpu, after_tp)))
    _check(before.batch, context, before.tp)
    _check(after.batch, context, after.tp)
    capacity_note = ""
    if demand is not None and new_batch is None and context and has_kv_shape(model):
        room = max_concurrent_sequences(model, after.gpu, int(context), mem_fraction, after.tp, dtype=after.dtype,
                                        kv_dtype=after.kv_dtype)
        grown = max(batch, min(demand, float(room)))
        if grown != batch:
            after = _Setup(after.gpu, after.dtype, after.kv_dtype, grown, after.tp, after.link)
        capacity_note = (f"{room} sequences of {context:g} tokens fit after the change; {demand:g} want to run, "
                         f"so the batch goes {batch:g} -> {after.batch:g}")
    change = _describe_change(before, after)
    rates = [_tokens_per_s(model, s, context, mem_fraction) for s in (before, after)]
    problems = [_memory_problem(model, s, context, mem_fraction) for s in (before, after)]
    if problems[1]:
        why = problems[1]
    elif problems[0]:
        why = f"it fits, whereas now {problems[0]}"
    else:
        why = _why(model, before, after, context)
    speedup = rates[1] / rates[0] if rates[0] > 0 else None
    realised = None
    if efficiency is not None and speedup is not None and rates[1] > 0:
        workloads = [decode_workload(model, s.gpu, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp,
                                     link=s.link) for s in (before, after)]
        realised = realised_range(workloads[0], workloads[1], efficiency, engine=engine)
    tail = ""
    if speedup is not None and not problems[1]:
        tail = f", so tokens/s {ratio_text(speedup)} at the ceiling"
        if realised is not None:
            tail += (f"; {ratio_text(realised.value)} realised at {efficiency:.0%} of the ceiling (the time beyond the "
                     f"roofline stays{_growth_text(realised.low, realised.high)})")
    assumptions = _assumptions(model, before, after, context, efficiency if realised is not None else None,
                               mem_fraction)
    if realised is not None:
        assumptions.append(f"realised range {range_text(realised.low, realised.high)}: {realised.basis}")
    if capacity_note:
        assumptions.insert(0, capacity_note)
    return WhatIf(change, rates[0], rates[1], speedup, f"{change}: {why}{tail}.",
                  realised.value if realised else None, efficiency, tuple(assumptions), before.batch, after.batch,
                  realised.low if realised else None, realised.high if realised else None,
                  realised.basis if realised else "")


def kv_dtype_what_if(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float,
    context: float,
    *,
    new_kv_dtype: str = "fp8",
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
    demand: float | None = None,
    efficiency: float | None = None,
    link: Interconnect | None = None,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    engine: str | None = None,
) -> WhatIf:
    """Storing the KV cache in `new_kv_dtype` (FP8/INT8: half the bytes per token), nothing else changed: each step
    reads half the KV bytes, and twice the sequences fit. With `demand` (running + waiting sequences) the batch
    grows into the freed memory, up to the demand; without it the batch stays and only the bytes move."""
    return what_if(model, gpu, dtype, batch, context, tp, kv_dtype=kv_dtype, new_kv_dtype=new_kv_dtype,
                   demand=demand, efficiency=efficiency, link=link, mem_fraction=mem_fraction, engine=engine)


def tp_what_if(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float,
    context: float,
    new_tp: int,
    *,
    tp: int = 1,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    efficiency: float | None = None,
    link: Interconnect | None = None,
    new_link: Interconnect | None = None,
    demand: float | None = None,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    engine: str | None = None,
) -> WhatIf:
    """Sharding over `new_tp` GPUs: each reads 1/new_tp of the weights and KV cache and adds 2 all-reduces a layer
    plus a logits gather (physics.parallel), so the ceiling grows less than new_tp/tp; its assumptions name the link
    and the collective time per step."""
    return what_if(model, gpu, dtype, batch, context, tp, new_tp=new_tp, kv_dtype=kv_dtype, efficiency=efficiency,
                   link=link, new_link=new_link, demand=demand, mem_fraction=mem_fraction, engine=engine)


def generation_what_if(
    model: ModelInfo,
    gpu: GpuSpec,
    dtype: str | None,
    batch: float,
    prompt_tokens: int,
    generated_tokens: int,
    new_batch: float,
    tp: int = 1,
    *,
    context: float | None = None,
    kv_dtype: str | None = None,
    efficiency: float | None = None,
    link: Interconnect | None = None,
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    engine: str | None = None,
) -> WhatIf:
    """A batch change counted over whole requests: each of `prompt_tokens` prefilled and `generated_tokens`
    generated, so every request costs its prefill besides its decode steps (physics.generation_workload: the prompts
    prefilled together, the decode steps at the mean context). A larger batch amortises the decode's weight reads
    but not the prefill's FLOPs, so the gain is below the decode-only ratio, the more so the longer the prompts.
    `context`: the context `efficiency` was measured at (default: the prompt's). `engine`: as for what_if."""
    if prompt_tokens < 1 or generated_tokens < 1:
        raise InputError("a request needs at least one prompt token and one generated token.")
    wdtype = weight_dtype(model, dtype)
    kv = kv_cache_dtype(model, kv_dtype, wdtype)
    ln = link or interconnect(gpu, tp)
    before = _Setup(gpu, wdtype, kv, batch, tp, ln)
    after = _Setup(gpu, wdtype, kv, new_batch, tp, ln)
    _check(before.batch, prompt_tokens, tp)
    _check(after.batch, prompt_tokens, tp)
    held = float(prompt_tokens + generated_tokens) if has_kv_shape(model) else 0.0  # a finished sequence's KV
    works = [generation_workload(model, gpu, s.batch, prompt_tokens, generated_tokens, dtype=wdtype, kv_dtype=kv,
                                 tp=tp, link=ln) for s in (before, after)]
    problems = [_memory_problem(model, s, held, mem_fraction) for s in (before, after)]
    rates = [0.0 if p else w.ceiling_tokens_per_s for w, p in zip(works, problems, strict=True)]
    change = _describe_change(before, after)
    speedup = rates[1] / rates[0] if rates[0] > 0 else None
    mean_context = prompt_tokens + generated_tokens / 2 if has_kv_shape(model) else 0.0
    decode_only = [decode_ceiling_tokens_per_s(model, gpu, s.batch, mean_context, wdtype, tp, kv_dtype=kv, link=ln)
                   for s in (before, after)]
    prefill_share = [w.prefill.ceiling_s / w.ceiling_s if w.prefill else 0.0 for w in works]
    realised = None
    if efficiency is not None and speedup is not None and rates[1] > 0:
        # The efficiency was measured against the steady decode step at the context: its time beyond the roofline
        # is kept per decode step; the prefill runs at its attained roof.
        step = decode_workload(model, before.gpu, before.batch, context if context is not None else prompt_tokens,
                               dtype=before.dtype, kv_dtype=before.kv_dtype, tp=before.tp, link=before.link)
        realised = realised_range(works[0], works[1], efficiency, measured_on=step, engine=engine)
    if problems[1]:
        why = problems[1]
    elif problems[0]:
        why = f"it fits, whereas now {problems[0]}"
    else:
        why = (f"each request's prefill of {prompt_tokens:,} tokens is counted beside its {generated_tokens:,} "
               f"generated tokens: the prefill is {prefill_share[0]:.0%} -> {prefill_share[1]:.0%} of the time at the "
               f"ceiling, and a larger batch shares only the decode's weight reads (decode alone: "
               f"{ratio_text(decode_only[1] / decode_only[0])})")
    tail = ""
    if speedup is not None and not problems[1]:
        tail = f", so tokens/s {ratio_text(speedup)} at the ceiling"
        if realised is not None:
            tail += (f"; {ratio_text(realised.value)} realised at {efficiency:.0%} of the decode ceiling (the time "
                     f"beyond the roofline stays per decode step{_growth_text(realised.low, realised.high)})")
    notes = [f"requests of {prompt_tokens:,} prompt tokens and {generated_tokens:,} generated, the prompts "
             f"prefilled together, the decode steps at the mean context {prompt_tokens + generated_tokens / 2:,.0f}"]
    notes += _assumptions(model, before, after, held, efficiency if realised is not None else None, mem_fraction)
    if realised is not None:
        notes.append(f"realised range {range_text(realised.low, realised.high)}: {realised.basis}")
    return WhatIf(change, rates[0], rates[1], speedup, f"{change}: {why}{tail}.",
                  realised.value if realised else None, efficiency, tuple(notes), before.batch, after.batch,
                  realised.low if realised else None, realised.high if realised else None,
                  realised.basis if realised else "")
