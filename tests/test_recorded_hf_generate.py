"""Hugging Face `generate` recorded on an H200 (tests/fixtures/gpu/hf): code nobody on this project wrote. The
expected verdicts and gains were written before the recording (scripts/gpu/EXPECTED.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnoser.capture import load
from diagnoser.compare import compare
from diagnoser.diagnosis import FixKind, GainKind
from diagnoser.pipeline import diagnose_capture
from diagnoser.rules import diagnose
from diagnoser.traces.analysis import analyze_file

HF = Path(__file__).parent / "fixtures" / "gpu" / "hf"


def _diagnose(name: str):  # type: ignore[no-untyped-def]
    return diagnose(load(HF / f"{name}.dgc"))


@pytest.mark.parametrize("name, verdicts", [
    ("hf-eager-b1", ("host_launch",)),
    ("hf-eager-b16", ("host_launch",)),
    ("hf-static-compile-b1", ("latency", "host_launch")),  # host_launch only because it ran 66 % busy (< 70 %)
])
def test_verdicts_as_written_before_the_recording(name: str, verdicts: tuple[str, ...]) -> None:
    d = _diagnose(name)
    assert d.verdict in verdicts, d.headline
    assert d.regime.value in ("memory", "")  # batch 1 and 16 are far below the ridge (~185)


def test_eager_decode_first_fix_is_graphs_or_compile_bounded_by_the_idle_gpu() -> None:
    d = _diagnose("hf-eager-b1")
    first = d.fixes[0]
    assert first.kind in (FixKind.CUDA_GRAPHS, FixKind.TUNED_ENGINE, FixKind.FUSE_KERNELS)
    busy = 1 / 0.0884  # NVML busy over the window
    for fix in d.fixes:
        if fix.kind in (FixKind.CUDA_GRAPHS, FixKind.FUSE_KERNELS, FixKind.OFFLOAD_HOST_WORK):
            # Every fix sized from the launch gaps is host-side: no more than keeping the GPU busy (read 19.6x)
            assert fix.gain is not None and fix.gain <= busy * 1.01 and fix.gain_kind is GainKind.UPPER_BOUND
        if fix.kind in (FixKind.FP8_WEIGHTS, FixKind.INT4_WEIGHTS):
            assert fix.gain is None or fix.gain < 1.2  # GPU time is not on the critical path


def test_the_larger_batch_realised_what_the_physics_predicted() -> None:
    c = compare(diagnose_capture(load(HF / "hf-eager-b1.dgc")), diagnose_capture(load(HF / "hf-eager-b16.dgc")))
    (p,) = [p for p in c.predictions if p.kind is FixKind.BATCH_MORE]
    assert p.applied and p.verdict == "held" and p.realised == pytest.approx(17.96, rel=0.01)


def test_trace_windows_show_the_host_gaps_and_the_graphs() -> None:
    """Eager: ~1,400 kernels in 50 ms, the GPU waiting on the host most of the window, no graph. Compiled: graphs
    replayed, the host's share of the idle down."""
    eager = analyze_file(HF / "hf-eager-b1-50ms.json.gz").summary
    compiled = analyze_file(HF / "hf-static-compile-b1-50ms.json.gz").summary
    assert eager.kernel_count > 1000 and eager.cuda_graph_launches == 0
    assert eager.idle_frac_by_cause["host"] > 0.7
    assert compiled.cuda_graph_launches > 0
    assert compiled.idle_frac_by_cause["host"] < eager.idle_frac_by_cause["host"]
