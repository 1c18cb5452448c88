"""Real-GPU recordings keep their known verdicts.

tests/fixtures/gpu/manifest.json lists captures that `diagnoser selftest --record tests/fixtures/gpu` made on a real
GPU (see ../shared/gpu-recording.md), each with the verdicts that count as right for its scenario. Every one is
diagnosed here with today's rules, so a change that breaks a verdict on real hardware fails CI, which has no GPU.
Until such recordings exist this module skips, saying how to make them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnoser.capture import load
from diagnoser.diagnosis import INCONCLUSIVE, Limiter
from diagnoser.rules import diagnose
from diagnoser.selftest.record import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"
ENTRIES = load_manifest(FIXTURES)
KNOWN_VERDICTS = {limiter.value for limiter in Limiter} | {INCONCLUSIVE}
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
