"""The rule set. Importing this package registers every rule (see base.RULES)."""

# Import order is the listing order: VRAM first (if it does not fit nothing else helps), then the roofs, load,
# host and hardware, then the serving engine's own metrics.
from diagnoser.rules import memory, roofs, load, host, hardware, serving  # noqa: F401, I001  (registers the rules)
from diagnoser.rules.base import RULES, Page, Rule, Threshold
from diagnoser.rules.engine import diagnose, load_thresholds

__all__ = ["RULES", "Page", "Rule", "Threshold", "diagnose", "load_thresholds", "get_rule"]


def get_rule(code: str) -> Rule | None:
    return RULES.get(code.upper())
