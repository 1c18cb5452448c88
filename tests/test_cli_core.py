"""`diagnose` and `rules` through typer's runner, and the console script through a real subprocess."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from diagnoser.capture import save
from diagnoser.cli.app import app
from diagnoser.rules import default_rules
from tests.factories import make_capture

runner = CliRunner()
BW = {"gpu.busy": 0.97, "gpu.dram_active": 0.72, "gpu.tensor_active": 0.12, "server.waiting": 0}


@pytest.fixture
def bw_capture(tmp_path):
    return save(make_capture(BW), tmp_path / "bw.dgc")


def test_diagnose_prints_verdict_evidence_and_fixes(bw_capture):
    result = runner.invoke(app, ["diagnose", str(bw_capture)])
    assert result.exit_code == 0, result.output
    assert "MEMORY-BANDWIDTH-LIMITED" in result.output
    assert "gpu.dram_active mean = 72 %" in result.output
    assert "Serve FP8 weights" in result.output


def test_diagnose_json(bw_capture):
    result = runner.invoke(app, ["diagnose", str(bw_capture), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["verdict"] == "memory_bandwidth"
    assert doc["findings"][0]["code"] == "BW001"


@pytest.mark.parametrize("fail_on,code", [("memory_bandwidth", 1), ("vram,compute", 0), ("any", 1),
                                          ("memory-bandwidth", 1)])
def test_fail_on_exit_codes(bw_capture, fail_on, code):
    assert runner.invoke(app, ["diagnose", str(bw_capture), "--fail-on", fail_on]).exit_code == code


def test_fail_on_unknown_limiter_is_a_usage_error(bw_capture):
    result = runner.invoke(app, ["diagnose", str(bw_capture), "--fail-on", "slowness"])
    assert result.exit_code == 2
    assert "unknown limiter" in result.output


def test_rules_config_changes_the_verdict(bw_capture, tmp_path):
    cfg = tmp_path / "r.toml"
    cfg.write_text("[thresholds.BW001]\ndram_active_mean = 0.9\n")
    result = runner.invoke(app, ["diagnose", str(bw_capture), "--rules-config", str(cfg), "--json"])
    assert json.loads(result.output)["verdict"] != "memory_bandwidth"


def test_diagnose_bad_files(tmp_path):
    missing = runner.invoke(app, ["diagnose", str(tmp_path / "nope.dgc")])
    assert missing.exit_code == 2 and "no capture file" in missing.output
    junk = tmp_path / "junk.dgc"
    junk.write_bytes(b"\x1f\x8b\x08\x00\x00")
    bad = runner.invoke(app, ["diagnose", str(junk)])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_rules_lists_every_rule_and_prints_pages():
    listing = runner.invoke(app, ["rules"])
    assert listing.exit_code == 0
    codes = {r.code for r in default_rules()}
    for code in codes:
        assert code in listing.output
    page = runner.invoke(app, ["rules", "vram001"])
    assert page.exit_code == 0
    for heading in ("What it detects", "Why it limits throughput", "How to fix it", "Sources", "Thresholds"):
        assert heading in page.output
    doc = json.loads(runner.invoke(app, ["rules", "--json"]).output)
    assert {r["code"] for r in doc} == codes
    unknown = runner.invoke(app, ["rules", "ZZZ999"])
    assert unknown.exit_code == 2 and "no rule" in unknown.output


def test_console_script_in_a_real_subprocess(bw_capture):
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "diagnoser", "diagnose", str(bw_capture), "--fail-on", "any"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "MEMORY-BANDWIDTH-LIMITED" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "diagnoser", "diagnose", "/nonexistent/x.dgc"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "diagnoser: no capture file at /nonexistent/x.dgc."
    version = subprocess.run([sys.executable, "-m", "diagnoser", "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.stdout.startswith("diagnoser ")


def test_docs_rules_md_is_up_to_date():
    from pathlib import Path

    from diagnoser.cli.rules import rules_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "rules.md"
    assert doc.read_text() == rules_markdown(default_rules()) + "\n", \
        "regenerate: diagnoser rules --markdown > docs/rules.md"


def test_cli_start_does_not_import_torch():
    # The agent on a GPU node must stay light: torch belongs to the hook, demo, calibration and tests only.
    code = "import sys, diagnoser.cli.app; print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_an_unexpected_error_is_one_sentence_not_a_traceback(tmp_path, monkeypatch, capsys):
    # A bug of ours must still end in one sentence and its own exit code (70), never a traceback.
    from diagnoser.capture import save
    from diagnoser.cli.app import main
    from tests.factories import make_capture

    path = save(make_capture({"gpu.busy": 0.5}), tmp_path / "c.dgc")

    def broken(*_a, **_k):
        raise TypeError("unsupported format string passed to NoneType.__format__")

    import diagnoser.pipeline

    monkeypatch.setattr(diagnoser.pipeline.Pipeline, "diagnose", broken)
    monkeypatch.delenv("DIAGNOSER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["diagnose", str(path)])
    assert exit_info.value.code == 70
    err = capsys.readouterr().err.strip()
    assert err.startswith("diagnoser: internal error (TypeError: unsupported format string") and "\n" not in err
    assert "Traceback" not in err


def test_help_and_version_import_no_command_module():
    # Commands load when they run: the root help lists them from cli.app.COMMANDS without importing their code.
    for args in (["--help"], ["--version"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "diagnoser", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
        loaded = sorted(m for m in imported if m.startswith(("diagnoser.cli.", "diagnoser.rules", "diagnoser.collectors",
                                                              "diagnoser.reports", "diagnoser.physics"))
                        and m not in ("diagnoser.cli.app",))
        assert loaded == [], f"{args}: {loaded}"


def test_every_command_summary_is_its_docstring_and_every_module_registers():
    from diagnoser.cli.app import COMMANDS

    for name, (_module, summary) in COMMANDS.items():
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        words = " ".join(result.output.replace("│", " ").split())
        assert " ".join(summary.split()) in words, (name, summary)


def test_rules_finds_a_page_by_the_name_it_lists():
    # `diagnoser rules` lists code and name; the name was refused ("no rule 'kv-cache-full'").
    by_code = runner.invoke(app, ["rules", "VRAM001"])
    by_name = runner.invoke(app, ["rules", "kv-cache-full"])
    assert by_name.exit_code == 0, by_name.output
    assert by_name.output == by_code.output and by_name.output.startswith("# VRAM001 kv-cache-full")
    assert json.loads(runner.invoke(app, ["rules", "kv_cache_full", "--json"]).output)["code"] == "VRAM001"
    unknown = runner.invoke(app, ["rules", "kv-cache-empty"])
    assert unknown.exit_code == 2 and "no rule with the code or name 'kv-cache-empty'" in unknown.output
