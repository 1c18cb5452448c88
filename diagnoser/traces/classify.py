"""What each event is: kernel roles by name, copy directions, and which runtime/driver calls launch or synchronise.

Names are classified once per distinct name (a trace has thousands of events per name), so the regexes here are
not on the hot path. Order matters: communication before everything (NCCL kernels mention "Sum_float"), attention
before GEMM (flash-attention kernels are CUTLASS kernels too), embedding gathers before GEMM (fbgemm's namespace
contains "gemm"), GEMM before elementwise (cuBLAS epilogues, Tensile's "_Bias_").
"""

from __future__ import annotations

import re
from functools import lru_cache

GEMM = "gemm"
ATTENTION = "attention"
EMBEDDING = "embedding"  # table lookups, gathers and permutes of recommendation models: memory-bound
NORM_ELEMENTWISE = "norm_elementwise"
REDUCTION = "reduction"
COMM = "comm"
MEMCPY = "memcpy"
MEMSET = "memset"
OTHER = "other"
# The keys of TraceSummary.kernel_share (docs/traces.md).
KERNEL_CLASSES = (GEMM, ATTENTION, EMBEDDING, NORM_ELEMENTWISE, REDUCTION, COMM, MEMCPY, MEMSET, OTHER)

# Every NCCL generation (ncclKernel_*, ncclDevKernel_*, ncclDevFunc), RCCL/HCCL, vLLM/SGLang custom all-reduce,
# NVSHMEM and DeepEP expert-parallel exchange kernels.
_COMM = re.compile(
    r"nccl|rccl|hccl|msccl|nvshmem|cross_device_reduce|custom_?all_?reduce|all_?reduce|allgather|all_?gather"
    r"|reduce_?scatter|all_?to_?all|deep_?ep|two_shot|one_shot_all|multimem",
    re.IGNORECASE,
)
# FlashAttention 1-3, xFormers/CUTLASS fmha, cuDNN SDPA, FlashInfer, vLLM/SGLang paged and Triton attention, the
# KV-cache write that belongs to the attention block.
_ATTENTION = re.compile(
    r"flash|fmha|attention|attn|_fwd_kernel|_fwd_grouped_kernel|_bwd_kernel|mha_|paged|BatchDecode|BatchPrefill|SinglePrefill"
    r"|SingleDecode|decode_kernel|reshape_and_cache|concat_and_cache|mla_|sdpa|softmax_fwd_.*kv",
    re.IGNORECASE,
)
# fbgemm/TorchRec embedding tables (split_embedding_* forward and backward with the fused optimizer), index bounds
# checks, pooled-embedding and KJT permutes, jagged tensors, the UVM cache; ATen's embedding and index_select.
_EMBEDDING = re.compile(
    r"split_embedding|(?<!rotary_)embedding|bounds_check_indices|(?<![A-Za-z])permute_(?:pooled|2D|1D|sparse|multi|data|seq)"
    r"|jagged|lxu_cache|linearize_cache|lfu_cache|lru_cache|batch_index_select|index_select|indexSelect"
    r"|segment_sum_csr|reorder_batched_ad",
    re.IGNORECASE,
)
# cuBLAS/cuBLASLt (incl. Hopper nvjet_*), CUTLASS, cuDNN implicit-GEMM convolutions, Triton matmul templates,
# quantised GEMMs (Marlin, Machete, GPTQ/AWQ, FP8 scaled_mm), MoE grouped GEMMs, split-K reductions of cuBLAS; on
# ROCm Tensile's Cijk_* (rocBLAS and hipBLASLt), MIOpen's implicit-GEMM convolutions, Composable Kernel GEMMs.
_GEMM = re.compile(
    r"(?<!fb)gemm|gemv|cublas|cutlass|nvjet|xmma|_mm_|_mm$|matmul|\bmm_|bmm|sgemm|hgemm|dgemm|s884|s1688|h884|h1688"
    r"|\bCijk_|hipblaslt|rocblas|MIOpenConv|miopenSp3AsmConv|naive_conv|conv_fwd_xdl|conv_bwd|xdl_cshuffle"
    r"|i8816|splitK|splitk|marlin|machete|gptq|awq|scaled_mm|fused_moe|moe_align|grouped_mm|wgrad|dgrad|fprop"
    r"|implicit_convolve|conv2d|convolve|winograd|fft2d|fft_|tensorop|triton_tem_|scudnn|hcudnn|884cudnn|1688cudnn"
    r"|_interior_nn|_small_nn|_large_nn|_medium_nn",
    re.IGNORECASE,
)
_REDUCTION = re.compile(
    r"reduce|reduction|softmax|SoftMax|argmax|argmin|topk|top_k|top_p|sort|cumsum|scan|sampling|sampler"
    r"|logsumexp|triton_red_|triton_per_|\bsum\b|nll_loss|cross_entropy",
    re.IGNORECASE,
)
_NORM_ELEMENTWISE = re.compile(
    r"elementwise|vectorized|unrolled|layer_?norm|rms_?norm|batch_?norm|group_?norm|bn_f|bn_b|instance_?norm"
    r"|act_and_mul|silu|gelu|relu|tanh|sigmoid|rotary|rope|triton_poi_|copy|Copy|fill|index|gather|scatter"
    r"|cat_|CatArray|transpose|permute|nchwTo|nhwcTo|pool|dropout|where|masked|arange|distribution"
    r"|clamp|add_kernel|mul_kernel|quant|dequant|scale|bias|epilogue|multi_tensor_apply|lamb|adam",
    re.IGNORECASE,
)


