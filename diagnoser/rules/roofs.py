"""The roofs and the gap below them: memory-bandwidth-limited, compute-limited, and latency/kernel-bound.

Two questions, kept apart (see diagnoser/characterise.py): the *regime* says which roof the work would hit (its
arithmetic intensity against the ridge point); the *saturation* says how close it gets (achieved bytes/s or FLOP/s
over the roof, DRAM and tensor-pipe activity). Memory-bound work at 90 % of the bandwidth roof is bandwidth-limited;
at 30 % it is limited by its kernels, and the fix is in the kernels (fusion, graphs, a tuned engine), not in HBM.
Nsight Compute reads under 60 % of peak as latency issues; XProf calls a step latency-bound when neither unit
reaches 50 %.
"""

from __future__ import annotations

from diagnoser import signals as S
from diagnoser.characterise import _LOW_PRECISION_MARKS as LOW_PRECISION_GEMM_MARKS
from diagnoser.diagnosis import Finding, FixKind, GainKind, Limiter, Regime
from diagnoser.evidence import Evidence
from diagnoser.physics import bytes_per_element, fp32_matmul_dtype, peak_flops, sixteen_bit_dtype
from diagnoser.rules import formula as fm
from diagnoser.rules import gains
from diagnoser.rules.base import MEAN, VALUE, AnyOf, Check, Gain, Page, Threshold, rule

_NCU = "Nsight Compute speed-of-light: under 60 % of peak reads as latency issues, a 10-point split names the " \
    "heavier unit; XProf: memory- or compute-bound when HBM or the MXU exceeds 70 % with the other under 50 %, " \
    "latency-bound when neither reaches 50 %; DCGM docs: DRAM_ACTIVE ~0.8 is the practical peak."
_PHYSICS = "Seed physics: t_token >= weight_bytes / HBM_bandwidth; arithmetic intensity = FLOPs / bytes; ridge = " \
    "peak FLOP/s / peak bytes/s; roofline model (Williams et al. 2009)."


def graphs(ev: Evidence) -> str:
    return "HIP graphs" if ev.platform == "rocm" else "CUDA graphs"


def top_kernels_text(ev: Evidence, n: int = 3) -> str:
    """The kernels that hold the time, with how close each gets to its roof when its op's shapes were recorded."""
    trace, gpu = ev.trace, ev.gpu_spec
    if trace is None or not trace.top_kernels:
        return ""
    parts = []
    for k in trace.top_kernels[:n]:
        text = f"{k.name} {k.share:.0%}"
        if gpu is not None and k.achieved_bytes_per_s:
            text += f" at {k.achieved_bytes_per_s / gpu.hbm_bytes_per_s:.0%} of the bandwidth roof"
        parts.append(text)
    return " Top kernels by time: " + "; ".join(parts) + "."


def _memory_regime_fixes(c: Check) -> None:
    """Fewer bytes per token, or more tokens per byte read."""
    dtype = c.ev.weights_dtype()
    half = sixteen_bit_dtype(c.ev.gpu_spec) if c.ev.gpu_spec is not None else "bf16"
    if by_bytes_model(c.ev) and half is not None:
        # An FP32 model reads twice the bytes of a 16-bit one in every kernel: the first precision step, before FP8.
        _precision_fix(c, half, gains.model_dtype_gain(c.ev, half))
    if not dtype or bytes_per_element(dtype) > 1:
        part = "a quarter of" if dtype and bytes_per_element(dtype) >= 4 else "half"
        c.fix(FixKind.FP8_WEIGHTS, "Serve FP8 weights", "Use an FP8 checkpoint or on-the-fly FP8 quantisation (vLLM "
              f"--quantization fp8): each decode step reads {part} the weight bytes.", gains.dtype_gain(c.ev, "fp8"))
    elif bytes_per_element(dtype) > 0.5:
        c.fix(FixKind.INT4_WEIGHTS, "Serve INT4 weights", f"The weights are already {dtype}: an INT4 checkpoint (AWQ "
              "or GPTQ, Marlin kernels in vLLM) halves the bytes each decode step reads again.",
              gains.dtype_gain(c.ev, "int4"))
    rb, batch = gains.ridge_batch(c.ev), c.ev.observed_batch()
    if rb is not None and batch is not None and batch < rb / 2:
        c.fix(FixKind.BATCH_MORE, "Batch more sequences per step", f"Raise the running batch toward {rb / 2:.0f} (half "
              f"the ridge batch {rb:.0f}): vLLM --max-num-seqs, more concurrent clients; each weight read then "
              "serves more tokens.", gains.batch_gain(c.ev, target=rb / 2, raises_limit=True))


