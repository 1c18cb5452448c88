"""The fleet's one table from DCGM field statistics to signals: for each (signal, statistic) a rule may read on the
fleet path, the window statistics of DCGM fields (`Stat`s, one number per GPU that the time-series engine computes)
it is computed from, and how.

The rules declare what they read (`@rule(reads=...)`); the statistics the fleet asks the engine for
(prom_stats.STATS, and with them the rule group's recorded series) are those the declarations need through this
table, and `check_fleet_reads` refuses a rule set with a rule reading a statistic of a DCGM signal that no entry here
computes: on the fleet path it would get a value interpolated from the mean instead of failing. A signal is always
made with its mean (a Signal has one), so a signal read at all costs its mean's statistics too.

To let a rule read a new DCGM statistic: add its `Stat` to the group's `inputs` (in the order the engine is asked),
the (signal, statistic) it gives to the group's `reads`, and compute it in the group's `make`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from dataclasses import field as dataclass_field  # Stat has a field named `field`
from typing import TYPE_CHECKING, Protocol

from diagnoser import signals as S
from diagnoser.collectors.dcgm import (
    CLOCK_EVENT_BRAKE,
    CLOCK_EVENT_OTHER,
    CLOCK_EVENT_POWER,
    CLOCK_EVENT_THERMAL,
    FIELDS,
    MIB,
)

if TYPE_CHECKING:
    from diagnoser.rules.base import Rule

# The statistics' names as rules.base.Statistic spells them (a str enum: equal to these), kept as text here because
# the rule set checks its rules against this table when it is made.
MEAN, VALUE, P90, MAX, FRAC_ABOVE = "mean", "value", "p90", "max", "frac_above"


@dataclass(frozen=True)
class Stat:
    """One statistic of one field over the window. `field` is a DCGM field key, or `fb_total` (used + free memory,
    the board or MIG slice less its reserve)."""

    field: str
    stat: str  # avg, p90, min, max, last, rate, increase
    key: str = dataclass_field(init=False, compare=False, repr=False)  # "field.stat": WindowStats' column, read per GPU

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.field}.{self.stat}")


class GpuStats(Protocol):
    """One GPU's statistics as a group's `make` reads them (NaN: no value), and its maximum SM clock."""

    max_clock: float | None

    def get(self, stat: Stat) -> float: ...


class Add(Protocol):
    """Adds one signal of the GPU (nothing when `mean` is NaN)."""

    def __call__(self, name: str, mean: float, p90: float | None = None, high: float | None = None,
                 frac_above: dict[float, float] | None = None) -> None: ...


Pair = tuple[str, str]


@dataclass(frozen=True)
class Group:
    """Signals made together from the same statistics: `inputs` in the order the engine is asked for them, `reads`
    each (signal, statistic) the fleet can give with the inputs it is computed from, `make` one GPU's signals."""

    inputs: tuple[Stat, ...]
    reads: Mapping[Pair, tuple[Stat, ...]]
    make: Callable[[GpuStats, Add], None] = field(compare=False)


GR_ENGINE_ACTIVE = Stat("gr_engine_active", "avg")
# GPU_UTIL stands in for GR_ENGINE_ACTIVE, asked separately and only for the GPUs that lack the latter.
GPU_UTIL = Stat("gpu_util", "avg")
SM_ACTIVE, TENSOR_ACTIVE = Stat("sm_active", "avg"), Stat("tensor_active", "avg")
DRAM_ACTIVE = Stat("dram_active", "avg")
FB_USED, FB_USED_P90, FB_TOTAL = Stat("fb_used", "avg"), Stat("fb_used", "p90"), Stat("fb_total", "last")
SM_CLOCK, MAX_SM_CLOCK = Stat("sm_clock", "avg"), Stat("max_sm_clock", "last")
POWER_VIOLATION, THERMAL_VIOLATION = Stat("power_violation", "rate"), Stat("thermal_violation", "rate")
# The clock event mask, as numbers: testing its bits sample by sample takes a subquery, which costs Prometheus 30-50
# times an average (benchmarks/FLEET.md). Its minimum, maximum and mean give each group of bits' share of the window
# exactly while the mask takes at most two values (one held all window, or clocks held and released), which is how
# it moves (`bit_shares`).
REASONS = (Stat("reasons_power", "min"), Stat("reasons_power", "max"), Stat("reasons_power", "avg"))
PCIE = {d: (Stat(f"pcie_{d}", "avg"), Stat(f"pcie_{d}", "p90"), Stat(f"pcie_{d}_total", "rate")) for d in ("tx", "rx")}
XID, ECC_DBE = Stat("xid", "max"), Stat("ecc_dbe", "increase")


def bit_shares(low: float, high: float, mean: float, mask: int) -> float:
    """The share of the window a clock event mask had one of `mask`'s bits set, from the mask's minimum, maximum and
    mean over the window: exact while it took at most two values (the time at the maximum is (mean - min) /
    (max - min)), an estimate otherwise."""
    at_low, at_high = float(bool(int(low) & mask)), float(bool(int(high) & mask))
    if high <= low:
        return at_high
    return min(1.0, max(0.0, (at_low * (high - mean) + at_high * (mean - low)) / (high - low)))


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


