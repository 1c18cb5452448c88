"""`compare` under another host load, a loss under an upper bound, and a KV size set where the engine's default ran
before (issue 32, item 12)."""

from __future__ import annotations

from pathlib import Path

from diagnoser import signals as S
from diagnoser.capture import Capture, Series, load
from diagnoser.compare import LOSS, Measure, Prediction, _judge, compare
from diagnoser.diagnosis import FixKind
from diagnoser.pipeline import diagnose_capture
from diagnoser.reports.compare import build_compare_view, render_html, terminal_lines

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
B1, FP8 = (GPU / f"nvidia-h100-80gb-hbm3-{n}.dgc" for n in ("decode-b1", "decode-fp8"))


def _with_host(c: Capture, others: float, cores: float = 8.0, wait: float | None = None) -> Capture:
    n = 8
    times = [float(i) for i in range(n)]
    c.series.append(Series(name=S.HOST_OTHERS_CPU, unit="cores", source="psutil", times=times, values=[others] * n))
    c.series.append(Series(name=S.HOST_CORES, unit="cores", source="psutil", times=times, values=[cores] * n))
    if wait is not None:
        c.series.append(Series(name=S.HOST_TARGET_CPU_WAIT, unit="ratio", source="psutil", times=times,
                               values=[wait] * n))
    return c


def test_a_gain_under_another_host_load_is_not_graded_and_the_load_is_said() -> None:
    before = diagnose_capture(_with_host(load(B1), others=0.2))
    after = diagnose_capture(_with_host(load(FP8), others=6.0))
    c = compare(before, after)
    (load_said,) = [x for x in c.confounders if "host's load" in x]
    assert "other processes used 0.2 -> 6.0 of the host's 8 cores" in load_said
    (p,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert p.applied and not p.graded and p.verdict.startswith("not checked")  # "held" before
    assert not any("held to the physics" in line for line in build_compare_view(c).summary)
    text = "\n".join(terminal_lines(c))
    assert "host's load changed" in text and ": held" not in text
    assert "verdict-tag ok" not in render_html(c)


def test_the_servers_own_cpu_wait_moving_with_the_fix_is_not_a_host_load_change() -> None:
    """A fix that lets the server batch more keeps its own threads busier: their run-queue wait moves with the fix
    (vLLM's CPU build oversubscribes two cores on its own), while the others' load stays the same."""
    before = diagnose_capture(_with_host(load(B1), others=1.0, wait=0.02))
    after = diagnose_capture(_with_host(load(FP8), others=1.0, wait=0.40))
    c = compare(before, after)
    assert not any("host's load" in x for x in c.confounders), c.confounders


def test_a_similar_host_load_still_grades() -> None:
    before = diagnose_capture(_with_host(load(B1), others=0.2))
    after = diagnose_capture(_with_host(load(FP8), others=0.9))
    c = compare(before, after)
    assert not c.confounders
    (p,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert p.verdict == "held"


def test_a_drop_under_an_upper_bound_is_a_loss_not_within_the_bound() -> None:
    """A 49 % throughput drop read "within the bound" (a x1.6 upper bound) and "held to the physics", in green."""
    p = Prediction(FixKind.FUSE_KERNELS, "Fuse the small kernels", 1.6, "upper_bound", "speed", True)
    rate = Measure(S.SERVER_GEN_TOKENS_PER_S, "1/s", 200.0, 102.0)
    judged = _judge(p, rate, [])
    assert judged.verdict == LOSS and judged.graded
    assert _judge(p, Measure(S.SERVER_GEN_TOKENS_PER_S, "1/s", 200.0, 190.0), []).verdict == "within the bound"


def test_a_kv_size_set_where_the_engine_default_ran_counts_as_applied() -> None:
    a, b = load(B1), load(B1)
    a.serving.engine = b.serving.engine = "vllm"
    b.serving.gpu_memory_utilization = 0.95  # before: not on the command line, vLLM's default
    b.target = "after"
    c = compare(diagnose_capture(a), diagnose_capture(b))
    (ch,) = [ch for ch in c.changes if ch.what == "serving.gpu_memory_utilization"]
    assert ch.fix is FixKind.KV_MEMORY and ch.before == "engine default" and ch.after == "0.95"
    # A setting whose absence says nothing (no engine read) stays unknown: no fix laid on it.
    a.serving.engine = b.serving.engine = ""
    c = compare(diagnose_capture(a), diagnose_capture(b))
    (ch,) = [ch for ch in c.changes if ch.what == "serving.gpu_memory_utilization"]
    assert ch.fix is None
