"""Realised gains: what a change delivers to a server that runs below its ceiling.

A ceiling ratio says what a step running at its floor would gain. A real step takes T = t / e, where t is the
ceiling time and e the measured efficiency (measured tokens/s over the ceiling). The model here splits T into

- the attained roofline time: max(bytes / (s_m x bandwidth), FLOPs / (s_c x peak)) + collectives, where s_m and s_c
  are the shares of the datasheet roofs that streaming kernels reach (ATTAINABLE_BANDWIDTH, ATTAINABLE_COMPUTE; 1
  for a roof `diagnoser calibrate` measured), which scales with the bytes and FLOPs a change moves, and
- the rest, O = T - attained, per decode step: kernel launches and their fixed latencies, small unfused kernels
  (norms, casts, sampling), host scheduling. It does not shrink with fewer bytes, a larger batch or more GPUs
  (each GPU runs the same kernels), so it stays.

After the change T' = attained' + O', and the realised speedup is (tokens' / T') / (tokens / T). For a pure bytes
change on a memory-bound step with measured roofs this is 1 / (1 - e + e / r) for a ceiling ratio r
(realised_gain). docs/physics.md derives it per change and checks it against published measurements.

A batch change moves O too (issue 44, item 2): O = F + G(B), a fixed part F per step and a part G that grows with
the sequences the step carries, G(B) = the arithmetic the roofline's max() hides under the weight stream
(min(weights' reads, matrix products' FLOPs) at the attained roofs: a GEMM of B rows overlaps its FLOPs with its
weight reads only in part) + the batch's activation traffic + B x the engine's host
work per sequence (PER_SEQUENCE_HOST_S, where the engine is known). F is what the baseline's O leaves: O - G(B0).
Where G(B0) exceeds O, F is 0 and G is scaled to O on both sides. realised_range gives the estimate with its range:
low with O fixed per step (perfect overlap, no host work per sequence), high with the largest published host cost
per sequence (vLLM V0's) added.
"""

from __future__ import annotations

from dataclasses import dataclass

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.gpus import GpuSpec, compute_dtype
from diagnoser.physics.llm import (
    decode_comm_s,
    decode_compute_s,
    decode_floor_s,
    has_kv_shape,
    prefill_cost,
    weight_dtype,
)
from diagnoser.physics.parallel import Interconnect

# Shares of the datasheet roofs that streaming kernels reach. Memory: a copy or read kernel reaches 3.1 of an H100
# SXM's 3.35 TB/s (0.93, `diagnoser calibrate`, tests/fixtures/gpu/README.md) and about 1.7 of an A100's 2.04 TB/s at
# a 330 W cap (0.83, gpt-fast's README); 0.9 between them. Compute: dense BF16 GEMMs reach 799 of 989 TFLOP/s on
# the same H100 (0.81), FP8 0.74; 0.8.
ATTAINABLE_BANDWIDTH = 0.9
ATTAINABLE_COMPUTE = 0.8

# Host work a serving engine does per sequence in each decode step (sampling's host side, preparing the next step's
# inputs, processing outputs, scheduling), where a figure is published. vLLM V0 (2024): "When BS is 200, all this
# together can be 20 ms" between two steps (vllm-project/vllm issue 6801, 2024-08-08), 0.1 ms a sequence; V1
# (0.8 on, 2025) overlaps much of it with the GPU, so the figure is V0's only. No figure is published for vLLM V1,
# TensorRT-LLM's C++ runtime, SGLang or the others: 0 at the estimate, and V0's figure bounds the range above
# (HOST_PER_SEQUENCE_HIGH_S).
PER_SEQUENCE_HOST_S: dict[str, float] = {"vllm-v0": 20e-3 / 200}
HOST_PER_SEQUENCE_HIGH_S = max(PER_SEQUENCE_HOST_S.values())
# Activation traffic of a decode step, per token and layer: about 16 hidden-sized vectors of 2 bytes read or
# written by the unfused elementwise kernels (two norms read and write the residual stream, two residual adds read
# two and write one, rotary, the attention output, the MLP's gate, up and activation outputs at a few hidden sizes
# each), plus the logits (vocabulary x 4 bytes written, read by the sampler). A stated estimate, not a measurement:
# it is a few percent of the per-sequence work at most (Llama 3.1 405B on 8 MI300X: 14 µs a sequence a step).
ACTIVATION_VECTORS_PER_LAYER = 16
ACTIVATION_BYTES = 2.0
LOGIT_BYTES = 4.0


