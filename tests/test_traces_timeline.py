"""Idle-gap attribution, one cause at a time, on small traces written here in Kineto's format, plus kernel roles,
CUDA-graph replays and launch statistics. Times are microseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diagnoser.traces import analyze_trace
from diagnoser.traces.analysis import TraceAnalysis
from diagnoser.traces.classify import kernel_class, memcpy_direction

HOST_TID = 100


def kernel(ts: float, dur: float, corr: int, name: str = "void gemm_kernel<float>()", stream: int = 7,
           cat: str = "kernel", **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": corr, **args}}


def call(name: str, ts: float, dur: float, corr: int, cat: str = "cuda_runtime", tid: int = HOST_TID) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def op(name: str, ts: float, dur: float, tid: int = HOST_TID) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def analyze(tmp_path: Path, events: list[dict], window: str = "gpu") -> TraceAnalysis:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return analyze_trace(path, window=window)


def causes(a: TraceAnalysis) -> dict[str, int]:
    (tl,) = a.timelines
    return {c: n for c, n in tl.gaps_by_cause.items() if n}


def test_host_not_launched_yet(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        op("aten::mm", 18, 30),  # the host is busy building the next op
        call("cudaLaunchKernel", 40, 5, 2), kernel(50, 10, 2),
    ])
    assert causes(a) == {"host": 1}
    assert a.summary.idle_frac_by_cause["host"] == pytest.approx(30 / 50)
    assert a.summary.gpu_busy_frac == pytest.approx(20 / 50)


def test_kernel_to_kernel_overhead_when_the_next_kernel_was_queued(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), call("cudaLaunchKernel", 6, 5, 2),
        kernel(10, 10, 1), kernel(24, 10, 2),
    ])
    assert causes(a) == {"kernel_overhead": 1}
    assert a.summary.idle_frac_by_cause["kernel_overhead"] == pytest.approx(4 / 24)


def test_host_synchronisation(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 100, 1),
        call("cudaStreamSynchronize", 20, 92, 9),  # the host waits for the kernel, wakes up at 112
        op("aten::item", 112, 40),
        call("cudaLaunchKernel", 160, 5, 2), kernel(170, 10, 2),
    ])
    assert causes(a) == {"sync": 1}
    assert a.summary.idle_frac_by_cause["sync"] == pytest.approx(60 / 170)


def test_a_blocking_copy_called_just_after_the_gpu_ran_dry_is_a_sync(tmp_path: Path) -> None:
    """The MI300X SGLang trace: 0.3 ms after the GPU ran dry the host called hipMemcpyWithStream (PyTorch's
    blocking copy on ROCm) and stayed in it for the whole 463 ms gap: blocked, not late to launch."""
    a = analyze(tmp_path, [
        call("hipLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        call("hipMemcpyWithStream", 25, 960, 2), kernel(980, 3, 2, name="Memcpy DtoH (Device -> Pinned)",
                                                         cat="gpu_memcpy"),
        call("hipLaunchKernel", 990, 5, 3), kernel(1000, 10, 3),
    ])
    assert "host" not in causes(a) and a.summary.idle_frac_by_cause["sync"] > 0.95
    # A sync that began late in a gap does not take the whole gap: the host was late before it.
    b = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        op("aten::mm", 20, 900),
        call("cudaStreamSynchronize", 925, 50, 2),
        call("cudaLaunchKernel", 980, 5, 3), kernel(990, 10, 3),
    ])
    assert "sync" not in causes(b)


def test_item_style_device_to_host_copy_is_a_sync(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 50, 1),
        call("cudaMemcpyAsync", 20, 45, 2), kernel(60, 2, 2, name="Memcpy DtoH (Device -> Pageable)",
                                                   cat="gpu_memcpy", bytes=4),
        call("cudaStreamSynchronize", 65, 0.5, 3),
        call("cudaLaunchKernel", 300, 5, 4), kernel(310, 10, 4),
    ])
    assert causes(a) == {"sync": 1}


def test_copy_from_pageable_memory(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        # the copy call stages the pageable buffer on the host before the DMA can start
        call("cudaMemcpyAsync", 15, 80, 2),
        kernel(90, 5, 2, name="Memcpy HtoD (Pageable -> Device)", cat="gpu_memcpy", bytes=1 << 20),
        call("cudaStreamSynchronize", 95, 2, 3),
        call("cudaLaunchKernel", 130, 5, 4), kernel(140, 10, 4),
    ])
    assert causes(a) == {"pageable_memcpy": 2}
    assert a.summary.idle_frac_by_cause["pageable_memcpy"] == pytest.approx((70 + 45) / 140)


def test_queue_dry_when_the_host_did_nothing(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        # 50 ms with no event on the launching thread: no request arrived
        op("aten::linear", 50_000, 20), call("cudaLaunchKernel", 50_010, 5, 2), kernel(50_020, 10, 2),
    ])
    assert causes(a) == {"queue_dry": 1}


def test_long_gap_with_a_busy_host_is_host(tmp_path: Path) -> None:
    busy = [op("aten::index", 20 + 100 * i, 80) for i in range(500)]
    a = analyze(tmp_path, [call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1), *busy,
                           call("cudaLaunchKernel", 50_010, 5, 2), kernel(50_020, 10, 2)])
    assert causes(a) == {"host": 1}


def test_queued_kernel_waiting_on_another_stream_is_a_stream_wait(tmp_path: Path) -> None:
    wait = {"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": 0, "tid": 8, "ts": 15, "dur": 190,
            "args": {"device": 0, "stream": 8, "correlation": 7, "cuda_sync_kind": "Stream Wait Event",
                     "wait_on_stream": 7}}
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), call("cudaLaunchKernel", 6, 5, 2),
        kernel(10, 10, 1), wait, kernel(200, 10, 2, stream=8),
    ])
    assert causes(a) == {"stream_wait": 1}
    # the cuda_sync record itself is not GPU work
    assert a.summary.gpu_busy_frac == pytest.approx(20 / 200)


def test_a_gpu_far_behind_the_host_waits_and_that_is_not_launch_overhead(tmp_path: Path) -> None:
    # The host launched everything 100 ms before the GPU ran it; the GPU still sat idle 64 ms between two kernels
    # (issue 13 saw this called "kernel-to-kernel overhead"): the second kernel waited on the device side.
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), call("cudaLaunchKernel", 6, 5, 2), call("cudaLaunchKernel", 12, 5, 3),
        kernel(100_000, 1_000, 1), kernel(165_000, 1_000, 2), kernel(166_010, 1_000, 3),
    ])
    (tl,) = a.timelines
    assert causes(a) == {"stream_wait": 1, "kernel_overhead": 1}
    assert tl.idle_us_by_cause["stream_wait"] == pytest.approx(64_000)
    assert tl.idle_us_by_cause["kernel_overhead"] == pytest.approx(10)


def test_a_slow_launch_call_is_the_host_not_a_device_wait(tmp_path: Path) -> None:
    # the launch call started before the GPU went idle but took 80 µs; the kernel ran as soon as it returned
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        call("cudaLaunchKernel", 15, 80, 2), kernel(100, 10, 2),
    ])
    assert causes(a) == {"host": 1}


def test_overlapping_streams_are_one_busy_union(tmp_path: Path) -> None:
    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 1, 1), call("cudaLaunchKernel", 1, 1, 2), call("cudaLaunchKernel", 2, 1, 3),
        kernel(10, 50, 1, stream=7), kernel(30, 50, 2, stream=8), kernel(100, 10, 3, stream=7),
    ])
    (tl,) = a.timelines
    assert tl.busy_us == pytest.approx(70 + 10)
    assert tl.busy_us_by_stream == {7: 60, 8: 50}
    assert a.summary.kernel_share["gemm"] == 1.0


def test_profiler_window_edges_are_idle_in_a_live_capture(tmp_path: Path) -> None:
    path = tmp_path / "live.json"
    path.write_text(json.dumps({"diagnoser_window": {"seconds": 0.001}, "traceEvents": [
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 0, "dur": 1000, "args": {}},
        call("cudaLaunchKernel", 500, 5, 1), kernel(510, 100, 1),
    ]}))
    a = analyze_trace(path)
    assert a.window == (0, 1000) and "live capture" in a.window_policy
    assert a.summary.gpu_busy_frac == pytest.approx(0.1)
    assert sum(a.summary.idle_frac_by_cause.values()) == pytest.approx(0.9)


def test_cuda_graph_replays_are_recognised_and_their_kernels_attributed(tmp_path: Path) -> None:
    events = [call("cudaGraphLaunch", 0, 8, 1)]
    events += [kernel(10 + 5 * i, 4, 1, name=n) for i, n in enumerate(
        ["nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_TNT", "void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>()",
         "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>>()",
         "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"])]
    events += [call("cuLaunchKernelEx", 40, 20, 2, cat="cuda_driver"), kernel(70, 2, 2, name="triton_red_fused_0")]
    a = analyze(tmp_path, events)
    k = a.kernels
    assert k is not None
    assert a.summary.cuda_graph_launches == 1 and k.graph_kernels == 4
    assert k.launched == 1 and k.short_kernels == 1  # the Triton kernel ran 2 µs after a 20 µs launch
    assert a.summary.short_kernel_frac == 1.0 and a.summary.launch_call_us_p50 == 20
    assert k.count_by_class == {"gemm": 1, "attention": 1, "embedding": 0, "norm_elementwise": 1, "reduction": 1, "comm": 1,
                                "memcpy": 0, "memset": 0, "other": 0}
    assert a.summary.graph_kernel_count_frac == pytest.approx(4 / 5)


@pytest.mark.parametrize("name, expected", [
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>()", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("fused_moe_kernel", "gemm"),
    ("void marlin::Marlin<256, 4, 16, 4, 4, 8>()", "gemm"),
    ("void vllm::paged_attention_v2_kernel<__nv_bfloat16, 128, 16, 128, 512>()", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>()", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("BatchDecodeWithPagedKVCacheKernel", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>()", "attention"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "comm"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>()", "comm"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>()", "norm_elementwise"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>()", "norm_elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()", "norm_elementwise"),
    ("triton_poi_fused_add_cos_sin_0", "norm_elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>()",
     "reduction"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>()", "reduction"),
    ("triton_per_fused__softmax_0", "reduction"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 32, true, 1, true>()", "norm_elementwise"),
    ("some_unknown_kernel", "other"),
    # fbgemm / TorchRec embedding tables and their permutes: memory-bound gathers, not GEMMs (issue 13)
    ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float, false, long, 2ul, 32ul>()",
     "embedding"),
    ("void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<c10::Half, float>()",
     "embedding"),
    ("void fbgemm_gpu::bounds_check_indices_kernel<long, long>(at::GenericPackedTensorAccessor<long, 1ul>)",
     "embedding"),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int, int, int)", "embedding"),
    ("void permute_pooled_embs_kernel<float>(float const*, long const*, long*, long, long, long)", "embedding"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>()",
     "embedding"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*)", "norm_elementwise"),
    # AMD: Tensile (rocBLAS, hipBLASLt) and MIOpen GEMMs are GEMMs, whatever "_Bias_" says (issue 13)
    ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1_AFEM1_AFEM1_ASEM1_CLR1", "gemm"),
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x32x64_MI16x16x1_SN_LDSB1_AFC1", "gemm"),
    ("igemm_bwd_gtcx3_nhwc_bf16_bx0_ex1_bt256x64x32_wt32x32x8_ws1x1_wr2x2", "gemm"),
    ("_ZN2ck16tensor_operation6device12_GLOBAL__N_139kernel_grouped_conv_fwd_xdl_cshuffle_v3INS_34GridwiseGemm",
     "gemm"),
    ("void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16, __hip_bfloat16>()", "attention"),
])
def test_kernel_roles(name: str, expected: str) -> None:
    assert kernel_class(name) == expected


def test_copy_directions() -> None:
    assert memcpy_direction("Memcpy HtoD (Pageable -> Device)") == "HtoD"
    assert memcpy_direction("Memcpy DtoH (Device -> Pinned)") == "DtoH"
    assert memcpy_direction("Memcpy DtoD (Device -> Device)") == "DtoD"
    assert memcpy_direction("Memcpy PtoP (Device -> Device)") == "PtoP"


def test_each_device_has_its_own_timeline(tmp_path: Path) -> None:
    dev1 = kernel(0, 50, 2)
    dev1["pid"] = 1
    dev1["args"]["device"] = 1
    a = analyze(tmp_path, [call("cudaLaunchKernel", -10, 5, 1), kernel(0, 100, 1),
                           call("cudaLaunchKernel", -5, 5, 2), dev1])
    assert [tl.device for tl in a.timelines] == [0, 1]
    assert [tl.busy_frac for tl in a.timelines] == [1.0, 0.5]
    assert a.summary.devices == [0, 1] and a.summary.gpu_busy_frac == pytest.approx(0.75)


def test_idle_inside_ops_counts_each_name_once_and_skips_step_annotations() -> None:
    from diagnoser.traces.timeline import idle_inside_ops

    ops = [("ProfilerStep#3", 0, 1000), ("DDP.forward", 100, 600), ("aten::copy_", 150, 400),
           ("aten::copy_", 200, 300), ("aten::copy_", 700, 800)]
    # gaps 120..350 and 650..900: DDP.forward holds 230 + 0; copy_ 200 (150..350, its nested twin counted once)
    # + 100 (700..800); the step annotation encloses everything and names nothing.
    assert idle_inside_ops([(120, 350), (650, 900)], ops) == {"DDP.forward": 230, "aten::copy_": 300}
    assert idle_inside_ops([], ops) == {} and idle_inside_ops([(0, 10)], []) == {}


def test_the_host_op_that_holds_the_idle_is_named(tmp_path: Path) -> None:
    """The A100 DDP trace's idle sits inside aten::unflatten_dense_tensors (DDP's bucket copy): the analysis names
    the CPU ops of 0.5 ms or more the host was inside while the GPU waited, and the finding says so."""
    from diagnoser.rules import diagnose
    from diagnoser.traces import capture_from_trace

    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        op("aten::unflatten_dense_tensors", 25, 900), op("aten::add", 930, 20),
        call("cudaLaunchKernel", 950, 5, 2), kernel(960, 10, 2),
    ])
    assert causes(a) == {"host": 1}
    assert a.summary.host_idle_ops == {"aten::unflatten_dense_tensors": pytest.approx(900 / 960)}
    d = diagnose(capture_from_trace(a))
    assert "The host was inside aten::unflatten_dense_tensors (94% of the window)" in d.headline, d.headline


def test_a_long_runtime_call_is_named_and_the_rest_is_said(tmp_path: Path) -> None:
    """The H100 host-bound trace's gaps: a 2 ms cudaGraphLaunch and 7.6 ms with no event (Python). The launch call
    is named with its share, and the rest is said to be shorter ops or Python, not left out."""
    from diagnoser.rules import diagnose
    from diagnoser.traces import capture_from_trace

    a = analyze(tmp_path, [
        call("cudaLaunchKernel", 0, 5, 1), kernel(10, 10, 1),
        call("cudaGraphLaunch", 7000, 2000, 2), kernel(9010, 10, 2),
    ])
    assert a.summary.host_idle_ops == {"cudaGraphLaunch": pytest.approx(2000 / 9010, rel=0.01)}
    d = diagnose(capture_from_trace(a))
    assert "The host was inside cudaGraphLaunch (22% of the window)" in d.headline, d.headline
    assert "more is in shorter ops and launches, or Python between them" in d.headline