def _kernel_fixes(c: Check, regime: Regime) -> None:
    """The gap between the kernels and the roof: fuse them, replay them, or use kernels tuned for this shape."""
    c.fix(FixKind.FUSE_KERNELS, "Fuse the small kernels", "Fuse the norms, activations, casts and softmax between the "
          "matmuls (torch.compile, fused RMSNorm, FlashAttention/FlashInfer kernels): each unfused kernel reads and "
          "writes its tensors through HBM and pays a launch.", gains.fusion_gain(c.ev))
    if c.ev.model is not None and regime is Regime.MEMORY:
        # Graphs already replayed are no part of what the engine would bring.
        parts = "fused attention, GEMV kernels for one row" + (
            "" if FixKind.CUDA_GRAPHS in c.ev.in_place else f", {graphs(c.ev)}")
        c.fix(FixKind.TUNED_ENGINE, "Serve with a tuned decode path", "An engine whose decode kernels are tuned for "
              f"small batches (vLLM, SGLang, TensorRT-LLM: {parts}) closes most of the gap to the bandwidth floor.",
              gains.tuned_engine_gain(c.ev))
    gaps = (c.ev.value(S.TRACE_IDLE_KERNEL_OVERHEAD_FRAC) or 0.0) + (c.ev.value(S.TRACE_IDLE_HOST_FRAC) or 0.0)
    if gaps >= 0.05:
        c.fix(FixKind.CUDA_GRAPHS, f"Replay the step with {graphs(c.ev)}", f"Capture the step in {graphs(c.ev)} "
              "(torch.compile mode='reduce-overhead', vLLM without --enforce-eager) so one launch replaces hundreds.",
              gains.removal(gaps, "launch and kernel-to-kernel gaps"))


def _compute_fixes(c: Check) -> None:
    c.fix(FixKind.FP8_MATMUL, "Run the matmuls in FP8", "FP8 weights and activations (vLLM --quantization fp8 on "
          "Hopper/Ada/Blackwell) double the tensor-core peak for the matmul share of the time.",
          gains.fp8_matmul_gain(c.ev))
    share = gains.elementwise_share(c.ev)
    if share is not None and share >= 0.15:
        c.fix(FixKind.FUSE_KERNELS, "Fuse the elementwise work", f"{share:.0%} of the time goes to norms, "
              "activations and reductions that leave the tensor cores idle: fuse them into the matmuls' epilogues "
              "(torch.compile, fused RMSNorm/SwiGLU kernels).", gains.fusion_gain(c.ev))
    gen, requests = c.ev.value(S.SERVER_GEN_TOKENS_PER_S), c.ev.value(S.SERVER_REQUESTS_PER_S)
    # Only where there is decoding to protect: requests that each generate one token or two are all prefill.
    decodes = gen is not None and gen > 0 and (not requests or gen / requests > 2.0)
    if c.ev.workload != "training" and decodes:
        c.fix(FixKind.SPLIT_PREFILL, "Split prefill from decode", "Chunked prefill (vLLM --enable-chunked-prefill, a "
              "smaller --max-num-batched-tokens) keeps long prompts from stalling decode; or disaggregate prefill to "
              "its own GPUs.")
    # Compute-bound work does not get faster per GPU with more GPUs: the same FLOPs are spread wider. What more GPUs
    # buy is room for more load (replicas, linearly) or shorter prompts (tensor parallelism, sublinearly).
    c.fix(FixKind.ADD_GPUS, "Add GPUs", "Tensor or data parallelism: compute-bound work scales with the number of "
          "GPUs (tensor parallelism less than linearly: each layer ends in an all-reduce; replicas scale linearly "
          "with the load offered).",
          Gain(2.0, "twice the GPUs as replicas serve at most twice the load, each GPU at the throughput measured",
               GainKind.UPPER_BOUND).as_capacity("a gain only for more offered load: each GPU's work is unchanged"))


# The rules' formulas (rules/formula.py: what the fleet's rule group compiles to PromQL), each the predicate's test
# and strength below written over the statistics it reads.
_DRAM, _TENSOR, _SM = (fm.Read(S.GPU_DRAM_ACTIVE, MEAN), fm.Read(S.GPU_TENSOR_ACTIVE, MEAN),
                       fm.Read(S.GPU_SM_ACTIVE, MEAN))
_BW_FIRES = (_DRAM >= fm.Bar("dram_active_mean")).unless(_DRAM - _TENSOR < fm.Bar("split"))
_CMP_HITS = (_TENSOR >= fm.Bar("tensor_active_mean"),
             fm.Read(S.THEORY_COMPUTE_ROOF_FRAC, VALUE) >= fm.Bar("compute_roof_frac"),
             (_SM >= fm.Bar("sm_active_mean")) & fm.InRegime((Regime.COMPUTE,)))
_CMP_TOP = fm.Named("compute_top", fm.Larger(fm.Larger(_CMP_HITS[0], _CMP_HITS[1]), _CMP_HITS[2]))
_CMP_FIRES = _CMP_TOP.unless(_CMP_TOP - _DRAM < fm.Bar("split"))
# LAT001 and LAT002: busy from the counters, else from the trace's idle share.
_KERNEL_BUSY = fm.Read(S.GPU_BUSY, MEAN) | (1 - fm.Read(S.TRACE_GPU_IDLE_FRAC, VALUE))
_HBM_USE = fm.Named("hbm_use", fm.Larger(_DRAM, fm.Read(S.THEORY_HBM_ROOF_FRAC, VALUE)))
_MATH_USE = fm.Named("math_use", fm.Larger(_TENSOR, fm.Read(S.THEORY_COMPUTE_ROOF_FRAC, VALUE)))
_LAT_FIRES = fm.Named("kernel_bound", (_KERNEL_BUSY >= fm.Bar("busy_min")).unless(_HBM_USE >= fm.Bar("roof_frac"))
                      .unless(_MATH_USE >= fm.Bar("roof_frac")).unless(_SM >= fm.Bar("sm_active")))