@dataclass(frozen=True)
class StepCost:
    """One step's roofline parts on one GPU, at the datasheet (or measured) roofs: seconds of memory traffic, of
    arithmetic, and of tensor-parallel collectives."""

    memory_s: float
    compute_s: float
    comm_s: float = 0.0
    activation_s: float = 0.0  # the batch's activation traffic at the datasheet bandwidth: not in the ceiling
    weights_s: float | None = None  # of memory_s, the weights' reads (None: all of it)
    gemm_s: float | None = None  # of compute_s, the matrix products' (None: all of it; the rest is attention's)

    @property
    def ceiling_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    def attained_s(self, bandwidth_share: float, compute_share: float) -> float:
        return max(self.memory_s / bandwidth_share, self.compute_s / compute_share) + self.comm_s

    def hidden_s(self, bandwidth_share: float, compute_share: float) -> float:
        """What the roofline's max() hides and a real step pays for its rows: the smaller of the weights' attained
        read time and the matrix products' attained arithmetic (a GEMM of B rows overlaps its FLOPs with its weight
        reads only in part), plus the activation traffic. Grows with the batch. Attention's FLOPs are left hidden
        under its KV reads: at decode its intensity is a few FLOP a byte, far below any ridge."""
        weights = self.memory_s if self.weights_s is None else self.weights_s
        gemm = self.compute_s if self.gemm_s is None else self.gemm_s
        return min(weights / bandwidth_share, gemm / compute_share) + self.activation_s / bandwidth_share


@dataclass(frozen=True)
class Workload:
    """A unit of serving work: an optional prefill, then `steps` decode steps like `decode`, yielding `tokens`
    output tokens. Steady-state decode is one step yielding `batch` tokens."""

    decode: StepCost
    steps: float
    tokens: float
    prefill: StepCost | None = None
    bandwidth_share: float = ATTAINABLE_BANDWIDTH
    compute_share: float = ATTAINABLE_COMPUTE
    batch: float = 1.0  # sequences a decode step carries

    def growth_s(self, host_per_sequence_s: float) -> float:
        """G: the part of a decode step's time beyond the roofline that grows with the batch (module docstring)."""
        return self.decode.hidden_s(self.bandwidth_share, self.compute_share) + self.batch * host_per_sequence_s

    @property
    def ceiling_s(self) -> float:
        prefill = self.prefill.ceiling_s if self.prefill else 0.0
        return prefill + self.steps * self.decode.ceiling_s

    @property
    def ceiling_tokens_per_s(self) -> float:
        return self.tokens / self.ceiling_s

    @property
    def attained_s(self) -> float:
        shares = (self.bandwidth_share, self.compute_share)
        prefill = self.prefill.attained_s(*shares) if self.prefill else 0.0
        return prefill + self.steps * self.decode.attained_s(*shares)


def attainable_shares(gpu: GpuSpec, dtype: str) -> tuple[float, float]:
    """(bandwidth, compute) shares of `gpu`'s roofs that kernels reach: 1 for a roof measured on the GPU
    (GpuSpec.measured), else ATTAINABLE_BANDWIDTH and ATTAINABLE_COMPUTE."""
    bandwidth = 1.0 if "hbm" in gpu.measured else ATTAINABLE_BANDWIDTH
    compute = 1.0 if compute_dtype(gpu, dtype) in gpu.measured else ATTAINABLE_COMPUTE
    return bandwidth, compute


def activation_bytes_per_token(model: ModelInfo) -> float:
    """Bytes of activations one decode token moves on each GPU (ACTIVATION_VECTORS_PER_LAYER hidden-sized vectors a
    layer, the logits); 0 when the shape is unknown."""
    if not (model.layers and model.hidden):
        return 0.0
    return (model.layers * ACTIVATION_VECTORS_PER_LAYER * model.hidden * ACTIVATION_BYTES
            + (model.vocab or 0) * LOGIT_BYTES * 2)


