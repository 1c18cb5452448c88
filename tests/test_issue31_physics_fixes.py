"""Issue 31: precision advice from the GPU's capabilities, batch gains capped by the server's configured limits, MIG
advice that knows the smallest slice, and CLI batch what-ifs that count each request's prefill. Each expectation
is written from the datasheet rates and the recorded numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from diagnoser.capture import KernelStat, TraceSummary, loads
from diagnoser.cli import theory
from diagnoser.diagnosis import Diagnosis, Finding, Fix, FixKind
from diagnoser.evidence_build import build_evidence
from diagnoser.physics import (
    decode_step_s,
    get_gpu,
    load_bundled_model,
    mig_slice,
    prefill_time_s,
    sixteen_bit_dtype,
    what_if,
)
from diagnoser.rules import diagnose, gains
from tests.factories import llama_7b, make_capture

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def _finding(d: Diagnosis, code: str) -> Finding:
    return next(f for f in d.findings if f.code == code)


def _fix(f: Finding, kind: FixKind) -> Fix:
    return next(x for x in f.fixes if x.kind is kind)


# --- item 3: precision advice and rates from the GPU -----------------------------------------------------------

def _fp32_trace(kernels: list[tuple[str, float]], gemm: float, workload: str) -> TraceSummary:
    return TraceSummary(path="t.json", workload=workload, gpu_busy_frac=1.0, kernel_share={"gemm": gemm},
                        top_kernels=[KernelStat(name=n, full_name=n, kind="gemm", share=s) for n, s in kernels])


def _cmp003(gpu: str, kernels: list[tuple[str, float]], gemm: float, workload: str = "training") -> Finding:
    cap = make_capture({"gpu.busy": 1.0}, gpu=gpu, gpu_bytes=None, trace=_fp32_trace(kernels, gemm, workload))
    return _finding(diagnose(cap), "CMP003")


def test_v100_training_gets_fp16_with_a_grad_scaler_at_the_fp16_over_fp32_rate() -> None:
    """V100 SXM2: 125 TFLOP/s FP16 tensor, 15.7 FP32, no BF16 units. 40 % of a busy window in sgemm at x7.96:
    1 / (0.6 + 0.4 / 7.96) = 1.54x, not the 1.25x of a default 2x rate; and fp16 autocast with a GradScaler."""
    f = _cmp003("Tesla V100-SXM2-32GB", [("volta_sgemm_128x64_nn", 0.4)], 0.4)
    fix = _fix(f, FixKind.MIXED_PRECISION)
    assert fix.gain == pytest.approx(1 / (0.6 + 0.4 / (125 / 15.7)), rel=1e-6) and fix.is_upper_bound
    assert "dtype=torch.float16" in fix.action and "GradScaler" in fix.action
    assert "dtype=torch.bfloat16" not in fix.action
    assert sixteen_bit_dtype(get_gpu("v100")) == "fp16" and sixteen_bit_dtype(get_gpu("t4")) == "fp16"


def test_v100_serving_is_told_fp16_not_bf16() -> None:
    fix = _fix(_cmp003("Tesla V100-SXM2-32GB", [("volta_sgemm_128x64_nn", 0.4)], 0.4, "inference"),
               FixKind.MIXED_PRECISION)
    assert "--dtype float16" in fix.action and "--dtype bfloat16" not in fix.action


def test_fp32_pipes_and_tf32_tensor_cores_gain_their_own_rates_on_an_a100() -> None:
    """A100: BF16 312, TF32 156, FP32 19.5 TFLOP/s. A TF32 tensor-op GEMM (s16816) gains 2x on its share; a plain
    sgemm 16x: 40 % of the window gives 1 / (0.6 + 0.2) = 1.25x and 1 / (0.6 + 0.025) = 1.6x."""
    tf32 = _fix(_cmp003("NVIDIA A100-SXM4-80GB", [("ampere_s16816gemm_128x64_tn", 0.4)], 0.4),
                FixKind.MIXED_PRECISION)
    sgemm = _fix(_cmp003("NVIDIA A100-SXM4-80GB", [("ampere_sgemm_128x64_nn", 0.4)], 0.4),
                 FixKind.MIXED_PRECISION)
    assert tf32.gain == pytest.approx(1 / (0.6 + 0.4 / 2), rel=1e-6)
    assert sgemm.gain == pytest.approx(1 / (0.6 + 0.4 / 16), rel=1e-6)


def test_fp32_share_read_from_top_kernels_says_so_and_the_bound_counts_the_gemms_outside_them() -> None:
    """H100: 32 % of busy time in the listed sgemm, 49 % of it in GEMMs overall (a bf16 GEMM of 10 % listed). The
    FP32 share is at least 32 % and at most 32 + (49 - 42) = 39 %; the upper bound prices the 39 % at BF16 over
    FP32 (989.4 / 67): 1 / (0.61 + 0.39 / 14.77)."""
    f = _cmp003("NVIDIA H100 80GB HBM3", [("sm90_sgemm_128x64_nn", 0.32), ("sm90_bf16_s16816gemm_tn", 0.10)], 0.49)
    assert "At least 32% (up to 39%" in f.message
    fix = _fix(f, FixKind.MIXED_PRECISION)
    assert fix.gain == pytest.approx(1 / (0.61 + 0.39 / (989.4 / 67)), rel=1e-6) and fix.is_upper_bound


# --- item 4: batch gains capped by the server's configured limits ------------------------------------------------

def test_demo_kv_fix_is_capped_by_max_num_seqs_and_names_it_as_the_next_fix() -> None:
    """The recorded demo: 6.8 sequences running, 17 waiting, --max-num-seqs 16. More KV memory lets the batch grow to
    16, not 24: at most 16 / 6.8 = 2.36x (a step never gets shorter with more sequences), and raising the limit is
    the next fix."""
    cap = loads((FIXTURES / "nvidia-h100-80gb-hbm3-demo.dgc").read_bytes())
    assert cap.serving.max_num_seqs == 16
    ev = build_evidence(cap)
    batch = ev.observed_batch()
    assert batch is not None and (ev.waiting() or 0) + batch > 16
    fix = _fix(_finding(diagnose(cap), "VRAM001"), FixKind.KV_MEMORY)
    assert fix.gain is not None and 1.0 < fix.gain <= 16 / batch + 1e-6
    assert "--max-num-seqs 16" in fix.action and "next fix" in fix.action
    assert "batch 16 vs" in fix.basis


def _kv_full(serving: dict) -> Diagnosis:
    return diagnose(make_capture({"gpu.busy": 0.9, "server.running": 8, "server.waiting": 40,
                                  "server.kv_usage": 0.99, "gpu.mem_used_frac": 0.3}, model=llama_7b(),
                                 serving={"mean_context_tokens": 2048, **serving}))


def test_batch_gain_stops_at_the_engines_own_limit() -> None:
    """8 running and 40 waiting want 48 sequences; SGLang --max-running-requests 16 lets 16 run; TGI's token budget
    of 24,576 holds 12 sequences of 2,048 tokens."""
    sglang = _fix(_finding(_kv_full({"engine": "sglang", "max_num_seqs": 16}), "VRAM001"), FixKind.KV_MEMORY)
    assert "--max-running-requests 16" in sglang.action and "batch 16 vs 8.0" in sglang.basis
    tgi = _fix(_finding(_kv_full({"engine": "tgi", "max_batch_total_tokens": 24576}), "VRAM001"), FixKind.KV_MEMORY)
    assert "--max-batch-total-tokens 24576" in tgi.action and "batch 12 vs 8.0" in tgi.basis
    unlimited = _fix(_finding(_kv_full({}), "VRAM001"), FixKind.KV_MEMORY)
    assert unlimited.gain is not None and tgi.gain is not None and sglang.gain is not None
    assert tgi.gain < sglang.gain < unlimited.gain and "next fix" not in unlimited.action


def test_fp8_kv_growth_stops_at_the_limit() -> None:
    """A full pool at 8 sequences: FP8 KV fits 16, but --max-num-seqs 12 lets 12 run."""
    ev = build_evidence(make_capture({"gpu.busy": 0.9, "server.running": 8, "server.waiting": 40,
                                      "server.kv_usage": 0.99}, model=llama_7b(),
                                     serving={"mean_context_tokens": 2048, "max_num_seqs": 12}))
    g = gains.kv_dtype_gain(ev, "fp8")
    assert "the batch grows 8 -> 12" in g.basis and "--max-num-seqs 12" in g.basis


def test_a_batch_already_at_the_limit_gets_no_gain_from_a_fix_that_keeps_it() -> None:
    ev = build_evidence(make_capture({"gpu.busy": 0.9, "server.running": 16, "server.waiting": 20},
                                     model=llama_7b(), serving={"mean_context_tokens": 2048, "max_num_seqs": 16}))
    kept = gains.batch_gain(ev, factor=2.0)
    assert kept.value is None and "--max-num-seqs 16" in kept.basis
    raised = gains.batch_gain(ev, factor=2.0, raises_limit=True)
    assert raised.value is not None and raised.value > 1.0


# --- item 7: MIG advice where a smaller slice exists -----------------------------------------------------------

def _idle_action(gpu: str, *, mig_instance: str = "", mig_mode: bool = False) -> str:
    cap = make_capture({"gpu.busy": 0.04}, gpu=gpu, gpu_bytes=None)
    cap.gpus[0].mig_instance, cap.gpus[0].mig_mode = mig_instance, mig_mode
    return _fix(_finding(diagnose(cap), "IDLE001"), FixKind.RIGHT_SIZE).action


def test_smallest_mig_slices_are_not_offered_a_mig_split() -> None:
    # dcgm-exporter: the profile label on the GPU's name; NVML: the MIG device's own name.
    for action in (_idle_action("NVIDIA A30 MIG 1g.6gb", mig_mode=True),
                   _idle_action("NVIDIA H100 80GB HBM3", mig_mode=True,
                                mig_instance="NVIDIA H100 80GB HBM3 MIG 1g.10gb")):
        assert "already the smallest MIG slice" in action and "(MIG, time-slicing)" not in action
    larger = _idle_action("NVIDIA A100-SXM4-40GB MIG 3g.20gb", mig_mode=True)
    assert "smaller MIG profile than 3g.20gb" in larger
    assert "(MIG, time-slicing)" in _idle_action("NVIDIA H100 80GB HBM3")


def test_mig_profiles_are_read_from_names() -> None:
    for name, slices in (("1g.5gb", 1), ("NVIDIA A30 MIG 1g.6gb", 1), ("MIG 1g.12gb", 1), ("MIG 1g.10gb+me", 1),
                         ("MIG 4g.40gb", 4), ("MIG 1c.3g.40gb", 1)):
        found = mig_slice(name)
        assert found is not None and found.compute_slices == slices, name
    assert mig_slice("NVIDIA H100 80GB HBM3") is None


# --- item 10: a CLI batch what-if counts each request's prefill --------------------------------------------------

def _theory_json(*args: str) -> dict:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    result = CliRunner().invoke(app, ["theory", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _by_hand(batch: int, prompt: int, generated: int) -> float:
    """Llama-3.1-8B on an H100 SXM: batch x G tokens over the prompts' prefill and G - 1 decode steps at the mean
    context P + G / 2."""
    model, h100 = load_bundled_model("llama-3.1-8b"), get_gpu("h100-sxm")
    prefill = prefill_time_s(model, h100, batch * prompt, "bf16", sequence_tokens=prompt)
    step = decode_step_s(model, h100, batch, prompt + generated / 2, dtype="bf16")
    return batch * generated / (prefill + (generated - 1) * step)


def test_a_batch_what_if_counts_each_requests_prefill() -> None:
    """2,048-token prompts, 128 generated: batch 1 -> 16 shares the decode's weight reads but not the prefill's
    FLOPs, so the gain is the ratio of whole-request rates, well under the x12.7 of decode alone."""
    (w,) = _theory_json("--model", "llama-3.1-8b", "--vs-batch", "16")["what_ifs"]
    expected = _by_hand(16, 2048, 128) / _by_hand(1, 2048, 128)
    assert w["speedup"] == pytest.approx(expected, rel=1e-6) and expected < 9
    assert w["after_tokens_per_s"] == pytest.approx(_by_hand(16, 2048, 128), rel=1e-6)
    assert "prefill of 2,048 tokens is counted" in w["explanation"]
    longer = _theory_json("--model", "llama-3.1-8b", "--vs-batch", "16", "--gen-tokens", "1024")["what_ifs"][0]
    assert longer["speedup"] == pytest.approx(_by_hand(16, 2048, 1024) / _by_hand(1, 2048, 1024), rel=1e-6)
    assert expected < longer["speedup"]  # longer generations amortise the prefill more


def test_a_batch_what_if_without_a_prompt_is_decode_alone() -> None:
    (w,) = _theory_json("--model", "llama-3.1-8b", "--context", "0", "--vs-batch", "16")["what_ifs"]
    assert w["speedup"] == pytest.approx(16.0, rel=0.05) and "prefill" not in w["explanation"]


def test_the_realised_batch_gain_keeps_the_decode_steps_overhead_and_the_prefill() -> None:
    """At half the decode ceiling the time beyond the roofline stays per decode step; the prefill is still paid, so
    the realised gain stays below what decode alone at the same context would realise."""
    (w,) = _theory_json("--model", "llama-3.1-8b", "--efficiency", "0.5", "--vs-batch", "16")["what_ifs"]
    decode_alone = what_if(load_bundled_model("llama-3.1-8b"), get_gpu("h100-sxm"), "bf16", 1, 2048, new_batch=16,
                           efficiency=0.5).realised_speedup
    assert decode_alone is not None and 1 < w["realised_speedup"] < 0.8 * decode_alone
