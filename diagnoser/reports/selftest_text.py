"""The self-test's report as text (`diagnoser selftest`): the device, a table of scenarios (expected verdict, the one
got, tokens/s against the ceiling), each scenario's error, skip or trace, the physics checks, where the files are and
one closing line that says whether the self-test passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from diagnoser.units import fmt

if TYPE_CHECKING:
    from diagnoser.selftest.harness import PhysicsCheck, ScenarioResult, SelftestReport


def render(report: SelftestReport, console: Console) -> None:
    """The whole self-test report, in reading order."""
    console.print(_device_line(report), markup=False)
    for note in report.notes:
        console.print(f"! {note}", style="yellow", markup=False)
    console.print(_scenario_table(report))
    for r in report.results:
        _print_outcome(r, console)
    if report.checks:
        console.print("Physics checks", style="bold")
        console.print(_checks_table(report.checks))
    if report.out_dir:
        console.print(f"Captures and workload logs in {report.out_dir} (diagnoser diagnose FILE.dgc shows each "
                      "verdict).", markup=False, style="dim")
    else:
        console.print("Captures, workload logs and traces were in a temporary folder, now removed (--out DIR keeps "
                      "them).", markup=False, style="dim")
    text, style = _closing(report)
    console.print(text, style=style, markup=False)


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _device_line(report: SelftestReport) -> str:
    if report.cpu_run:
        return "Self-test on the CPU (toy size)."
    return (f"Self-test on {report.gpu_name or 'GPU 0'} (driver {report.driver or 'unknown'}), roofs: "
            f"{report.roofs or 'n/a'}.")


def _scenario_table(report: SelftestReport) -> Table:
    table = Table("scenario", "expected", "got", "confidence", "tokens/s", "ceiling", "of ceiling", "",
                  box=None, show_header=True)
    for r in report.results:
        table.add_row(*_scenario_row(r))
    return table


def _scenario_row(r: ScenarioResult) -> tuple[str, ...]:
    """One scenario's cells; a scenario that did not run shows no numbers, a CPU run no ceiling."""
    mark = "" if r.passed is None else ("ok" if r.passed else "WRONG")
    share = (f"{r.measured_tokens_per_s / r.ceiling_tokens_per_s:.0%}"
             if r.measured_tokens_per_s and r.ceiling_tokens_per_s else "")
    rate = _rate(r.measured_tokens_per_s) + (" prompt" if r.rate == "prompt" and r.measured_tokens_per_s else "")
    ran = not (r.error or r.skipped)
    ceiling = (_rate(r.ceiling_tokens_per_s) if r.ceiling_tokens_per_s
               else "n/a (CPU)" if r.cpu_run and ran else "")
    return (r.scenario, " or ".join(r.expected), r.shown_verdict, f"{r.confidence:.2f}" if ran else "",
            rate if ran else "", ceiling, share, mark)


def _print_outcome(r: ScenarioResult, console: Console) -> None:
    """A scenario's error, skip or trace under the table (nothing when it ran without a trace)."""
    if r.error:
        console.print(f"  {r.scenario}: error: {r.error}", style="red", markup=False)
    elif r.skipped:
        console.print(f"  {r.scenario}: skipped: {r.skipped}", style="dim", markup=False)
    elif r.trace:
        console.print(f"  {r.scenario}: {r.trace}", style="dim", markup=False)


def _checks_table(checks: list[PhysicsCheck]) -> Table:
    table = Table("check", "predicted", "measured", "", "note", box=None, show_header=True)
    for c in checks:
        unit = "" if c.unit == "x" else c.unit
        shown = [("n/a" if v is None else (f"{v:.2f}x" if c.unit == "x" else fmt(v, unit)))
                 for v in (c.predicted, c.measured)]
        table.add_row(c.name, *shown, "" if c.ok is None else ("ok" if c.ok else "OFF"), c.note)
    return table


def _closing(report: SelftestReport) -> tuple[str, str]:
    """The last line and its style: a failure first, a CPU run never passed off as a GPU result."""
    if report.failed and not report.cpu_run:
        return f"Self-test FAILED: {'; '.join(report.failed)}", "bold red"
    if report.failed:
        return f"Harness FAILED on the CPU: {'; '.join(report.failed)}", "bold red"
    if report.cpu_run:
        return "Harness OK on the CPU. Run on a GPU for verdicts that count.", ""
    return "Self-test passed: every verdict as expected and the physics agrees.", "bold green"


__all__ = ["render"]
