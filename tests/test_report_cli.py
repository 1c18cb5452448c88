"""`diagnoser report` and `diagnose --html`, run as real processes: the file is written, errors are one sentence
with exit code 2, and --fail-on still decides the exit code after the report is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diagnoser.capture import save
from tests.test_report_cases import SECRETS, case_capture, hostile_capture


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def capture_file(tmp_path: Path) -> Path:
    return save(case_capture("memory_bandwidth"), tmp_path / "run.dgc")


def test_report_command_writes_the_file(capture_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "r.html"
    # A folder that is not there is refused in one sentence, and not created (a typo must not make folders).
    missing = run("report", str(capture_file), "-o", str(out))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    assert not out.parent.exists()
    out.parent.mkdir()
    result = run("report", str(capture_file), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert "memory-bandwidth-limited" in result.stderr
    page = out.read_text()
    assert 'data-verdict="memory_bandwidth"' in page and 'data-chart="roofline"' in page


def test_report_defaults_next_to_the_capture(capture_file: Path) -> None:
    result = run("report", str(capture_file))
    assert result.returncode == 0, result.stderr
    assert capture_file.with_suffix(".html").is_file()


def test_diagnose_html_with_fail_on(capture_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.html"
    result = run("diagnose", str(capture_file), "--html", str(out), "--fail-on", "memory_bandwidth")
    assert result.returncode == 1  # the verdict matched --fail-on ...
    assert out.is_file() and "Memory-bandwidth-limited" in out.read_text()  # ... and the report was written first
    assert "\x1b" not in result.stdout and result.stdout.startswith("VERDICT MEMORY-BANDWIDTH-LIMITED")
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_report_redacts_a_real_capture_file(tmp_path: Path) -> None:
    path = save(hostile_capture(), tmp_path / "hostile.dgc")
    out = tmp_path / "hostile.html"
    assert run("report", str(path), "-o", str(out)).returncode == 0
    page = out.read_text()
    for secret in SECRETS.values():
        assert secret not in page


@pytest.mark.parametrize("make_bad, message", [
    (lambda d: d / "missing.dgc", "no capture file at"),
    (lambda d: (d / "cut.dgc").write_bytes(b"\x1f\x8b\x08\x00garbage") and d / "cut.dgc", "not a readable capture"),
    (lambda d: (d / "plain.dgc").write_text("hello") and d / "plain.dgc", "not a diagnoser capture"),
])
def test_bad_capture_is_one_sentence_and_exit_2(tmp_path: Path, make_bad: object, message: str) -> None:
    bad = make_bad(tmp_path)  # type: ignore[operator]
    result = run("report", str(bad), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("diagnoser:")]
    assert len(said) == 1 and said[0].endswith(".")
    assert not (tmp_path / "x.html").exists()


def test_unwritable_output_keeps_the_capture(capture_file: Path, tmp_path: Path) -> None:
    before = capture_file.read_bytes()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    result = run("report", str(capture_file), "-o", str(blocker / "r.html"))
    assert result.returncode == 2 and "is not a folder" in result.stderr
    assert "Traceback" not in result.stderr
    refused = run("report", str(capture_file), "-o", str(capture_file))
    assert refused.returncode == 2 and "would overwrite the capture" in refused.stderr
    assert capture_file.read_bytes() == before


@pytest.mark.parametrize("option", ["-o", "--output"])
def test_an_unwritable_output_is_named_by_the_option_given(capture_file: Path, tmp_path: Path, option: str) -> None:
    # The error named --html, an option `report` does not have.
    out = tmp_path / "missing" / "r.html"
    result = run("report", str(capture_file), option, str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"diagnoser: {option} {out}: the folder {out.parent} does not exist; create it "
                                     "first or pick another path.")