_MEMORY, _COMPUTE = fm.InRegime((Regime.MEMORY,)), fm.InRegime((Regime.COMPUTE,))
# The saturation of the regime's roof (the larger of the two where none is named), 0.3 where none is known.
_LAT_SATURATION = ((_HBM_USE & _MEMORY) | (_MATH_USE & _COMPUTE)
                   | fm.Larger(_HBM_USE, _MATH_USE).unless(_MEMORY).unless(_COMPUTE) | _LAT_FIRES.valued(0.3))
_LAT_KNOWN = fm.InRegime((Regime.MEMORY, Regime.COMPUTE)).valued(0.1) | _LAT_FIRES.valued(0.0)


# --- memory bandwidth ---------------------------------------------------------------------------------------------

@rule(
    code="BW001",
    name="dram-bandwidth-saturated",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="The memory interface is near its roof and clearly busier than the tensor pipes.",
    requires=(S.GPU_DRAM_ACTIVE,),
    uses=(S.GPU_TENSOR_ACTIVE, S.GPU_SM_ACTIVE, S.THEORY_RIDGE_BATCH, S.SERVER_WAITING),
    reads={S.GPU_DRAM_ACTIVE: (MEAN,), S.GPU_TENSOR_ACTIVE: (MEAN,)},
    fleet=0.6 + fm.Clamp((_BW_FIRES - fm.Bar("dram_active_mean")) * 1.5, high=0.3),
    thresholds={
        "dram_active_mean": Threshold(0.60, "DRAM activity (mean) at or above which HBM counts as saturated",
                                      "ratio"),
        "split": Threshold(0.10, "how much busier DRAM must be than the tensor pipes to call it memory-limited",
                           "ratio"),
    },
    page=Page(
        detects="DRAM activity (GPM DRAM_BW_UTIL or DCGM DRAM_ACTIVE) at or above {dram_active_mean} with the tensor "
        "pipes at least {split} less busy.",
        why="Decode reads every weight once per step, so t_token >= weight_bytes / HBM bandwidth. At small batch the "
        "arithmetic intensity is far below the ridge point and, once the kernels stream at full speed, the memory "
        "interface sets the pace. NVIDIA puts the practical DRAM_ACTIVE peak near 0.8, so {dram_active_mean} is "
        "most of what is reachable. Below it the kernels, not HBM, are the gap (LAT001).",
        fixes="Read fewer bytes per token: FP8 weights halve them, INT4 quarters them; batch more so each weight "
        "read serves more tokens; an FP8 KV cache for long contexts.",
        sources=_NCU,
    ),
)
def dram_bandwidth_saturated(c: Check) -> Finding | None:
    dram = c.req(S.GPU_DRAM_ACTIVE)
    if dram.mean < c.t["dram_active_mean"]:
        return None
    tensor = c.opt(S.GPU_TENSOR_ACTIVE)
    if tensor is not None and dram.mean - tensor.mean < c.t["split"]:
        return None
    c.cite(dram, "mean", ">=", c.t["dram_active_mean"])
    if tensor is not None:
        c.cite(tensor, "mean")
    _memory_regime_fixes(c)
    strength = 0.6 + min(0.3, (dram.mean - c.t["dram_active_mean"]) * 1.5)
    return c.finding(strength, f"DRAM is {dram.mean:.0%} busy"
                     + (f" against {tensor.mean:.0%} tensor activity" if tensor else "")
                     + ": the steps stream memory at its roof.", regime=Regime.MEMORY, saturation=dram.mean)


@rule(
    code="BW002",
    name="decode-at-bandwidth-floor",
    limiter=Limiter.MEMORY_BANDWIDTH,
    summary="Decode reads its bytes at most of the bandwidth roof: it runs near its physical floor.",
    requires=(S.THEORY_HBM_ROOF_FRAC, S.THEORY_RIDGE_BATCH),
    uses=(S.THEORY_EFFICIENCY, S.SERVER_WAITING),
    reads={S.THEORY_HBM_ROOF_FRAC: (VALUE,), S.THEORY_RIDGE_BATCH: (VALUE,)},
    thresholds={
        "hbm_roof_frac": Threshold(0.60, "bytes read per second over the bandwidth roof at or above which decode is "
                                   "at its floor", "ratio"),
    },
    page=Page(
        detects="The bytes decode reads per second (the measured token rate x the weights and KV cache each step "
        "reads) at or above {hbm_roof_frac} of the memory bandwidth, in the memory-bound regime.",
        why="At such a batch no kernel tuning helps much: the step time is already set by the bytes each step must "
        "read. Only reading fewer bytes (quantisation) or serving more tokens per read (batching) moves it.",
        fixes="Quantise the weights (FP8, INT4), batch toward the ridge batch, an FP8 KV cache for long contexts.",
        sources=_PHYSICS + " " + _NCU,
    ),
)
def decode_at_bandwidth_floor(c: Check) -> Finding | None:
    frac, rb = c.req(S.THEORY_HBM_ROOF_FRAC), c.req(S.THEORY_RIDGE_BATCH)
    if frac.value < c.t["hbm_roof_frac"] or c.ev.regime is not Regime.MEMORY:
        return None
    c.cite(frac, "value", ">=", c.t["hbm_roof_frac"])
    c.cite(rb, "value")
    _memory_regime_fixes(c)
    batch = c.ev.observed_batch()
    at = f" at batch {batch:.1f}" if batch is not None else ""
    return c.finding(0.6 + 0.3 * min(1.0, frac.value), f"Decode{at} reads its weights and KV cache at "
                     f"{frac.value:.0%} of the bandwidth roof: it runs near its physical floor.",
                     regime=Regime.MEMORY, saturation=frac.value)


