import math

from diagnoser.capture import Series, TraceSummary
from diagnoser.evidence import Signal
from diagnoser.evidence_build import build_evidence
from tests.factories import H100_BYTES, llama_7b, make_capture


def test_signal_statistics():
    s = Signal("x", "ratio", ("nvml",), tuple(float(v) for v in range(11)))
    assert s.mean == 5.0
    assert s.p50 == 5.0
    assert math.isclose(s.p90, 9.0)
    assert s.frac_above(8) == 3 / 11
    assert s.frac_below(2) == 2 / 11
    assert s.stat("frac_above:10") == 1 / 11


def test_missing_signal_stays_missing_and_says_why():
    cap = make_capture({"gpu.busy": 0.5})
    cap.mark_unavailable("gpm", "gpu.dram_active", "GPM is not supported on this GPU", "Hopper or newer")
    ev = build_evidence(cap)
    assert "gpu.dram_active" not in ev
    assert "gpu.tensor_active" not in ev
    assert ev.why_missing("gpu.dram_active") == "gpm: GPM is not supported on this GPU"
    assert ev.why_missing("server.waiting") == "not collected in this capture"


def test_family_unavailability_explains_members():
    cap = make_capture({}, gpu=None)
    cap.mark_unavailable("nvml", "gpu.*", "no NVIDIA driver on this machine")
    assert build_evidence(cap).why_missing("gpu.busy") == "nvml: no NVIDIA driver on this machine"


def test_series_of_several_gpus_are_pooled():
    cap = make_capture({})
    for gpu, value in (("0", 0.2), ("1", 0.8)):
        cap.series.append(Series(name="gpu.busy", unit="ratio", source="nvml", times=[0, 1], values=[value] * 2,
                                 labels={"gpu": gpu}))
    busy = build_evidence(cap)["gpu.busy"]
    assert busy.n == 4 and math.isclose(busy.mean, 0.5)


def test_nan_samples_are_not_zeros():
    ev = build_evidence(make_capture({"gpu.busy": [float("nan"), 0.6, 0.8]}, n=3))
    assert ev["gpu.busy"].n == 2


def test_memory_fraction_is_derived_from_bytes_and_gpu_size():
    ev = build_evidence(make_capture({"gpu.mem_used_bytes": H100_BYTES * 0.5}))
    assert math.isclose(ev["gpu.mem_used_frac"].mean, 0.5)


def test_trace_summary_becomes_signals():
    trace = TraceSummary(window_s=2.0, gpu_busy_frac=0.6, idle_frac_by_cause={"host": 0.25, "sync": 0.1},
                         kernel_share={"gemm": 0.5, "memcpy": 0.05, "memset": 0.01}, kernel_count=400,
                         short_kernel_frac=0.7, intensity_flop_per_byte=40.0)
    ev = build_evidence(make_capture({}, trace=trace))
    assert math.isclose(ev["trace.gpu_idle_frac"].values[0], 0.4)
    assert ev["trace.idle.host_frac"].values[0] == 0.25
    assert math.isclose(ev["trace.share.memcpy"].values[0], 0.06)
    assert ev["trace.kernels_per_s"].values[0] == 200.0
    assert ev["trace.cuda_graph_launches"].values[0] == 0.0
    assert "trace.share.comm" not in ev  # not in the summary: absent, not zero
    assert "trace.decode_batch" not in ev


def test_physics_signals_need_a_known_gpu_and_model():
    ev = build_evidence(make_capture({"server.running": 4, "server.gen_tokens_per_s": 300}, model=llama_7b()))
    assert 280 < ev["theory.ridge_flop_per_byte"].values[0] < 310  # H100 BF16: 989 TFLOP/s / 3.35 TB/s
    assert math.isclose(ev["theory.weight_bytes"].values[0], 6.74e9 * 2)
    ceiling = ev["theory.decode_ceiling_tokens_per_s"].values[0]
    # Weights only at context 0; a step reads one embedding row per sequence, not the whole 32,000 x 4,096 table.
    assert math.isclose(ceiling, 4 * 3.35e12 / ((6.74e9 - 32000 * 4096) * 2 + 4 * 4096 * 2), rel_tol=0.01)
    assert math.isclose(ev["theory.efficiency"].values[0], 300 / ceiling)

    unknown = build_evidence(make_capture({"server.running": 4}, gpu="Some Future GPU", model=llama_7b()))
    assert "theory.ridge_flop_per_byte" not in unknown
    assert any("not in the physics table" in n for n in unknown.notes)


def test_energy_and_cost_signals():
    ev = build_evidence(make_capture({"server.gen_tokens_per_s": 700.0, "gpu.power_w": 350.0},
                                     serving={"usd_per_gpu_hour": 2.5}))
    assert math.isclose(ev["energy.tokens_per_joule"].values[0], 2.0)
    assert math.isclose(ev["energy.usd_per_million_tokens"].values[0], 2.5 / (700 * 3600) * 1e6)
    assert "energy.tokens_per_joule" not in build_evidence(make_capture({"gpu.power_w": 350.0}))


def test_window_statistics_make_evidence_through_build_evidence():
    """The fleet's GPUs: signals from a time-series engine's statistics, no samples. build_evidence adds the physics
    of the GPU's model (made once per model) and characterises the regime, as for a capture."""
    from diagnoser.capture import GpuInfo
    from diagnoser.evidence import Meta
    from diagnoser.evidence_build import WindowSignals

    gpu = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=H100_BYTES)
    physics: dict = {}
    evs = []
    for busy in (0.95, 0.05):
        signals = {"gpu.busy": Signal.from_stats("gpu.busy", "ratio", ("dcgm",), mean=busy, n=60),
                   "gpu.dram_active": Signal.from_stats("gpu.dram_active", "ratio", ("dcgm",), mean=0.8 * busy, n=60)}
        meta = Meta(target="node-1 GPU 0", window_s=3600.0, origin="fleet", gpus=(gpu,))
        evs.append(build_evidence(WindowSignals(meta, signals), physics=physics))
    assert len(physics) == 1  # one model, its physics made once
    busy, idle = evs
    assert busy.signals["gpu.busy"].mean == 0.95 and idle.signals["gpu.busy"].mean == 0.05
    assert busy.gpu_spec is not None and busy.gpu_spec is idle.gpu_spec
    assert busy.meta.origin == "fleet" and busy.meta.gpus == (gpu,)
    physics_only = build_evidence(make_capture({}, gpu=gpu.name, gpu_bytes=H100_BYTES))
    assert physics_only.signals and set(physics_only.signals) <= set(busy.signals)  # the capture path's physics
    assert busy.regime is not None
