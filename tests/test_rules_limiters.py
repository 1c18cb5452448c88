"""Each limiter, from captures built with explicit counter values, diagnosed end to end by the engine."""

import pytest

from diagnoser.capture import ModelInfo, TraceSummary
from diagnoser.diagnosis import Limiter, Verdict
from diagnoser.rules import diagnose
from tests.factories import H100_BYTES, llama_7b, make_capture

CASES = {
    "vram-kv-full": (
        dict(signals={"gpu.busy": 0.9, "gpu.mem_used_bytes": 0.93 * H100_BYTES, "server.kv_usage": 0.99,
                      "server.waiting": 12, "server.running": 40, "server.preemptions_per_s": [0.0] * 20 + [2.0] * 10,
                      "gpu.dram_active": 0.65, "gpu.tensor_active": 0.3}),
        Limiter.VRAM, "VRAM001"),
    "vram-weights-do-not-fit": (
        dict(signals={"gpu.busy": 0.3, "server.running": 1},
             model=ModelInfo(name="405b", params=405e9, layers=126, kv_heads=8, head_dim=128, dtype="bf16")),
        Limiter.VRAM, "VRAM002"),
    "bandwidth-decode": (
        dict(signals={"gpu.busy": 0.97, "gpu.sm_active": 0.8, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12,
                      "server.running": 1, "server.waiting": 0, "server.kv_usage": 0.05}),
        Limiter.MEMORY_BANDWIDTH, "BW001"),
    "bandwidth-at-floor-from-physics": (
        dict(signals={"gpu.busy": 0.95, "server.running": 1, "server.waiting": 0, "server.gen_tokens_per_s": 200},
             model=llama_7b()),
        Limiter.MEMORY_BANDWIDTH, "BW002"),
    # An H100 batch-1 decode as recorded (tests/fixtures/gpu): a third of its ceiling, DRAM well under 50 %: the
    # memory-bound regime, but HBM is not saturated, so the kernels are the gap.
    "latency-small-batch-decode": (
        dict(signals={"gpu.busy": 0.997, "gpu.sm_active": 0.27, "gpu.dram_active": 0.29, "gpu.tensor_active": 0.009,
                      "server.running": 1, "server.waiting": 0, "server.gen_tokens_per_s": 20,
                      "server.prompt_tokens_per_s": 5},
             model=llama_7b()),
        Limiter.LATENCY, "LAT001"),
    "latency-busy-but-underfilled-no-model": (
        dict(signals={"gpu.busy": 0.998, "gpu.sm_active": 0.27, "gpu.dram_active": 0.29, "gpu.tensor_active": 0.009,
                      "server.running": 1, "server.waiting": 0}),
        Limiter.LATENCY, "LAT001"),
    "compute-prefill": (
        dict(signals={"gpu.busy": 0.99, "gpu.sm_active": 0.95, "gpu.tensor_active": 0.78, "gpu.dram_active": 0.35,
                      "server.running": 64, "server.waiting": 0, "server.kv_usage": 0.5}),
        Limiter.COMPUTE, "CMP001"),
    "batching-queue-with-idle-gpu": (
        dict(signals={"gpu.busy": 0.3, "gpu.dram_active": 0.15, "gpu.tensor_active": 0.05, "server.running": 1,
                      "server.waiting": 9, "server.kv_usage": 0.1}),
        Limiter.BATCHING, "BAT001"),
    "batching-small-batch-below-ridge": (
        dict(signals={"gpu.busy": 0.9, "server.running": 4, "server.waiting": 20, "server.kv_usage": 0.2},
             model=llama_7b()),
        Limiter.BATCHING, "BAT002"),
    "idle": (
        dict(signals={"gpu.busy": 0.03, "gpu.dram_active": 0.01, "server.running": 0, "server.waiting": 0}),
        Limiter.IDLE, "IDLE001"),
    "host-bound-thread": (
        dict(signals={"gpu.busy": 0.45, "host.target_busiest_thread": 0.99, "server.running": 8,
                      "server.waiting": 0}),
        Limiter.HOST_LAUNCH, "HOST001"),
    "host-launch-gaps-trace": (
        dict(signals={"gpu.busy": 0.6},
             trace=TraceSummary(window_s=2, gpu_busy_frac=0.55, idle_frac_by_cause={"host": 0.4}, kernel_count=5000,
                                short_kernel_frac=0.8)),
        Limiter.HOST_LAUNCH, "HOST002"),
    "throttled": (
        dict(signals={"gpu.busy": 0.98, "gpu.throttle.power": 1.0, "gpu.sm_clock_frac": 0.62,
                      "gpu.dram_active": 0.4, "gpu.tensor_active": 0.35}),
        Limiter.THROTTLING, "THR001"),
    "nccl-bound": (
        dict(signals={"gpu.busy": 0.95},
             trace=TraceSummary(window_s=1, gpu_busy_frac=0.95, kernel_share={"comm": 0.55, "gemm": 0.35},
                                kernel_count=300)),
        Limiter.INTERCONNECT, "NET001"),
    "xid-errors": (
        dict(signals={"gpu.busy": 0.9, "gpu.xid_errors": [0.0] * 29 + [79.0], "gpu.dram_active": 0.7,
                      "gpu.tensor_active": 0.1}),
        Limiter.ERRORS, "ERR001"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_limiter(case):
    kwargs, limiter, code = CASES[case]
    d = diagnose(make_capture(**kwargs))
    assert d.verdict == limiter.value, (d.headline, [(f.code, f.strength) for f in d.findings], d.confidence_reasons)
    assert d.findings[0].code == code
    assert d.confidence >= 0.45
    assert d.findings[0].citations, "a finding must cite its evidence"
    assert d.fixes, "a verdict comes with fixes"


def test_vram_beats_bandwidth_when_both_fire():
    d = diagnose(make_capture(**CASES["vram-kv-full"][0]))
    assert "memory_bandwidth" in d.secondary


def test_batching_beats_roofs_when_gpu_is_busy_under_half():
    # Memory counters say 'bandwidth' but the GPU works only 35 % of the time while requests queue.
    d = diagnose(make_capture({"gpu.busy": 0.35, "gpu.dram_active": 0.6, "gpu.tensor_active": 0.05,
                               "server.waiting": 5, "server.running": 2}))
    assert d.verdict == Limiter.BATCHING.value
    assert "memory_bandwidth" in d.secondary


def test_predicted_gain_of_fp8_is_near_two_at_batch_one():
    d = diagnose(make_capture(**CASES["bandwidth-at-floor-from-physics"][0]))
    fp8 = next(f for f in d.fixes if "FP8" in f.title)
    assert 1.55 < fp8.gain <= 2.0  # the embedding and lm_head stay 16-bit, so a little under the bytes ratio
    assert "fp8" in fp8.basis


def test_batching_gain_is_capped_by_kv_memory():
    d = diagnose(make_capture(**CASES["batching-small-batch-below-ridge"][0]))
    fix = next(f for f in d.fixes if f.rule == "BAT002")
    assert fix.gain is not None and fix.gain > 1.5
    assert "batch 24 vs 4.0" in fix.basis  # toward the demand: 4 running + 20 waiting


def test_contradictory_capture_has_low_confidence():
    # DRAM and tensor pipes both just past their thresholds, split too small: neither roof rule fires; with a
    # saturated serving thread too and an idle reading, strong limiters contradict each other.
    d = diagnose(make_capture({"gpu.busy": 0.05, "gpu.sm_active": 0.9, "gpu.tensor_active": 0.75,
                               "gpu.dram_active": 0.1}))
    assert d.verdict in (Verdict.INCONCLUSIVE, Limiter.IDLE.value)
    assert d.confidence < 0.45
    assert any("almost as well" in r for r in d.confidence_reasons) or d.verdict == Verdict.INCONCLUSIVE


def test_thin_capture_is_inconclusive_and_says_what_to_collect():
    d = diagnose(make_capture({"gpu.mem_used_bytes": 0.5 * H100_BYTES}, n=2))
    assert d.verdict == Verdict.INCONCLUSIVE
    assert any("DRAM and tensor" in w for w in d.to_collect)
    assert any("--port" in w for w in d.to_collect)


def test_two_samples_lower_confidence():
    many = diagnose(make_capture({"gpu.busy": 0.97, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12}))
    few = diagnose(make_capture({"gpu.busy": 0.97, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12}, n=2))
    assert few.confidence < many.confidence
    assert any("only 2 GPU samples" in r for r in few.confidence_reasons)


def test_empty_capture_is_inconclusive():
    d = diagnose(make_capture({}, gpu=None))
    assert d.verdict == Verdict.INCONCLUSIVE
    assert d.confidence == 0
    assert "no signals" in d.headline


def test_memory_full_alone_is_weak():
    d = diagnose(make_capture({"gpu.mem_used_bytes": 0.99 * H100_BYTES, "gpu.busy": 0.8}))
    vram = next(f for f in d.findings if f.code == "VRAM003")
    assert vram.strength < 0.5
    assert d.confidence_label == "low"  # preallocation looks the same: never a confident VRAM verdict


def test_small_batch_decode_names_the_regime_the_gap_and_capacity_apart():
    from diagnoser.diagnosis import Benefit, FixKind, Regime
    from diagnoser.evidence_build import build_evidence

    capture = make_capture(**CASES["latency-small-batch-decode"][0])
    d = diagnose(capture)
    efficiency = build_evidence(capture)["theory.efficiency"].value
    assert d.regime is Regime.MEMORY and "Memory-bound regime at" in d.headline and "of the bandwidth roof" in d.headline
    kinds = {f.kind: f for f in d.fixes}
    tuned = kinds[FixKind.TUNED_ENGINE]
    assert tuned.gain is not None and tuned.gain > 1.5  # far below the ceiling: tuned kernels would gain a lot
    assert tuned.gain <= 1 / efficiency + 1e-9  # never past the floor
    batch = kinds[FixKind.BATCH_MORE]
    assert batch.benefit is Benefit.CAPACITY and batch.gain and batch.gain > 5  # nothing waits: capacity
    assert d.fixes[0].benefit is Benefit.SPEED


def test_fp8_fix_counts_the_time_beyond_the_floor():
    """FP8 weights shorten only the weight reads: a step far from its floor gains 1 / (1 - e + e / ratio)."""
    from diagnoser.evidence_build import build_evidence
    from diagnoser.physics import decode_ceiling_tokens_per_s, get_gpu

    model = llama_7b()
    ceiling = decode_ceiling_tokens_per_s(model, get_gpu("h100-sxm"), batch=1, context=1024)
    ratio = decode_ceiling_tokens_per_s(model, get_gpu("h100-sxm"), batch=1, context=1024, dtype="fp8") / ceiling
    assert 1.8 < ratio < 2.0
    for efficiency in (0.25, 0.9):
        capture = make_capture(**{**CASES["latency-small-batch-decode"][0],
                                  "signals": {**CASES["latency-small-batch-decode"][0]["signals"],
                                              "server.gen_tokens_per_s": efficiency * ceiling,
                                              "server.prompt_tokens_per_s": 0.0}},
                               serving={"mean_context_tokens": 1024})
        assert build_evidence(capture)["theory.efficiency"].values[0] == pytest.approx(efficiency)
        (fix,) = [f for f in diagnose(capture).fixes if f.title == "Serve FP8 weights"]
        # The physics realises it against the attained roofline (90 % of a datasheet bandwidth: a step at 90 % of
        # its ceiling has no time beyond it); far below the roof, close to the closed form 1 / (1 - e + e / r).
        from diagnoser.physics import what_if

        realised = what_if(model, get_gpu("h100-sxm"), "bf16", 1, 1024, new_dtype="fp8",
                           efficiency=efficiency).realised_speedup
        assert fix.gain == pytest.approx(realised, rel=1e-6), fix.basis
        if efficiency < 0.5:
            assert fix.gain == pytest.approx(1 / (1 - efficiency + efficiency / ratio), rel=0.04), fix.basis
        assert f"runs at {efficiency:.0%} of it" in fix.basis
    # Without a measured rate the fix can only quote the ceilings' ratio, and says it is an upper bound.
    bare = make_capture(signals={"gpu.busy": 0.97, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12,
                                 "server.running": 1, "server.waiting": 0}, model=model,
                        serving={"mean_context_tokens": 1024})
    (fix,) = [f for f in diagnose(bare).fixes if f.title == "Serve FP8 weights"]
    assert fix.gain == pytest.approx(ratio, rel=1e-3) and fix.is_upper_bound and "upper bound" in fix.basis


def test_quantised_weights_are_offered_int4_not_fp8_again():
    signals = {"gpu.busy": 0.97, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12, "server.running": 1,
               "server.waiting": 0}
    for dtype, offered in (("fp8", "Serve INT4 weights"), ("int8", "Serve INT4 weights"), ("int4", None)):
        model = ModelInfo(name="7b", params=7e9, layers=32, kv_heads=8, head_dim=128, dtype=dtype)
        titles = {f.title for f in diagnose(make_capture(signals, model=model)).fixes}
        assert "Serve FP8 weights" not in titles, dtype
        assert (offered in titles) if offered else not any(t.startswith("Serve INT4") for t in titles), dtype


def test_kernel_bound_stands_back_for_a_saturated_prefill_and_for_an_idle_gpu():
    prefill = make_capture(signals={"gpu.busy": 0.99, "gpu.tensor_active": 0.2, "server.running": 4,
                                    "server.waiting": 0, "server.gen_tokens_per_s": 40,
                                    "server.prompt_tokens_per_s": 80000}, model=llama_7b())
    d = diagnose(prefill)
    assert d.verdict == "compute" and "LAT001" not in {f.code for f in d.findings}  # model FLOP/s at the peak
    idle = make_capture(signals={"gpu.busy": 0.4, "server.running": 1, "server.waiting": 0,
                                 "server.gen_tokens_per_s": 10}, model=llama_7b())
    assert "LAT001" not in {f.code for f in diagnose(idle).findings}


def test_busy_gpu_with_neither_unit_saturated_is_kernel_bound_in_the_regime_the_counters_show():
    from diagnoser.diagnosis import Regime

    busy_math = make_capture(signals={"gpu.busy": 0.99, "gpu.sm_active": 0.45, "gpu.dram_active": 0.3,
                                      "gpu.tensor_active": 0.4})
    d = diagnose(busy_math)
    assert d.verdict == "latency" and d.regime is Regime.COMPUTE
    assert "Compute-bound regime at 40% of the tensor peak" in d.headline


def test_preemptions_with_a_queue_mean_the_kv_cache_ran_out_whatever_its_sampled_p90():
    # The demo server on a loaded CPU: usage read at 1 Hz swings as sequences are preempted and re-admitted, so its
    # p90 (0.88) misses the moments it was full; the preemption counter does not.
    capture = make_capture({"server.kv_usage": [0.84, 0.91, 0.78, 0.83, 0.67], "server.waiting": [10, 11, 9, 10, 11],
                            "server.running": [6, 5, 6, 6, 4], "server.preemptions_per_s": [1.0, 1.0, 2.0, 1.0]},
                           gpu=None, n=5)
    d = diagnose(capture)
    assert d.verdict == "vram" and d.findings[0].code == "VRAM001", d.headline
    assert "runs out" in d.findings[0].message
    calm = make_capture({"server.kv_usage": [0.84, 0.91, 0.78, 0.83, 0.67], "server.waiting": [10, 11, 9, 10, 11],
                         "server.running": [6, 5, 6, 6, 4], "server.preemptions_per_s": [0.0] * 4}, gpu=None, n=5)
    assert "VRAM001" not in {f.code for f in diagnose(calm).findings}  # a queue alone, cache not full: not VRAM


def test_batch_gain_is_capped_by_the_memory_share_the_server_may_use():
    from diagnoser.evidence_build import build_evidence
    from diagnoser.rules.gains import batch_gain

    signals = {"gpu.busy": 0.9, "server.running": 2, "server.waiting": 20}
    default = build_evidence(make_capture(signals, model=llama_7b(), serving={"mean_context_tokens": 8192}))
    half = build_evidence(make_capture(signals, model=llama_7b(), serving={"mean_context_tokens": 8192,
                                                                         "gpu_memory_utilization": 0.5}))
    g_default, g_half = batch_gain(default, target=64), batch_gain(half, target=64)
    gain_default, basis_default = g_default.value, g_default.basis
    gain_half, basis_half = g_half.value, g_half.basis
    assert gain_default is not None and gain_half is not None and gain_half < gain_default
    assert "capped by the" in basis_default and "(--gpu-memory-utilization)" not in basis_default
    assert "in 50% of memory (--gpu-memory-utilization)" in basis_half


def test_a_throttle_message_keeps_the_share_of_the_window_apart_from_the_mean_clock():
    # Power-capped for 12 of 30 samples (40 %) at 55 % clock, at full clock otherwise: the clock averages
    # 0.4 x 0.55 + 0.6 = 82 % over the window. It was not "held at 82 % for 40 % of the window": it ran at 55 %
    # while capped. The message says the two numbers measured, each for what it is.
    capped = [1.0] * 12 + [0.0] * 18
    clock = [0.55] * 12 + [1.0] * 18
    d = diagnose(make_capture({"gpu.busy": 0.98, "gpu.throttle.power": capped, "gpu.sm_clock_frac": clock,
                               "gpu.dram_active": 0.4, "gpu.tensor_active": 0.35}))
    thr = next(f for f in d.findings if f.code == "THR001")
    assert "for 40% of the window" in thr.message and "averaging 82% of its maximum" in thr.message, thr.message
    assert "at 82%" not in thr.message
    # No power limit was read, so whether the cap was lowered is not known: no gain, only the bound if it was.
    fix = next(f for f in d.fixes if f.rule == "THR001")
    assert fix.gain is None and "up to 1 / 82% clock" in fix.basis, fix.basis


def test_fp8_matmuls_are_not_offered_where_the_weights_already_are_fp8():
    # A compute-bound prefill: the tensor pipes 80 % busy. With BF16 weights FP8 matmuls gain at most
    # 1 / (0.2 + 0.8 / 2) = 1.67x on an H100; with FP8 weights (W8A8 on Hopper) the matmuls already run at the FP8
    # rate, and with INT8 weights at the same rate: nothing to offer, and the report says why.
    counters = {"gpu.busy": 0.97, "gpu.tensor_active": 0.8, "gpu.dram_active": 0.3}
    bf16 = diagnose(make_capture(counters, model=llama_7b()))
    fix = next(f for f in bf16.fixes if f.title == "Run the matmuls in FP8")
    assert fix.gain == pytest.approx(1 / 0.6, rel=1e-3) and "assum" not in fix.basis
    for dtype in ("fp8", "int8"):
        model = llama_7b()
        model.dtype = dtype
        d = diagnose(make_capture(counters, model=model))
        assert d.verdict == "compute"
        assert "Run the matmuls in FP8" not in {f.title for f in d.fixes}, dtype
        held = next(w for w in d.withheld if w.title == "Run the matmuls in FP8")
        assert dtype in held.why


def test_fp8_matmul_gain_says_which_dtype_it_assumed_when_none_is_known():
    # DCGM counters alone (the fleet's case) do not say the dtype: the gain is for BF16/FP16 matmuls, and a server
    # already on FP8 gains nothing. The basis says so instead of presenting the assumption as measured.
    d = diagnose(make_capture({"gpu.busy": 0.97, "gpu.tensor_active": 0.8, "gpu.dram_active": 0.3}))
    fix = next(f for f in d.fixes if f.title == "Run the matmuls in FP8")
    assert fix.is_upper_bound and fix.gain == pytest.approx(1 / 0.6, rel=1e-3)
    assert "assumes" in fix.basis and "FP8 already" in fix.basis, fix.basis
