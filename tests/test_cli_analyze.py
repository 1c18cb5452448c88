"""`diagnoser analyze TRACE`: the printed analysis, --json, --save, --fail-on, --gpu, --model, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diagnoser.capture import load
from diagnoser.cli.app import app

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from tests import traces_workload as w

    return w.profile_generation(tmp_path_factory.mktemp("t") / "gen.json", decode_steps=4)


def _gpu_trace(tmp_path: Path) -> Path:
    """A small launch-bound GPU trace in Kineto's format: 40 short kernels, each launched late."""
    events = []
    for i in range(40):
        t0 = 100.0 * i
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": t0, "dur": 60,
                       "args": {"External id": i}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": t0 + 50, "dur": 8, "args": {"correlation": i}})
        events.append({"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>()",
                       "pid": 0, "tid": 7, "ts": t0 + 60, "dur": 3,
                       "args": {"device": 0, "stream": 7, "correlation": i}})
    path = tmp_path / "launch_bound.json"
    path.write_text(json.dumps({"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                                                       "totalGlobalMem": 85520809984}], "traceEvents": events}))
    return path


def test_analyze_prints_the_analysis_then_the_verdict(tmp_path: Path) -> None:
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path))])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("GPU busy") < out.index("VERDICT")
    assert "host had not launched yet" in out
    assert "Launches: 40 kernels launched one by one" in out
    assert "HOST/LAUNCH-BOUND" in out and "HOST002" in out
    assert "HOST003" in out  # every kernel is shorter than its launch and no CUDA graph is used


def test_analyze_json_has_the_diagnosis_and_the_trace(tmp_path: Path) -> None:
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["verdict"] == "host_launch"
    trace = doc["context"]["trace"]
    assert trace["summary"]["kernel_count"] == 40
    assert trace["summary"]["short_kernel_frac"] == 1.0
    assert trace["timelines"][0]["idle_frac_by_cause"]["host"] > 0.9


def test_fail_on_and_save(tmp_path: Path) -> None:
    saved = tmp_path / "trace.dgc"
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), "--fail-on", "host_launch",
                                 "--save", str(saved)])
    assert result.exit_code == 1
    cap = load(saved)
    assert cap.trace is not None and cap.trace.kernel_count == 40
    assert cap.gpus[0].name == "NVIDIA H100 80GB HBM3" and cap.gpus[0].spec_name == "h100-sxm"
    assert runner.invoke(app, ["diagnose", str(saved), "--fail-on", "compute"]).exit_code == 0


def test_cpu_trace_with_model_and_gpu_override(cpu_trace: Path) -> None:
    result = runner.invoke(app, ["analyze", str(cpu_trace), "--gpu", "H100", "--model", "qwen2.5-0.5b"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "FLOPs:" in out and "ridge" in out and "H100" in out
    assert "Phases (ProfilerStep): 5 steps, 1 prefill-like, 4 decode-like; decode batch 2.0" in out
    assert "skipped: no GPU events" in out


def test_window_option(tmp_path: Path) -> None:
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), "--window", "trace", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["context"]["trace"]["window_policy"] == "profiler window"


@pytest.mark.parametrize("args, code, text", [
    (["--gpu", "Z9000"], 2, "unknown GPU"),
    (["--model", "/nonexistent/config.json"], 2, "no config file"),
    (["--window", "forever"], 2, "unknown window"),
    (["--fail-on", "slowness"], 2, "unknown limiter"),
])
def test_bad_options_are_one_sentence(tmp_path: Path, args: list[str], code: int, text: str) -> None:
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), *args])
    assert result.exit_code == code
    assert text in result.output and "Traceback" not in result.output


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["analyze", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "no trace file" in missing.output
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage-after-the-gzip-magic")
    result = runner.invoke(app, ["analyze", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_console_script_on_a_real_gpu_trace(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("diagnoser")
    done = subprocess.run([str(exe), "analyze", str(FIXTURES / "a100_ddp_2rank_nccl_rank0.json.gz"), "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["verdict"] == "host_launch"
    assert doc["context"]["trace"]["kernels"]["count_by_class"]["comm"] == 21
    assert doc["context"]["trace"]["window_policy"] == "ProfilerSteps (3, last one kept)"


def _flat(text: str) -> str:
    return " ".join(text.split())  # the terminal report wraps at its width


def test_html_report_as_the_docs_say(tmp_path: Path) -> None:
    # docs/reports.md listed `analyze --html`, which did not exist.
    out = tmp_path / "trace.html"
    result = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and "<html" in out.read_text()
    missing = runner.invoke(app, ["analyze", str(_gpu_trace(tmp_path)), "--html", str(tmp_path / "no" / "x.html")])
    assert missing.exit_code == 2 and "--html" in missing.output and "does not exist" in missing.output


def test_numbers_are_printed_as_people_read_them() -> None:
    # They were "1.57e+03 GFLOP, 4.27e+04 MB" for this trace, and a 46 ms window was a "0.0 s window".
    big = runner.invoke(app, ["analyze", str(FIXTURES / "recsys-sampled-2of128" / "rank-0.json.gz")])
    assert big.exit_code == 0, big.output
    flops = next(line for line in big.output.splitlines() if line.startswith("FLOPs:"))
    assert "1.6 TFLOP, 39.8 GiB;" in flops
    assert not re.search(r"\de[+-]\d", big.output), big.output
    short = runner.invoke(app, ["analyze", str(FIXTURES.parent / "gpu" / "hf" / "hf-eager-b1-50ms.json.gz")])
    assert short.exit_code == 0, short.output
    assert "roofs (spec sheet), 46.4 ms window" in _flat(short.output)
    assert "0.0 s window" not in _flat(short.output)
