"""The terminal verdict: rich panels that fit 80 columns, plain text when stdout is not a TTY."""

from __future__ import annotations

from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from diagnoser.diagnosis import INCONCLUSIVE, Diagnosis
from diagnoser.units import gain

_VERDICT_STYLE = {INCONCLUSIVE: "yellow"}


class TerminalRenderer:
    def __init__(self, file: TextIO | None = None, width: int = 80, color: bool | None = None) -> None:
        self.console = Console(file=file, width=width, no_color=color is False, force_terminal=color,
                               highlight=False, soft_wrap=False)

    def render(self, d: Diagnosis, *, verbose: bool = False) -> None:
        c = self.console
        label = d.limiter.label if d.limiter else INCONCLUSIVE
        style = _VERDICT_STYLE.get(d.verdict, "bold red")
        head = Text("Verdict: ", style="bold")
        head.append(label.upper(), style=style)
        head.append(f"  (confidence {d.confidence_label}, {d.confidence:.2f})")
        c.print(head)
        c.print(f"Target: {d.target}", markup=False)
        c.print(d.headline, markup=False)
        for note in d.notes:
            c.print(Text(f"! {note}", style="yellow"))
        if d.findings:
            c.print(Text("\nEvidence", style="bold"))
            for f in d.findings:
                c.print(Text(f"  {f.code} {f.name} [{f.limiter.label}, strength {f.strength:.2f}]", style="bold"))
                c.print(f"    {f.message}", markup=False)
                for cit in f.citations:
                    c.print(f"    - {cit.text()}", markup=False)
        if d.fixes:
            c.print(Text("\nFixes, by predicted gain", style="bold"))
            for i, fix in enumerate(d.fixes[: 5 if not verbose else None], 1):
                c.print(Text(f"  {i}. {fix.title} ({gain(fix.gain)}) [{fix.rule}]", style="green"))
                c.print(f"     {fix.action}", markup=False)
                if fix.basis and verbose:
                    c.print(f"     basis: {fix.basis}", markup=False)
        if d.to_collect:
            c.print(Text("\nTo sharpen this verdict, collect", style="bold"))
            for want in d.to_collect:
                c.print(f"  - {want}", markup=False)
        if d.unavailable:
            c.print(Text("\nUnavailable", style="bold"))
            for u in d.unavailable:
                hint = f" -> {u['hint']}" if u.get("hint") else ""
                c.print(f"  - {u['source']}: {u['what']}: {u['reason']}{hint}", markup=False)
        c.print(Text(f"\n{len(d.findings)} findings, {len(d.passed)} rules passed, {len(d.skipped)} skipped "
                     "(diagnoser rules CODE explains each).", style="dim"))
        if verbose and d.skipped:
            table = Table("rule", "skipped because", box=None, show_header=True)
            for s in d.skipped:
                table.add_row(s.code, s.reason)
            c.print(table)