def decode_step_cost(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float,
    context: float,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | None = None,
) -> StepCost:
    """The roofline parts of one decode step (llm.decode_floor_s, decode_compute_s, decode_comm_s)."""
    context = context if has_kv_shape(model) else 0.0
    return StepCost(decode_floor_s(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp),
                    decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp, context=context),
                    decode_comm_s(model, gpu, batch, tp=tp, link=link),
                    batch * activation_bytes_per_token(model) / gpu.hbm_bytes_per_s,
                    decode_floor_s(model, gpu, batch, 0.0, dtype=dtype, kv_dtype=kv_dtype, tp=tp),
                    decode_compute_s(model, gpu, batch, dtype=dtype, tp=tp))


def decode_workload(
    model: ModelInfo,
    gpu: GpuSpec,
    batch: float,
    context: float,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | None = None,
) -> Workload:
    """Steady-state decode: one step of `batch` sequences at `context` tokens, yielding `batch` tokens."""
    shares = attainable_shares(gpu, weight_dtype(model, dtype))
    return Workload(decode_step_cost(model, gpu, batch, context, dtype=dtype, kv_dtype=kv_dtype, tp=tp, link=link),
                    1.0, float(batch), None, *shares, batch=float(batch))


def generation_workload(
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
) -> Workload:
    """A static batch: `batch` prompts of `input_tokens` prefilled together, then output_tokens - 1 decode steps at
    the mean context input + output / 2 (llm.generation_ceiling_tokens_per_s)."""
    if output_tokens < 1 or input_tokens < 1:
        raise InputError("a generation needs at least one input and one output token.")
    prefill = StepCost(*prefill_cost(model, gpu, round(batch * input_tokens), dtype, tp,
                                     sequence_tokens=input_tokens, kv_dtype=kv_dtype, link=link))
    step = decode_step_cost(model, gpu, batch, input_tokens + output_tokens / 2, dtype=dtype, kv_dtype=kv_dtype,
                            tp=tp, link=link)
    shares = attainable_shares(gpu, weight_dtype(model, dtype))
    return Workload(step, float(output_tokens - 1), float(batch * output_tokens), prefill, *shares,
                    batch=float(batch))


def _check_efficiency(efficiency: float) -> float:
    if not 0 < efficiency <= 1:
        raise InputError(f"an efficiency against the ceiling must be in (0, 1], not {efficiency:.3g}; a measured rate "
                         "above the ceiling means the setup (model, precision, GPU, batch) is not the one measured.")
    return efficiency


def realised_gain(ceiling_ratio: float, efficiency: float) -> float:
    """Realised speedup of a pure bytes change (weights' or KV cache's precision) on a memory-bound step that runs at
    `efficiency` of its ceiling: the time beyond the floor stays, so 1 / (1 - e + e / ceiling_ratio).

    Example: FP8 weights halve the bytes (ratio 2); at e = 0.33 the step gets 1 / (0.67 + 0.165) = 1.20x faster.
    """
    if ceiling_ratio <= 0:
        raise InputError(f"a ceiling ratio must be positive, not {ceiling_ratio:.3g}.")
    e = _check_efficiency(efficiency)
    return 1.0 / (1.0 - e + e / ceiling_ratio)