# --- how each group makes its signals ----------------------------------------------------------------------------

def _busy(g: GpuStats, add: Add) -> None:
    busy = g.get(GR_ENGINE_ACTIVE)
    add(S.GPU_BUSY, g.get(GPU_UTIL) * 0.01 if math.isnan(busy) else busy)


def _activity(name: str, stat: Stat) -> Callable[[GpuStats, Add], None]:
    def make(g: GpuStats, add: Add) -> None:
        add(name, g.get(stat))
    return make


def _memory(g: GpuStats, add: Add) -> None:
    # Only what the rules read: the bytes themselves are for plots, which a fleet row has none of.
    total = g.get(FB_TOTAL)
    if total > 0:
        add(S.GPU_MEM_TOTAL_BYTES, total * MIB)
        add(S.GPU_MEM_USED_FRAC, g.get(FB_USED) / total, p90=_or_none(g.get(FB_USED_P90) / total))


def _clock(g: GpuStats, add: Add) -> None:
    clock = g.get(SM_CLOCK)
    if g.max_clock and not math.isnan(clock):
        add(S.GPU_SM_CLOCK_FRAC, clock / g.max_clock)


_THROTTLES = ((S.GPU_THROTTLE_POWER, POWER_VIOLATION, CLOCK_EVENT_POWER),
              (S.GPU_THROTTLE_THERMAL, THERMAL_VIOLATION, CLOCK_EVENT_THERMAL),
              (S.GPU_THROTTLE_BRAKE, None, CLOCK_EVENT_BRAKE),
              (S.GPU_THROTTLE_OTHER, None, CLOCK_EVENT_OTHER))


def _throttling(g: GpuStats, add: Add) -> None:
    """The throttled shares of time: from the violation counters, else from the clock-event mask's statistics."""
    low, high, mean = (g.get(s) for s in REASONS)
    for name, counter, mask in _THROTTLES:
        share = g.get(counter) * 1e-9 if counter is not None else math.nan  # ns of throttling per second
        if math.isnan(share) and not (math.isnan(low) or math.isnan(high) or math.isnan(mean)):
            share = bit_shares(low, high, mean, mask)
        if not math.isnan(share):
            share = min(1.0, max(0.0, share))
            # The share of time throttled is the mean of a 0/1 signal: exactly what "samples above 0.5" asks.
            add(name, share, frac_above={0.5: share})


def _pcie(g: GpuStats, add: Add) -> None:
    for name, (avg, p90, total) in ((S.GPU_PCIE_TX_BPS, PCIE["tx"]), (S.GPU_PCIE_RX_BPS, PCIE["rx"])):
        mean, high = g.get(avg), g.get(p90)
        if math.isnan(mean):
            mean, high = g.get(total), math.nan
        add(name, mean, p90=_or_none(high))


def _errors(g: GpuStats, add: Add) -> None:
    xid = g.get(XID)
    if not math.isnan(xid):
        flag = float(xid > 0)
        add(S.GPU_XID_ERRORS, flag, high=flag)
    ecc = g.get(ECC_DBE)
    if not math.isnan(ecc):
        add(S.GPU_ECC_DBE, max(0.0, ecc), high=max(0.0, ecc))


def _same(name: str, stats: Iterable[str], inputs: tuple[Stat, ...]) -> dict[Pair, tuple[Stat, ...]]:
    return {(name, s): inputs for s in stats}


# A throttled share is the mean of a 0/1 signal; its share of samples above 0.5 (what THR001 asks) is given exactly.
_THROTTLE_READS: dict[Pair, tuple[Stat, ...]] = {}
for _name, _counter, _ in _THROTTLES:
    _THROTTLE_READS.update(_same(_name, (MEAN, VALUE, FRAC_ABOVE), (*((_counter,) if _counter else ()), *REASONS)))

