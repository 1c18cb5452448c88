"""What ran, as far as a trace shows it: the platform (CUDA or ROCm), the workload (training or inference, with the
evidence), the profiler steps, and whether the trace holds only a sample of what ran.

Every answer says "" (or None) when the trace does not show enough to tell; a guess is never made from the absence
of one kind of evidence alone when the trace is too small to hold it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from itertools import islice
from operator import lt, sub
from typing import Any

from diagnoser.traces.classify import COMM, STEP_PREFIX, kernel_class
from diagnoser.traces.tables import SAMPLE_IDS, Tables

CUDA = "cuda"
ROCM = "rocm"
TRAINING = "training"
INFERENCE = "inference"

# --- platform ----------------------------------------------------------------------------------------------------

_ROCM_KERNEL = re.compile(r"^Cijk_|MIOpen|miopen|^igemm_|^_ZN2ck|\bck::|ck_tile|rocprim|__hip_|hipblaslt|rocblas"
                          r"|_ZN5aiter|aiter::|_mfma|mfma_|sgl_hip")
_ROCM_DEVICE = re.compile(r"\bAMD\b|Instinct|Radeon|\bMI\d{3}", re.IGNORECASE)
_CUDA_DEVICE = re.compile(r"NVIDIA|Tesla|Quadro|GeForce|RTX|\b[AHBL]\d{2,3}\b|\bGH200\b|\bGB200\b", re.IGNORECASE)


def platform(t: Tables, devices: Iterable[str]) -> tuple[str, str]:
    """("cuda" | "rocm" | "", why). HIP runtime calls, ROCm libraries' kernels (Tensile Cijk_*, MIOpen, Composable
    Kernel, rocPRIM, aiter) and AMD device names mean ROCm; CUDA runtime/driver calls and NVIDIA device names mean
    CUDA (Kineto files both under the category "cuda_runtime")."""
    hip = sum(n for name, n in t.runtime_names.items() if name.startswith("hip"))
    cuda = sum(n for name, n in t.runtime_names.items() if name.startswith("cu"))
    kernels = {t.names[i] for i in set(t.g_name)}
    rocm_kernels = sorted(k for k in kernels if _ROCM_KERNEL.search(k))
    names = [d for d in devices if d]
    amd = [d for d in names if _ROCM_DEVICE.search(d)]
    nvidia = [d for d in names if _CUDA_DEVICE.search(d) and not _ROCM_DEVICE.search(d)]
    meta = t.metadata
    rocm_meta = [k for k in ("roctracer_version", "hip_runtime_version", "hip_driver_version") if k in meta]
    cuda_meta = [k for k in ("cupti_version", "cuda_runtime_version", "cuda_driver_version") if k in meta]
    rocm_why = []
    if hip:
        rocm_why.append(f"{hip} HIP runtime calls")
    if rocm_kernels:
        rocm_why.append(f"ROCm library kernels ({rocm_kernels[0][:40]})")
    if amd:
        rocm_why.append(f"device {amd[0]}")
    if rocm_meta:
        rocm_why.append(f"metadata {rocm_meta[0]}")
    cuda_why = []
    if cuda:
        cuda_why.append(f"{cuda} CUDA runtime/driver calls")
    if nvidia:
        cuda_why.append(f"device {nvidia[0]}")
    if cuda_meta:
        cuda_why.append(f"metadata {cuda_meta[0]}")
    if rocm_why and not (cuda or nvidia):
        return ROCM, ", ".join(rocm_why)
    if cuda_why and not (hip or amd):
        return CUDA, ", ".join(cuda_why)
    if rocm_why and cuda_why:  # both: go by the calls that launch the work
        return (ROCM, ", ".join(rocm_why)) if hip > cuda else (CUDA, ", ".join(cuda_why))
    return "", ""


# --- training or inference ---------------------------------------------------------------------------------------

_BACKWARD_OP = re.compile(r"^autograd::engine::evaluate_function|Backward\d*$|^## backward ##$|\.backward$"
                          r"|^torch::autograd::AccumulateGrad$")
_OPTIMIZER_OP = re.compile(r"^Optimizer\.(step|zero_grad)#|^aten::_fused_(adam|adamw|sgd)|^aten::_foreach_(addcdiv|"
                           r"addcmul|lerp)_?$|fused_adam|FusedAdam|^Optimizer")
_BACKWARD_KERNEL = re.compile(r"backward|_bwd|bwd_|wgrad|dgrad|_grad_|grad_input|grad_weight|Backward", re.IGNORECASE)
_OPTIMIZER_KERNEL = re.compile(r"Adam|SGD|sgd_|LambFunctor|lamb_|adagrad|fused_optim|multi_tensor_(adam|sgd|lamb)",
                               re.IGNORECASE)
_SERVING = re.compile(r"vllm|sglang|execute_model|model_runner|decode|prefill|generate|step\[(DECODE|EXTEND|PREFILL)"
                      r"|paged_attention|flash_fwd_splitkv|flashinfer|BatchDecode|reshape_and_cache|tensorrt_llm",
                      re.IGNORECASE)
MIN_OPS = 50  # CPU ops (or kernels) a trace needs before the absence of backward ops says "inference"
MIN_KERNELS = 100


def workload(t: Tables, kernel_names: dict[str, int], comm_kinds: dict[str, float]) -> tuple[str, list[str]]:
    """("training" | "inference" | "", evidence). Training: backward ops (autograd's evaluate_function, *Backward
    nodes), optimizer steps, backward or optimizer kernels, gradient all-reduce beside them. Inference: a forward-only
    trace large enough that their absence means something, with serving markers when there are any."""
    ops = t.op_names
    evidence: list[str] = []
    backward = {n: c for n, c in ops.items() if _BACKWARD_OP.search(n)}
    optimizer = {n: c for n, c in ops.items() if _OPTIMIZER_OP.search(n)}
    bwd_kernels = {n: c for n, c in kernel_names.items() if _BACKWARD_KERNEL.search(n)}
    opt_kernels = {n: c for n, c in kernel_names.items() if _OPTIMIZER_KERNEL.search(n) and kernel_class(n) != COMM}
    if backward:
        evidence.append(f"{sum(backward.values())} backward ops ({_top(backward)})")
    if optimizer:
        evidence.append(f"{sum(optimizer.values())} optimizer ops ({_top(optimizer)})")
    if bwd_kernels:
        evidence.append(f"{sum(bwd_kernels.values())} backward kernels ({_top(bwd_kernels)})")
    if opt_kernels:
        evidence.append(f"{sum(opt_kernels.values())} optimizer kernels ({_top(opt_kernels)})")
    if evidence:
        reduce = comm_kinds.get("all_reduce", 0.0) + comm_kinds.get("reduce_scatter", 0.0)
        if reduce > 0 and (backward or bwd_kernels):
            evidence.append(f"gradient-style collectives (all_reduce/reduce_scatter) hold {reduce:.1%} of GPU time")
        return TRAINING, evidence
    n_ops = sum(ops.values())
    n_kernels = sum(kernel_names.values())
    serving = sorted({n for n in list(ops) + list(kernel_names) if _SERVING.search(n)})
    if serving:
        evidence.append(f"serving markers: {', '.join(s[:48] for s in serving[:3])}")
    if n_ops >= MIN_OPS:
        evidence.insert(0, f"forward only: no backward or optimizer ops among {n_ops} CPU ops")
    elif n_kernels >= MIN_KERNELS:
        evidence.insert(0, f"no backward or optimizer kernels among {n_kernels} kernels")
    elif not serving:
        return "", []
    if t.runtime_names and any("GraphLaunch" in n for n in t.runtime_names):
        evidence.append("kernels replayed from CUDA/HIP graphs")
    return INFERENCE, evidence


def _top(counts: dict[str, int], n: int = 2) -> str:
    return ", ".join(name[:48] for name, _ in sorted(counts.items(), key=lambda kv: -kv[1])[:n])


# --- steps and sampling ------------------------------------------------------------------------------------------

def steps(t: Tables) -> int | None:
    """Distinct ProfilerStep#N annotations (the profiler writes some twice, on the CPU and GPU rows)."""
    names = {name for name, _, _, _ in t.steps if name.startswith(STEP_PREFIX)}
    return len(names) or None


