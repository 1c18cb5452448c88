"""The terminal verdict: a rich summary that fits 80 columns, and plain text (no colour, no control codes) when the
output is not a terminal or colour is off.

Order follows what a reader needs: the verdict and its confidence, the top fixes with their predicted gain, the
evidence with each number's threshold and source, then what was missing. Wrapped lines keep their indent.

It reads the Report alone: every line is a view the model built and redacted (reports/model.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from diagnoser.reports.figdata import KernelTable
from diagnoser.reports.labels import verdict_term_style
from diagnoser.reports.model import Report
from diagnoser.reports.trace_figures import duration_text

MAX_WIDTH = 80
TOP_FIXES = 3
TOP_KERNELS = 5

_SOURCES = {"nvml": "NVML", "gpm": "GPM", "dcgm": "DCGM", "psutil": "psutil", "server": "server",
            "trace": "trace", "physics": "physics", "user": "user"}


def _is_tty(file: TextIO | None) -> bool:
    stream = file if file is not None else sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class TerminalRenderer:
    """Renders a Report to a terminal (styled) or to a pipe or file (plain text), at most 80 columns wide."""

    def __init__(self, file: TextIO | None = None, width: int | None = None, color: bool | None = None) -> None:
        tty = _is_tty(file)
        self.plain = color is False or (color is None and (not tty or "NO_COLOR" in os.environ))
        if width is None:
            width = min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns) if tty else MAX_WIDTH
        self.console = Console(
            file=file, width=width, highlight=False, soft_wrap=False, emoji=False, markup=False,
            force_terminal=False if self.plain else True if color else None,
            color_system=None if self.plain else "auto", no_color=self.plain,
        )

    def render(self, report: Report, *, verbose: bool = False) -> None:
        if not self.plain:
            for block in self.blocks(report, verbose=verbose):
                self.console.print(block)
            return
        # Plain text: rich pads table cells to the full width; a file or a pipe gets no trailing blanks.
        with self.console.capture() as captured:
            for block in self.blocks(report, verbose=verbose):
                self.console.print(block)
        text = "\n".join(line.rstrip() for line in captured.get().splitlines())
        self.console.file.write(text + "\n")

    # --- the blocks, in reading order -----------------------------------------------------------------------

    def blocks(self, r: Report, *, verbose: bool = False) -> list[RenderableType]:
        out: list[RenderableType] = [self._verdict(r)]
        if r.fixes:
            out.append(self._fixes(r, verbose))
        if r.withheld and verbose:
            out.append(self._section("Not proposed", self._bullets(
                [f"{w.title} ({w.rule}): {w.why}." for w in r.withheld])))
        if r.findings:
            out.append(self._evidence(r))
        if r.kernels is not None and r.kernels.rows:
            out.append(self._kernels(r.kernels, verbose))
        if r.to_collect:
            out.append(self._section("To sharpen this verdict, collect" if r.fixes else "To reach a verdict, collect",
                                     self._bullets(r.to_collect)))
        if r.unavailable:
            out.append(self._section("Not available", self._unavailable(r)))
        if verbose and r.skipped:
            table = self._grid(("code", {"no_wrap": True}), ("reason", {}))
            for s in r.skipped:
                table.add_row(s.code, s.reason)
            out.append(self._section("Rules skipped for lack of signals", table))
        out.append(self._footer(r, verbose))
        return out

    def _verdict(self, r: Report) -> RenderableType:
        head = Text("VERDICT ", style="bold")
        head.append(r.verdict.upper(), style=verdict_term_style(r.verdict_key))
        head.append(f"   confidence {r.confidence_label} ({r.confidence:.2f})", style="dim" if not self.plain else "")
        facts = self._grid(("key", {"no_wrap": True, "style": "dim"}), ("value", {}))
        facts.add_row("target", r.target)
        if r.gpu_line:
            facts.add_row("GPU", r.gpu_line)
        if r.regime:
            facts.add_row("regime", r.regime)
        if r.also:
            facts.add_row("also", ", ".join(r.also))
        parts: list[RenderableType] = [head, Text(r.headline)]
        if r.near_tie:
            parts.append(Text(r.near_tie, style="yellow" if not self.plain else ""))
        parts.append(Padding(facts, (0, 0, 0, 2)))
        if r.notes:
            notes = Table.grid(padding=(0, 1))
            notes.add_column(no_wrap=True, style="yellow")
            notes.add_column(ratio=1, style="yellow")
            for note in r.notes:
                notes.add_row("!", note)
            parts.append(notes)
        if r.confidence_reasons and r.confidence < 0.7:
            # Padded rather than prefixed with spaces, so wrapped lines keep the indent.
            parts.append(Padding(Text("confidence: " + "; ".join(r.confidence_reasons), style="dim"),
                                 (0, 0, 0, 2)))
        return Group(*parts)

    def _fixes(self, r: Report, verbose: bool) -> RenderableType:
        shown = r.fixes if verbose else r.fixes[:TOP_FIXES]
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True, justify="right", width=3)
        table.add_column(ratio=1)
        for i, fix in enumerate(shown, 1):
            text = Text(fix.title, style="bold")
            text.append("  ")
            text.append(fix.gain, style="green" if fix.multiplier else "dim")
            text.append("\n" + fix.action)
            text.append(f" [{fix.rule}]", style="dim")
            if verbose and fix.basis:
                text.append(f"\nbasis: {fix.basis}", style="dim")
            if verbose and fix.capped:
                text.append(f"\nbounded: {fix.capped}", style="dim")
            table.add_row(Text(f"{i}.", style="bold"), text)
        parts: list[RenderableType] = [table]
        # judge.py ranks the fixes for the verdict first, then other speed fixes, capacity last; each by expected gain
        title = "Top fixes (for the verdict first, then by expected gain)" if not verbose else \
            "Every fix (for the verdict first, then by expected gain)"
        more = len(r.fixes) - len(shown)
        if more > 0:
            parts.append(Text(f"  {more} more with --verbose.", style="dim"))
        return self._section(title, Group(*parts))

    def _evidence(self, r: Report) -> RenderableType:
        parts: list[RenderableType] = []
        for f in r.findings:
            head = Text(f"{f.code} ", style="bold")
            head.append(f.name)
            head.append(f"  {f.limiter}, strength {f.strength:.2f}", style="dim")
            parts.append(head)
            parts.append(Padding(Text(f.message), (0, 0, 0, 2)))
            if f.citations:
                # One line per number, in Citation.text()'s form: "gpu.dram_active mean = 72 % (>= 50 %) [gpm]".
                table = Table.grid(padding=(0, 1))
                table.add_column(no_wrap=True)
                table.add_column(ratio=1)
                for c in f.citations:
                    table.add_row("-", c.text)
                parts.append(Padding(table, (0, 0, 0, 2)))
        return self._section("Evidence", Group(*parts))

    def _kernels(self, kernels: KernelTable, verbose: bool) -> RenderableType:
        """The kernels holding the GPU time: share, calls x mean, name, and speed of light where known."""
        shown = kernels.rows if verbose else kernels.rows[:TOP_KERNELS]
        table = self._grid(("share", {"no_wrap": True, "justify": "right"}),
                           ("calls", {"no_wrap": True, "justify": "right"}), ("kernel", {"ratio": 1}))
        for k in shown:
            text = Text(k.name)
            text.append(f"  {k.kind}", style="dim")
            if k.sol is not None:
                text.append(f"\nspeed of light {k.sol:.0%} {k.sol_roof}", style="green" if k.sol >= 0.6 else "yellow")
            table.add_row(f"{k.share:.1%}", f"{k.count:,} x {duration_text(k.mean_us)}", text)
        parts: list[RenderableType] = [table]
        more = len(kernels.rows) - len(shown)
        if more > 0:
            parts.append(Text(f"{more} more with --verbose; the HTML report (--html) has each one's spread.",
                              style="dim"))
        return self._section(kernels.title, Group(*parts))

    def _unavailable(self, r: Report) -> RenderableType:
        table = self._grid(("source", {"no_wrap": True}), ("what", {"ratio": 1}))
        for u in r.unavailable:
            text = Text(f"{u.what}: {u.reason}")
            if u.hint:
                text.append(f"\n-> {u.hint}", style="dim")
            table.add_row(_SOURCES.get(u.source, u.source), text)
        return table

    def _footer(self, r: Report, verbose: bool) -> RenderableType:
        n = len(r.findings)
        text = (f"{n} finding{'s' if n != 1 else ''}, {len(r.passed)} rules passed, {len(r.skipped)} skipped. "
                "`diagnoser rules CODE` explains a rule")
        text += "." if verbose else "; --verbose shows all fixes and skipped rules."
        return Group(Text(""), Text(text, style="dim"))

    # --- helpers ---------------------------------------------------------------------------------------------

    def _section(self, title: str, body: RenderableType) -> RenderableType:
        return Group(Text(""), Text(title, style="bold underline" if not self.plain else ""),
                     Padding(body, (0, 0, 0, 2)))

    @staticmethod
    def _bullets(items: list[str]) -> RenderableType:
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(ratio=1)
        for item in items:
            table.add_row("-", item)
        return table

    @staticmethod
    def _grid(*columns: tuple[str, dict[str, object]]) -> Table:
        table = Table.grid(padding=(0, 2))
        for _, options in columns:
            table.add_column(**options)  # type: ignore[arg-type]
        return table
