"""The agent's configuration: durations, targets, the TOML file, flags over the file, and one-sentence errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from diagnoser.agent.config import (
    build_config,
    parse_duration,
    parse_fraction,
    parse_target,
    validate,
)
from diagnoser.cli.app import app
from diagnoser.errors import InputError


@pytest.mark.parametrize("text, seconds", [
    ("15m", 900.0), ("10s", 10.0), ("1h30m", 5400.0), ("500ms", 0.5), ("30d", 2592000.0), ("2w", 1209600.0),
    ("90", 90.0), (" 2 m ", 120.0), (7, 7.0), (0.25, 0.25),
])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["15 minutes", "m15", "10x", "", "-5", "1h-3m", True])
def test_bad_durations_are_one_sentence(text: object) -> None:
    with pytest.raises(InputError) as err:
        parse_duration(text, "--every")  # type: ignore[arg-type]
    assert str(err.value).startswith("--every must") and "\n" not in str(err.value)


def test_fractions() -> None:
    assert parse_fraction("10%") == pytest.approx(0.1)
    assert parse_fraction(0.25) == 0.25
    for bad in ("150%", "-1", "ten"):
        with pytest.raises(InputError):
            parse_fraction(bad)


@pytest.mark.parametrize("text, expect", [
    ("8000", {"name": "port-8000", "port": 8000}),
    ("port:8001", {"name": "port-8001", "port": 8001}),
    ("pid:1234", {"name": "pid-1234", "pid": 1234}),
    ("llama=pid:1234", {"name": "llama", "pid": 1234}),
    ("10.0.0.5:8000", {"name": "10.0.0.5-8000", "port": 8000, "host": "10.0.0.5"}),
    ("match:vllm serve", {"name": "match-vllm-serve", "match": "vllm serve"}),
    ("url:http://gpu-node:8000/metrics", {"name": "gpu-node-8000", "metrics_url": "http://gpu-node:8000/metrics"}),
    ("http://gpu-node:9000/metrics", {"metrics_url": "http://gpu-node:9000/metrics"}),
])
def test_targets_from_flags(text: str, expect: dict[str, object]) -> None:
    spec = parse_target(text)
    for key, value in expect.items():
        assert getattr(spec, key) == value


@pytest.mark.parametrize("text", ["pid:abc", "port:70000", "match:([", "bogus", "url:ftp://x", "bad name=8000"])
def test_bad_targets(text: str) -> None:
    with pytest.raises(InputError):
        parse_target(text)


CONFIG = """
[agent]
every = "5m"
jitter = "20%"
window = "20s"
max_parallel = 2

[history]
db = "{db}"
retention = "7d"
max_db_mb = 64

[reports]
keep = 5

[metrics]
textfile = "{tmp}/diagnoser.prom"

[notify]
webhook = "http://127.0.0.1:9/hook"
notify_inconclusive = true

[sources]
dcgm_exporter = "http://127.0.0.1:9400/metrics"

[[targets]]
name = "llama"
port = 8000
window = "30s"
labels = {{ pod = "llama-0" }}
model = "llama-2-7b"

[[targets]]
match = "sglang"

[thresholds.VRAM001]
kv_usage_p90 = 0.9
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text.format(db=tmp_path / "h.db", tmp=tmp_path))
    return path


