"""Real-GPU recordings keep their known verdicts.

tests/fixtures/gpu/manifest.json lists captures that `diagnoser selftest --record tests/fixtures/gpu` made on a real
GPU (see ../shared/gpu-recording.md), each with the verdicts that count as right for its scenario. Every one is
diagnosed here with today's rules, so a change that breaks a verdict on real hardware fails CI, which has no GPU.
Until such recordings exist this module skips, saying how to make them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diagnoser.capture import load
from diagnoser.diagnosis import Verdict
from diagnoser.rules import diagnose
from diagnoser.selftest.record import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"
ENTRIES = load_manifest(FIXTURES)
KNOWN_VERDICTS = {v.value for v in Verdict}
NONE_YET = ("no real-GPU recordings in tests/fixtures/gpu yet: run `diagnoser selftest --record tests/fixtures/gpu` "
            "on a GPU machine (../shared/gpu-recording.md)")


def _id(entry: dict) -> str:
    return str(entry.get("capture", "?"))


@pytest.mark.skipif(not ENTRIES, reason=NONE_YET)
@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_recorded_capture_keeps_its_verdict(entry):
    capture = load(FIXTURES / entry["capture"])
    assert not capture.cpu_only and capture.gpus, "a GPU fixture must come from a GPU"
    diagnosis = diagnose(capture)
    if entry.get("xfail"):
        pytest.xfail(f"known wrong on real hardware: {entry['xfail']}")
    assert diagnosis.verdict in entry["expected"], (
        f"{entry['capture']} ({entry.get('gpu')}, scenario {entry.get('scenario')}): expected "
        f"{' or '.join(entry['expected'])}, diagnosed {diagnosis.verdict}: {diagnosis.headline}")


@pytest.mark.skipif(not ENTRIES, reason=NONE_YET)
def test_manifest_entries_are_complete():
    for entry in ENTRIES:
        assert (FIXTURES / entry["capture"]).is_file(), f"manifest lists a missing capture: {entry['capture']}"
        assert entry["expected"] and set(entry["expected"]) <= KNOWN_VERDICTS, entry["capture"]
        for field in ("gpu", "driver", "command", "scenario"):
            assert entry.get(field), f"{entry['capture']} has no {field}"


def _entry(scenario: str) -> dict | None:
    return next((e for e in ENTRIES if e.get("scenario") == scenario), None)


@pytest.mark.skipif(_entry("decode-fp8") is None or _entry("decode-b1") is None,
                    reason="needs the decode-b1 and decode-fp8 recordings")
def test_fp8_fix_predicts_the_gain_measured_on_the_gpu():
    """The bf16 decode's "Serve FP8 weights" fix against what FP8 weights did on the same GPU and model: 1.12x
    measured. The ceilings' ratio (1.97x) assumes a step at its floor; this one ran at 33 % of it."""
    from diagnoser.evidence_build import build_evidence
    from diagnoser.selftest.harness import BATCH_GAIN_AGREEMENT

    b1, fp8 = (load(FIXTURES / _entry(name)["capture"]) for name in ("decode-b1", "decode-fp8"))
    (fix,) = [f for f in diagnose(b1).fixes if f.title == "Serve FP8 weights"]
    rates = [build_evidence(c)["server.gen_tokens_per_s"].mean for c in (b1, fp8)]
    measured = rates[1] / rates[0]
    assert 1.0 < measured < 1.5
    assert fix.gain is not None and "at the ceiling" in fix.basis
    low, high = BATCH_GAIN_AGREEMENT
    assert low <= measured / fix.gain <= high, (measured, fix.gain, fix.basis)
    ceiling_ratio = float(re.search(r"x([0-9.]+) at the ceiling", fix.basis).group(1))  # type: ignore[union-attr]
    assert measured / ceiling_ratio < low  # what the fix said before it counted the time beyond the floor
    # Serving FP8 already, the next step down is INT4, not FP8 again.
    titles = [f.title for f in diagnose(fp8).fixes]
    assert "Serve FP8 weights" not in titles and "Serve INT4 weights" in titles
