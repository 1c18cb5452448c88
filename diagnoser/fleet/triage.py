"""The fleet's triage: each GPU diagnosed by the normal rule engine from the window statistics the time-series engine
computed (collectors/prom_stats.py), with no samples in hand.

Each statistic becomes a `Signal.from_stats` (mean, p90, max answer from it; the throttled share answers the rules'
"share of samples above 0.5" exactly, being the mean of a 0/1 signal), the GPU gets evidence of its own (its identity,
what is missing and why, what the counters say of its regime), and `diagnose_evidence` runs as for any capture. What
is shared by most GPUs is built once: the physics signals per GPU model, and the list of missing signals per set of
signals present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diagnoser import __version__
from diagnoser.capture import Capture, GpuInfo, Unavailable
from diagnoser.characterise import characterise
from diagnoser.collectors.dcgm import (
    CLOCK_EVENT_BRAKE,
    CLOCK_EVENT_OTHER,
    CLOCK_EVENT_POWER,
    CLOCK_EVENT_THERMAL,
    MIB,
    GpuIdentity,
    gpu_info,
    mark_missing,
    spec_max_clock,
)
from diagnoser.collectors.prom_stats import WindowStats, bit_shares
from diagnoser.diagnosis import Diagnosis
from diagnoser.evidence import Evidence, Meta, Signal
from diagnoser.evidence_build import build_evidence
from diagnoser.rules.engine import diagnose_evidence
from diagnoser.rules.ruleset import RuleSet
from diagnoser.signals import spec

SOURCES = ("dcgm",)


@dataclass
class Triage:
    """What the triage of a whole fleet shares: the statistics, and caches of what most GPUs have in common."""

    stats: WindowStats
    rules: RuleSet | None = None
    _templates: dict[tuple[str, int | None], Evidence] = field(default_factory=dict)
    _missing: dict[tuple[frozenset[str], bool], tuple[Unavailable, ...]] = field(default_factory=dict)
    spec_clock_models: set[str] = field(default_factory=set)  # models whose max clock came from the spec table

    most_samples: float = 0.0  # the anchor field's count of the GPUs that reported all along (fewer: gaps)
    processes: int = 1  # how many processes diagnosed the GPUs (run.triage_rows)

    def __post_init__(self) -> None:
        self.most_samples = max(self.stats.samples, default=0.0)

    def _template(self, info: GpuInfo) -> Evidence:
        """Physics signals and the GPU spec of one model: the same for all its GPUs."""
        key = (info.name, info.memory_total_bytes)
        ev = self._templates.get(key)
        if ev is None:
            ev = self._templates[key] = build_evidence(Capture(target="", started_at=0.0, duration_s=0.0,
                                                               gpus=[info]))
        return ev

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
        """One GPU's signals from its statistics, notes about it, and its maximum SM clock."""
        s = self.stats
        out = _GpuSignals(max(1, int(s.samples[i])) if i < len(s.samples) else 1)
        busy = s.get("gr_engine_active.avg", i)
        if math.isnan(busy):
            busy = s.get("gpu_util.avg", i) * 0.01
        out.add("gpu.busy", busy)
        for name, key in (("gpu.sm_active", "sm_active.avg"), ("gpu.tensor_active", "tensor_active.avg"),
                          ("gpu.dram_active", "dram_active.avg")):
            out.add(name, s.get(key, i))
        # Only what the rules read: the bytes and MHz themselves are for plots, which a fleet row has none of.
        used, used_p90, total = s.get("fb_used.avg", i), s.get("fb_used.p90", i), s.get("fb_total.last", i)
        if total > 0:
            out.add("gpu.mem_total_bytes", total * MIB)
            out.add("gpu.mem_used_frac", used / total, p90=_or_none(used_p90 / total))
        max_clock = self._clock(i, ident, out)
        _throttling(s, i, out)
        for name, direction in (("gpu.pcie_tx_bps", "tx"), ("gpu.pcie_rx_bps", "rx")):
            mean, p90 = s.get(f"pcie_{direction}.avg", i), s.get(f"pcie_{direction}.p90", i)
            if math.isnan(mean):
                mean, p90 = s.get(f"pcie_{direction}_total.rate", i), math.nan
            out.add(name, mean, p90=_or_none(p90))
        notes = _errors(s, i, ident, out)
        return out.signals, notes, max_clock or None

    def _clock(self, i: int, ident: GpuIdentity, out: _GpuSignals) -> float | None:
        """The SM clock as a share of the maximum (the spec table's where DCGM does not export it); the maximum."""
        s = self.stats
        clock = s.get("sm_clock.avg", i)
        max_clock: float | None = s.get("max_sm_clock.last", i)
        if max_clock is None or math.isnan(max_clock) or max_clock <= 0:
            max_clock, _ = spec_max_clock(ident.model)
            if max_clock and not math.isnan(clock):
                self.spec_clock_models.add(ident.model)
        if max_clock and not math.isnan(clock):
            out.add("gpu.sm_clock_frac", clock / max_clock)
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
        template = self._template(info)
        meta = Meta(target=ident.describe(), window_s=window.length_s, started_at=window.start, host=ident.node,
                    tool_version=__version__, origin="fleet", gpus=(info,), notes=tuple(notes),
                    unavailable=self._unavailable(produced, bool(ident.mig_id)))
        ev = Evidence(signals={**template.signals, **signals}, meta=meta, gpu_spec=template.gpu_spec,
                      notes=list(template.notes))
        characterise(ev)  # the regime, from the counters, as for any capture
        busy = signals.get("gpu.busy") or signals.get("gpu.sm_active")
        return diagnose_evidence(ev, self.rules), busy.mean if busy is not None else None, \
            bool(produced & _ACTIVITY), bool(produced)


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