def step_ms_p50(t: Tables) -> float | None:
    by_name: dict[str, float] = {}
    for name, _, dur, _ in t.steps:
        by_name[name] = max(by_name.get(name, 0.0), dur)
    durs = [d for d in by_name.values() if d > 0]
    return statistics.median(durs) / 1e3 if durs else None


_DROPPED = re.compile(r"Dropped (\d+) activity records")
_OVERFLOW = re.compile(r"Exceeded max GPU buffer count|terminating tracing")
_STOPPED_EARLY = re.compile(r"CUPTI stopped early\?\s*=\s*([1-9]\d*)")
# The profiler numbers every op it records (External id): in the whole traces seen (26 of them, A100/H100/B200/V100/
# MI300, training and inference) 96-100 % of consecutive ids differ by exactly 1; in HolisticTraceAnalysis' sampled
# traces 37 %. Under this share, most ops are missing: the trace holds a sample of them.
MIN_CONSECUTIVE_IDS = 0.8
MIN_IDS = 100


def sampling(t: Tables) -> tuple[bool, str]:
    """(sampled, why): the profiler's own log lines in the trace saying records were dropped or tracing stopped when
    its buffers filled, or CPU-op External ids so sparse that the events are a sample."""
    lines = _log_lines(t.metadata)
    dropped = sum(int(m.group(1)) for line in lines for m in _DROPPED.finditer(line))
    if dropped:
        return True, f"the profiler dropped {dropped} activity records (its log in the trace says so)"
    if any(_OVERFLOW.search(line) for line in lines):
        return True, "the profiler's GPU buffers filled and it stopped recording early (its log in the trace says so)"
    if any(_STOPPED_EARLY.search(line) for line in lines):
        return True, "CUPTI stopped recording early (the profiler's log in the trace says so)"
    ids = sorted(t.ext_ids[:SAMPLE_IDS])  # the first ops' ids tell as well as all of them; (nearly) in order already
    if not all(map(lt, ids, islice(ids, 1, None))):  # without repeats, as a rule: no set needed
        ids = sorted(set(ids))
    if len(ids) >= MIN_IDS:
        gaps = list(map(sub, islice(ids, 1, None), ids))
        consecutive = gaps.count(1) / len(gaps)
        if consecutive < MIN_CONSECUTIVE_IDS:
            near = [g for g in gaps if g <= 1000]  # (large jumps are other threads' or steps' numbering)
            cover = len(near) / sum(near) if near else 0.0
            return True, (f"only {consecutive:.0%} of the CPU ops' consecutive External ids follow each other (96-100 "
                          f"% in a whole trace; about {cover:.0%} of the ops are present): the trace holds a sample "
                          "of the events")
    return False, ""


def _log_lines(meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("WARNING", "ERROR", "INFO"):
        value = meta.get(key)
        if isinstance(value, list):
            out.extend(v for v in value if isinstance(v, str))
        elif isinstance(value, str):
            out.append(value)
    return out
