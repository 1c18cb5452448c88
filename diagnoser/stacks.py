"""The Python code a busy server thread runs, in the form a finding, a fix and a report cite.

Reads Capture.stacks (sampled by collectors/stacks.py); knows nothing of py-spy. `hot_code(capture)` gives the
busiest threads' hottest code, each with a one-sentence `cite()`; `stack_summary(capture)` one line for a report.
"""

from __future__ import annotations

from dataclasses import dataclass

from diagnoser.capture import Capture, StackFrame, StackSamples, ThreadStacks

# A thread busy less than this share of the window is not what saturates a core.
MIN_ACTIVE_FRAC = 0.2


def where(frame: StackFrame) -> str:
    """'schedule (vllm/v1/core/sched/scheduler.py:123)'."""
    if not frame.file:
        return frame.function
    return f"{frame.function} ({frame.file}:{frame.line})" if frame.line else f"{frame.function} ({frame.file})"


@dataclass(frozen=True)
class HotCode:
    """The hottest code of one busy thread."""

    pid: int
    thread: str
    active_frac: float  # share of the window the thread was busy in Python
    role: str  # scheduler, tokenizer, detokenizer, sampling, data movement, serialization, http, ""
    function: str  # 'hot_loop (hot.py:5)': the innermost function it was most often in
    self_frac: float  # share of the thread's samples in that function itself
    path: tuple[str, ...]  # its hottest stack, innermost first
    path_frac: float

    def cite(self) -> str:
        """One sentence: which thread, how busy, in what code."""
        role = f"; {self.role}, by its frames" if self.role else ""
        callers = f", called from {' <- '.join(self.path[1:3])}" if len(self.path) > 1 else ""
        return (f"thread {self.thread or '?'} (pid {self.pid}{role}) was busy {self.active_frac:.0%} of the window, "
                f"{self.self_frac:.0%} of its samples in {self.function}{callers}")


# Frames that only pass a call through (decorators, thread bootstrap): left out of a cited call path.
_PASS_THROUGH = ("contextlib.py", "functools.py", "threading.py", "torch/nn/modules/module.py")


def _hot(th: ThreadStacks) -> HotCode | None:
    if not th.top:
        return None
    top = th.top[0]
    path = th.stacks[0] if th.stacks else None
    frames = [f for f in path.frames if not f.file.endswith(_PASS_THROUGH)] if path else []
    return HotCode(pid=th.pid, thread=th.name, active_frac=th.active_frac, role=th.role, function=where(top.frame),
                   self_frac=top.self_frac, path=tuple(where(f) for f in frames) or (where(top.frame),),
                   path_frac=path.frac if path else top.self_frac)


def hot_code(source: Capture | StackSamples | None, limit: int = 3,
             min_active: float = MIN_ACTIVE_FRAC) -> list[HotCode]:
    """The busiest threads' hottest code, busiest first; empty when no stacks were sampled or no thread was busy.
    `source`: a capture, or its stacks (Evidence.stacks, for a rule)."""
    stacks = source.stacks if isinstance(source, Capture) else source
    if stacks is None:
        return []
    out: list[HotCode] = []
    for th in sorted(stacks.threads, key=lambda t: t.active_frac, reverse=True):
        if th.active_frac < min_active:
            continue
        hot = _hot(th)
        if hot is not None:
            out.append(hot)
        if len(out) >= limit:
            break
    return out


def stack_summary(capture: Capture) -> str:
    """One line for a report: the busiest thread's hottest code, or why there is none."""
    found = hot_code(capture, limit=1)
    if found:
        return found[0].cite() + "."
    if capture.stacks is None:
        reason = next((u.reason for u in capture.unavailable if u.source == "stacks"), "")
        return f"No Python stacks were sampled ({reason})." if reason else "No Python stacks were sampled."
    return "No thread of the target was busy in Python for a fifth of the window or more."
