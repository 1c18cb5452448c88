"""A RuleSet: an ordered tuple of rules with the thresholds in force, that runs them over evidence.

No global state: the caches of which rules can run on which signals live in the instance, and the order of the
rules is the order given (which breaks ties between equally strong findings deterministically, with the rule code as
the last key). `default_rules()` is the rule set shipped with diagnoser.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from diagnoser.collectors.dcgm_stats import check_fleet_reads
from diagnoser.diagnosis import Finding, Skipped
from diagnoser.errors import InputError
from diagnoser.evidence import Evidence, NoSuchStatistic
from diagnoser.fileio import read_text_bounded
from diagnoser.rules.base import AnyOf, CannotDecide, Check, Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Overrides = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class RuleResults:
    findings: list[Finding]
    skipped: list[Skipped]
    passed: list[str]


class RuleSet:
    """Rules in a fixed order, with their thresholds (defaults, overridden per rule code)."""

    _PLANS_MAX = 1024

    def __init__(self, rules: Iterable[Rule], overrides: Overrides | None = None) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        codes = [r.code for r in self.rules]
        duplicate = {c for c in codes if codes.count(c) > 1}
        if duplicate:
            raise ValueError(f"duplicate rule code(s) {', '.join(sorted(duplicate))}")
        # A rule reading a DCGM statistic the fleet cannot compute would get one interpolated from the mean there.
        check_fleet_reads(self.rules)
        self._by_code = {r.code: r for r in self.rules}
        self._order = {r.code: i for i, r in enumerate(self.rules)}
        self._thresholds: dict[str, Mapping[str, float]] = {}
        for r in self.rules:
            values = r.defaults()
            extra = (overrides or {}).get(r.code)
            if extra:
                unknown = set(extra) - set(values)
                if unknown:
                    raise InputError(f"rule {r.code} has no threshold {', '.join(sorted(unknown))} "
                                     f"(it has {', '.join(values)}).")
                values.update({k: float(v) for k, v in extra.items()})
            self._thresholds[r.code] = MappingProxyType(values)
        self.overrides: dict[str, dict[str, float]] = {k: dict(v) for k, v in (overrides or {}).items()}
        # Which rules run and why the others are skipped depends only on the signals present and on what the
        # capture says is unavailable; a fleet's GPUs mostly share both, so the plan is made once per case.
        self._plans: dict[tuple[frozenset[str], tuple[tuple[str, str, str], ...]],
                          tuple[tuple[Rule, Skipped | None], ...]] = {}
        self._unmet: dict[tuple[frozenset[str], tuple[tuple[str, str, str], ...]], frozenset[str]] = {}

    # --- lookup -------------------------------------------------------------------------------------------

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, code: str) -> Rule | None:
        return self._by_code.get(code.upper())

    def thresholds(self, code: str) -> Mapping[str, float]:
        return self._thresholds[code]

    def order(self, code: str) -> int:
        """The rule's place in the set (ties between findings go to the earlier rule)."""
        return self._order.get(code, len(self._order))

    def with_overrides(self, overrides: Overrides | None) -> RuleSet:
        return RuleSet(self.rules, overrides) if overrides else self

    # --- running ----------------------------------------------------------------------------------------------

    def _plan(self, ev: Evidence) -> tuple[tuple[Rule, Skipped | None], ...]:
        key = (frozenset(ev.signals), ev.absent_key())
        plan = self._plans.get(key)
        if plan is None:
            plan = tuple((r, self._skip(r, ev)) for r in self.rules)
            if len(self._plans) >= self._PLANS_MAX:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    @staticmethod
    def _skip(r: Rule, ev: Evidence) -> Skipped | None:
        missing = r.missing(ev)
        if not missing:
            return None
        parts = []
        for req in missing:
            first = req.names[0] if isinstance(req, AnyOf) else req
            parts.append(f"{req} ({ev.why_missing(first)})")
        return Skipped(r.code, "needs " + "; ".join(parts))

    def unmet(self, ev: Evidence) -> frozenset[str]:
        """The signals that the rules which cannot run on this evidence declare (required or used) and it lacks:
        what to collect for them to run. Made once per plan, as the plan is."""
        key = (frozenset(ev.signals), ev.absent_key())
        found = self._unmet.get(key)
        if found is None:
            signals = ev.signals
            found = frozenset(n for r, skip in self._plan(ev) if skip is not None for n in r.declared
                              if n not in signals)
            if len(self._unmet) >= self._PLANS_MAX:
                self._unmet.clear()
            self._unmet[key] = found
        return found

    def run(self, ev: Evidence) -> RuleResults:
        findings: list[Finding] = []
        skipped: list[Skipped] = []
        passed: list[str] = []
        for r, skip in self._plan(ev):
            if skip is not None:
                skipped.append(skip)
                continue
            try:
                result = r.predicate(Check(r, ev, self._thresholds[r.code]))
            except NoSuchStatistic as exc:
                # A statistic the rule reads that this GPU's window statistics lack (a p90 where the engine had
                # only a counter's rate): the rule cannot decide, and says so rather than guess one.
                skipped.append(Skipped(r.code, f"needs the {exc.what} of {exc.signal}, which the window statistics "
                                               "do not hold"))
                continue
            except CannotDecide as exc:
                skipped.append(Skipped(r.code, str(exc)))
                continue
            if result is None:
                passed.append(r.code)
            else:
                findings.append(result)
        findings.sort(key=lambda f: (-f.strength, self.order(f.code), f.code))
        return RuleResults(findings, skipped, passed)


def load_overrides(path: str | Path, rules: RuleSet) -> dict[str, dict[str, float]]:
    """Threshold overrides from a TOML file: [thresholds.BW001] dram_active_mean = 0.45"""
    path = Path(path)
    try:
        data = tomllib.loads(read_text_bounded(path))  # bounded: a path to /dev/zero never fills memory
    except FileNotFoundError:
        raise InputError(f"no rules config at {path}.") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read rules config {path}: {exc}.") from None
    table = data.get("thresholds", {})
    if not isinstance(table, dict):
        raise InputError(f"{path}: [thresholds] must be a table of [thresholds.CODE] tables.")
    out: dict[str, dict[str, float]] = {}
    for code, values in table.items():
        r = rules.get(code)
        if r is None:
            raise InputError(f"{path} sets thresholds for unknown rule {code}.")
        if not isinstance(values, dict):
            raise InputError(f"{path}: [thresholds.{code}] must be a table of name = number.")
        for name, value in values.items():
            if name not in r.thresholds:
                raise InputError(f"{path}: rule {code} has no threshold '{name}' "
                                 f"(it has {', '.join(r.thresholds)}).")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InputError(f"{path}: threshold {code}.{name} must be a number.")
        out[r.code] = {k: float(v) for k, v in values.items()}
    return out


@functools.lru_cache(maxsize=1)
def default_rules() -> RuleSet:
    """The shipped rules, VRAM first (if it does not fit nothing else helps), then the roofs and latency, load,
    host, hardware and serving."""
    from diagnoser.rules import hardware, host, load, memory, roofs, server_load, serving

    return RuleSet((*memory.RULES, *roofs.RULES, *load.RULES, *host.RULES, *hardware.RULES, *serving.RULES,
                    *server_load.RULES))
