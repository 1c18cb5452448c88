"""The JSON schema (docs/diagnosis.schema.json) is valid, matches every diagnosis the project produces, rejects
malformed ones, and the suite-wide check in conftest.py fails a test that builds an invalid one."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from diagnoser.capture import save
from diagnoser.diagnosis import Citation, Diagnosis, Finding, Fix, Limiter, Verdict
from diagnoser.reports.jsonout import diagnosis_json, dumps, schema_path
from tests.test_report_cases import LIMITERS, SECRETS, case_diagnosis, fleet_report, hostile_capture

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "diagnosis.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["properties"]["schema_version"]["const"] == 1
    assert schema_path() == ROOT / "docs" / "diagnosis.schema.json"


@pytest.mark.parametrize("limiter", LIMITERS)
def test_every_verdict_validates(limiter: str) -> None:
    _, d = case_diagnosis(limiter)
    data = json.loads(dumps(d))  # strict JSON: dumps refuses NaN and infinities
    VALIDATOR.validate(data)
    assert data["verdict"] == limiter and data["schema_version"] == 1


def test_published_json_is_redacted() -> None:
    from diagnoser.rules import diagnose

    text = dumps(diagnose(hostile_capture()))
    VALIDATOR.validate(json.loads(text))
    for secret in SECRETS.values():
        assert secret not in text


def test_fleet_rows_validate() -> None:
    for row in fleet_report().rows:
        VALIDATOR.validate(diagnosis_json(row.diagnosis))


def _diagnosis(**changes: object) -> Diagnosis:
    finding = Finding("BW002", "decode-at-bandwidth-floor", Limiter.MEMORY_BANDWIDTH, 0.8, "Decode is at the floor.",
                      (Citation("theory.ridge_batch", "value", math.inf, "sequences", "physics"),),
                      (Fix("Serve FP8 weights", "Use FP8.", 1.6, "ceiling ratio", "BW002"),))
    base: dict[str, object] = dict(verdict="memory_bandwidth", confidence=0.8, headline="h", target="t",
                                   findings=[finding], fixes=list(finding.fixes))
    base.update(changes)
    return Diagnosis(**base)  # type: ignore[arg-type]


def test_infinite_numbers_become_null() -> None:
    data = diagnosis_json(_diagnosis())
    assert data["findings"][0]["citations"][0]["value"] is None
    json.dumps(data, allow_nan=False)
    VALIDATOR.validate(data)


@pytest.mark.parametrize("path, bad", [
    (("verdict",), "slow"),
    (("confidence",), 1.5),
    (("secondary",), ["fast"]),
    (("fixes", 0, "gain"), -1.0),
    (("findings", 0, "citations", 0, "stat"), "median"),
    (("findings", 0, "limiter"), "gpu"),
    (("schema_version",), 2),
])
def test_schema_rejects_malformed(path: tuple[object, ...], bad: object) -> None:
    data = diagnosis_json(_diagnosis())
    holder: object = data
    for key in path[:-1]:
        holder = holder[key]  # type: ignore[index]
    holder[path[-1]] = bad  # type: ignore[index]
    errors = list(VALIDATOR.iter_errors(data))
    assert errors and all(tuple(e.absolute_path)[: len(path)] == path for e in errors)


def test_schema_rejects_unknown_and_missing_fields() -> None:
    data = diagnosis_json(_diagnosis())
    assert not VALIDATOR.is_valid({**data, "surprise": 1})
    assert not VALIDATOR.is_valid({k: v for k, v in data.items() if k != "fixes"})


def _run_pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403\n")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_conftest_fails_a_test_that_builds_an_invalid_diagnosis(tmp_path: Path) -> None:
    result = _run_pytest(tmp_path, """
        from diagnoser.diagnosis import Diagnosis

        def test_valid():
            Diagnosis(verdict="idle", confidence=0.5, headline="h", target="t")

        def test_invalid():
            Diagnosis(verdict="idle", confidence=2.0, headline="h", target="t")
    """)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed" in result.stdout
    assert "test_invalid" in result.stdout and "does not match docs/diagnosis.schema.json" in result.stdout


def test_cli_json_output_validates(tmp_path: Path) -> None:
    capture, _ = case_diagnosis("batching")
    path = save(capture, tmp_path / "c.dgc")
    result = subprocess.run([sys.executable, "-m", "diagnoser", "diagnose", str(path), "--json",
                             "--fail-on", "batching"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr  # --fail-on matched
    data = json.loads(result.stdout)
    VALIDATOR.validate(data)
    assert data["verdict"] == "batching"


def test_the_verdict_is_an_enum_of_every_limiter_and_inconclusive_that_serialises_as_before() -> None:
    assert [v.value for v in Verdict] == [lim.value for lim in Limiter] + ["inconclusive"]
    assert all(Verdict.of(lim).limiter is lim for lim in Limiter) and Verdict.INCONCLUSIVE.limiter is None
    assert str(Verdict.HOST_LAUNCH) == f"{Verdict.HOST_LAUNCH}" == "host_launch" == Verdict.HOST_LAUNCH
    for limiter in LIMITERS:
        _, d = case_diagnosis(limiter)
        assert type(d.verdict) is Verdict and d.verdict == limiter
        assert json.loads(dumps(d))["verdict"] == limiter
