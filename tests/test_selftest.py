"""`diagnoser selftest`: the harness end to end on the CPU (real workload processes with their own /metrics, the
real attach path, real diagnoses, labelled as CPU runs), the scenario sizing, the model's KV-cache logic, the
physics checks on explicit numbers, and the GPU fixture manifest."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from diagnoser import physics
from diagnoser.capture import load
from diagnoser.errors import InputError
from diagnoser.evidence_build import build_evidence
from diagnoser.reports.selftest_text import render
from diagnoser.selftest.harness import (
    BATCH_GAIN_AGREEMENT,
    CPU_VERDICT_NOTE,
    DECODE_EFFICIENCY,
    ScenarioResult,
    SelftestReport,
    batch_gain_check,
    efficiency_check,
    quantisation_gain_check,
    run_selftest,
    scenario_names,
)
from diagnoser.selftest.record import load_manifest, record_fixtures
from diagnoser.selftest.scenarios import DEFAULT_ORDER, SCENARIOS, SHAPES, plan
from tests.factories import llama_7b, make_capture

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_harness_end_to_end_on_cpu(tmp_path):
    """Real workload processes, attached to and diagnosed through the library call the CLI makes."""
    out = tmp_path / "run"
    report, captures = run_selftest(["decode-b1", "kv-full", "prefill", "decode-fp8"], device="cpu", window_s=3.0,
                                    trace_s=0.0, out_dir=out)
    assert report.cpu_run and report.failed == []
    results = {r.scenario: r for r in report.results}
    assert list(results) == ["decode-b1", "kv-full", "prefill", "decode-fp8"]
    for (name, r), capture in zip(results.items(), captures, strict=True):
        assert r.error == "" and r.skipped == "", (name, r)
        # Never passed off as a GPU result: no pass/fail, and the verdict says so.
        assert r.passed is None and r.shown_verdict.endswith(f"({CPU_VERDICT_NOTE})")
        assert r.measured_tokens_per_s and r.measured_tokens_per_s > 0 and r.ceiling_tokens_per_s is None
        saved = load(r.capture_path)
        assert saved.cpu_only and saved.model is not None and saved.model.name == "selftest-toy"
        assert saved.server is not None and saved.server.kind == "vllm"
        assert saved.process is not None and saved.process.pid > 0
        assert saved.serving.selftest_scenario == name
        assert capture is not None and capture.target == saved.target
        # Each workload stopped cleanly on SIGTERM and wrote its own totals.
        assert r.stats["steps"] > 0 and r.stats["elapsed_s"] > 0
    # The one verdict server metrics alone can support: every KV slot taken while requests wait.
    assert results["kv-full"].verdict == "vram"
    ev = build_evidence(load(results["kv-full"].capture_path))
    assert ev["server.kv_usage"].p90 >= 0.9 and ev["server.waiting"].mean >= 1
    # Batch 1 decode has a KV pool larger than its batch: not a full cache, nothing waiting.
    ev = build_evidence(load(results["decode-b1"].capture_path))
    assert ev["server.kv_usage"].max < 0.5 and ev["server.waiting"].max == 0
    assert results["prefill"].rate == "prompt"
    # FP8 weights through torch._scaled_mm on the CPU: the model says so, the KV cache keeps the activations' dtype.
    fp8 = load(results["decode-fp8"].capture_path).model
    assert fp8 is not None and (fp8.dtype, fp8.kv_dtype) == ("fp8", "fp32")
    assert {c.name.split(":")[0] for c in report.checks} == {"decode-b1", "prefill", "FP8 weights"}
    assert all(c.ok is None and "CPU run" in c.note for c in report.checks)

    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["cpu_run"] is True and doc["results"][1]["shown_verdict"] == f"vram ({CPU_VERDICT_NOTE})"
    text = io.StringIO()
    render(report, Console(file=text, width=160, no_color=True))
    shown = text.getvalue()
    assert f"vram ({CPU_VERDICT_NOTE})" in shown and "n/a (CPU)" in shown and "Harness OK on the CPU" in shown
    assert "WRONG" not in shown and "passed" not in shown


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("diagnoser.tracing.acquire") is None,
                    reason="live trace acquisition (diagnoser.tracing.acquire) is not in this build")
def test_trace_window_through_the_hook(tmp_path):
    """The workload imports diagnoser.hook, so the window also gets a torch.profiler trace, analysed into evidence."""
    report, (capture,) = run_selftest(["decode-b1"], device="cpu", window_s=3.0, trace_s=1.0, out_dir=tmp_path)
    (result,) = report.results
    assert result.error == "" and result.trace.startswith("trace "), result.trace
    assert capture is not None and capture.trace is not None and capture.trace.window_s > 0
    assert load(result.capture_path).trace is not None


def test_cli_runs_and_skips_gpu_only_scenarios_on_cpu(tmp_path):
    proc = _run_cli("selftest", "--device", "cpu", "--scenarios", "throttled", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert CPU_VERDICT_NOTE in proc.stdout and "skipped: needs a GPU" in proc.stdout


def test_record_refuses_cpu_runs_and_bad_options(tmp_path):
    proc = _run_cli("selftest", "--device", "cpu", "--scenarios", "nope", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "unknown scenario(s) nope" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run_cli("selftest", "--device", "cpu", "--record", str(tmp_path / "fx"), timeout=60)
    assert proc.returncode == 2 and "a CPU run is not a GPU fixture" in proc.stderr  # refused before running
    assert not (tmp_path / "fx").exists()
    proc = _run_cli("selftest", "--device", "cpu", "--compile", "--record", str(tmp_path / "fx"), timeout=60)
    assert proc.returncode == 2 and "run --compile without it" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(InputError, match="a CPU run is not a GPU recording"):
        record_fixtures(SelftestReport(device="cpu"), [], tmp_path, command="x")


def test_scenarios_are_sized_to_the_gpu():
    assert scenario_names("") == list(DEFAULT_ORDER)
    assert scenario_names("prefill, kv-full") == ["prefill", "kv-full"]
    for free in (14 * GIB, 20 * GIB, 75 * GIB, 135 * GIB):
        for name in ("decode-b1", "decode-b16", "prefill", "kv-full", "host-bound"):
            p = plan(name, device="cuda", free_bytes=free)
            assert 1e9 <= p.shape.params() <= 3e9, (name, free)  # a 1-3B decoder, as the issue asks
            assert p.dtype == "bf16"
            assert p.shape.params() * 2 < free / 2  # weights leave room for the KV cache and activations
    assert plan("decode-b1", device="cuda", free_bytes=75 * GIB).graph  # decode replays CUDA graphs on a GPU
    launch = plan("launch", device="cuda", free_bytes=75 * GIB)
    assert launch.shape.params() < 50e6 and not launch.graph and launch.clients > launch.batch
    b16 = plan("decode-b16", device="cuda", free_bytes=75 * GIB)
    assert b16.batch == 16 and b16.kv_slots > b16.batch
    assert plan("kv-full", device="cuda", free_bytes=75 * GIB).fill_memory > 0.5
    for name in SCENARIOS:  # every CPU run is toy-sized, whatever size was asked for
        if not SCENARIOS[name].gpu_only:
            assert plan(name, device="cpu", size="auto").shape == SHAPES["toy"]


def test_shape_parameter_counts_match_the_model():
    from diagnoser.selftest.model import Decoder

    for shape in SHAPES.values():
        for fp8 in (False, True):
            model = Decoder(shape, device="meta", fp8=fp8)
            assert sum(p.numel() for p in model.parameters()) == shape.params()


def test_fp8_plan_and_weights():
    import torch

    from diagnoser.selftest.model import FP8, Decoder

    p = plan("decode-fp8", device="cuda", free_bytes=75 * GIB)
    assert (p.weights, p.weight_dtype, p.dtype, p.batch, p.graph) == ("fp8", "fp8", "bf16", 1, True)
    assert p.shape == plan("decode-b1", device="cuda", free_bytes=75 * GIB).shape  # the same model, other bytes
    torch.manual_seed(0)
    model = Decoder(SHAPES["toy"], fp8=True)
    layer = model.blocks()[0]
    stored = layer.gate.weight
    assert stored.dtype == FP8 and 0.5 < stored.float().std() < 1.5  # N(0, 1) over the scale: e4m3's sweet range
    # Each layer's seven matrices take one byte per weight; norms, embeddings and the head keep the model's dtype.
    fp8_bytes = sum(p.numel() for p in model.parameters() if p.dtype == FP8)
    s = SHAPES["toy"]
    assert fp8_bytes == s.params() - 2 * s.vocab * s.hidden - s.hidden - s.layers * 2 * s.hidden


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_steps_agree_with_a_full_prefill(fp8):
    """The static KV cache is right: decoding token by token picks what a fresh prefill of the whole sequence picks."""
    import torch

    from diagnoser.selftest.model import Decoder, DecodeRunner, KvCache

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = SHAPES["toy"]
    model = Decoder(shape, fp8=fp8)
    pool = KvCache.allocate(shape, slots=5, max_ctx=32, device="cpu", dtype=torch.float32)
    runner = DecodeRunner(model, pool.first(3), graph=False)
    prompts = torch.randint(0, shape.vocab, (3, 6))
    runner.start([0, 1, 2], prompts)
    sequences = [prompts[i].tolist() + [int(runner.tokens[i])] for i in range(3)]
    for _ in range(5):
        runner.step()
        for i in range(3):
            sequences[i].append(int(runner.tokens[i]))
    assert runner.positions.tolist() == [11, 11, 11]
    for seq in sequences:
        assert int(model.prefill(torch.tensor([seq[:-1]]))[0]) == seq[-1]
    assert pool.k[:, 3:].abs().sum() == 0  # slots beyond the batch untouched


@pytest.mark.slow
def test_compiled_decode_picks_the_same_tokens():
    """`selftest --compile` runs the decode step through torch.compile: the same tokens as eager, and the static KV
    cache updated in place (the compiled step must not work on a copy)."""
    import torch

    from diagnoser.selftest.model import Decoder, DecodeRunner, KvCache

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = SHAPES["toy"]
    model = Decoder(shape)
    pool = KvCache.allocate(shape, slots=2, max_ctx=32, device="cpu", dtype=torch.float32)
    prompts = torch.randint(0, shape.vocab, (2, 6))
    runs = []
    for compiled in (False, True):
        cache = KvCache(pool.k.clone(), pool.v.clone())
        runner = DecodeRunner(model, cache, graph=False, compiled=compiled)
        runner.start([0, 1], prompts)
        tokens = []
        for _ in range(4):
            runner.step()
            tokens.append(runner.tokens.tolist())
        runs.append((tokens, cache.k[:, :, :, 6:10].abs().sum().item()))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] > 0 and runs[1][1] == pytest.approx(runs[0][1], rel=1e-4)  # the decoded tokens' K written


# --- physics checks on explicit numbers ---------------------------------------------------------------------------

def _gpu_result(name: str, measured: float, ceiling: float | None, batch: float = 1) -> ScenarioResult:
    model = llama_7b()
    return ScenarioResult(name, SCENARIOS[name].expected, measured_tokens_per_s=measured,
                          ceiling_tokens_per_s=ceiling, batch=batch, context=1024,
                          model={k: getattr(model, k) for k in model.__struct_fields__})


def test_decode_efficiency_check():
    low, high = DECODE_EFFICIENCY
    ok = efficiency_check("decode-b1", _gpu_result("decode-b1", 350.0, 500.0), DECODE_EFFICIENCY)
    assert ok.ok is True and "70%" in ok.note
    faster_than_physics = efficiency_check("decode-b1", _gpu_result("decode-b1", 500 * (high + 0.1), 500.0),
                                           DECODE_EFFICIENCY)
    assert faster_than_physics.ok is False
    assert efficiency_check("decode-b1", _gpu_result("decode-b1", 500 * low * 0.5, 500.0), DECODE_EFFICIENCY).ok \
        is False
    cpu = _gpu_result("decode-b1", 350.0, None)
    cpu.cpu_run = True
    assert efficiency_check("decode-b1", cpu, DECODE_EFFICIENCY).ok is None
    assert efficiency_check("decode-b1", None, DECODE_EFFICIENCY).ok is None


def test_batch_gain_check_against_what_if():
    spec = physics.get_gpu("h100-sxm")
    predicted = physics.what_if(llama_7b(), spec, batch=1, context=1024, new_batch=16).speedup
    assert predicted is not None and 10 < predicted < 16  # memory-bound: nearly linear, KV bytes take a little
    b1 = _gpu_result("decode-b1", 100.0, None)
    agreeing = batch_gain_check(b1, _gpu_result("decode-b16", 100.0 * predicted * 0.95, None, batch=16), spec)
    assert agreeing.ok is True and agreeing.predicted == pytest.approx(predicted)
    lo = BATCH_GAIN_AGREEMENT[0]
    off = batch_gain_check(b1, _gpu_result("decode-b16", 100.0 * predicted * lo * 0.8, None, batch=16), spec)
    assert off.ok is False and off.measured == pytest.approx(predicted * lo * 0.8)
    assert batch_gain_check(b1, None, spec).ok is None
    assert batch_gain_check(b1, _gpu_result("decode-b16", 900.0, None, batch=16), None).ok is None


def test_quantisation_gain_check():
    # decode-b1 at 40 % of a 1000 tok/s ceiling (2.5 ms a token, floor 1 ms); FP8 halves the floor to 0.5 ms. If
    # the 1.5 ms beyond the floor stays, the step becomes 2.0 ms: 1.25x, not the ceilings' 2x.
    base, quantised = _gpu_result("decode-b1", 400.0, 1000.0), _gpu_result("decode-fp8", 500.0, 2000.0)
    check = quantisation_gain_check(base, quantised)
    assert check.ok is True and check.predicted == pytest.approx(1.25) and check.measured == pytest.approx(1.25)
    assert "ceilings' ratio is 2.00x" in check.note
    lo = BATCH_GAIN_AGREEMENT[0]
    slow = quantisation_gain_check(base, _gpu_result("decode-fp8", 400.0 * 1.25 * lo * 0.9, 2000.0))
    assert slow.ok is False
    # A step at its floor gains the whole ratio; one measured above its ceiling cannot be predicted from.
    assert quantisation_gain_check(_gpu_result("decode-b1", 1000.0, 1000.0),
                                   _gpu_result("decode-fp8", 1900.0, 2000.0)).predicted == pytest.approx(2.0)
    assert quantisation_gain_check(_gpu_result("decode-b1", 2500.0, 1000.0),
                                   _gpu_result("decode-fp8", 2600.0, 2000.0)).ok is None
    assert quantisation_gain_check(base, None).ok is None
    skipped = _gpu_result("decode-fp8", 0.0, None)
    skipped.skipped = "needs FP8 tensor cores"
    assert quantisation_gain_check(base, skipped).note == "needs decode-b1 and decode-fp8"


def test_a_scenario_the_device_cannot_run_is_skipped(tmp_path, monkeypatch):
    """The workload says so in its ready file (FP8 weights on a GPU older than Ada) and exits; the report skips it."""
    from diagnoser.selftest import harness

    script = ("import json, os, sys; p = sys.argv[sys.argv.index('--ready-file') + 1]; "
              "json.dump({'pid': os.getpid(), 'scenario': 'decode-fp8', 'skipped': 'needs FP8 tensor cores "
              "(compute capability 8.9 or newer: Ada, Hopper, Blackwell); this GPU is 8.0'}, open(p, 'w'))")
    monkeypatch.setattr(harness, "_workload_command",
                        lambda name, **kw: [sys.executable, "-c", script, "--ready-file", str(kw["ready"])])
    report, captures = run_selftest(["decode-fp8"], device="cpu", window_s=1.0, trace_s=0.0, out_dir=tmp_path)
    (result,) = report.results
    assert result.skipped.startswith("needs FP8 tensor cores") and result.error == "" and captures == [None]
    assert report.failed == [] and result.shown_verdict == "skipped"


def test_report_failures_count_only_gpu_verdicts():
    wrong = _gpu_result("decode-b1", 1.0, None)
    wrong.verdict, wrong.passed = "compute", False
    report = SelftestReport(device="cuda", results=[wrong])
    assert report.failed == ["decode-b1: expected latency or memory_bandwidth, got compute"]
    cpu = _gpu_result("decode-b1", 1.0, None)
    cpu.verdict, cpu.cpu_run = "inconclusive", True
    assert SelftestReport(device="cpu", results=[cpu]).failed == []
    broken = ScenarioResult("prefill", ("compute",), error="the workload exited with code 1")
    assert SelftestReport(device="cpu", results=[broken]).failed == ["prefill: the workload exited with code 1"]


def test_recorded_fixtures_manifest_round_trip(tmp_path):
    """The manifest `selftest --record` writes is what tests/test_recorded_gpu_captures.py reads."""
    from diagnoser.capture import save

    capture = make_capture({"gpu.busy": 0.95, "gpu.dram_active": 0.75, "gpu.tensor_active": 0.1,
                            "server.running": 1, "server.waiting": 0}, model=llama_7b())
    source = save(capture, tmp_path / "decode-b1.dgc")
    result = _gpu_result("decode-b1", 420.0, 600.0)
    result.verdict, result.confidence, result.passed, result.capture_path = "memory_bandwidth", 0.8, True, str(source)
    report = SelftestReport(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", driver="550.54.15",
                            roofs="spec sheet", results=[result])
    folder = tmp_path / "fixtures"
    written = record_fixtures(report, [capture], folder, command="diagnoser selftest --record x")
    assert [p.name for p in written] == ["nvidia-h100-80gb-hbm3-decode-b1.dgc"]
    (entry,) = load_manifest(folder)
    assert entry["expected"] == ["latency", "memory_bandwidth"] and entry["gpu"] == "NVIDIA H100 80GB HBM3"
    assert entry["observed"]["tokens_per_s"] == 420.0 and entry["observed"]["gpu.dram_active"] == 0.75
    assert load(folder / entry["capture"]).gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert entry["trace"] == ""  # no trace was taken for this one
    record_fixtures(report, [capture], folder, command="again")  # re-recording replaces, never duplicates
    assert len(load_manifest(folder)) == 1


def test_recording_keeps_a_short_window_of_the_scenario_trace(tmp_path):
    # A real H100 trace window stands in for the 2 s trace the scenario took: recording cuts 30 ms out of it.
    from diagnoser.capture import save
    from diagnoser.traces import analyze_trace

    capture = make_capture({"gpu.busy": 0.95, "server.running": 1}, model=llama_7b())
    result = _gpu_result("decode-b1", 420.0, 600.0)
    result.verdict, result.passed = "memory_bandwidth", True
    result.capture_path = str(save(capture, tmp_path / "decode-b1.dgc"))
    result.trace_path = str(Path(__file__).parent / "fixtures" / "gpu" / "traces" / "h100-decode-b1-30ms.json.gz")
    report = SelftestReport(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", results=[result])
    record_fixtures(report, [capture], tmp_path / "fx", command="x")
    (entry,) = load_manifest(tmp_path / "fx")
    kept = tmp_path / "fx" / entry["trace"]
    assert entry["trace"] == "traces/nvidia-h100-80gb-hbm3-decode-b1-30ms.json.gz" and kept.is_file()
    summary = analyze_trace(kept).summary
    assert 0 < summary.window_s <= 0.03 + 0.003  # 30 ms, plus the launches kept from just before it
    assert summary.kernel_count > 1000 and summary.cuda_graph_launches >= 1


def test_selftest_refuses_a_busy_gpu(tmp_path):
    from diagnoser.collectors import nvml_seam
    from diagnoser.errors import SourceUnavailable
    from tests.fake_nvml import FakeGpu, FakeNvml, FakeProcess

    with nvml_seam.use(FakeNvml([FakeGpu(processes=[FakeProcess(pid=4242)], util_gpu=0)])):
        with pytest.raises(SourceUnavailable, match="busy with pid 4242"):
            run_selftest(["decode-b1"], device="cuda", out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before any workload started
