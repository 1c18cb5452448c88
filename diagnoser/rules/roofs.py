"""Roofline rules: memory-bandwidth- and compute-limited work, from GPU counters and from trace intensity."""

from __future__ import annotations

from diagnoser import physics
from diagnoser.diagnosis import Finding, Limiter
from diagnoser.rules.base import Check, Page, Threshold, rule
from diagnoser.rules.gains import batch_gain, dtype_gain, observed_batch, ridge_batch, weights_dtype

_BW_FIXES = "Quantise the weights (FP8 halves the bytes each decode step reads, INT4 quarters them); raise the " \
    "batch toward the ridge batch so each weight read serves more tokens; store the KV cache in FP8 for long " \
    "contexts; speculative decoding turns several sequential steps into one verify step."


def _bandwidth_fixes(c: Check) -> None:
    dtype = weights_dtype(c.ev)
    # Fewer bytes per weight: FP8 from 16-bit weights, INT4 from FP8/INT8 ones; nothing below INT4.
    if not dtype or physics.bytes_per_element(dtype) > 1:
        gain, basis = dtype_gain(c.ev, "fp8")
        c.fix("Serve FP8 weights", "Use an FP8 checkpoint or on-the-fly FP8 quantisation (vLLM --quantization fp8): "
              "each decode step reads half the bytes.", gain,
              basis if gain is not None else "weight bytes halve from BF16; the gain approaches 2x at small batch "
              "only where the step runs near its bandwidth floor")
    elif physics.bytes_per_element(dtype) > 0.5:
        gain, basis = dtype_gain(c.ev, "int4")
        c.fix("Serve INT4 weights", f"The weights are already {dtype}: an INT4 checkpoint (AWQ or GPTQ, Marlin "
              "kernels in vLLM) halves the bytes each decode step reads again.", gain, basis)
    rb, batch = ridge_batch(c.ev), observed_batch(c.ev)
    if rb is not None and batch is not None and batch < rb / 2:
        gain, basis = batch_gain(c.ev, target=rb / 2)
        c.fix("Batch more sequences per step", f"Raise the running batch toward {rb / 2:.0f} (half the ridge batch "
              f"{rb:.0f}): vLLM --max-num-seqs, more concurrent clients.", gain, basis)


@rule(
    code="BW001",
    name="dram-bandwidth-saturated",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="The memory interface is busy and clearly busier than the tensor pipes.",
    requires=("gpu.dram_active",),
    uses=("gpu.tensor_active", "gpu.sm_active"),
    thresholds={
        "dram_active_mean": Threshold(0.50, "DRAM activity (mean) at or above which memory is heavily used"),
        "split": Threshold(0.10, "how much busier DRAM must be than the tensor pipes to call it memory-limited"),
    },
    page=Page(
        detects="DRAM activity (GPM DRAM_BW_UTIL or DCGM DRAM_ACTIVE) at or above 50 % with the tensor pipes at "
        "least 10 points less busy.",
        why="Decode reads every weight once per step, so t_token >= weight_bytes / HBM bandwidth. At small batch "
        "the arithmetic intensity is far below the ridge point and the memory interface, not the math units, sets "
        "the speed. NVIDIA puts the practical DRAM_ACTIVE peak near 0.8, so 0.5 is already most of what is "
        "reachable.",
        fixes=_BW_FIXES,
        sources="Nsight Compute SOL: 60 % of peak = heavily used, a 10-point split names the heavier unit; XProf "
        "MemoryBound (HBM > 70 % with MXU < 50 %); DCGM docs: DRAM_ACTIVE ~0.8 is the practical peak.",
    ),
)
def dram_bandwidth_saturated(c: Check) -> Finding | None:
    dram = c.sig("gpu.dram_active")
    assert dram is not None
    if dram.mean < c.t["dram_active_mean"]:
        return None
    tensor = c.sig("gpu.tensor_active")
    if tensor is not None and dram.mean - tensor.mean < c.t["split"]:
        return None
    c.cite(dram, "mean", ">=", c.t["dram_active_mean"])
    if tensor is not None:
        c.cite(tensor, "mean")
    _bandwidth_fixes(c)
    strength = 0.55 + min(0.4, (dram.mean - c.t["dram_active_mean"]) * 1.5)
    return c.finding(strength, f"DRAM is {dram.mean:.0%} busy"
                     + (f" against {tensor.mean:.0%} tensor activity" if tensor else "")
                     + ": each step waits on memory, not math.")