# --- compute ------------------------------------------------------------------------------------------------------

@rule(
    code="CMP001",
    name="compute-saturated",
    limiter=Limiter.COMPUTE,
    summary="The tensor pipes or the SMs are near their roof in compute-bound work, clearly busier than DRAM.",
    requires=(AnyOf(S.GPU_TENSOR_ACTIVE, S.GPU_SM_ACTIVE, S.THEORY_COMPUTE_ROOF_FRAC),),
    uses=(S.GPU_DRAM_ACTIVE, S.TRACE_SHARE_GEMM, S.TRACE_SHARE_ATTENTION, S.TRACE_SHARE_ELEMENTWISE,
          S.SERVER_GEN_TOKENS_PER_S),
    reads={S.GPU_DRAM_ACTIVE: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,), S.GPU_TENSOR_ACTIVE: (MEAN,),
           S.THEORY_COMPUTE_ROOF_FRAC: (VALUE,)},
    fleet=0.6 + fm.Clamp(0.1 * fm.Count(_CMP_HITS) + (_CMP_FIRES - 0.6) * 0.5, high=0.3),
    thresholds={
        "tensor_active_mean": Threshold(0.60, "tensor-pipe activity (mean) at or above which math is saturated",
                                        "ratio"),
        "compute_roof_frac": Threshold(0.60, "model FLOP/s over the tensor peak at or above which math is "
                                       "saturated", "ratio"),
        "sm_active_mean": Threshold(0.80, "SM activity that counts as saturated in compute-bound work", "ratio"),
        "split": Threshold(0.10, "how much busier the math units must be than DRAM", "ratio"),
    },
    page=Page(
        detects="Tensor-pipe activity at or above {tensor_active_mean}, model FLOP/s at or above {compute_roof_frac} "
        "of the tensor peak, or SMs active at or above {sm_active_mean} in compute-bound work (prefill, large "
        "batches), with DRAM at least {split} less busy.",
        why="Prefill multiplies each weight by many tokens, so its intensity is above the ridge point and the math "
        "units set the speed; large decode batches get there too. More bandwidth will not help.",
        fixes="FP8 matmuls (twice the tensor peak on Hopper) for the matmul share of the time; fuse the elementwise "
        "work that leaves the tensor cores idle; chunked or disaggregated prefill; more GPUs.",
        sources=_NCU + " Seed physics: prefill is compute-bound.",
    ),
)
def compute_saturated(c: Check) -> Finding | None:
    tensor, sm = c.opt(S.GPU_TENSOR_ACTIVE), c.opt(S.GPU_SM_ACTIVE)
    roof = c.opt(S.THEORY_COMPUTE_ROOF_FRAC)
    dram = c.opt(S.GPU_DRAM_ACTIVE)
    hits = []
    if tensor is not None and tensor.mean >= c.t["tensor_active_mean"]:
        hits.append((tensor, "mean", c.t["tensor_active_mean"], f"the tensor pipes are {tensor.mean:.0%} busy"))
    if roof is not None and roof.value >= c.t["compute_roof_frac"]:
        hits.append((roof, "value", c.t["compute_roof_frac"], f"the model runs at {roof.value:.0%} of the tensor peak"))
    if sm is not None and sm.mean >= c.t["sm_active_mean"] and c.ev.regime is Regime.COMPUTE:
        hits.append((sm, "mean", c.t["sm_active_mean"], f"the SMs are {sm.mean:.0%} active in compute-bound work"))
    if not hits:
        return None
    top = max(h[0].stat(h[1]) for h in hits)
    if dram is not None and top - dram.mean < c.t["split"]:
        return None
    for signal, stat, limit, _ in hits:
        c.cite(signal, stat, ">=", limit)
    for other in (tensor, roof):
        if other is not None and all(other is not h[0] for h in hits):
            c.cite(other, "value" if other is roof else "mean")
    if dram is not None:
        c.cite(dram, "mean")
    _compute_fixes(c)
    saturation = roof.value if roof is not None else tensor.mean if tensor is not None else None
    strength = 0.6 + min(0.3, 0.1 * len(hits) + (top - 0.6) * 0.5)
    detail = "; ".join(h[3] for h in hits)
    others = []
    if tensor is not None and all(tensor is not h[0] for h in hits):
        others.append(f"tensor pipes {tensor.mean:.0%}")
    if roof is not None and all(roof is not h[0] for h in hits):
        others.append(f"model FLOP/s {roof.value:.0%} of the tensor peak")
    if dram is not None:
        others.append(f"DRAM {dram.mean:.0%}")
    return c.finding(strength, f"Compute-bound regime: {detail}" + (f" ({', '.join(others)})" if others else "")
                     + ": math sets the pace.", regime=Regime.COMPUTE, saturation=saturation)


# --- the gap below the roofs --------------------------------------------------------------------------------------

