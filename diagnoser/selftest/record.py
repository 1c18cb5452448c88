"""The real-GPU corpus: captures recorded by `diagnoser selftest --record DIR` on a GPU, each with its known verdict.

DIR/manifest.json lists the fixtures; tests/test_recorded_gpu_captures.py diagnoses every capture it lists and
asserts the expected verdict, so each later change is checked against real hardware. Each entry records what
../shared/gpu-recording.md asks for: GPU model, driver, torch version, the command, and what was observed (tokens/s,
utilisations) next to what the verdict said at recording time.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from diagnoser import signals as S
from diagnoser.capture import Capture
from diagnoser.errors import InputError
from diagnoser.evidence_build import build_evidence
from diagnoser.fileio import write_atomic
from diagnoser.selftest.harness import SelftestReport
from diagnoser.traces.decode import TraceError
from diagnoser.traces.trim import trim_trace

MANIFEST = "manifest.json"
TRACES = "traces"  # trimmed trace windows, beside the captures
FORMAT_NAME = "diagnoser-gpu-fixtures"
FORMAT_VERSION = 1
# Observed numbers kept beside each fixture, as window means.
_OBSERVED = (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_TENSOR_ACTIVE, S.GPU_DRAM_ACTIVE, S.GPU_MEM_USED_FRAC,
             S.GPU_POWER_W, S.GPU_SM_CLOCK_FRAC, S.HOST_TARGET_BUSIEST_THREAD, S.SERVER_RUNNING, S.SERVER_WAITING,
             S.SERVER_KV_USAGE)


def load_manifest(folder: Path) -> list[dict[str, Any]]:
    """The fixtures listed in folder/manifest.json; none when the file is absent."""
    path = folder / MANIFEST
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the fixture manifest {path}: {exc}.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise InputError(f"{path} is not a diagnoser GPU fixture manifest.")
    fixtures = data.get("fixtures", [])
    if not isinstance(fixtures, list):
        raise InputError(f"{path}: 'fixtures' must be a list.")
    return fixtures


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _observed(capture: Capture) -> dict[str, float]:
    ev = build_evidence(capture)
    return {name: round(ev[name].mean, 4) for name in _OBSERVED if name in ev}


def _keep_trace_window(src: str, dst: Path) -> str:
    """A 30 ms window of the scenario's trace (the whole one is hundreds of MB), as a path relative to the fixture
    folder; "" when there is no trace or it cannot be cut."""
    if not src or not Path(src).is_file():
        return ""
    try:
        trim_trace(Path(src), dst, window_ms=30.0)
    except TraceError:
        return ""
    return f"{TRACES}/{dst.name}"


def record_fixtures(report: SelftestReport, captures: list[Capture | None], folder: Path, *,
                    command: str) -> list[Path]:
    """Copy each scenario's capture into `folder` and add (or replace) its manifest entry. GPU runs only."""
    if report.cpu_run:
        raise InputError("a CPU run is not a GPU recording.")
    folder.mkdir(parents=True, exist_ok=True)
    fixtures = {f["capture"]: f for f in load_manifest(folder)}
    written = []
    gpu = _slug(report.gpu_name or "gpu")
    for result, capture in zip(report.results, captures, strict=True):
        if capture is None or result.error or result.skipped or not result.capture_path:
            continue
        name = f"{gpu}-{result.scenario}.dgc"
        shutil.copyfile(result.capture_path, folder / name)
        written.append(folder / name)
        trace = _keep_trace_window(result.trace_path, folder / TRACES / f"{gpu}-{result.scenario}-30ms.json.gz")
        fixtures[name] = {
            "capture": name,
            "scenario": result.scenario,
            "expected": list(result.expected),
            "verdict_at_recording": result.verdict,
            "confidence_at_recording": round(result.confidence, 3),
            "gpu": report.gpu_name,
            "driver": report.driver,
            "roofs": report.roofs,
            "torch": str(result.stats.get("torch") or ""),
            "model": result.model.get("name", ""),
            "command": command,
            "trace": trace,
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "observed": {"tokens_per_s": result.measured_tokens_per_s, "ceiling_tokens_per_s":
                         result.ceiling_tokens_per_s, "rate": result.rate, **_observed(capture)},
        }
    body = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "fixtures": sorted(fixtures.values(), key=lambda f: f["capture"])}
    write_atomic(folder / MANIFEST, (json.dumps(body, indent=2) + "\n").encode())
    return written