@rule(
    code="BW002",
    name="decode-at-bandwidth-floor",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="Generation runs near the physical ceiling that bandwidth allows at this small batch.",
    requires=("theory.efficiency", "theory.ridge_batch"),
    uses=("server.running", "trace.decode_batch"),
    thresholds={
        "efficiency": Threshold(0.50, "achieved over the bandwidth ceiling at or above which decode is at the floor"),
        "batch_over_ridge": Threshold(0.5, "observed batch below this fraction of the ridge batch counts as small"),
    },
    page=Page(
        detects="Achieved generation tokens/s at or above half of the decode ceiling (weight and KV bytes over HBM "
        "bandwidth at the observed batch), with the batch well below the ridge batch.",
        why="At such a batch no kernel tuning helps: the step time is already set by the bytes each step must "
        "read. Only reading fewer bytes (quantisation) or serving more tokens per read (batching) moves it.",
        fixes=_BW_FIXES,
        sources="Seed physics: t_token >= weight_bytes / HBM_bandwidth; ideal batch ~ ridge x (total/active params).",
    ),
)
def decode_at_bandwidth_floor(c: Check) -> Finding | None:
    eff, rb = c.sig("theory.efficiency"), c.sig("theory.ridge_batch")
    assert eff is not None and rb is not None
    batch = observed_batch(c.ev)
    if batch is None or eff.values[0] < c.t["efficiency"] or batch >= c.t["batch_over_ridge"] * rb.values[0]:
        return None
    c.cite(eff, "value", ">=", c.t["efficiency"])
    c.cite(rb, "value")
    _bandwidth_fixes(c)
    return c.finding(0.5 + 0.4 * min(1.0, eff.values[0]), f"Decode reaches {eff.values[0]:.0%} of the bandwidth "
                     f"ceiling at batch {batch:.1f}, far below the ridge batch {rb.values[0]:.0f}.")


@rule(
    code="BW003",
    name="intensity-below-ridge",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="The traced ops' arithmetic intensity is well below the GPU's ridge point while the GPU is busy.",
    requires=("trace.intensity", "theory.ridge_flop_per_byte"),
    uses=("trace.gpu_idle_frac",),
    thresholds={
        "intensity_over_ridge": Threshold(0.5, "intensity below this fraction of the ridge counts as memory-bound"),
        "idle_max": Threshold(0.5, "the GPU must be idle less than this for the roofs to matter"),
    },
    page=Page(
        detects="Time-weighted FLOP/byte of the traced GEMM/attention ops below half the ridge point (peak FLOP/s "
        "over peak bytes/s) while the GPU is busy most of the window.",
        why="Below the ridge every op finishes when its bytes arrive; the math units wait.",
        fixes=_BW_FIXES,
        sources="Roofline model (Williams et al. 2009): intensity = FLOPs / bytes; ridge = peak FLOP/s / peak B/s.",
    ),
)
def intensity_below_ridge(c: Check) -> Finding | None:
    ai, ridge = c.sig("trace.intensity"), c.sig("theory.ridge_flop_per_byte")
    assert ai is not None and ridge is not None
    idle = c.sig("trace.gpu_idle_frac")
    limit = c.t["intensity_over_ridge"] * ridge.values[0]
    if ai.values[0] >= limit or (idle is not None and idle.values[0] >= c.t["idle_max"]):
        return None
    c.cite(ai, "value", "<", limit)
    c.cite(ridge, "value")
    if idle is not None:
        c.cite(idle, "value", "<", c.t["idle_max"])
    _bandwidth_fixes(c)
    return c.finding(0.6, f"The traced ops do {ai.values[0]:.0f} FLOP per byte, below the ridge point "
                     f"({ridge.values[0]:.0f}): they are memory-bound.")


# What tuned decode paths reach at small batch (fused norms and attention, CUDA graphs): the target of the "close the
# gap to the floor" fix.
REACHABLE_EFFICIENCY = 0.70


