"""What the evidence says about the workload before any rule runs: its regime (which roof it would hit), which
fixes are already in place, whether it is training or serving, on which platform, and what limits the data's quality.

Pure functions over an Evidence being built (evidence_build.build_evidence calls `characterise` last). The regime is a
different question from the limiter: a batch-1 decode is in the memory-bound regime, but whether HBM is saturated is
measured separately (theory.hbm_roof_frac, gpu.dram_active), and a decode at a third of its roof is limited by its
kernels, not by HBM.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from diagnoser import signals as S
from diagnoser.diagnosis import FixKind, Regime
from diagnoser.evidence import Evidence, Quality
from diagnoser.physics.precision import weight_only
from diagnoser.units import fmt

if TYPE_CHECKING:
    from diagnoser.capture import TraceSummary

# Below this share of GPU time covered by ops with known FLOPs and bytes, the trace's op intensity describes a sliver
# of the work (a CUDA-graph decode's eager prefills, say) and does not name the regime.
MIN_COSTED_SHARE = 0.5
# Counter-based regime: DRAM clearly used while the tensor pipes are nearly idle reads as memory-bound work; tensor
# pipes busier than DRAM as compute-bound. (Tensor-active counts the cycles the pipes run, padded tiles included, so
# the ratio of the two counters overstates intensity for small-M GEMMs: only the clear cases are read.)
COUNTER_DRAM_MIN = 0.10
COUNTER_TENSOR_IDLE = 0.10
COUNTER_TENSOR_BUSY = 0.30

# One idle gap holding this share of a trace's window makes the window a pause (a warm-up, a first call) more than a
# workload: the data's quality, what to collect, and the judge's refusal to size host fixes from it use this bar.
LONG_PAUSE = 0.5

ENGINES_WITH_CONTINUOUS_BATCHING = ("vllm", "sglang", "tgi")
ENGINES_WITH_TUNED_DECODE = ("vllm", "sglang", "tgi", "trtllm")


def characterise(ev: Evidence) -> None:
    ev.platform = _platform(ev)
    ev.workload = _workload(ev)
    ev.regime, ev.regime_basis = _regime(ev)
    ev.in_place = _in_place(ev)
    ev.quality = _quality(ev)


def _platform(ev: Evidence) -> str:
    trace = ev.trace
    found = trace.platform if trace is not None else ""
    if found:
        return found
    if any(g.name for g in ev.meta.gpus):
        return "rocm" if any("amd" in g.name.lower() or "instinct" in g.name.lower() for g in ev.meta.gpus) else "cuda"
    return ""


def _workload(ev: Evidence) -> str:
    trace = ev.trace
    found = trace.workload if trace is not None else ""
    if found:
        return found
    if ev.meta.server_kind or any(map(_SERVER_SIGNAL, ev.signals)):
        return "inference"
    return ""


def _regime(ev: Evidence) -> tuple[Regime, str]:
    """The roof the work would hit, and the numbers that say so."""
    ridge = ev.value(S.THEORY_RIDGE_FLOP_PER_BYTE)
    intensity = ev.value(S.THEORY_INTENSITY)
    share = ev.value(S.THEORY_DECODE_SHARE)
    prefill = ev.value(S.TRACE_PREFILL_FRAC)
    rb = ev.value(S.THEORY_RIDGE_BATCH)
    batch = ev.observed_batch()
    if share is not None and share < 0.5 or prefill is not None and prefill > 0.5:
        why = (f"prefill takes {1 - share:.0%} of the least GPU time the served tokens need" if share is not None
               and share < 0.5 else f"the trace spends {prefill:.0%} of its GPU time in prefill-like steps")
        return Regime.COMPUTE, f"{why}; prefill multiplies each weight by every prompt token"
    if intensity is not None and ridge:
        regime = Regime.MEMORY if intensity < ridge else Regime.COMPUTE
        where = f" (batch {fmt(batch)} against a ridge batch of {fmt(rb)})" if batch is not None and rb else ""
        return regime, (f"decode does {intensity:.1f} FLOP per byte read{where}, "
                        f"{'below' if regime is Regime.MEMORY else 'above'} the ridge point {ridge:.0f}")
    traced = ev.value(S.TRACE_INTENSITY)
    costed = costed_share(ev.trace)
    if traced is not None and ridge and (costed is None or costed >= MIN_COSTED_SHARE):
        regime = Regime.MEMORY if traced < ridge else Regime.COMPUTE
        cover = f" ({costed:.0%} of GPU time costed)" if costed is not None else ""
        return regime, (f"the traced ops do {traced:.1f} FLOP per byte{cover}, "
                        f"{'below' if regime is Regime.MEMORY else 'above'} the ridge point {ridge:.0f}")
    dram, tensor = ev.value(S.GPU_DRAM_ACTIVE), ev.value(S.GPU_TENSOR_ACTIVE)
    if dram is not None and tensor is not None:
        if dram >= COUNTER_DRAM_MIN and tensor < COUNTER_TENSOR_IDLE:
            return Regime.MEMORY, (f"DRAM is {dram:.0%} active while the tensor pipes are {tensor:.1%}: the work "
                                   "moves bytes, not math (read from counters)")
        if tensor >= COUNTER_TENSOR_BUSY and tensor > dram:
            return Regime.COMPUTE, (f"the tensor pipes are {tensor:.0%} active against {dram:.0%} DRAM activity "
                                    "(read from counters)")
    return Regime.UNKNOWN, ""


def costed_share(trace: TraceSummary | None) -> float | None:
    """Share of GPU kernel time whose op FLOPs and bytes are known (older captures: of the GEMM and attention time)."""
    if trace is None:
        return None
    return trace.costed_time_frac if trace.costed_time_frac is not None else trace.costed_gemm_attention_frac


def graph_share(trace: TraceSummary | None) -> float | None:
    """Share of GPU kernel time (older captures: of kernels) launched from graph replays."""
    if trace is None or not trace.kernel_count:
        return None
    return trace.graph_kernel_frac if trace.graph_kernel_frac is not None else trace.graph_kernel_count_frac


def _in_place(ev: Evidence) -> dict[FixKind, str]:
    """Fixes the capture shows are already applied, each with the evidence."""
    found: dict[FixKind, str] = {}
    graphs = ev.value(S.TRACE_GRAPH_KERNEL_FRAC)
    launches = ev.value(S.TRACE_CUDA_GRAPH_LAUNCHES)
    word = "HIP" if ev.platform == "rocm" else "CUDA"
    if graphs is not None and graphs >= 0.5:
        found[FixKind.CUDA_GRAPHS] = f"{graphs:.0%} of the traced kernels run inside {word} graph replays"
    elif launches and launches > 0 and graphs is None:
        found[FixKind.CUDA_GRAPHS] = f"the trace replays {word} graphs ({launches:.0f} graph launches)"
    elif ev.serving.graphs_disabled() is False:
        found[FixKind.CUDA_GRAPHS] = f"{ev.serving.engine} captures {word} graphs by default (no --enforce-eager)"
    dtype = ev.weights_dtype()
    if dtype in ("fp8", "int8"):
        found[FixKind.FP8_WEIGHTS] = f"the weights are already {dtype}"
        # W8A8 serving runs the matmuls in 8 bits: FP8 tensor cores run them no faster (Hopper's INT8 rate is its
        # FP8 rate).
        found[FixKind.FP8_MATMUL] = f"the weights are already {dtype}: the matmuls run at the 8-bit tensor rate"
    elif dtype and weight_only(dtype):  # int4 and below: FP8 or INT4 weights would read more bytes
        found[FixKind.FP8_WEIGHTS] = f"the weights are already {dtype}"
        found[FixKind.INT4_WEIGHTS] = f"the weights are already {dtype}"
    kv = (ev.model.kv_dtype if ev.model is not None else "") or ev.serving.kv_cache_dtype
    if kv and kv.lower().startswith(("fp8", "int8", "e4m3", "e5m2")):
        found[FixKind.FP8_KV] = f"the KV cache is already {kv}"
    # A self-test workload or the demo exports vLLM-named metrics, but is not vLLM.
    engine = ev.serving.engine or ("selftest" if ev.serving.selftest_scenario else ev.meta.server_kind)
    if engine in ENGINES_WITH_CONTINUOUS_BATCHING:
        found[FixKind.CONTINUOUS_BATCHING] = f"{engine} schedules per iteration (continuous batching)"
    if engine in ENGINES_WITH_TUNED_DECODE:
        found[FixKind.TUNED_ENGINE] = f"the server is already {engine}"
    if ev.serving.prefix_caching:
        found[FixKind.PREFIX_CACHING] = "prefix caching is enabled"
    if ev.serving.chunked_prefill:
        found[FixKind.SPLIT_PREFILL] = "chunked prefill is enabled"
    fused = _compiler_fused_share(ev)
    if fused is not None and fused >= 0.8:
        found[FixKind.FUSE_KERNELS] = (f"{fused:.0%} of the GPU time is in kernels torch.compile (Inductor) already "
                                       "generated and fused (triton_*_fused_*)")
    return found


def _compiler_fused_share(ev: Evidence) -> float | None:
    """Share of the trace's kernel time in Inductor-generated fused Triton kernels (named triton_<kind>_fused_...),
    from the top kernels; None without a trace."""
    trace = ev.trace
    if trace is None or not trace.top_kernels:
        return None
    return sum(k.share for k in trace.top_kernels if k.name.startswith("triton_") and "_fused_" in k.name)


def _quality(ev: Evidence) -> list[Quality]:
    """What limits how far the data can be trusted: each a confidence factor with its reason."""
    out: list[Quality] = []
    trace = ev.trace
    has_counters = any(n in ev for n in (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_DRAM_ACTIVE, S.GPU_TENSOR_ACTIVE))
    if trace is not None:
        if trace.truncated:
            out.append(Quality(0.6, "the trace file is cut short: its end is missing, so its shares describe only "
                                    "what was read"))
        total, skipped = trace.events_total, trace.events_skipped
        if total and skipped / total >= 0.01:
            frac = skipped / total
            out.append(Quality(max(0.4, 1.0 - frac), f"{skipped:,} of {total:,} trace events ({frac:.0%}) were "
                                                     "damaged and skipped"))
        if trace.longest_gap_frac is not None and trace.longest_gap_frac >= LONG_PAUSE:
            out.append(Quality(0.5, f"one idle gap is {trace.longest_gap_frac:.0%} of the traced window: the window "
                                    "holds a long pause (a warm-up, a stray kernel before the steps), and its idle "
                                    "shares describe that pause more than the workload"))
        if trace.sampled:
            why = trace.sampled_reason or "its events are a sample"
            out.append(Quality(0.7, f"the trace is sampled ({why}): shares and gaps are estimates"))
        kernels = trace.kernel_count
        # A trace with no GPU work at all (a CPU build's, a frontend's) says nothing against verdicts drawn from the
        # server's own signals: `attach --trace` on a CPU vLLM turned a VRAM verdict inconclusive (x0.40).
        no_gpu_work = kernels == 0 and (ev.meta.cpu_only or any(_SERVER_SIGNAL(n) for n in ev.signals))
        if not has_counters and not no_gpu_work:
            if kernels < 20:
                out.append(Quality(0.4, f"the trace holds only {kernels} GPU kernel{'s' if kernels != 1 else ''}: "
                                        "too few to describe a workload"))
            elif kernels < 200:
                out.append(Quality(0.65, f"the trace holds only {kernels} GPU kernels"))
            if 0 < trace.window_s < 0.01:
                out.append(Quality(0.7, f"the traced window is {trace.window_s * 1e3:.1f} ms"))
            steps = trace.steps
            if steps is not None and 0 < steps < 3:
                out.append(Quality(0.85, f"the trace covers {steps} step{'s' if steps != 1 else ''}"))
    return out


# GEMM-name markers of FP32 data: cuBLAS sgemm, CUTLASS s1688/s16816 (TF32 tensor ops on float data), cuDNN
# scudnn, TF32 implicit GEMMs. Only GEMMs are read: elementwise kernels of a 16-bit model often accumulate in float
# and would look FP32 by their template arguments.
_SERVER_SIGNAL = re.compile(r"server\.").match  # a signal from the server's own metrics
# cuBLAS on sm80 and later names FP32 GEMMs by their types and pipe: sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_ (FP32
# FMA, no tensor cores; seen on an H200 at batch 16, tests/fixtures/gpu/hf/precision).
_FP32_GEMM_MARKS = ("sgemm", "s1688gemm", "s16816gemm", "scudnn", "tf32", "gemm_f32f32_f32f32")
# cuBLAS GEMV (M = 1: a batch-1 decode's matmuls) names its types only in its template arguments: all float for FP32
# data (gemv2T_kernel_val<int, int, float, float, float, float, ...>, internal::gemvx::kernel<int, int, float, ...>),
# __nv_bfloat16 / __half for a 16-bit model. Seen on an H200 with an FP32 Llama (tests/fixtures/gpu/hf/precision).
_FP32_GEMV = re.compile(r"gemv\w*(?:::kernel)?<int, int, float, float, float, float").search
_LOW_PRECISION_MARKS = ("h1688", "h16816", "bf16", "bfloat16", "half", "fp16", "e4m3", "e5m2", "fp8", "i8816", "int8")


def fp32_share(trace: TraceSummary | None) -> float | None:
    """Share of GPU busy time in the top kernels that are FP32/TF32 GEMMs by name (a lower bound: only the listed
    kernels are read), or None without top kernels."""
    if trace is None or not trace.top_kernels:
        return None
    share = 0.0
    for k in trace.top_kernels:
        name = (k.full_name or k.name).lower()
        if k.kind == "gemm" and (any(m in name for m in _FP32_GEMM_MARKS) or _FP32_GEMV(name)) \
                and not any(m in name for m in _LOW_PRECISION_MARKS):
            share += k.share
    return share