@rule(
    code="LAT001",
    name="kernel-bound",
    limiter=Limiter.LATENCY,
    summary="The GPU is busy, but its kernels saturate neither HBM nor the SMs: the gap is in the kernels.",
    requires=(AnyOf(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC),
              AnyOf(S.GPU_DRAM_ACTIVE, S.GPU_SM_ACTIVE, S.THEORY_HBM_ROOF_FRAC, S.THEORY_COMPUTE_ROOF_FRAC)),
    uses=(S.GPU_TENSOR_ACTIVE, S.THEORY_EFFICIENCY, S.THEORY_RIDGE_BATCH, S.TRACE_SHARE_ELEMENTWISE,
          S.TRACE_IDLE_KERNEL_OVERHEAD_FRAC, S.TRACE_IDLE_HOST_FRAC, S.SERVER_WAITING),
    reads={S.GPU_BUSY: (MEAN,), S.TRACE_GPU_IDLE_FRAC: (VALUE,), S.GPU_SM_ACTIVE: (MEAN,), S.GPU_DRAM_ACTIVE: (MEAN,),
           S.GPU_TENSOR_ACTIVE: (MEAN,), S.THEORY_HBM_ROOF_FRAC: (VALUE,), S.THEORY_COMPUTE_ROOF_FRAC: (VALUE,),
           S.TRACE_SHARE_ELEMENTWISE: (VALUE,)},
    fleet=fm.Clamp(0.55 + 0.25 * fm.Clamp(1 - _LAT_SATURATION / fm.Bar("roof_frac"), low=0) + _LAT_KNOWN, high=0.9)
    & _LAT_FIRES,
    thresholds={
        "busy_min": Threshold(0.70, "share of the time a kernel runs at or above which the GPU sets the pace",
                              "ratio"),
        "roof_frac": Threshold(0.60, "HBM or tensor use (of the roof) at or above which that roof is saturated",
                               "ratio"),
        "sm_active": Threshold(0.80, "SM activity at or above which the SMs are saturated", "ratio"),
    },
    page=Page(
        detects="A kernel runs at least {busy_min} of the time, yet HBM stays under {roof_frac} of its roof (DRAM "
        "activity, bytes read per second from the token rate), the tensor pipes and the model FLOP/s under "
        "{roof_frac} of theirs and the SMs under {sm_active} active. The finding names the regime (which roof the "
        "work would hit) and how far below it the work runs.",
        why="'GPU utilisation' only says that some kernel was running. Small and unfused kernels (a batch-1 GEMV, "
        "a norm or a cast over one token) occupy a few SMs, move little data each, and leave gaps between them, so "
        "a GPU can be busy all the time at a third of its bandwidth. Measured on an H100: a 2.4 B decoder at batch "
        "1 ran at 33 % of its bandwidth floor with DRAM 29 % and SMs 27 % active, 41 % of the GPU time in norms, "
        "casts and softmax; FP8 weights then gave 1.12x, not the 2x the bytes promise. Neither more bandwidth nor "
        "more FLOP/s would help: the kernels are the gap.",
        fixes="Fuse the small kernels (torch.compile, fused norms and attention), replay the step as a graph, serve "
        "with an engine whose decode kernels are tuned for small batches; fewer weight bytes help only in proportion "
        "to the time spent at the floor.",
        sources=_NCU + " " + _PHYSICS,
    ),
)
def kernel_bound(c: Check) -> Finding | None:
    busy_sig = c.first(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC)
    busy = busy_sig.mean if busy_sig.name == S.GPU_BUSY else 1.0 - busy_sig.value
    if busy < c.t["busy_min"]:
        return None
    dram, sm, tensor = c.opt(S.GPU_DRAM_ACTIVE), c.opt(S.GPU_SM_ACTIVE), c.opt(S.GPU_TENSOR_ACTIVE)
    hbm, flops = c.opt(S.THEORY_HBM_ROOF_FRAC), c.opt(S.THEORY_COMPUTE_ROOF_FRAC)
    hbm_use = max((x for x in (dram.mean if dram else None, hbm.value if hbm else None) if x is not None), default=None)
    math_use = max((x for x in (tensor.mean if tensor else None, flops.value if flops else None) if x is not None),
                   default=None)
    if hbm_use is not None and hbm_use >= c.t["roof_frac"] or math_use is not None and math_use >= c.t["roof_frac"]:
        return None
    if sm is not None and sm.mean >= c.t["sm_active"]:
        return None
    c.cite(busy_sig, "mean" if busy_sig.name == S.GPU_BUSY else "value",
           ">=" if busy_sig.name == S.GPU_BUSY else "<",
           c.t["busy_min"] if busy_sig.name == S.GPU_BUSY else 1.0 - c.t["busy_min"])
    for s, stat in ((dram, "mean"), (hbm, "value"), (tensor, "mean"), (flops, "value")):
        if s is not None:
            c.cite(s, stat, "<", c.t["roof_frac"])
    if sm is not None:
        c.cite(sm, "mean", "<", c.t["sm_active"])
    regime = c.ev.regime
    if regime is Regime.MEMORY:
        saturation = hbm_use
        lead = f"Memory-bound regime at {hbm_use:.0%} of the bandwidth roof" if hbm_use is not None else \
            "Memory-bound regime"
        gap = "the kernels, not HBM, are the gap"
    elif regime is Regime.COMPUTE:
        saturation = math_use
        lead = f"Compute-bound regime at {math_use:.0%} of the tensor peak" if math_use is not None else \
            "Compute-bound regime"
        gap = "the kernels, not the math units, are the gap"
    else:
        saturation = max((x for x in (hbm_use, math_use) if x is not None), default=None)
        lead = "Neither HBM nor the SMs are saturated"
        gap = "the kernels are the gap"
    counters = [f"a kernel runs {busy:.0%} of the time"]
    if dram is not None:
        counters.append(f"DRAM {dram.mean:.0%} active")
    if sm is not None:
        counters.append(f"SMs {sm.mean:.0%}")
    if tensor is not None:
        counters.append(f"tensor pipes {tensor.mean:.1%}")
    message = f"{lead}: {gap} ({', '.join(counters)})."
    small = c.opt(S.TRACE_SHARE_ELEMENTWISE)
    if small is not None and small.value >= 0.15:
        c.cite(small, "value")
        message += f" {small.value:.0%} of the GPU time is in norm, elementwise and reduction kernels."
    message += top_kernels_text(c.ev)
    _kernel_fixes(c, regime)
    if regime is Regime.MEMORY:
        _memory_regime_fixes(c)
    elif regime is Regime.COMPUTE:
        c.fix(FixKind.FP8_MATMUL, "Run the matmuls in FP8", "FP8 weights and activations double the tensor peak for "
              "the matmul share of the time.", gains.fp8_matmul_gain(c.ev))
    far = 1.0 - (saturation if saturation is not None else 0.3) / c.t["roof_frac"]
    strength = 0.55 + 0.25 * max(0.0, far) + (0.1 if regime is not Regime.UNKNOWN else 0.0)
    return c.finding(min(0.9, strength), message, regime=regime, saturation=saturation)