def realised_speedup(before: Workload, after: Workload, efficiency: float,
                     measured_on: Workload | None = None, *, host_per_sequence_s: float = 0.0,
                     per_sequence: bool = True) -> float:
    """Realised tokens/s ratio of moving from `before` (measured at `efficiency` of its ceiling) to `after`.

    Measured time T = ceiling / e; the time beyond the attained roofline, O = T - attained, is a fixed part F per
    decode step and a part G that grows with the batch (Workload.growth_s: the arithmetic and activation traffic the
    roofline hides, and `host_per_sequence_s` a sequence): F = O - G(before), T' = attained' + steps' x (F +
    G(after)). Where G(before) exceeds O, F is 0 and G is scaled to O on both sides. `per_sequence=False` keeps O
    fixed per step (the model before issue 44, item 2: the low end of realised_range). If the measurement beat the
    attained estimate (e above the attainable share), O is 0 and the attained times are scaled to the measurement.
    `measured_on`: the workload the efficiency was measured on when it is not `before` (a steady decode step, for
    whole requests that also prefill): its O per step is split and kept in both."""
    e = _check_efficiency(efficiency)
    ref = before if measured_on is None else measured_on
    measured, attained = ref.ceiling_s / e, ref.attained_s
    scale, fixed, grows = 1.0, 0.0, 0.0
    if attained >= measured:
        scale = measured / attained
    else:
        overhead = (measured - attained) / max(ref.steps, 1.0)
        growth = ref.growth_s(host_per_sequence_s) if per_sequence else 0.0
        grows = min(1.0, overhead / growth) if growth > 0 else 0.0
        fixed = overhead - growth * grows

    def time(w: Workload) -> float:
        per_step = fixed + (w.growth_s(host_per_sequence_s) * grows if per_sequence else 0.0)
        return w.attained_s * scale + max(w.steps, 1.0) * per_step

    return (after.tokens / time(after)) / (before.tokens / time(before))


@dataclass(frozen=True)
class RealisedRange:
    """A realised gain with its range and where the range comes from."""

    value: float
    low: float
    high: float
    basis: str


def realised_range(before: Workload, after: Workload, efficiency: float, measured_on: Workload | None = None, *,
                   engine: str | None = None) -> RealisedRange:
    """realised_speedup with its range. The estimate: the time beyond the roofline split into a fixed part and one
    that grows with the batch, with `engine`'s host work per sequence where PER_SEQUENCE_HOST_S has a figure (else
    none). The range: from O held fixed per step (every kernel's FLOPs hidden under its weight reads, no host work a
    sequence) to the growth with the largest published host work per sequence (HOST_PER_SEQUENCE_HIGH_S) added; the
    two ends are ordered whichever way the change goes."""
    host = PER_SEQUENCE_HOST_S.get((engine or "").strip().lower(), 0.0)
    value = realised_speedup(before, after, efficiency, measured_on, host_per_sequence_s=host)
    ends = (realised_speedup(before, after, efficiency, measured_on, per_sequence=False),
            realised_speedup(before, after, efficiency, measured_on, host_per_sequence_s=HOST_PER_SEQUENCE_HIGH_S))
    low, high = min(*ends, value), max(*ends, value)
    named = f"{engine}'s host work of {host * 1e3:.2g} ms a sequence" if host else "no host work per sequence"
    basis = (f"estimate with {named}; range from the time beyond the roofline held fixed per step to its growth "
             f"with {HOST_PER_SEQUENCE_HIGH_S * 1e3:.2g} ms of host work a sequence (vLLM V0's)")
    return RealisedRange(value, low, high, basis)


def decode_efficiency(requests: Workload, efficiency: float, step: Workload) -> float:
    """The share of a steady decode step's ceiling (`step`) that a rate measured over whole requests implies: the
    requests (`requests`, prefill included) take T = ceiling / efficiency; the time beyond their attained roofline,
    O, is per decode step (realised_speedup), so a decode step takes attained + O and runs at ceiling / (attained +
    O) of its ceiling. A rate read as decode tokens/s when it counts each request's prefill too puts the prefill's
    time into O, and a batch change is then over-promised (issue 44, item 3)."""
    e = _check_efficiency(efficiency)
    measured, attained = requests.ceiling_s / e, requests.attained_s
    if attained >= measured:
        step_time = step.attained_s * measured / attained
    else:
        step_time = step.attained_s + (measured - attained) / max(requests.steps, 1.0)
    return min(1.0, step.ceiling_s / step_time)


def realised_tokens_per_s(workload: Workload, efficiency: float, after: Workload) -> float:
    """Tokens/s after the change: the measured rate (efficiency x ceiling) times realised_speedup."""
    return efficiency * workload.ceiling_tokens_per_s * realised_speedup(workload, after, efficiency)
