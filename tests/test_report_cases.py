"""Captures for the report tests: one per limiter (explicit counter values, as a collector would have recorded them),
a hostile one full of markup and secrets, and a fleet built from them. The tests here check each case diagnoses as
the limiter it stands for, so the report tests that use them exercise every verdict."""

from __future__ import annotations

import math

import pytest

from diagnoser.capture import Capture, ProcessInfo, ServerInfo, ServingConfig, TraceSummary
from diagnoser.diagnosis import Diagnosis
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.rules import diagnose
from diagnoser.signals import spec
from tests.factories import llama_7b, make_capture

N = 120  # samples: a 60 s window at 2 Hz


def wave(base: float, amplitude: float, period: float = 40.0, phase: float = 0.0) -> list[float]:
    """A deterministic wobble around `base`, so charts show movement and statistics stay predictable."""
    return [max(0.0, base + amplitude * math.sin(2 * math.pi * i / period + phase)) for i in range(N)]


def _with_units(capture: Capture) -> Capture:
    """Give each series its signal's unit (the factory guesses from the name; requests are not ratios)."""
    for s in capture.series:
        unit = spec(s.name).unit
        if unit:
            s.unit = unit
    return capture


def _context(capture: Capture) -> Capture:
    capture.target = "pid 4242 (python3 -m vllm.entrypoints.openai.api_server)"
    capture.host = "gpu-node-07"
    capture.process = ProcessInfo(pid=4242, name="python3", user="svc-infer", cmdline=[
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "meta-llama/Llama-2-7b-hf",
        "--max-num-seqs", "256", "--port", "8000"], gpu_indices=[0])
    capture.server = ServerInfo(kind="vllm", url="http://10.0.0.5:8000/metrics", version="0.6.3")
    return capture


def _trace(**fields: object) -> TraceSummary:
    return TraceSummary(path="traces/rank0.pt.trace.json.gz", window_s=5.0, devices=[0], **fields)  # type: ignore[arg-type]


def case_capture(limiter: str) -> Capture:
    """A capture whose diagnosis is `limiter` (a Limiter value, or "inconclusive")."""
    model = llama_7b()
    serving = {"mean_context_tokens": 1024}
    builders = {
        "memory_bandwidth": lambda: make_capture({
            "gpu.busy": wave(0.97, 0.02), "gpu.sm_active": wave(0.86, 0.04), "gpu.dram_active": wave(0.74, 0.05),
            "gpu.tensor_active": wave(0.21, 0.04, phase=1.0), "gpu.mem_used_bytes": 72e9,
            "gpu.power_w": wave(540, 25), "gpu.sm_clock_frac": 0.98, "server.running": wave(8, 2),
            "server.waiting": 0.0, "server.gen_tokens_per_s": wave(900, 60), "server.kv_usage": wave(0.35, 0.05)},
            n=N, model=model, serving=serving),
        "compute": lambda: make_capture({
            "gpu.busy": 0.99, "gpu.sm_active": wave(0.95, 0.02), "gpu.dram_active": wave(0.31, 0.04),
            "gpu.tensor_active": wave(0.76, 0.05), "gpu.power_w": wave(680, 15)}, n=N, model=model,
            trace=_trace(gpu_busy_frac=0.93, idle_frac_by_cause={"host": 0.03, "sync": 0.02},
                         kernel_share={"gemm": 0.71, "attention": 0.16, "norm_elementwise": 0.08, "memcpy": 0.02,
                                       "other": 0.03}, kernel_count=48211, intensity_flop_per_byte=410.0,
                         achieved_flops=5.1e14, cuda_graph_launches=120)),
        "vram": lambda: make_capture({
            "gpu.busy": 0.9, "gpu.mem_used_bytes": 78e9, "server.kv_usage": wave(0.96, 0.03),
            "server.waiting": wave(5, 2), "server.running": wave(30, 3),
            "server.preemptions_per_s": [0.0] * 100 + [0.5] * 20}, n=N, model=model, serving=serving),
        "batching": lambda: make_capture({
            "gpu.busy": wave(0.3, 0.08), "gpu.sm_active": wave(0.25, 0.08), "server.waiting": wave(6, 3),
            "server.running": wave(2, 1), "server.kv_usage": wave(0.2, 0.04),
            "server.gen_tokens_per_s": wave(420, 60)}, n=N, model=model, serving=serving),
        "host_launch": lambda: make_capture({
            "gpu.busy": wave(0.45, 0.05), "host.target_busiest_thread": wave(0.97, 0.02)}, n=N,
            trace=_trace(gpu_busy_frac=0.55, idle_frac_by_cause={"host": 0.3, "sync": 0.1},
                         kernel_share={"gemm": 0.5, "attention": 0.2, "norm_elementwise": 0.2, "memcpy": 0.1},
                         kernel_count=12000, intensity_flop_per_byte=40.0, achieved_flops=1e14,
                         short_kernel_frac=0.7)),
        "throttling": lambda: make_capture({
            "gpu.busy": 0.95, "gpu.sm_clock_frac": [0.98] * 40 + [0.7] * 80,
            "gpu.throttle.power": [0.0] * 40 + [1.0] * 80, "gpu.power_w": [400.0] * 40 + [498.0] * 80,
            "gpu.power_limit_w": 500.0}, n=N),
        "interconnect": lambda: make_capture({"gpu.busy": wave(0.9, 0.03)}, n=N, trace=_trace(
            gpu_busy_frac=0.9, kernel_share={"comm": 0.45, "gemm": 0.4, "other": 0.15}, kernel_count=9000)),
        "idle": lambda: make_capture({"gpu.busy": wave(0.04, 0.02), "server.waiting": 0.0,
                                      "server.running": wave(0.5, 0.3), "gpu.power_w": wave(90, 5)}, n=N),
        "errors": lambda: make_capture({"gpu.busy": 0.8, "gpu.xid_errors": [0.0] * 60 + [1.0] * 60}, n=N),
        "inconclusive": lambda: make_capture({}, n=N, gpu="Some Unknown GPU"),
    }
    capture = _context(_with_units(builders[limiter]()))
    if limiter != "inconclusive":
        capture.mark_unavailable("dcgm", "gpu.nvlink_tx_bps", "no dcgm-exporter endpoint was given",
                                 "run dcgm-exporter and pass --dcgm-exporter URL")
    return capture


