import pytest

from diagnoser.capture import ProcessInfo
from diagnoser.errors import InputError
from diagnoser.rules import RULES, diagnose, load_thresholds
from tests.factories import make_capture

BW_CASE = {"gpu.busy": 0.97, "gpu.dram_active": 0.55, "gpu.tensor_active": 0.12}


def test_rule_with_missing_required_signal_is_skipped_with_the_reason():
    cap = make_capture({"gpu.busy": 0.9})
    cap.mark_unavailable("gpm", "gpu.dram_active", "GPM needs a Hopper or newer GPU")
    d = diagnose(cap)
    bw = next(s for s in d.skipped if s.code == "BW001")
    assert "gpu.dram_active" in bw.reason and "Hopper" in bw.reason
    assert {s.code for s in d.skipped} | set(d.passed) | {f.code for f in d.findings} == set(RULES)


def test_every_rule_has_a_page_thresholds_and_a_limiter():
    for rule in RULES.values():
        assert rule.code[:-3].isalpha() and rule.code[-3:].isdigit()
        assert rule.page.detects and rule.page.why and rule.page.fixes and rule.page.sources
        assert rule.thresholds, rule.code
        assert rule.requires, rule.code


def test_thresholds_can_be_overridden_from_toml(tmp_path):
    assert diagnose(make_capture(BW_CASE)).verdict == "memory_bandwidth"
    cfg = tmp_path / "rules.toml"
    cfg.write_text("[thresholds.BW001]\ndram_active_mean = 0.6\n")
    overrides = load_thresholds(cfg)
    assert overrides == {"BW001": {"dram_active_mean": 0.6}}
    d = diagnose(make_capture(BW_CASE), overrides)
    assert "BW001" in d.passed


@pytest.mark.parametrize("text,match", [
    ("[thresholds.XX999]\na = 1\n", "unknown rule"),
    ("[thresholds.BW001]\nnope = 1\n", "has no threshold 'nope'"),
    ("[thresholds.BW001]\ndram_active_mean = 'high'\n", "must be a number"),
    ("[thresholds.BW001\n", "cannot read rules config"),
])
def test_bad_threshold_files(tmp_path, text, match):
    cfg = tmp_path / "rules.toml"
    cfg.write_text(text)
    with pytest.raises(InputError, match=match):
        load_thresholds(cfg)


def test_cpu_only_and_exited_process_are_said():
    cap = make_capture({"gpu.busy": 0.9}, gpu=None)
    cap.cpu_only = True
    cap.process = ProcessInfo(pid=123, exited_at_s=4.2)
    d = diagnose(cap)
    assert d.notes[0].startswith("CPU run: not a GPU verdict")
    assert any("exited 4.2 s into the window" in n for n in d.notes)


def test_fixes_are_ranked_by_expected_gain():
    from diagnoser.diagnosis import Finding, Fix, Limiter
    from diagnoser.rules.engine import _rank_fixes

    weak = Finding("A001", "a", Limiter.COMPUTE, 0.3, "m",
                   fixes=(Fix("big but unsure", "x", 3.0), Fix("modest and sure", "dup", 9.0)))
    strong = Finding("B001", "b", Limiter.BATCHING, 0.9, "m", fixes=(Fix("unknown", "z", None),
                                                                     Fix("modest and sure", "y", 1.8)))
    ranked = [f.title for f in _rank_fixes([strong, weak], strong)]
    # 1 + 0.8 x 0.9 = 1.72 (+0.05 primary) beats 1 + 2 x 0.3 = 1.6, which beats an unknown gain (1 + 0.1 x 0.9);
    # a fix proposed twice keeps its first (strongest) proposal.
    assert ranked == ["modest and sure", "big but unsure", "unknown"]


def test_to_dict_is_json_ready():
    import json

    d = diagnose(make_capture(BW_CASE))
    doc = json.loads(json.dumps(d.to_dict()))
    assert doc["verdict"] == "memory_bandwidth"
    assert doc["findings"][0]["citations"][0]["signal"] == "gpu.dram_active"
    assert doc["schema_version"] == 1