@lru_cache(maxsize=65536)
def kernel_class(name: str) -> str:
    """The role of a kernel from its (demangled or mangled) name."""
    if _COMM.search(name):
        return COMM
    if _ATTENTION.search(name):
        return ATTENTION
    if _EMBEDDING.search(name):
        return EMBEDDING
    if _GEMM.search(name):
        return GEMM
    if _REDUCTION.search(name):
        return REDUCTION
    if _NORM_ELEMENTWISE.search(name):
        return NORM_ELEMENTWISE
    return OTHER


_COPY_DIRECTION = re.compile(r"\b(HtoD|DtoH|DtoD|HtoH|PtoP|DtoA|AtoD|AtoH|HtoA|AtoA)\b")


@lru_cache(maxsize=4096)
def memcpy_direction(name: str) -> str:
    """'HtoD', 'DtoH', 'DtoD', 'PtoP', ... from a Kineto memcpy name such as 'Memcpy HtoD (Pageable -> Device)'."""
    m = _COPY_DIRECTION.search(name)
    return m.group(1) if m else "other"


def is_pageable_copy(name: str) -> bool:
    """A copy to or from pageable host memory: staged through a driver buffer and synchronous for the host."""
    return "Pageable" in name


# Runtime and driver calls that put one kernel on a stream. Kineto reports kernels launched through the driver API
# (Triton, inductor, CUTLASS via cuLaunchKernelEx) under cat "cuda_driver"; they are launches like any other.
KERNEL_LAUNCHES = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchKernelEx", "cudaLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernelMultiDevice", "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
    "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC_ptsz", "cuLaunchKernel_ptsz", "cuLaunchKernelEx_ptsz",
    "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel",
})
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch", "cudaGraphLaunch_ptsz", "hipGraphLaunch"})
COPY_CALLS = frozenset({
    "cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync", "cudaMemcpy2D", "cudaMemcpyPeerAsync", "cudaMemcpyPeer",
    "cudaMemcpyToSymbolAsync", "cudaMemcpyFromSymbolAsync", "cudaMemsetAsync", "cudaMemset", "cudaMemset2DAsync",
    "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2", "cuMemsetD8Async",
    "cuMemsetD32Async", "cudaMemcpyAsync_ptsz", "cudaMemsetAsync_ptsz", "hipMemcpyAsync", "hipMemcpy",
    "hipMemsetAsync", "hipMemcpyWithStream",
})
# Calls that block the host until the GPU (or a stream, or an event) is done. A blocking cudaMemcpy is one too.
SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMemset", "cudaMemcpyPeer", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
    "cudaStreamSynchronize_ptsz", "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize",
    "hipMemcpy",
    # PyTorch's at::cuda::memcpy_and_sync (a blocking .to()/.copy_()/.item()) is cudaMemcpyAsync +
    # cudaStreamSynchronize on CUDA, and hipMemcpyWithStream, which returns only when the copy is done, on ROCm.
    "hipMemcpyWithStream",
})
# cuda_sync activity records (on the GPU rows) that mirror a host wait; "Stream Wait Event" is a GPU-side
# dependency between streams, not a host wait.
HOST_SYNC_KINDS = frozenset({"Stream Sync", "Context Sync", "Event Sync", "Device Sync"})
STREAM_WAIT_KIND = "Stream Wait Event"

# Calls kept for launch/sync attribution; the many other runtime calls only count as host activity.
LAUNCH_KIND_KERNEL = 1
LAUNCH_KIND_GRAPH = 2
LAUNCH_KIND_COPY = 3
LAUNCH_KIND_SYNC = 4


def runtime_kind(name: str) -> int:
    """0 for calls that neither launch nor wait; else one of the LAUNCH_KIND_* codes."""
    if name in KERNEL_LAUNCHES:
        return LAUNCH_KIND_KERNEL
    if name in GRAPH_LAUNCHES:
        return LAUNCH_KIND_GRAPH
    if name in SYNC_CALLS:
        return LAUNCH_KIND_SYNC  # cudaMemcpy (blocking) is both; the sync matters more for idle time
    if name in COPY_CALLS:
        return LAUNCH_KIND_COPY
    return 0


# Host-side records of collectives: c10d ops ("c10d::allreduce_", "c10d::alltoall_base_"), the record_param_comms op
# (its "Collective name" arg) and the "nccl:<collective>" annotations of PyTorch's ProcessGroupNCCL.
COMM_OP_PREFIX = "c10d::"
COMM_OP_NAMES = frozenset({"record_param_comms"})
COMM_ANNOTATION_PREFIX = "nccl:"

# The serving loop's profiler steps; the last one is kept (HolisticTraceAnalysis drops it by default).
STEP_PREFIX = "ProfilerStep#"
