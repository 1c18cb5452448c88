"""Where a declaration lives, for a failing test's one sentence: a rule's file and line (its @rule), a line of a
source file holding some text (a table's entry, a field), relative to the repository."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from diagnoser import signals as S
from diagnoser.rules.base import Rule

ROOT = Path(__file__).resolve().parent.parent


def rel(path: str | Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def rule_at(r: Rule) -> str:
    """'rule CODE (diagnoser/rules/x.py line N)': the line of its @rule."""
    fn = inspect.unwrap(r.predicate)
    try:
        path, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return f"rule {r.code}"
    return f"rule {r.code} ({rel(path or '?')} line {line})"


@functools.cache
def _lines(path: str) -> tuple[str, ...]:
    return tuple((ROOT / path).read_text().splitlines())


def line_of(path: str, *needles: str, after: str = "") -> str:
    """'path line N' for the first line holding every needle (past the first line holding `after`), else 'path'."""
    lines = _lines(path)
    start = next((i for i, line in enumerate(lines) if after in line), 0) if after else 0
    for i in range(start, len(lines)):
        if all(n in lines[i] for n in needles):
            return f"{path} line {i + 1}"
    return path


def constant(name: str) -> str:
    """The signals.py constant a signal is named by in the code ('S.GPU_TEMP_C'), else the name quoted."""
    for attr, value in vars(S).items():
        if isinstance(value, S.Sig) and str.__str__(value) == name and attr.isupper():
            return f"S.{attr}"
    return repr(name)


__all__ = ["ROOT", "constant", "line_of", "rel", "rule_at"]