def _throttling(s: WindowStats, i: int, out: _GpuSignals) -> None:
    """The throttled shares of time: from the violation counters, else from the clock-event mask's statistics."""
    low, high, mean = s.get("reasons_power.min", i), s.get("reasons_power.max", i), s.get("reasons_power.avg", i)
    for name, counter, mask in (("gpu.throttle.power", "power_violation.rate", CLOCK_EVENT_POWER),
                                ("gpu.throttle.thermal", "thermal_violation.rate", CLOCK_EVENT_THERMAL),
                                ("gpu.throttle.power_brake", "", CLOCK_EVENT_BRAKE),
                                ("gpu.throttle.other", "", CLOCK_EVENT_OTHER)):
        share = s.get(counter, i) * 1e-9 if counter else math.nan  # ns of throttling per second
        if math.isnan(share) and not (math.isnan(low) or math.isnan(high) or math.isnan(mean)):
            share = bit_shares(low, high, mean, mask)
        if not math.isnan(share):
            share = min(1.0, max(0.0, share))
            # The share of time throttled is the mean of a 0/1 signal: exactly what "samples above 0.5" asks.
            out.add(name, share, frac_above={0.5: share})


def _errors(s: WindowStats, i: int, ident: GpuIdentity, out: _GpuSignals) -> list[str]:
    """The XID and double-bit ECC signals; a note naming the XID DCGM reports."""
    notes: list[str] = []
    xid = s.get("xid.max", i)
    if not math.isnan(xid):
        flag = float(xid > 0)
        out.add("gpu.xid_errors", flag, high=flag)
        if xid > 0:
            notes.append(f"DCGM reports XID {int(xid)} on {ident.describe()} (DCGM_FI_DEV_XID_ERRORS holds the "
                         "last XID seen, which may predate the window).")
    ecc = s.get("ecc_dbe.increase", i)
    if not math.isnan(ecc):
        out.add("gpu.ecc_dbe", max(0.0, ecc), high=max(0.0, ecc))
    return notes


_ACTIVITY = frozenset({"gpu.busy", "gpu.sm_active", "gpu.dram_active", "gpu.tensor_active"})
_UNITS = {name: spec(name).unit for name in (
    "gpu.busy", "gpu.sm_active", "gpu.tensor_active", "gpu.dram_active", "gpu.mem_total_bytes", "gpu.mem_used_frac",
    "gpu.sm_clock_frac", "gpu.throttle.power", "gpu.throttle.thermal", "gpu.throttle.power_brake",
    "gpu.throttle.other", "gpu.pcie_tx_bps", "gpu.pcie_rx_bps", "gpu.xid_errors", "gpu.ecc_dbe")}


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


__all__ = ["Triage"]