def test_file_sets_everything(tmp_path: Path) -> None:
    cfg = build_config(_write(tmp_path, CONFIG))
    assert (cfg.every_s, cfg.jitter, cfg.window_s, cfg.max_parallel) == (300.0, pytest.approx(0.2), 20.0, 2)
    # Beside a history not named history.db, its reports get a folder of their own (keyed by its name).
    assert cfg.db_path == tmp_path / "h.db" and cfg.reports_dir == tmp_path / "reports-h.db"
    assert (cfg.retention_s, cfg.max_db_bytes, cfg.keep_reports) == (7 * 86400, 64 << 20, 5)
    assert cfg.textfile == tmp_path / "diagnoser.prom" and cfg.metrics_port is None  # the textfile instead
    assert cfg.webhook == "http://127.0.0.1:9/hook" and cfg.notify_inconclusive
    assert cfg.sources.dcgm_exporter == "http://127.0.0.1:9400/metrics" and cfg.sources.nvml
    llama, sglang = cfg.targets
    assert (llama.name, llama.port, llama.window_s, llama.labels, llama.model) == \
        ("llama", 8000, 30.0, {"pod": "llama-0"}, "llama-2-7b")
    assert sglang.match == "sglang" and sglang.name == "match-sglang"
    assert cfg.timeout_for(llama) == 30.0 + cfg.grace_s
    assert not cfg.discovering  # targets given, discovery not asked for
    # The file's own [thresholds] table is the rules config, checked by the rule engine's loader.
    assert cfg.thresholds_path == tmp_path / "agent.toml"
    validate(cfg)


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = build_config(_write(tmp_path, CONFIG), {"agent.every": "1m", "metrics.port": 9999, "targets": ["8080"]})
    assert cfg.every_s == 60.0 and cfg.metrics_port == 9999 and cfg.textfile == tmp_path / "diagnoser.prom"
    assert [t.name for t in cfg.targets] == ["port-8080"]


def test_defaults_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    cfg = build_config(None, {})
    assert (cfg.every_s, cfg.jitter, cfg.window_s, cfg.metrics_port, cfg.metrics_addr) == \
        (900.0, 0.1, 10.0, 9464, "127.0.0.1")
    assert cfg.db_path == tmp_path / "state" / "history.db" and cfg.discovering


@pytest.mark.parametrize("text, words", [
    ("[agent]\nevery = 'soon'\n", "agent.every must be a duration"),
    ("[agnet]\nevery = '1m'\n", "unknown section(s) agnet"),
    ("[agent]\nevry = '1m'\n", "unknown key(s) evry"),
    ("[[targets]]\nname = 'x'\n", "needs pid, port, match or metrics_url"),
    ("[[targets]]\npid = 1\nport = 2\n", "one of pid, port or match"),
    ("[[targets]]\nport = 1\nname='a'\n[[targets]]\nport = 2\nname='a'\n", "a appears more than once"),
    ("[thresholds.NOPE001]\nx = 1\n", "unknown rule NOPE001"),
    ("[[targets]]\nport = 1\nmodel = 'no-such-model'\n", "no config file or bundled model"),
    ("not toml [", "is not valid TOML"),
])
def test_bad_files_say_what_is_wrong(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        validate(build_config(path))
    assert words in str(err.value)


def test_cli_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\nevery = 'soon'\n")
    result = CliRunner().invoke(app, ["agent", "--once", "--config", str(path)])
    assert result.exit_code == 2
    assert "agent.every must be a duration" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["agent", "--once", "--config", str(tmp_path / "missing.toml")])
    assert result.exit_code == 2 and "no agent config at" in result.output


def test_jitter_spreads_the_schedule(tmp_path: Path) -> None:
    import random

    from diagnoser.agent.loop import Agent

    cfg = build_config(None, {"agent.every": "100s", "agent.jitter": "10%", "history.db": str(tmp_path / "h.db"),
                              "metrics.port": 0})
    agent = Agent(cfg, rng=random.Random(5))
    try:
        firsts = [agent.first_delay() for _ in range(200)]
        assert all(0 <= d <= 10 for d in firsts) and max(firsts) - min(firsts) > 5
        nexts = [agent.next_delay(cycle_seconds=20) for _ in range(200)]
        # The interval is measured start to start: a 20 s cycle leaves 70..90 s of sleep.
        assert all(70 <= d <= 90 for d in nexts) and max(nexts) - min(nexts) > 10
        assert agent.next_delay(cycle_seconds=500) == 0  # a cycle longer than the interval: start the next now
    finally:
        agent.close()
    assert not list(tmp_path.glob(".agent-work-*"))
