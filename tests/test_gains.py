"""Each bound a predicted gain obeys, against hand computations (issue: no gain beyond what was measured)."""

from __future__ import annotations

import pytest

from diagnoser.capture import TraceSummary
from diagnoser.diagnosis import Benefit, FixKind, GainKind
from diagnoser.evidence_build import build_evidence
from diagnoser.physics import get_gpu, kv_bytes_per_token, max_concurrent_sequences
from diagnoser.rules import diagnose, gains
from tests.factories import llama_7b, make_capture


def test_amdahl_and_removal_by_hand() -> None:
    assert gains.amdahl(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    assert gains.amdahl(0.4, float("inf")) == pytest.approx(1 / 0.6)
    g = gains.removal(0.4, "idle")
    assert g.value == pytest.approx(1 / 0.6) and g.kind is GainKind.UPPER_BOUND


def test_a_capped_gain_says_so_and_keeps_the_measured_share() -> None:
    """98.4 % idle is 62x before the 20x cap; the basis gives the share measured (not a share clipped to 95 %), and
    the cap is said. A GPU busy 0.7 % of the time is 137x before the cap."""
    g = gains.removal(0.984, "the host launch gaps")
    assert g.value == gains.MAX_GAIN and g.kind is GainKind.UPPER_BOUND
    assert "98%" in g.basis and "95%" not in g.basis and g.capped == "capped at 20x (from 62.50x)"
    assert "99.3%" in gains.removal(0.993, "gaps").basis
    assert gains.removal(1.0, "gaps").capped.startswith("capped at 20x")
    assert not gains.removal(0.9, "gaps").capped  # 10x: under the cap, nothing to say
    busy = gains.kept_busy(0.00728)
    assert busy.value == gains.MAX_GAIN and busy.capped == "capped at 20x (from 137.36x)"
    assert "1 / 0.7% busy" in busy.basis
    assert gains.kept_busy(0.25).value == pytest.approx(4.0) and not gains.kept_busy(0.25).capped


def test_overlapping_communication_cannot_beat_the_communication_itself() -> None:
    """MI300X DDP step: 9.2 ms of 16 ms exposed communication, 6.8 ms of everything else. Overlapped, the step
    lasts at least the 9.2 ms: 16 / 9.2 = 1.74x, not 1 / (1 - 0.575) = 2.35x."""
    g = gains.overlap(9.2 / 16, "exposed communication")
    assert g.value == pytest.approx(16 / 9.2) and g.kind is GainKind.UPPER_BOUND
    # under half: the rest of the step can hide all of it
    assert gains.overlap(0.3, "exposed communication").value == pytest.approx(1 / 0.7)


def test_removing_a_sync_overlaps_the_host_work_after_it_and_no_more() -> None:
    """H100 host-bound decode: per 12.4 ms step the GPU runs 4.3 ms, a 13 us cudaStreamSynchronize returns as the GPU
    drains, then 7.6 ms of Python with the GPU idle. Without the sync the Python runs beside the GPU's work: the step
    is at least 7.6 ms, 12.4 / 7.6 = 1.6x, not 1 / 0.35 = 2.9x."""
    d = diagnose(make_capture({"trace.idle.sync_frac": 0.31, "trace.idle.host_frac": 0.32,
                               "trace.gpu_idle_frac": 0.66}))
    syncs = next(f for f in d.fixes if f.kind is FixKind.REMOVE_SYNCS)
    assert syncs.gain == pytest.approx(1 / 0.63) and syncs.is_upper_bound  # host 32 % + 31 % against busy 34 %
    # The launch-bound decode: the GPU busy 4 %, the host the rest; without the syncs it still is.
    d = diagnose(make_capture({"trace.idle.sync_frac": 0.35, "trace.idle.host_frac": 0.61,
                               "trace.gpu_idle_frac": 0.96}))
    assert next(f for f in d.fixes if f.kind is FixKind.REMOVE_SYNCS).gain == pytest.approx(1 / 0.96)


def test_fp8_matmuls_gain_only_the_gemm_share_of_a_prefill() -> None:
    # A prefill whose trace puts 40 % of the GPU time in norms/elementwise: FP8 can speed up the other 60 % only.
    trace = TraceSummary(window_s=1.0, gpu_busy_frac=0.99, kernel_count=5000,
                         kernel_share={"gemm": 0.55, "attention": 0.05, "norm_elementwise": 0.4})
    ev = build_evidence(make_capture({"gpu.busy": 0.99}, trace=trace))
    g = gains.fp8_matmul_gain(ev)
    ratio = 1978.9 / 989.4  # H100 SXM FP8 over BF16 dense
    assert g.value == pytest.approx(1 / (0.4 + 0.6 / ratio), rel=1e-3)  # 1.43x, not the +100 % of the peak ratio
    assert g.kind is GainKind.UPPER_BOUND


def test_fusion_is_bounded_by_the_small_kernels_and_gaps_and_by_the_floor() -> None:
    trace = TraceSummary(window_s=1.0, gpu_busy_frac=0.9, kernel_count=5000,
                         kernel_share={"gemm": 0.6, "norm_elementwise": 0.3, "reduction": 0.1},
                         idle_frac_by_cause={"kernel_overhead": 0.05})
    ev = build_evidence(make_capture({"gpu.busy": 0.9}, trace=trace))
    g = gains.fusion_gain(ev)
    assert g.value == pytest.approx(1 / (1 - (0.4 * 0.9 + 0.05)))  # small kernels' share of the window + gaps
    # With a measured floor, nothing gets past it: a decode at 80 % of its ceiling gains at most 1.25x.
    capped = build_evidence(make_capture({"gpu.busy": 0.9, "server.running": 1, "server.waiting": 0,
                                          "server.gen_tokens_per_s": 0.8 * 246.2}, trace=trace, model=llama_7b()))
    eff = capped["theory.efficiency"].value
    assert gains.fusion_gain(capped).value == pytest.approx(1 / eff)
    assert "floor" in gains.fusion_gain(capped).capped


def test_fp8_kv_halves_kv_bytes_and_doubles_capacity() -> None:
    model, h100 = llama_7b(), get_gpu("h100-sxm")
    assert kv_bytes_per_token(model, "fp8") == kv_bytes_per_token(model, "bf16") / 2 == 2 * 32 * 32 * 128
    assert max_concurrent_sequences(model, h100, 4096, kv_dtype="fp8") in (
        2 * max_concurrent_sequences(model, h100, 4096, kv_dtype="bf16"),
        2 * max_concurrent_sequences(model, h100, 4096, kv_dtype="bf16") + 1)


def test_fp8_kv_gain_on_a_kv_bound_decode_with_a_full_pool_and_a_queue() -> None:
    # 4,096-token contexts at batch 16: KV is most of each step's bytes. The pool is full and 16 more wait, so the
    # batch can double; the gain is well above the +0.4 % the fix once predicted, and at most 2x at the ceiling.
    cap = make_capture({"gpu.busy": 0.95, "server.running": 16, "server.waiting": 16, "server.kv_usage": 0.99},
                       model=llama_7b(), serving={"mean_context_tokens": 4096})
    g = gains.kv_dtype_gain(build_evidence(cap), "fp8")
    assert g.value is not None and 1.5 < g.value <= 2.0 + 1e-9
    assert "the batch grows 16 -> 32" in g.basis
    # Nobody waits: the batch stays and only the KV bytes shrink.
    calm = make_capture({"gpu.busy": 0.95, "server.running": 16, "server.waiting": 0, "server.kv_usage": 0.5},
                        model=llama_7b(), serving={"mean_context_tokens": 4096})
    g2 = gains.kv_dtype_gain(build_evidence(calm), "fp8")
    assert g2.value is not None and 1.0 < g2.value < g.value and "grows" not in g2.basis


def test_a_bigger_batch_with_nothing_waiting_is_capacity_not_speed() -> None:
    d = diagnose(make_capture({"gpu.busy": 0.997, "gpu.sm_active": 0.27, "gpu.dram_active": 0.29,
                               "gpu.tensor_active": 0.009, "server.running": 1, "server.waiting": 0,
                               "server.gen_tokens_per_s": 80}, model=llama_7b()))
    batch = next(f for f in d.fixes if f.kind is FixKind.BATCH_MORE)
    assert batch.benefit is Benefit.CAPACITY and "nothing waits" in batch.basis
    assert d.fixes[-1].benefit is Benefit.CAPACITY and d.fixes[0].benefit is Benefit.SPEED


def test_training_host_work_the_trace_names_gets_its_own_fix_and_only_its_own_gain() -> None:
    """The A100 DDP trace: the GPU waits 76 % of the window for the host, 10 % of it inside DDP's bucket copy
    (aten::unflatten_dense_tensors) and 3.5 % in the optimizer's foreach ops. The fix names DDP's and the optimizer's
    options and promises only what those ops hold: 1 / (1 - 0.135), not the 4.2x of all the host's time."""
    trace = TraceSummary(path="ddp.json", workload="training", gpu_busy_frac=0.24,
                         idle_frac_by_cause={"host": 0.76}, host_idle_ops={
                             "aten::unflatten_dense_tensors": 0.10, "aten::_foreach_add_": 0.035,
                             "aten::batch_norm": 0.11, "aten::_foreach_mul_": 0.01})
    d = diagnose(make_capture({"trace.idle.host_frac": 0.76, "trace.gpu_idle_frac": 0.76}, trace=trace))
    fix = next(f for f in d.fixes if f.kind is FixKind.OFFLOAD_HOST_WORK)
    assert "gradient_as_bucket_view=True" in fix.action and "fused=True" in fix.action
    assert fix.gain == pytest.approx(1 / (1 - 0.135)) and fix.is_upper_bound
    assert "_foreach_mul_" not in fix.action  # 1 % of the window: not worth naming


def test_fp8_matmuls_without_a_trace_are_bounded_by_the_tensor_pipes_share() -> None:
    """Counters only (dcgm, fleet): the tensor pipes 40 % active. FP8 doubles their rate and shortens only those
    cycles: at most 1 / (0.6 + 0.2) = 1.25x, not the 2x of the peak ratio."""
    d = diagnose(make_capture({"gpu.busy": 0.97, "gpu.sm_active": 0.9, "gpu.tensor_active": 0.4,
                               "gpu.dram_active": 0.3}))
    fp8 = next(f for f in d.fixes if f.kind is FixKind.FP8_MATMUL)
    assert fp8.gain == pytest.approx(1.25, rel=1e-3) and fp8.is_upper_bound and "40%" in fp8.basis