LIMITERS = ("vram", "memory_bandwidth", "compute", "batching", "host_launch", "throttling", "interconnect", "idle",
            "errors", "inconclusive")

XSS_SCRIPT = "<script>window.__xss=1</script>"
XSS_IMG = '"><img src=x onerror="window.__xss=2">'
XSS_SVG = "</text></svg><svg onload=\"window.__xss=3\">"
KERNEL = "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)"
SECRETS = {"sk": "sk-proj-4f9Qx8TzLw2Rk7Vn3Hb6", "hf": "hf_AbCdEfGhIjKlMnOpQrStUvWx", "pass": "s3cr3tPa55"}


def hostile_capture() -> Capture:
    """Every string a capture can carry, filled with markup and secrets."""
    capture = case_capture("compute")
    capture.target = f"pid 4242 {XSS_SCRIPT} {XSS_IMG}"
    capture.host = f"node{XSS_SVG}"
    capture.process = ProcessInfo(pid=4242, name=f"py{XSS_SCRIPT}", user=XSS_IMG, cmdline=[
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--api-key", SECRETS["sk"],
        f"--served-model-name={XSS_SCRIPT}", f"HF_TOKEN={SECRETS['hf']}",
        f"--download-dir=https://admin:{SECRETS['pass']}@models.internal/llama"])
    capture.server = ServerInfo(kind="vllm", url=f"http://admin:{SECRETS['pass']}@10.0.0.5:8000/metrics",
                                version=XSS_IMG)
    capture.serving = ServingConfig(mean_context_tokens=1024, quantization=XSS_SCRIPT,
                                    extra={XSS_SCRIPT: XSS_IMG, "env": f"HF_TOKEN={SECRETS['hf']}"})
    assert capture.trace is not None and capture.model is not None
    capture.model.name = f"llama{XSS_SCRIPT}"
    capture.trace.path = f"/traces/{XSS_IMG}.json"
    capture.trace.kernel_share = {**capture.trace.kernel_share, KERNEL: 0.05, XSS_SCRIPT: 0.01}
    capture.trace.skipped = [f"kernel {KERNEL} has no shapes", XSS_SVG]
    for s in capture.series:
        s.labels = {**s.labels, "pod": f"vllm-{XSS_SCRIPT}", "container": XSS_IMG}
    capture.gpus[0].uuid = XSS_IMG
    capture.notes.append(f"launched with --api-key {SECRETS['sk']} by {XSS_SCRIPT}")
    capture.mark_unavailable(f"dcgm{XSS_SCRIPT}", XSS_IMG, f"endpoint https://user:{SECRETS['pass']}@dcgm:9400 "
                             f"refused {XSS_SVG}", f"set HF_TOKEN={SECRETS['hf']} {XSS_IMG}")
    return capture