@rule(
    code="BW004",
    name="small-batch-decode",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="The GPU is kept busy decoding at a batch far below the ridge batch: the regime memory bandwidth bounds.",
    requires=("theory.decode_share", "theory.ridge_batch", "gpu.busy|trace.gpu_idle_frac"),
    uses=("theory.efficiency", "gpu.tensor_active", "trace.prefill_frac"),
    thresholds={
        "decode_share": Threshold(0.5, "decode's share of the least GPU time the served tokens need"),
        "batch_over_ridge": Threshold(0.5, "observed batch below this fraction of the ridge batch counts as small"),
        "busy_min": Threshold(0.70, "GPU busy fraction at or above which the GPU, not the host, sets the pace"),
        "tensor_max": Threshold(0.50, "tensor activity below which the math units are not what limits"),
        "efficiency_gap": Threshold(0.50, "efficiency below which the gap to the bandwidth floor is named as a fix"),
    },
    page=Page(
        detects="Generation dominates the GPU's work (by the least time its tokens need), the running batch is below "
        "half the ridge batch, the GPU is busy at least 70 % of the time and the tensor pipes are under 50 %. "
        "Unlike BW001/BW002 it needs no DRAM counter and no particular efficiency: it names the regime, and when "
        "the decode reaches less than half its bandwidth ceiling it also names the gap.",
        why="Decode reads every weight once per step, so t_token >= weight_bytes / HBM bandwidth; at a batch far "
        "below the ridge the arithmetic intensity (about the batch, in FLOP per byte, for 16-bit weights) cannot "
        "reach the ridge point, so bandwidth, not math, bounds the step. A real decode often reaches only 30-60 % "
        "of that bound: small unfused kernels (norms, casts, softmax) and kernel-to-kernel gaps add time that reads "
        "no weights (measured on an H100: a 2.4B model at batch 1 ran at 31 % of its ceiling, 41 % of GPU time "
        "outside the GEMMs). Both are fixed by reading fewer bytes per token, not by a faster GPU's math.",
        fixes=_BW_FIXES + " When the decode is far from its ceiling, fuse the small kernels between the GEMMs "
        "(torch.compile, fused RMSNorm and FlashAttention/FlashInfer decode kernels) and replay the step as a CUDA "
        "graph.",
        sources="Seed physics: t_token >= weight_bytes / HBM_bandwidth, ideal batch ~ ridge x (total/active params); "
        "roofline model (Williams et al. 2009); nsys 50 % busy / XProf 70 % thresholds for 'the GPU is the "
        "bottleneck'.",
    ),
)
def small_batch_decode(c: Check) -> Finding | None:
    share, rb = c.sig("theory.decode_share"), c.sig("theory.ridge_batch")
    assert share is not None and rb is not None
    batch = observed_batch(c.ev)
    if batch is None or share.values[0] < c.t["decode_share"] or batch >= c.t["batch_over_ridge"] * rb.values[0]:
        return None
    busy, idle = c.sig("gpu.busy"), c.sig("trace.gpu_idle_frac")
    busy_frac = busy.mean if busy is not None else 1.0 - idle.values[0]  # type: ignore[union-attr]
    if busy_frac < c.t["busy_min"]:
        return None
    tensor = c.sig("gpu.tensor_active")
    if tensor is not None and tensor.mean >= c.t["tensor_max"]:
        return None
    prefill = c.sig("trace.prefill_frac")
    if prefill is not None and prefill.values[0] > 1.0 - c.t["decode_share"]:
        return None  # the trace saw mostly prefill steps, whatever the counters' rates say
    c.cite(share, "value", ">=", c.t["decode_share"])
    c.cite(rb, "value")
    if busy is not None:
        c.cite(busy, "mean", ">=", c.t["busy_min"])
    elif idle is not None:
        c.cite(idle, "value")
    if tensor is not None:
        c.cite(tensor, "mean", "<", c.t["tensor_max"])
    _bandwidth_fixes(c)
    eff = c.sig("theory.efficiency")
    tail = ""
    if eff is not None:
        c.cite(eff, "value")
        tail = f" It reaches {eff.values[0]:.0%} of that ceiling."
        if eff.values[0] < c.t["efficiency_gap"]:
            c.fix("Close the gap to the bandwidth floor", "Fuse the small kernels between the GEMMs (torch.compile, "
                  "fused RMSNorm, FlashAttention/FlashInfer decode kernels), replay the decode step as a CUDA graph, "
                  "or serve with an engine whose decode path is tuned (vLLM, SGLang, TensorRT-LLM).",
                  REACHABLE_EFFICIENCY / max(eff.values[0], 0.05),
                  f"from {eff.values[0]:.0%} to {REACHABLE_EFFICIENCY:.0%} of the bandwidth ceiling, what tuned "
                  "decode paths reach at small batch")
    # Weaker than BW002 (which also measured the floor being reached): the regime alone, up to 0.65.
    strength = 0.5 + 0.15 * (1.0 - batch / (c.t["batch_over_ridge"] * rb.values[0]))
    return c.finding(strength, f"Decode at batch {batch:.1f}, far below the ridge batch {rb.values[0]:.0f}, keeps the "
                     f"GPU {busy_frac:.0%} busy: each step reads every weight for a few tokens, so memory bandwidth "
                     f"bounds it.{tail}")