@rule(
    code="LAT002",
    name="busy-gpu-roof-unknown",
    limiter=Limiter.LATENCY,
    summary="The GPU is busy nearly all the time, but nothing captured says which roof its kernels press on.",
    requires=(AnyOf(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC),),
    uses=(S.GPU_DRAM_ACTIVE, S.GPU_SM_ACTIVE, S.GPU_TENSOR_ACTIVE, S.THEORY_HBM_ROOF_FRAC,
          S.THEORY_COMPUTE_ROOF_FRAC, S.TRACE_SHARE_ELEMENTWISE, S.TRACE_SHARE_GEMM, S.TRACE_IDLE_KERNEL_OVERHEAD_FRAC,
          S.TRACE_IDLE_HOST_FRAC),
    # The same bar as LAT001's: between two different bars a GPU busy 70-85 % of the time had no finding at all.
    reads={S.GPU_BUSY: (MEAN,), S.TRACE_GPU_IDLE_FRAC: (VALUE,), S.TRACE_SHARE_GEMM: (VALUE,),
           S.TRACE_SHARE_ELEMENTWISE: (VALUE,)},
    thresholds={"busy_min": Threshold(0.70, "share of the time a kernel runs at or above which the GPU is the "
                                      "bottleneck", "ratio")},
    decisive=False,
    fleet=(_KERNEL_BUSY >= fm.Bar("busy_min")).unless(fm.Present(S.GPU_DRAM_ACTIVE)).unless(fm.Present(S.GPU_SM_ACTIVE))
    .unless(fm.Present(S.GPU_TENSOR_ACTIVE)).unless(fm.Present(S.THEORY_HBM_ROOF_FRAC))
    .unless(fm.Present(S.THEORY_COMPUTE_ROOF_FRAC)).valued(0.45),
    page=Page(
        detects="A kernel runs at least {busy_min} of the time, and neither DRAM, SM or tensor-pipe counters nor "
        "the ops' FLOPs and bytes were captured.",
        why="What is known: the GPU, not the host, sets the pace, and the limit is inside the kernels. Whether they "
        "press on memory bandwidth, on the math units, or on neither (latency) needs DRAM and tensor activity (GPM "
        "on Hopper, DCGM profiling fields) or the ops' input shapes (torch.profiler record_shapes=True).",
        fixes="Collect the counters or shapes to name the roof; meanwhile, the trace's time split says which "
        "kernels to look at (small unfused kernels can be fused whatever the roof).",
        sources="nsys 'GPU is the bottleneck' at high busy time; " + _NCU,
    ),
)
def busy_gpu_roof_unknown(c: Check) -> Finding | None:
    if any(c.opt(n) is not None for n in (S.GPU_DRAM_ACTIVE, S.GPU_SM_ACTIVE, S.GPU_TENSOR_ACTIVE,
                                          S.THEORY_HBM_ROOF_FRAC, S.THEORY_COMPUTE_ROOF_FRAC)):
        return None
    busy_sig = c.first(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC)
    busy = busy_sig.mean if busy_sig.name == S.GPU_BUSY else 1.0 - busy_sig.value
    if busy < c.t["busy_min"]:
        return None
    c.cite(busy_sig, "mean" if busy_sig.name == S.GPU_BUSY else "value")
    message = (f"the GPU is busy {busy:.0%} of the time, so the limit is inside the kernels; DRAM and tensor-pipe "
               "counters or the ops' shapes would tell compute from memory")
    small, gemm = c.opt(S.TRACE_SHARE_ELEMENTWISE), c.opt(S.TRACE_SHARE_GEMM)
    if small is not None and gemm is not None:
        c.cite(gemm, "value")
        c.cite(small, "value")
        message += (f". Of the busy time, {gemm.value:.0%} is in GEMMs and {small.value:.0%} in norm, elementwise and "
                    "reduction kernels")
    message = message + "." + top_kernels_text(c.ev) if c.ev.trace is not None and c.ev.trace.top_kernels else \
        message + "."
    if small is not None and small.value >= 0.15:
        c.fix(FixKind.FUSE_KERNELS, "Fuse the small kernels", "Fuse the norms, activations, casts and softmax between "
              "the matmuls (torch.compile, fused kernels): whatever the roof, their reads and writes through HBM "
              "and their launches are time the matmuls do not need.", gains.fusion_gain(c.ev))
    return c.finding(0.45, message, regime=c.ev.regime)


