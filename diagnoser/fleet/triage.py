"""The fleet's triage: each GPU diagnosed by the normal rule engine from the window statistics the time-series engine
computed (collectors/prom_stats.py), with no samples in hand.

Each GPU's signals are made by walking the fleet's table (collectors/dcgm_stats.py: which DCGM statistics each
(signal, statistic) the rules declare is computed from, and how), each a `Signal.from_stats` (mean, p90, max answer
from it; the throttled share answers the rules' "share of samples above 0.5" exactly, being the mean of a 0/1
signal); `build_evidence` makes the GPU's evidence from them (`WindowSignals`: its identity, what is missing and
why; the physics of its model; what the counters say of its regime), and the Pipeline judges it as any capture's. What
is shared by most GPUs is built once: the physics signals per GPU model, and the list of missing signals per set of
signals present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diagnoser import __version__
from diagnoser.capture import Capture, Unavailable
from diagnoser.collectors.dcgm import GpuIdentity, gpu_info, mark_missing, spec_max_clock
from diagnoser.collectors.dcgm_stats import FLEET_SIGNALS, MAX_SM_CLOCK, SM_CLOCK, TABLE, XID, Stat
from diagnoser.collectors.prom_stats import WindowStats
from diagnoser.diagnosis import Diagnosis
from diagnoser.evidence import Meta, Signal
from diagnoser.evidence_build import PhysicsCache, WindowSignals, build_evidence
from diagnoser.pipeline import Pipeline
from diagnoser.rules.ruleset import RuleSet
from diagnoser.signals import spec

SOURCES = ("dcgm",)


@dataclass
class Triage:
    """What the triage of a whole fleet shares: the statistics, and caches of what most GPUs have in common."""

    stats: WindowStats
    rules: RuleSet | None = None
    _physics: PhysicsCache = field(default_factory=dict)  # each GPU model's physics evidence
    _missing: dict[tuple[frozenset[str], bool], tuple[Unavailable, ...]] = field(default_factory=dict)
    spec_clock_models: set[str] = field(default_factory=set)  # models whose max clock came from the spec table

    most_samples: float = 0.0  # the anchor field's count of the GPUs that reported all along (fewer: gaps)
    processes: int = 1  # how many processes diagnosed the GPUs (run.triage_rows)

    def __post_init__(self) -> None:
        self.most_samples = max(self.stats.samples, default=0.0)
        self.pipeline = Pipeline(self.rules)  # each GPU's evidence is judged as every command's is

    def _unavailable(self, produced: frozenset[str], mig: bool) -> tuple[Unavailable, ...]:
        key = (produced, mig)
        found = self._missing.get(key)
        if found is None:
            probe = Capture(target="", started_at=0.0, duration_s=0.0)
            mark_missing(probe, set(produced), fields_in_source=self.stats.fields_present, failed=self.stats.failed,
                         mig=mig)
            found = self._missing[key] = tuple(Unavailable(u.source, u.what, u.reason, u.hint)
                                               for u in probe.unavailable)
        return found

    def signals(self, i: int, ident: GpuIdentity) -> tuple[dict[str, Signal], list[str], float | None]:
        """One GPU's signals from its statistics (each group of the fleet's table in turn), notes about it, and its
        maximum SM clock."""
        s = self.stats
        out = _GpuSignals(max(1, int(s.samples[i])) if i < len(s.samples) else 1)
        gpu = _Gpu(s, i, self._max_clock(i, ident))
        add = out.add
        for group in TABLE:
            group.make(gpu, add)
        return out.signals, _xid_note(s, i, ident), gpu.max_clock or None

    def _max_clock(self, i: int, ident: GpuIdentity) -> float | None:
        """The maximum SM clock: DCGM's, else the spec table's (noted where a clock share is made from it)."""
        s = self.stats
        max_clock: float | None = s.get(MAX_SM_CLOCK.key, i)
        if max_clock is None or math.isnan(max_clock) or max_clock <= 0:
            max_clock, _ = spec_max_clock(ident.model)
            if max_clock and not math.isnan(s.get(SM_CLOCK.key, i)):
                self.spec_clock_models.add(ident.model)
        return max_clock

    def diagnose(self, i: int, ident: GpuIdentity) -> tuple[Diagnosis, float | None, bool, bool]:
        """The engine's diagnosis of one GPU from its statistics; its busy fraction; whether it has an activity
        counter; whether it has any signal a rule reads (a GPU that reports only its temperature has none)."""
        window = self.stats.window
        signals, notes, max_clock = self.signals(i, ident)
        info = gpu_info(ident)
        total = signals.get("gpu.mem_total_bytes")
        info.memory_total_bytes = int(total.mean) if total is not None else None
        info.max_sm_clock_mhz = max_clock
        produced = frozenset(signals)
        if not produced & _ACTIVITY:
            notes.append(f"{ident.describe()} is listed, but none of the activity fields the rules read "
                         "(GR_ENGINE_ACTIVE or GPU_UTIL, SM_ACTIVE, DRAM_ACTIVE, PIPE_TENSOR_ACTIVE) has a value for "
                         "it in the window.")
        meta = Meta(target=ident.describe(), window_s=window.length_s, started_at=window.start, host=ident.node,
                    tool_version=__version__, origin="fleet", gpus=(info,), notes=tuple(notes),
                    unavailable=self._unavailable(produced, bool(ident.mig_id)))
        ev = build_evidence(WindowSignals(meta, signals), physics=self._physics)
        busy = signals.get("gpu.busy") or signals.get("gpu.sm_active")
        return self.pipeline.judge(ev), busy.mean if busy is not None else None, \
            bool(produced & _ACTIVITY), bool(produced)


class _Gpu:
    """One GPU's statistics as the table's groups read them."""

    __slots__ = ("i", "max_clock", "stats")

    def __init__(self, stats: WindowStats, i: int, max_clock: float | None) -> None:
        self.stats, self.i, self.max_clock = stats, i, max_clock

    def get(self, stat: Stat) -> float:
        return self.stats.get(stat.key, self.i)


@dataclass
class _GpuSignals:
    """One GPU's signals as they are read from its statistics, each with the GPU's sample count."""

    n: int
    signals: dict[str, Signal] = field(default_factory=dict)

    def add(self, name: str, mean: float, p90: float | None = None, high: float | None = None,
            frac_above: dict[float, float] | None = None) -> None:
        if mean == mean:  # not NaN
            self.signals[name] = Signal.from_stats(name, _UNITS[name], SOURCES, mean=mean, p90=p90, max=high,
                                                   n=self.n, frac_above=frac_above)


def _xid_note(s: WindowStats, i: int, ident: GpuIdentity) -> list[str]:
    """A note naming the XID DCGM reports."""
    xid = s.get(XID.key, i)
    if xid > 0:
        return [f"DCGM reports XID {int(xid)} on {ident.describe()} (DCGM_FI_DEV_XID_ERRORS holds the last XID seen, "
                "which may predate the window)."]
    return []


_ACTIVITY = frozenset({"gpu.busy", "gpu.sm_active", "gpu.dram_active", "gpu.tensor_active"})
_UNITS = {name: spec(name).unit for name in FLEET_SIGNALS}


__all__ = ["Triage"]