def _compute_fixes(c: Check) -> None:
    gpu = c.ev.gpu_spec
    fp8 = getattr(gpu, "flops", {}).get("fp8") if gpu is not None else None
    bf16 = getattr(gpu, "flops", {}).get("bf16") if gpu is not None else None
    gain = fp8 / bf16 if fp8 and bf16 else None
    c.fix("Run the matmuls in FP8", "FP8 weights and activations (vLLM --quantization fp8 on Hopper/Ada/Blackwell) "
          "double the tensor-core peak.", gain, "FP8 over BF16 dense tensor peak of this GPU" if gain else
          "needs a GPU with FP8 tensor cores")
    c.fix("Split prefill from decode", "Chunked prefill (vLLM --enable-chunked-prefill, a smaller "
          "--max-num-batched-tokens) keeps long prompts from stalling decode; or disaggregate prefill to its own GPUs.")
    c.fix("Add GPUs", "Tensor or data parallelism: compute-bound work scales with the number of GPUs.")


@rule(
    code="CMP001",
    name="tensor-pipes-saturated",
    limiter=Limiter.COMPUTE,
    summary="The tensor pipes (or SMs) are busy and clearly busier than the memory interface.",
    requires=("gpu.tensor_active|gpu.sm_active",),
    uses=("gpu.dram_active",),
    thresholds={
        "tensor_active_mean": Threshold(0.50, "tensor-pipe activity (mean) at or above which math is heavily used"),
        "sm_active_mean": Threshold(0.80, "SM activity that counts as compute-heavy when no tensor counter exists"),
        "split": Threshold(0.10, "how much busier the math units must be than DRAM to call it compute-limited"),
    },
    page=Page(
        detects="Tensor-pipe activity at or above 50 % (or SM activity at or above 80 % without a tensor counter) "
        "with DRAM at least 10 points less busy.",
        why="Prefill multiplies each weight by many tokens, so its intensity is above the ridge point and the math "
        "units set the speed; large decode batches get there too. More bandwidth will not help.",
        fixes="FP8 matmuls (twice the tensor peak on Hopper), chunked or disaggregated prefill, more GPUs.",
        sources="Nsight Compute SOL 60 %/10-point split; XProf ComputeBound (MXU > 70 % with HBM < 50 %); seed "
        "physics: prefill is compute-bound.",
    ),
)
def tensor_pipes_saturated(c: Check) -> Finding | None:
    tensor, sm, dram = c.sig("gpu.tensor_active"), c.sig("gpu.sm_active"), c.sig("gpu.dram_active")
    if tensor is not None:
        busy, limit = tensor, c.t["tensor_active_mean"]
    else:
        assert sm is not None
        busy, limit = sm, c.t["sm_active_mean"]
    if busy.mean < limit:
        return None
    if dram is not None and busy.mean - dram.mean < c.t["split"]:
        return None
    c.cite(busy, "mean", ">=", limit)
    if dram is not None:
        c.cite(dram, "mean")
    _compute_fixes(c)
    strength = (0.55 if tensor is not None else 0.45) + min(0.4, (busy.mean - limit) * 1.5)
    if dram is None:
        strength -= 0.1  # cannot rule out memory without the DRAM counter
    return c.finding(strength, f"The {'tensor pipes are' if tensor else 'SMs are'} {busy.mean:.0%} busy"
                     + (f" against {dram.mean:.0%} DRAM activity" if dram else "") + ": math sets the pace.")


@rule(
    code="CMP002",
    name="intensity-above-ridge",
    limiter=Limiter.COMPUTE,
    summary="The traced ops' arithmetic intensity is above the GPU's ridge point while the GPU is busy.",
    requires=("trace.intensity", "theory.ridge_flop_per_byte"),
    uses=("trace.gpu_idle_frac", "trace.prefill_frac"),
    thresholds={
        "intensity_over_ridge": Threshold(1.0, "intensity at or above this fraction of the ridge is compute-bound"),
        "idle_max": Threshold(0.5, "the GPU must be idle less than this for the roofs to matter"),
    },
    page=Page(
        detects="Time-weighted FLOP/byte of the traced ops at or above the ridge point with the GPU busy.",
        why="Above the ridge each op finishes when its math is done; bytes arrive early.",
        fixes="FP8 matmuls, chunked or disaggregated prefill, more GPUs.",
        sources="Roofline model (Williams et al. 2009).",
    ),
)
def intensity_above_ridge(c: Check) -> Finding | None:
    ai, ridge = c.sig("trace.intensity"), c.sig("theory.ridge_flop_per_byte")
    assert ai is not None and ridge is not None
    idle = c.sig("trace.gpu_idle_frac")
    limit = c.t["intensity_over_ridge"] * ridge.values[0]
    if ai.values[0] < limit or (idle is not None and idle.values[0] >= c.t["idle_max"]):
        return None
    c.cite(ai, "value", ">=", limit)
    if idle is not None:
        c.cite(idle, "value", "<", c.t["idle_max"])
    _compute_fixes(c)
    return c.finding(0.6, f"The traced ops do {ai.values[0]:.0f} FLOP per byte, above the ridge point "
                     f"({ridge.values[0]:.0f}): they are compute-bound.")
