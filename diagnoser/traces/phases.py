"""Serving phases where the trace shows them: prefill-like vs decode-like steps, the batch of each step, and the
share of time in attention as the context grows.

A step is a ProfilerStep when the trace has them; otherwise a run of consecutive weight GEMMs with the same
number of rows (a forward pass processes all its tokens through every linear layer, so M is constant within a
pass and changes between passes of different size). A step's tokens is the most common M of its weight GEMMs.

A step is decode-like when its attention queries are at most MAX_DECODE_QUERY tokens long (one token per
sequence, or a few with speculative decoding); when attention shapes are not recorded (paged/varlen attention in
vLLM/SGLang), when its tokens are at most twice the median step's tokens and at most MAX_DECODE_TOKENS (a serving
loop spends most steps decoding, so the median step is a decode step). Its batch is the attention batch, or the
tokens divided by the query length.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from diagnoser.traces.flops import ATTENTION_KIND, is_weight_gemm
from diagnoser.traces.ops import CostedRun, LaunchIndex, OpsSummary

MAX_DECODE_QUERY = 8
MAX_DECODE_TOKENS = 1024


@dataclass
class Step:
    name: str
    start: float
    end: float
    tokens: int | None = None  # the step's GEMM M
    batch: float | None = None
    q_len: int | None = None
    kv_len: int | None = None  # longest key length seen by attention in the step (the context)
    time_us: float = 0.0  # GPU time of its kernels (CPU-only trace: the step's duration)
    attention_us: float = 0.0
    phase: str = "unknown"  # prefill, decode, unknown

    @property
    def attention_frac(self) -> float | None:
        return self.attention_us / self.time_us if self.time_us > 0 else None


@dataclass
class Phases:
    steps: list[Step] = field(default_factory=list)
    source: str = ""  # "ProfilerStep" or "GEMM runs"
    decode_batch: float | None = None
    prefill_frac: float | None = None
    attention_frac: float | None = None
    context_growth: tuple[tuple[int, float], tuple[int, float]] | None = None  # (kv_len, attn frac) first, last

    def to_dict(self, limit: int = 200) -> dict[str, object]:
        return {
            "source": self.source,
            "steps": len(self.steps),
            "decode_steps": sum(1 for s in self.steps if s.phase == "decode"),
            "prefill_steps": sum(1 for s in self.steps if s.phase == "prefill"),
            "decode_batch": self.decode_batch,
            "prefill_frac": self.prefill_frac,
            "attention_frac": self.attention_frac,
            "context_growth": None if self.context_growth is None else {
                "first": {"kv_len": self.context_growth[0][0], "attention_frac": self.context_growth[0][1]},
                "last": {"kv_len": self.context_growth[1][0], "attention_frac": self.context_growth[1][1]},
            },
            "per_step": [{"name": s.name, "phase": s.phase, "tokens": s.tokens, "batch": s.batch, "q_len": s.q_len,
                          "kv_len": s.kv_len, "time_us": s.time_us, "attention_frac": s.attention_frac}
                         for s in self.steps[:limit]],
        }


def find_phases(ops: OpsSummary, profiler_steps: list[tuple[str, float, float, int]],
                index: LaunchIndex | None, window: tuple[float, float]) -> Phases:
    runs = [r for r in ops.runs if r.cost.kind == ATTENTION_KIND or is_weight_gemm(r.name, r.cost)]
    ph = Phases()
    if profiler_steps:
        ph.source = "ProfilerStep"
        steps = [Step(name, ts, ts + dur) for name, ts, dur, _ in sorted(profiler_steps, key=lambda s: s[1])
                 if ts + dur > window[0] and ts < window[1]]
    else:
        ph.source = "GEMM runs"
        steps = _gemm_runs(runs)
    has_attention = any(r.cost.kind == ATTENTION_KIND for r in runs)
    if not steps or not runs or (not has_attention and not profiler_steps and len(steps) < 2):
        # One run of one GEMM shape and no attention: a fixed-batch model, not a serving loop with phases.
        return ph
    _fill(steps, runs, index)
    _classify(steps)
    ph.steps = steps
    _summarise(ph)
    return ph


def _gemm_runs(runs: list[CostedRun]) -> list[Step]:
    gemms = [r for r in runs if r.cost.kind != ATTENTION_KIND]
    steps: list[Step] = []
    for r in gemms:
        if steps and steps[-1].tokens == r.cost.tokens:
            steps[-1].end = max(steps[-1].end, r.end)
            continue
        if steps:
            steps[-1].end = max(steps[-1].end, r.ts)  # a run lasts until the next one starts
        steps.append(Step(f"run {len(steps)}", r.ts, r.end, tokens=r.cost.tokens))
    return steps


def _fill(steps: list[Step], runs: list[CostedRun], index: LaunchIndex | None) -> None:
    gpu = index is not None and len(index.ts) > 0
    j = 0
    for step in steps:
        while j < len(runs) and runs[j].ts < step.start:
            j += 1
        m_counts: Counter[int] = Counter()
        attn_us = 0.0
        k = j
        while k < len(runs) and runs[k].ts < step.end:
            r = runs[k]
            if r.cost.kind == ATTENTION_KIND:
                step.q_len = max(step.q_len or 0, r.cost.q_len or 0)
                step.kv_len = max(step.kv_len or 0, r.cost.kv_len or 0)
                if r.cost.batch is not None:
                    step.batch = float(max(step.batch or 0, r.cost.batch))
                attn_us += r.time_us
            elif r.cost.tokens is not None:
                m_counts[r.cost.tokens] += 1
            k += 1
        if m_counts:
            step.tokens = m_counts.most_common(1)[0][0]
        if gpu:
            assert index is not None
            step.time_us, step.attention_us = index.gpu_time(step.start, step.end)
        else:
            step.time_us = step.end - step.start
            step.attention_us = attn_us


def _classify(steps: list[Step]) -> None:
    known = [s.tokens for s in steps if s.tokens]
    median = statistics.median(known) if known else None
    for s in steps:
        if s.q_len:
            s.phase = "decode" if s.q_len <= MAX_DECODE_QUERY else "prefill"
        elif s.tokens and median is not None:
            s.phase = "decode" if s.tokens <= min(max(8.0, 2 * median), MAX_DECODE_TOKENS) else "prefill"
        if s.phase == "decode" and s.batch is None and s.tokens:
            s.batch = s.tokens / max(1, s.q_len or 1)


def _summarise(ph: Phases) -> None:
    decode = [s for s in ph.steps if s.phase == "decode" and s.batch]
    if decode:
        ph.decode_batch = statistics.fmean(s.batch for s in decode)  # type: ignore[misc]
    known = [s for s in ph.steps if s.phase != "unknown" and s.time_us > 0]
    total = sum(s.time_us for s in known)
    if total > 0:
        ph.prefill_frac = sum(s.time_us for s in known if s.phase == "prefill") / total
        ph.attention_frac = sum(s.attention_us for s in known) / total
    growth = [s for s in ph.steps if s.phase == "decode" and s.kv_len and s.attention_frac is not None]
    if len(growth) >= 2:
        first, last = growth[0], growth[-1]
        ph.context_growth = ((first.kv_len or 0, first.attention_frac or 0.0),
                             (last.kv_len or 0, last.attention_frac or 0.0))