# In the order the engine is asked for the statistics (prom_stats.STATS keeps it).
TABLE: tuple[Group, ...] = (
    Group((GR_ENGINE_ACTIVE,), _same(S.GPU_BUSY, (MEAN, VALUE), (GR_ENGINE_ACTIVE, GPU_UTIL)), _busy),
    *(Group((stat,), _same(name, (MEAN, VALUE), (stat,)), _activity(name, stat))
      for name, stat in ((S.GPU_SM_ACTIVE, SM_ACTIVE), (S.GPU_TENSOR_ACTIVE, TENSOR_ACTIVE),
                         (S.GPU_DRAM_ACTIVE, DRAM_ACTIVE))),
    Group((FB_USED, FB_USED_P90, FB_TOTAL),
          {**_same(S.GPU_MEM_TOTAL_BYTES, (MEAN, VALUE, MAX), (FB_TOTAL,)),  # a constant: its max is its value
           **_same(S.GPU_MEM_USED_FRAC, (MEAN, VALUE), (FB_USED, FB_TOTAL)),
           (S.GPU_MEM_USED_FRAC, P90): (FB_USED_P90, FB_TOTAL)}, _memory),
    Group((SM_CLOCK, MAX_SM_CLOCK), _same(S.GPU_SM_CLOCK_FRAC, (MEAN, VALUE), (SM_CLOCK, MAX_SM_CLOCK)), _clock),
    Group((POWER_VIOLATION, THERMAL_VIOLATION, *REASONS), _THROTTLE_READS, _throttling),
    Group((PCIE["tx"][0], PCIE["tx"][1], PCIE["rx"][0], PCIE["rx"][1], PCIE["tx"][2], PCIE["rx"][2]),
          {**_same(S.GPU_PCIE_TX_BPS, (MEAN, VALUE), (PCIE["tx"][0], PCIE["tx"][2])),
           (S.GPU_PCIE_TX_BPS, P90): (PCIE["tx"][1],),
           **_same(S.GPU_PCIE_RX_BPS, (MEAN, VALUE), (PCIE["rx"][0], PCIE["rx"][2])),
           (S.GPU_PCIE_RX_BPS, P90): (PCIE["rx"][1],)}, _pcie),
    Group((XID, ECC_DBE), {**_same(S.GPU_XID_ERRORS, (MEAN, VALUE, MAX), (XID,)),
                           **_same(S.GPU_ECC_DBE, (MEAN, VALUE, MAX), (ECC_DBE,))}, _errors),
)
PRODUCES: dict[Pair, tuple[Stat, ...]] = {pair: stats for g in TABLE for pair, stats in g.reads.items()}
FLEET_SIGNALS: frozenset[str] = frozenset(name for name, _ in PRODUCES)

# What the engine reads of a fleet GPU's signals besides the rules: characterise's regime (DRAM and tensor
# activity), the gains (busy, tensor activity), the fleet row's busy share and the GPU's memory size.
ENGINE_READS: tuple[Pair, ...] = ((S.GPU_BUSY, MEAN), (S.GPU_SM_ACTIVE, MEAN), (S.GPU_DRAM_ACTIVE, VALUE),
                                  (S.GPU_TENSOR_ACTIVE, VALUE), (S.GPU_MEM_TOTAL_BYTES, MEAN))


# Signals DCGM has that the fleet does not ask for, though a rule reads them where a capture has them: on the fleet
# the rule finds them absent, as it would on a host without them.
NOT_ON_FLEET: dict[str, str] = {
    S.GPU_POWER_LIMIT_W: "THR001 names a lowered power cap only where a capture read it",
    S.GPU_POWER_DEFAULT_LIMIT_W: "THR001 names a lowered power cap only where a capture read it",
}
# Every signal a DCGM field gives (dcgm.py): a rule's read of one is the fleet's concern.
DCGM_SIGNALS: frozenset[str] = frozenset(f.signal for f in FIELDS if f.signal)


def unproducible(rules: Iterable[Rule]) -> list[str]:
    """One sentence for each statistic a rule reads of a DCGM signal that the fleet cannot compute."""
    out: list[str] = []
    for r in rules:
        for name, stat in r.read_pairs():
            if (name, stat) in PRODUCES or name in NOT_ON_FLEET or name not in DCGM_SIGNALS | FLEET_SIGNALS:
                continue
            can = ", ".join(str(s) for n, s in PRODUCES if n == name)
            has = f"it has {can}" if can else "it makes no such signal"
            out.append(f"rule {r.code} reads {stat} of {name}, which the fleet cannot compute from DCGM statistics "
                       f"({has}): add it to the table in diagnoser/collectors/dcgm_stats.py (or, for a signal the "
                       "fleet need not make, to its NOT_ON_FLEET with why).")
    return out


def check_fleet_reads(rules: Iterable[Rule]) -> None:
    """Refuse rules that would read, on the fleet path, a statistic interpolated from the mean."""
    problems = unproducible(rules)
    if problems:
        raise ValueError(" ".join(problems))


def needed(rules: Iterable[Rule]) -> set[Stat]:
    """The DCGM statistics the rules' declared reads (and the engine's own) are computed from; a signal read at all
    is made with its mean, so its mean's statistics come too."""
    pairs = [*ENGINE_READS, *(p for r in rules for p in r.read_pairs() if p[0] in FLEET_SIGNALS)]
    pairs += [(name, MEAN) for name, _ in pairs]
    return {s for pair in pairs for s in PRODUCES.get(pair, ())}


def stats_for(rules: Iterable[Rule]) -> tuple[Stat, ...]:
    """The statistics to ask the engine for, in the table's order (the GPU_UTIL fallback apart: asked separately)."""
    want = needed(rules)
    out: list[Stat] = []
    for g in TABLE:
        out.extend(s for s in g.inputs if s in want and s not in out)
    return tuple(out)


__all__ = ["DCGM_SIGNALS", "ENGINE_READS", "FLEET_SIGNALS", "NOT_ON_FLEET", "GPU_UTIL", "MAX_SM_CLOCK", "PRODUCES",
           "SM_CLOCK", "TABLE", "XID", "Add", "GpuStats", "Group", "Stat", "bit_shares", "check_fleet_reads",
           "needed", "stats_for", "unproducible"]