# FP32-input GEMMs on tensor cores (cuBLAS/CUTLASS s1688/s16816 tensor-op kernels, names with tf32) run at the TF32
# rate; the others (sgemm, scudnn) on the FP32 pipes, slower still.
_TF32_MARKS = ("tf32", "s1688gemm", "s16816gemm")


def _tf32_share(ev: Evidence) -> float:
    """Share of GPU busy time in the top kernels that are TF32 tensor-op GEMMs by name."""
    if ev.trace is None:
        return 0.0
    names = [(k, (k.full_name or k.name).lower()) for k in ev.trace.top_kernels if k.kind == "gemm"]
    # The same low-precision marks that keep a kernel out of the FP32 share (a bf16 s16816 GEMM is no TF32 one).
    return sum(k.share for k, name in names if any(m in name for m in _TF32_MARKS)
               and not any(m in name for m in LOW_PRECISION_GEMM_MARKS))


def _unlisted_gemm_share(ev: Evidence, gemm: float | None) -> float:
    """GEMM time (`gemm`: the share of all kernels) outside the trace's top kernels: FP32 or not, the kernel names
    read do not say."""
    if gemm is None or ev.trace is None:
        return 0.0
    return max(0.0, gemm - sum(k.share for k in ev.trace.top_kernels if k.kind == "gemm"))


def by_bytes_model(ev: Evidence) -> bool:
    """An FP32 model served in the memory-bound regime: every kernel's bytes halve in 16 bits."""
    dtype = ev.weights_dtype()
    return ev.regime is Regime.MEMORY and dtype is not None and bytes_per_element(dtype) >= 4 \
        and ev.workload != "training"


def _precision_fix(c: Check, half: str | None, gain: Gain) -> None:
    """Mixed precision in the 16-bit float this GPU has tensor cores for: BF16, or FP16 (with loss scaling when
    training) on Volta and Turing, which have no BF16 units (BF16 math there runs at the FP32 rate)."""
    gpu = c.ev.gpu_spec
    if half == "fp16" and gpu is not None:
        why = f"the {gpu.name} has FP16 tensor cores but no BF16 ones, where BF16 math runs at the FP32 rate"
        if c.ev.workload == "training":
            c.fix(FixKind.MIXED_PRECISION, "Train in mixed precision (FP16)", "Wrap the forward pass and loss in "
                  "torch.autocast(device_type='cuda', dtype=torch.float16) and scale the loss with "
                  f"torch.amp.GradScaler (FP16 gradients underflow without it); not BF16: {why}.", gain)
        else:
            c.fix(FixKind.MIXED_PRECISION, "Serve the model in FP16", "Load the weights and run the model in fp16 "
                  f"(model.half(), or the engine's --dtype float16); not BF16: {why}.", gain)
        return
    if c.ev.workload == "training":
        c.fix(FixKind.MIXED_PRECISION, "Train in mixed precision", "Wrap the forward pass and loss in "
              "torch.autocast(device_type='cuda', dtype=torch.bfloat16) (or fp16 with torch.amp.GradScaler on a GPU "
              "without BF16 units: V100, T4): matmuls at the 16-bit tensor rate, activations at half the bytes.",
              gain)
    else:
        c.fix(FixKind.MIXED_PRECISION, "Serve the model in 16-bit", "Load the weights and run the model in bf16 "
              "(model.to(torch.bfloat16), or the engine's --dtype bfloat16; fp16 on a GPU without BF16 units: V100, "
              "T4).", gain)


