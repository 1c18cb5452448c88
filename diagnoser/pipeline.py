"""The one path from an observation to what a user reads: observe -> capture -> evidence -> rules -> diagnosis ->
report -> outputs.

Every command that ends in a verdict goes through a Pipeline (attach, dcgm, analyze, diagnose, report, demo, the
agent's worker, the self-test, the fleet's per-GPU diagnoses), so a change to how evidence is built, rules run or
outputs are written happens in one place. The capture is saved after it is observed and again after every
enrichment step (a model's shape, a trace), so neither a failing step nor a second Ctrl-C can lose the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from diagnoser.capture import Capture, save
from diagnoser.diagnosis import Diagnosis
from diagnoser.evidence import Evidence
from diagnoser.evidence_build import build_evidence
from diagnoser.fileio import check_writable
from diagnoser.rules.engine import diagnose_evidence
from diagnoser.rules.ruleset import Overrides, RuleSet, default_rules

if TYPE_CHECKING:  # the report model loads jinja-free, but only when a report is asked for
    from diagnoser.reports.model import Report

Step = Callable[[Capture], None]


@dataclass
class Outcome:
    """One capture, what the rules made of it, and (built on demand) its report."""

    capture: Capture
    evidence: Evidence
    diagnosis: Diagnosis
    rules: RuleSet
    written: dict[str, Path] = field(default_factory=dict)
    _report: Report | None = field(default=None, repr=False)

    def report(self) -> Report:
        if self._report is None:
            from diagnoser.reports.model import build_report

            self._report = build_report(self.capture, self.evidence, self.diagnosis, self.rules)
        return self._report


class Pipeline:
    """Runs the stages with one rule set and one set of outputs."""

    def __init__(self, rules: RuleSet | None = None, *, overrides: Overrides | None = None,
                 save_to: Path | None = None, html: Path | None = None,
                 on_saved: Callable[[Path], None] | None = None, html_option: str = "--html") -> None:
        base = rules or default_rules()
        self.rules = base.with_overrides(overrides) if overrides else base
        # An output that cannot be written is found now, before a window is observed, not after it; the error names
        # the option the user gave (`html_option`: `report` takes -o/--output).
        for option, path in (("--save", save_to), (html_option, html)):
            if path is not None:
                check_writable(path, option)
        self.save_to = save_to
        self.html = html
        self.on_saved = on_saved

    def observe(self, observe: Callable[[], Capture], steps: Sequence[Step] = ()) -> Capture:
        """The capture from `observe`, enriched by each step in turn, saved after each."""
        capture = observe()
        self.checkpoint(capture)
        for step in steps:
            step(capture)
            self.checkpoint(capture)
        return capture

    def checkpoint(self, capture: Capture) -> None:
        if self.save_to is not None:
            save(capture, self.save_to)

    def judge(self, evidence: Evidence) -> Diagnosis:
        return diagnose_evidence(evidence, self.rules)

    def diagnose(self, capture: Capture) -> Outcome:
        evidence = build_evidence(capture)
        return Outcome(capture, evidence, self.judge(evidence), self.rules)

    def write(self, outcome: Outcome) -> Outcome:
        """The HTML report, when asked for; written before anything is printed, so it exists whatever the exit."""
        if self.save_to is not None:
            outcome.written["capture"] = self.save_to
        if self.html is not None:
            from diagnoser.reports.html import write_html

            outcome.written["report"] = write_html(outcome.report(), self.html)
        return outcome

    def run(self, observe: Callable[[], Capture], steps: Sequence[Step] = ()) -> Outcome:
        capture = self.observe(observe, steps)
        if self.save_to is not None and self.on_saved is not None:
            self.on_saved(self.save_to)
        return self.write(self.diagnose(capture))


def diagnose_capture(capture: Capture, rules: RuleSet | None = None) -> Outcome:
    """Evidence and diagnosis of one capture with the shipped rules (or `rules`)."""
    return Pipeline(rules).diagnose(capture)


__all__ = ["Outcome", "Pipeline", "diagnose_capture"]