def fleet_report(hostile: bool = False) -> FleetReport:
    """A fleet of nine GPUs on three nodes, one per limiter but inconclusive, priced at $2.50 per GPU-hour."""
    rows = []
    stake = {"idle": 2.4, "batching": 1.75, "host_launch": 1.4, "memory_bandwidth": 0.6, "vram": 0.9,
             "compute": 0.1, "throttling": 0.5, "interconnect": 0.7, "errors": 2.5}
    for i, limiter in enumerate(name for name in LIMITERS if name != "inconclusive"):
        d = diagnose(case_capture(limiter))
        top = d.fixes[0].gain if d.fixes else None
        pod = f"vllm-{XSS_SCRIPT}" if hostile and i == 0 else f"llama-7b-{i:02d}"
        rows.append(FleetRow(node=f"gpu-node-{i // 3 + 1:02d}", gpu=str(i % 3), uuid=f"GPU-{i:08x}",
                             model_name="NVIDIA H100 80GB HBM3", diagnosis=d, pod=pod, namespace="serving",
                             container=XSS_IMG if hostile and i == 0 else "vllm",
                             usd_per_hour_at_stake=stake[limiter], top_fix_gain=top, partial=limiter == "errors",
                             usd_per_gpu_hour=2.5, frac_at_stake=stake[limiter] / 2.5, busy=0.04 + 0.1 * i))
    source = f"http://admin:{SECRETS['pass']}@prometheus:9090" if hostile else "http://prometheus:9090"
    return FleetReport(source=source, window_start=1_700_000_000.0, window_end=1_700_003_600.0, rows=rows,
                       usd_per_gpu_hour=2.5, errors=["node gpu-node-04: dcgm-exporter scrape timed out (3 of 60 "
                                                     "samples missing)"], query_seconds=1.8)


def case_diagnosis(limiter: str) -> tuple[Capture, Diagnosis]:
    capture = case_capture(limiter)
    return capture, diagnose(capture)


@pytest.mark.parametrize("limiter", LIMITERS)
def test_each_case_diagnoses_as_its_limiter(limiter: str) -> None:
    _, d = case_diagnosis(limiter)
    assert d.verdict == limiter, d.headline
    if limiter != "inconclusive":
        assert d.confidence >= 0.45
        assert d.fixes


def test_hostile_capture_still_diagnoses_and_carries_its_payloads() -> None:
    capture = hostile_capture()
    d = diagnose(capture)
    assert d.verdict == "compute"
    assert XSS_SCRIPT in d.target and SECRETS["sk"] in " ".join(capture.process.cmdline)  # type: ignore[union-attr]


def test_fleet_has_a_row_per_limiter() -> None:
    report = fleet_report()
    assert {r.diagnosis.verdict for r in report.rows} == set(LIMITERS) - {"inconclusive"}


# --- the report model, as the tests reach it ------------------------------------------------------------------

def report_of(d, capture, ev=None):  # type: ignore[no-untyped-def]
    """The Report of a capture and its diagnosis (what every renderer takes)."""
    from diagnoser.evidence_build import build_evidence
    from diagnoser.reports.model import build_report

    return build_report(capture, ev if ev is not None else build_evidence(capture), d)


def render_html(d, capture, ev=None) -> str:  # type: ignore[no-untyped-def]
    from diagnoser.reports.html import HtmlRenderer

    return HtmlRenderer().render(report_of(d, capture, ev))


def write_html(d, capture, path):  # type: ignore[no-untyped-def]
    from diagnoser.reports import html

    return html.write_html(report_of(d, capture), path)


def render_fleet_html(report) -> str:  # type: ignore[no-untyped-def]
    from diagnoser.reports.html import HtmlRenderer
    from diagnoser.reports.model import build_fleet_view

    return HtmlRenderer().render_fleet(build_fleet_view(report))


def write_fleet_html(report, path):  # type: ignore[no-untyped-def]
    from diagnoser.reports import html
    from diagnoser.reports.model import build_fleet_view

    return html.write_fleet_html(build_fleet_view(report), path)