@rule(
    code="CMP003",
    name="fp32-matmuls",
    limiter=Limiter.COMPUTE,
    summary="The GPU's matmuls run on FP32 data (FP32 or TF32 GEMMs) where 16-bit data would double their rate.",
    requires=(S.TRACE_FP32_SHARE, AnyOf(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC)),
    uses=(S.TRACE_SHARE_ELEMENTWISE, S.TRACE_SHARE_GEMM),
    reads={S.GPU_BUSY: (MEAN,), S.TRACE_GPU_IDLE_FRAC: (VALUE,), S.TRACE_FP32_SHARE: (VALUE,), S.TRACE_SHARE_GEMM:
           (VALUE,), S.TRACE_SHARE_ELEMENTWISE: (VALUE,)},
    thresholds={"fp32_share": Threshold(0.10, "share of GPU busy time in FP32/TF32 GEMMs (by kernel name)",
                                        "ratio")},
    page=Page(
        detects="At least {fp32_share} of GPU busy time in GEMM kernels whose names say FP32 or TF32 data (cuBLAS "
        "sgemm, xmma gemm_f32f32_f32f32 and all-float GEMVs, CUTLASS s1688/s16816 tensor-op GEMMs, cuDNN scudnn), "
        "among the trace's top kernels.",
        why="FP32 matmuls run at the TF32 rate (tensor-op kernels) or the FP32 rate (sgemm), a half to a sixteenth "
        "of the 16-bit rate, and move twice the bytes; norms and elementwise kernels on FP32 activations read and "
        "write twice the bytes as well.",
        fixes="Training: automatic mixed precision in the 16-bit float the GPU has tensor cores for: "
        "torch.autocast(dtype=torch.bfloat16), or on V100 and T4 (FP16 tensor cores, no BF16) dtype=torch.float16 "
        "with a GradScaler. Serving: the model in bf16 (fp16 on V100/T4). The gain is at most that of the matmuls "
        "at the GPU's 16-bit rate over their TF32 or FP32 rate (its datasheet ratio: 2x TF32 -> BF16 on an A100, "
        "8x FP32 -> FP16 on a V100) and the elementwise kernels at half the bytes, over the time the GPU is busy; "
        "the FP32 share is read from the top kernels, so the bound also counts the GEMM time outside them. An FP32 "
        "model served in the memory-bound regime (a decode) is sized by its bytes instead: the GPU's work at the "
        "16-bit floor with the host's time kept, an upper bound (on an H200, x1.75 and x3.09 realised at batch 1 "
        "and 16 against up to x2.6 and x4.9).",
        sources="NVIDIA's mixed-precision training guide; PyTorch AMP documentation; datasheet FP32/TF32/BF16/FP16 "
        "rates.",
    ),
)
def fp32_matmuls(c: Check) -> Finding | None:
    share = c.req(S.TRACE_FP32_SHARE)
    if share.value < c.t["fp32_share"]:
        return None
    busy_sig = c.first(S.GPU_BUSY, S.TRACE_GPU_IDLE_FRAC)
    busy = busy_sig.mean if busy_sig.name == S.GPU_BUSY else 1.0 - busy_sig.value
    c.cite(share, "value", ">=", c.t["fp32_share"])
    c.cite(busy_sig, "mean" if busy_sig.name == S.GPU_BUSY else "value")
    gpu = c.ev.gpu_spec
    half = sixteen_bit_dtype(gpu) if gpu is not None else None
    # The share is read from the top kernels only: GEMMs outside them may be FP32 too, so an upper bound counts
    # them (at the FP32 pipes' rate, the largest gain).
    gemm = c.opt(S.TRACE_SHARE_GEMM)
    unlisted = _unlisted_gemm_share(c.ev, gemm.value if gemm is not None else None)
    seen = f"{share.value:.0%}" + (f" (up to {share.value + unlisted:.0%} counting the {unlisted:.0%} of GEMM time "
                                   "outside the top kernels)" if unlisted >= 0.005 else "")
    small = c.opt(S.TRACE_SHARE_ELEMENTWISE)
    w_small = busy * (small.value if small is not None else 0.0)
    if gpu is None or half is None:
        gain = Gain.unknown("needs a recognised GPU: the gain is its 16-bit tensor rate over its TF32 or FP32 rate")
    else:
        tf32 = min(share.value, _tf32_share(c.ev))
        # Of the window: idle and the other kernels stay, each FP32 part runs at its 16-bit rate, the elementwise
        # kernels move half the bytes (Amdahl).
        after = 1.0 - busy * (share.value + unlisted) - w_small + w_small / 2.0
        rates: list[str] = []
        # In the memory-bound regime the GEMMs (a decode's GEMVs) wait on their bytes, not their FLOPs: 16-bit data
        # halves their time, whatever the tensor rate (on an H200, FP32 -> BF16 at batch 1 realised x1.75 where the
        # rate ratio would have said x15). An estimate then: kernels keep their efficiency.
        by_bytes = c.ev.regime is Regime.MEMORY
        for part, dtype in ((tf32, fp32_matmul_dtype(gpu, tf32=True)), (share.value - tf32 + unlisted, "fp32")):
            if part <= 0:
                continue
            rate = 2.0 if by_bytes else peak_flops(gpu, half) / peak_flops(gpu, dtype)
            after += busy * part / rate
            what = f"{dtype.upper()} GEMMs" + (" and the GEMMs outside the top kernels" if dtype == "fp32" and
                                               unlisted >= 0.005 else "")
            rates.append(f"{what} ({busy * part:.0%} of the window) at half the bytes (memory-bound)" if by_bytes
                         else f"{what} ({busy * part:.0%} of the window) at the {half.upper()} rate (x{rate:.1f})")
        gain = Gain(1.0 / after, f"{' and '.join(rates)} and elementwise kernels ({w_small:.0%}) at half the bytes, "
                                 f"on the {gpu.name}", GainKind.ESTIMATE if by_bytes else GainKind.UPPER_BOUND)
    if by_bytes_model(c.ev) and half is not None:
        # The whole FP32 model in the memory-bound regime: sized as the memory fixes size it, by its floor.
        gain = gains.model_dtype_gain(c.ev, half)
    _precision_fix(c, half, gain)
    rate_text = f"a half or less of the {half.upper()} tensor rate" if half else "a half or less of the 16-bit rate"
    return c.finding(0.45, f"At least {seen} of the GPU's busy time is in FP32/TF32 matmuls (by the names of the "
                     f"trace's top kernels), at {rate_text}.", regime=Regime.COMPUTE)


RULES = (dram_bandwidth_saturated, decode_at_bandwidth_floor, compute_saturated, fp32_matmuls, kernel_bound,
         busy_gpu_roof_unknown)
