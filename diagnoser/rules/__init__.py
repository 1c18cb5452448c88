"""The rules: each a code, a name, a page, thresholds and a predicate over the evidence (base.py); the rule set that
runs them (ruleset.py); the engine that weighs their findings into a diagnosis (engine.py) and the judge that checks
and ranks the fixes they propose (judge.py)."""

from __future__ import annotations

from pathlib import Path

from diagnoser.rules.base import AnyOf, Check, Gain, Page, Rule, Threshold, rule
from diagnoser.rules.engine import diagnose, diagnose_evidence
from diagnoser.rules.ruleset import RuleResults, RuleSet, default_rules, load_overrides

# Codes earlier versions had, and what replaced them: `diagnoser rules CODE` says so instead of "no such rule".
RETIRED = {
    "BW003": "LAT001 and the regime: an intensity below the ridge names the regime (memory-bound work), not whether "
             "HBM is saturated; BW001/BW002 decide saturation, LAT001 the gap below the roof.",
    "BW004": "LAT001: a small-batch decode that keeps the GPU busy below its bandwidth roof is kernel-bound in the "
             "memory regime (BW002 when it reaches the roof).",
    "CMP002": "the regime and CMP001: an intensity above the ridge names the regime, not saturation.",
    "BAT004": "LAT001: a busy GPU whose SMs and DRAM are mostly idle is kernel-bound, whatever the model.",
}


def get_rule(code: str) -> Rule | None:
    return default_rules().get(code)


def load_thresholds(path: str | Path) -> dict[str, dict[str, float]]:
    """Threshold overrides from a TOML file, checked against the shipped rules."""
    return load_overrides(path, default_rules())


__all__ = ["AnyOf", "Check", "Gain", "Page", "RETIRED", "Rule", "RuleResults", "RuleSet", "Threshold", "default_rules",
           "diagnose", "diagnose_evidence", "get_rule", "load_overrides", "load_thresholds", "rule"]
