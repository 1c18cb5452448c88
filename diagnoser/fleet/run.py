"""The fleet view: one verdict per GPU (or MIG instance) of a whole cluster over a window, from Prometheus.

Triage first: the time-series engine computes each GPU's window statistics (collectors/prom_stats.py: one number per
GPU and statistic, or the rule group's recorded series), and the normal rule engine diagnoses every GPU from them
(triage.py). Then only the GPUs that matter most, the top `detail` by money at stake (or every GPU chosen with
--node/--pod/--gpu/--uuid when they are few), are read again as points over the window (collectors/
prometheus_source.py) and diagnosed from those, as `diagnoser dcgm` would. Each GPU gets a price of what is at stake:
an idle GPU or one reporting errors puts its whole price at stake, an underfed one (batching, host-bound) the share
of time it sits idle, and any other limiter what its top fix predicts: price x (1 - 1/gain).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import multiprocessing
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import msgspec

from diagnoser import __version__
from diagnoser.capture import Capture
from diagnoser.collectors.dcgm import (
    FIELDS_BY_KEY,
    GpuIdentity,
    GpuSelector,
    add_gpu_window,
    drop_mig_parents,
    mark_missing,
    select_gpus,
)
from diagnoser.collectors.prom_client import PromClient
from diagnoser.collectors.prom_stats import FALLBACK, STATS, STATS_BY_KEY, StatsQuery, WindowStats
from diagnoser.collectors.prometheus_source import Window, WindowData, WindowQuery, matchers_for
from diagnoser.cores import default_jobs
from diagnoser.diagnosis import SCHEMA_VERSION, Diagnosis, Limiter, Verdict
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.fleet.pack import PackedDiagnosis, RowPacker, unpack_rows
from diagnoser.fleet.triage import Triage
from diagnoser.physics import match_gpu
from diagnoser.pipeline import Pipeline
from diagnoser.rules.ruleset import Overrides as Thresholds
from diagnoser.rules.ruleset import RuleSet, default_rules

# Rough on-demand list prices per GPU-hour, USD, from the large clouds' public price pages in 2025 (an 8-GPU instance
# divided by 8). Contracts, reservations and spot prices differ widely: pass --usd-per-gpu-hour for real numbers.
PRICE_USD_PER_GPU_HOUR: dict[str, float] = {
    "b200": 14.0,
    "h200": 7.9,
    "h200-nvl": 7.0,
    "h100-sxm": 6.9,
    "h100-nvl": 5.5,
    "h100-pcie": 5.0,
    "a100-80gb-sxm": 4.1,
    "a100-80gb-pcie": 3.7,
    "a100-40gb-sxm": 3.0,
    "a100-40gb-pcie": 2.9,
    "l40s": 1.9,
    "l40": 1.5,
    "a10g": 1.0,
    "a10": 1.0,
    "l4": 0.8,
    "rtx-4090": 0.7,
    "t4": 0.53,
}
PRICE_SOURCE = "rough 2025 cloud on-demand list prices (diagnoser/fleet/run.py); override with --usd-per-gpu-hour"
# MIG slices of a whole GPU: 7 on A100/H100/H200/B200, 4 on A30.
_MIG_SLICES = {"a30": 4}
_MIG_PROFILE = re.compile(r"^(\d+)g\.")

GROUPINGS = ("node", "model", "namespace", "pod")
# Verdicts whose whole GPU is at stake, and those where the idle share is.
_WHOLE = {Limiter.IDLE.value, Limiter.ERRORS.value}
_UNDERFED = {Limiter.BATCHING.value, Limiter.HOST_LAUNCH.value}


def gpu_price(model_name: str, mig_profile: str = "", override: float | None = None) -> float | None:
    """USD per hour of this GPU (or its MIG slice): the override, else the rough table; None when unknown."""
    if override is not None:
        price: float | None = override
    else:
        spec = match_gpu(model_name) if model_name else None
        price = PRICE_USD_PER_GPU_HOUR.get(spec.key) if spec is not None else None
    if price is None or not mig_profile:
        return price
    found = _MIG_PROFILE.match(mig_profile)
    if not found:
        return price
    slices = _MIG_SLICES.get("a30" if "A30" in model_name.upper() else "", 7)
    return price * min(1.0, int(found.group(1)) / slices)


def stake_fraction(d: Diagnosis, busy: float | None) -> float:
    """Share of the GPU's price at stake under this diagnosis (0 when nothing can be said)."""
    if d.verdict in _WHOLE:
        return 1.0
    if d.verdict in _UNDERFED:
        return max(0.0, 1.0 - busy) if busy is not None else 0.0
    if d.verdict == Verdict.INCONCLUSIVE:
        return 0.0
    gain = next((f.gain for f in d.fixes if f.gain is not None), None)
    return max(0.0, 1.0 - 1.0 / gain) if gain and gain > 1.0 else 0.0


def _busy(ev) -> float | None:  # type: ignore[no-untyped-def]
    for name in ("gpu.busy", "gpu.sm_active"):
        s = ev.get(name)
        if s is not None:
            return s.mean
    return None


def _row(data: WindowData, ident: GpuIdentity, usd_per_gpu_hour: float | None,
         thresholds: Thresholds | None) -> FleetRow:
    """One GPU: its own small capture, diagnosed by the normal engine, and what is at stake."""
    window = data.window
    cap = Capture(target=ident.describe(), started_at=window.start, duration_s=window.length_s, host=ident.node,
                  tool_version=__version__)
    produced = add_gpu_window(cap, data.gpu_window(ident.key))
    mark_missing(cap, set(produced), fields_in_source=data.fields_present, failed=data.failed, mig=bool(ident.mig_id))
    notes: list[str] = []
    gaps = data.gaps(ident.key)
    if gaps:
        notes.append(f"series partial: {gaps}")
        cap.notes.append(f"DCGM series are partial: {gaps}.")
    if data.failed:
        notes.append("some field queries failed: " + ", ".join(sorted(data.failed)))
    outcome = Pipeline(_rules_for(thresholds)).diagnose(cap)  # as any command diagnoses a capture
    return _fleet_row(ident, outcome.diagnosis, _busy(outcome.evidence), usd_per_gpu_hour, notes=notes,
                      partial=bool(gaps or data.failed), basis="points")


# The basis of a row whose GPU reports no field the fleet reads (only its temperature, say, or free memory without
# the memory used): listed, with what it reports, but not diagnosed.
NOT_DIAGNOSED = "not diagnosed"
NO_RULE_FIELD = "no field a rule reads"


def reported_names(stats: WindowStats, i: int) -> list[str]:
    """The DCGM metric names a GPU reports: those read by UUID when the anchor missed it, else the fields whose
    statistics have a value of its own."""
    key = stats.keys[i]
    seen = stats.names_seen.get(key)
    if seen:
        return sorted(seen)
    names: set[str] = set()
    for stat_key, column in stats.values.items():
        if column[i] == column[i]:
            stat = STATS_BY_KEY[stat_key]
            fields = ("fb_used", "fb_free") if stat.field == "fb_total" else (stat.field,)
            names.update(FIELDS_BY_KEY[f].name for f in fields)
    return sorted(names)


def _stats_row(triage: Triage, usd_per_gpu_hour: float | None, item: tuple[int, GpuIdentity]) -> FleetRow:
    """One GPU diagnosed from its window statistics, and what is at stake; or, when it reports no field a rule
    reads, listed as not diagnosed, with what it does report."""
    i, ident = item
    stats = triage.stats
    diagnosis, busy, has_counters, has_signals = triage.diagnose(i, ident)
    notes: list[str] = []
    expected = stats.expected_samples()
    if not has_signals and not any(column[i] == column[i] for column in stats.values.values()):
        names = reported_names(stats, i)
        notes.append(f"{NOT_DIAGNOSED}: {NO_RULE_FIELD} (only {', '.join(names) if names else 'no DCGM field'})")
        return _fleet_row(ident, diagnosis, busy, usd_per_gpu_hour, notes=notes, partial=True, basis=NOT_DIAGNOSED)
    if not has_counters:
        notes.append("no activity counters: none of GR_ENGINE_ACTIVE/GPU_UTIL, SM_ACTIVE, DRAM_ACTIVE, "
                      "PIPE_TENSOR_ACTIVE has a value for this GPU in the window")
    elif stats.keys[i] in stats.silent:
        # Silent at the end, whether or not every other GPU fell silent too (a fleet-wide outage).
        notes.append(f"series partial: no sample in the window's last {stats.quiet_s:.0f} s (exporter or GPU "
                     f"gone); {int(stats.samples[i])} of {int(expected)} samples in the window")
    elif expected and stats.samples[i] < 0.9 * expected:
        notes.append(f"series partial: {int(stats.samples[i])} of {int(expected)} samples in the window")
    if stats.failed:
        notes.append("some statistic queries failed: " + ", ".join(sorted(stats.failed)))
    return _fleet_row(ident, diagnosis, busy, usd_per_gpu_hour, notes=notes, partial=bool(notes),
                      basis="recorded statistics" if stats.recorded else "statistics")


def _fleet_row(ident: GpuIdentity, diagnosis: Diagnosis, busy: float | None, usd_per_gpu_hour: float | None, *,
               notes: list[str], partial: bool, basis: str) -> FleetRow:
    """A GPU's row: who it is, its diagnosis, and the money at stake on it."""
    price = _price(ident.model, ident.mig_profile, usd_per_gpu_hour)
    frac = stake_fraction(diagnosis, busy)
    gain = next((f.gain for f in diagnosis.fixes if f.gain is not None), None)
    return FleetRow(
        node=ident.node, gpu=ident.label, uuid=ident.uuid, model_name=ident.model, diagnosis=diagnosis,
        pod=", ".join(p for _, p in ident.pods), namespace=", ".join(ident.namespaces),
        container=", ".join(ident.containers), mig_profile=ident.mig_profile,
        usd_per_hour_at_stake=round(frac * price, 4) if price else 0.0, top_fix_gain=gain,
        frac_at_stake=round(frac, 4), usd_per_gpu_hour=price, busy=busy, partial=partial, notes=notes, basis=basis)


_RULES: list[tuple[object, RuleSet]] = []


def _rules_for(thresholds: Thresholds | None) -> RuleSet:
    """The rule set with these overrides, built once per fleet run (the same mapping for every GPU)."""
    if _RULES and _RULES[0][0] is thresholds:
        return _RULES[0][1]
    rules = default_rules().with_overrides(thresholds)
    _RULES[:] = [(thresholds, rules)]
    return rules


@functools.lru_cache(maxsize=256)
def _price(model: str, mig_profile: str, override: float | None) -> float | None:
    return gpu_price(model, mig_profile, override)


def build_rows(data: WindowData, *, usd_per_gpu_hour: float | None = None,
               thresholds: Thresholds | None = None) -> list[FleetRow]:
    """One row per GPU or MIG instance diagnosed from its points over the window, most money at stake first."""
    return _sorted([_row(data, ident, usd_per_gpu_hour, thresholds) for ident in drop_mig_parents(data.gpus.values())])


# GPUs per triage task in a worker process: about 0.1 s of diagnosis, so a task's overhead is nil; a fleet of fewer
# than two tasks' worth is diagnosed in this process.
TRIAGE_CHUNK = 1000
# What forked triage workers inherit: the triage, the price override, the GPUs in order.
_FORKED: tuple[Triage, float | None, list[tuple[int, GpuIdentity]]] | None = None


def triage_rows(stats: WindowStats, *, usd_per_gpu_hour: float | None = None, thresholds: Thresholds | None = None,
                processes: int | None = None, chunk: int = TRIAGE_CHUNK) -> tuple[list[FleetRow], Triage]:
    """One row per GPU or MIG instance diagnosed from its window statistics, most money at stake first.

    A GPU costs the rule engine about 100 us, so a large fleet is diagnosed by `processes` processes, this one
    included, `chunk` GPUs a task: by default a worker per core this process may use, when there are two tasks or
    more (this process mostly unpacks what they send, and takes the tasks they have not reached). The workers send
    their rows back with each diagnosis packed (pack.py): decoding them all here would cost about as much as
    making them. The rows are the same as one process makes, in the same order
    (tests/test_fleet_parallel.py)."""
    triage = Triage(stats, _rules_for(thresholds))
    items = [(stats.index[g.key], g) for g in drop_mig_parents(stats.gpus.values())]
    chunk = max(1, chunk)
    if processes is None:  # a worker per core, for a fleet of two tasks or more; this process takes what is left
        procs = min(default_jobs() + 1, len(items) // chunk)
    else:  # as many as asked, each with work, at most four a core (-j 1000 is a typo, not 1,000 forks)
        procs = min(max(1, processes), len(items), 4 * default_jobs())
        chunk = min(chunk, -(-len(items) // max(1, procs)))
    # Forked only from a single thread unless asked for: a lock another thread held at the fork stays held in the
    # child (the diagnosis itself takes none, but an embedding program's threads are not ours to reason about).
    alone = threading.active_count() == 1 or processes is not None
    if procs >= 2 and alone and "fork" in multiprocessing.get_all_start_methods():
        rows, triage.processes = _triage_forked(triage, usd_per_gpu_hour, items, procs, chunk)
    else:
        rows = [_stats_row(triage, usd_per_gpu_hour, item) for item in items]
    return _sorted(rows), triage


def _triage_forked(triage: Triage, usd_per_gpu_hour: float | None, items: list[tuple[int, GpuIdentity]],
                   processes: int, chunk: int) -> tuple[list[FleetRow], int]:
    """The rows of `items`, in order, made by this process and `processes - 1` forked workers; and how many processes
    made some. The workers take tasks from the front, two each in flight, this process from the back, so neither
    waits on the other; a task whose worker died is done here."""
    global _FORKED
    _FORKED = (triage, usd_per_gpu_hour, items)
    tasks = [(lo, min(len(items), lo + chunk)) for lo in range(0, len(items), chunk)]
    sent: list[Future[bytes]] = []
    done_here: dict[int, list[FleetRow]] = {}
    front, back = 0, len(tasks)  # tasks[front:back] are nobody's yet
    workers = processes - 1
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            broken = False
            while front < back:
                while not broken and front < back and sum(not f.done() for f in sent[-2 * workers:]) < 2 * workers:
                    try:
                        sent.append(pool.submit(_triage_task, *tasks[front]))
                    except BrokenProcessPool:
                        broken = True
                        break
                    front += 1
                if front < back:
                    back -= 1
                    done_here[back] = _rows_here(triage, usd_per_gpu_hour, items, *tasks[back])
            rows: list[FleetRow] = []
            by_workers = False
            for k, (lo, hi) in enumerate(tasks):
                part = done_here.get(k)
                if part is None:
                    try:
                        part, clock_models = unpack_rows(sent[k].result())
                    except BrokenProcessPool:
                        part = _rows_here(triage, usd_per_gpu_hour, items, lo, hi)
                    else:
                        triage.spec_clock_models.update(clock_models)
                        by_workers = True
                rows.extend(part)
    finally:
        _FORKED = None
    return rows, processes if by_workers else 1


def _rows_here(triage: Triage, usd_per_gpu_hour: float | None, items: list[tuple[int, GpuIdentity]], lo: int,
               hi: int) -> list[FleetRow]:
    return [_stats_row(triage, usd_per_gpu_hour, item) for item in items[lo:hi]]


def _triage_task(lo: int, hi: int) -> bytes:
    """In a forked worker: the rows of items[lo:hi], packed."""
    assert _FORKED is not None, "the triage workers are forked from triage_rows"
    triage, usd_per_gpu_hour, items = _FORKED
    gc.disable()  # the parent's objects, shared copy-on-write, stay untouched; nothing here forms cycles
    packer = RowPacker()
    for item in items[lo:hi]:
        packer.add(_stats_row(triage, usd_per_gpu_hour, item))
    return packer.finish(sorted(triage.spec_clock_models))


def _sorted(rows: list[FleetRow]) -> list[FleetRow]:
    rows.sort(key=lambda r: (-r.usd_per_hour_at_stake, -r.frac_at_stake, r.node, r.gpu))
    return rows


# Values per GPU and field when a GPU is read as points (the top of the triage, --detail).
DEFAULT_POINTS = 30


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a fleet run allocates millions of small objects that all live to its end
    (answers, captures, diagnoses), so every collection walked them for nothing. At 10,000 GPUs that was 3 CPU
    seconds of the command's 8, plus copy-on-write pages in the forked workers, for 40 MiB more peak memory when
    paused (benchmarks/FLEET.md). The previous state comes back at the end, nested or not."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# GPUs read again as points after the triage: the top of the list by money at stake.
DEFAULT_DETAIL = 20


def run_fleet(client: PromClient, window: Window, *, points: int | None = None,
              usd_per_gpu_hour: float | None = None, thresholds: Thresholds | None = None, workers: int = 4,
              notes: list[str] | None = None, timings: dict[str, float | int | None] | None = None,
              detail: int = DEFAULT_DETAIL, selector: GpuSelector | None = None,
              use_recorded: bool = True, processes: int | None = None) -> FleetReport:
    """Diagnose every GPU Prometheus knows over the window (or those `selector` picks): triage from window
    statistics (in `processes` processes, by default a worker per core for a large fleet: triage_rows), then points
    for the top `detail` GPUs at stake. Partial failures are kept in report.errors and the rows they touch are marked
    partial; only a failed discovery, or every statistic failing, raises SourceUnavailable. `notes` receives how the
    data was read and `timings` where the time went."""
    if usd_per_gpu_hour is not None and usd_per_gpu_hour < 0:
        raise InputError("--usd-per-gpu-hour cannot be negative.")
    if detail < 0:
        raise InputError("--detail cannot be negative.")
    with gc_paused():
        return _run_fleet(client, window, points=points, usd_per_gpu_hour=usd_per_gpu_hour, thresholds=thresholds,
                          workers=workers, notes=notes, timings=timings, detail=detail, selector=selector,
                          use_recorded=use_recorded, processes=processes)


def _run_fleet(client: PromClient, window: Window, *, points: int | None, usd_per_gpu_hour: float | None,
               thresholds: Thresholds | None, workers: int, notes: list[str] | None,
               timings: dict[str, float | int | None] | None, detail: int, selector: GpuSelector | None,
               use_recorded: bool, processes: int | None) -> FleetReport:
    t0 = time.perf_counter()
    if window.length_s < 2:
        raise InputError("the window is too short to read from Prometheus (under 2 s).")
    select = functools.partial(_select, selector) if selector is not None and not selector.is_empty() else None
    stats = StatsQuery(client, window, workers=workers).run(use_recorded=use_recorded, select=select)
    t1 = time.perf_counter()
    if not stats.fields_present and (stats.failed or not stats.values):
        reason = next(iter(stats.failed.values()), "no counters in the window")
        raise SourceUnavailable(f"Prometheus listed {len(stats.gpus)} GPUs but no counter could be read: {reason}")
    redact_identities(stats.gpus.values())
    # The source as every output shows it: `--prometheus http://user:pass@host` must not print the password.
    report = FleetReport(source=publishable(client.url, {}), window_start=window.start, window_end=window.end,
                         usd_per_gpu_hour=usd_per_gpu_hour, errors=list(stats.errors), lost=sorted(stats.failed))
    rows, triage = triage_rows(stats, usd_per_gpu_hour=usd_per_gpu_hour, thresholds=thresholds,
                               processes=processes)
    t2 = time.perf_counter()
    account = _account(stats, rows, report)
    diagnosable = [r for r in rows if r.basis != NOT_DIAGNOSED]
    wanted = diagnosable[:detail] if selector is None or selector.is_empty() or len(rows) > detail else diagnosable
    detailed = _detail(client, window, stats, wanted, points=points, usd_per_gpu_hour=usd_per_gpu_hour,
                       thresholds=thresholds, workers=workers, report=report) if wanted else {}
    if detailed:
        rows = _sorted([detailed.get((r.uuid, r.gpu), r) for r in rows])
    report.rows = rows
    t3 = time.perf_counter()
    said = [account, *stats.notes]
    said.append(f"{len(diagnosable):,} GPUs diagnosed from window statistics computed by the time-series engine"
                + (f" ({triage.processes} processes)" if triage.processes > 1 else "")
                + (f"; the {len(detailed)} with the most at stake read again as points over the window (--detail)"
                   if detailed else "") + ".")
    if triage.spec_clock_models:
        said.append("DCGM_FI_DEV_MAX_SM_CLOCK is not exported for " + ", ".join(sorted(triage.spec_clock_models))
                    + ": SM clocks are compared with the maximum in the spec table.")
    gappy = sum(1 for r in rows if r.notes and r.notes[0].startswith("series partial"))
    if gappy:
        report.errors.append(f"{gappy} GPU{'s have' if gappy > 1 else ' has'} gaps or stopped reporting within the "
                             "window (rows marked partial).")
    blind = sum(1 for r in rows if r.notes and r.notes[0].startswith("no activity counters"))
    if blind:
        report.errors.append(f"{blind} GPU{'s are' if blind > 1 else ' is'} listed without any activity counter in "
                             "the window (rows marked partial; docs/dcgm.md says which counters to export).")
    report.errors.extend(w for w in client.warnings if w not in report.errors)
    report.query_seconds = round(t3 - t0, 3)
    if notes is not None:
        notes.extend(said)
    if timings is not None:
        timings.update(statistics_s=round(t1 - t0, 3), triage_s=round(t2 - t1, 3), detail_s=round(t3 - t2, 3),
                       queries=client.queries, scrape_interval_s=stats.scrape_interval_s, gpus=len(rows),
                       detailed=len(detailed), recorded=stats.recorded, triage_processes=triage.processes)
    return report


def _plural(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def field_coverage(stats: WindowStats) -> dict[str, int]:
    """How many GPUs (or MIG instances; boards left out) each DCGM field the fleet reads shows, most first."""
    targets = {stats.index[g.key] for g in drop_mig_parents(stats.gpus.values())}
    others = [i for i in range(len(stats.keys)) if i not in targets]
    out: dict[str, int] = {}
    for stat in (*STATS, FALLBACK):
        column = stats.values.get(stat.key)
        name = FIELDS_BY_KEY["fb_used" if stat.field == "fb_total" else stat.field].name
        if stat.field == "fb_total" or column is None or name in out:
            continue
        count = len(column) - sum(map(math.isnan, column)) - sum(1 for i in others if column[i] == column[i])
        if count:
            out[name] = count
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _account(stats: WindowStats, rows: list[FleetRow], report: FleetReport) -> str:
    """The header's account of the GPUs: how many the window holds, how many each field shows, which could not be
    diagnosed and why. Kept in the report too (gpus_seen, gpus_diagnosed, gpus_per_field)."""
    blind = [r for r in rows if r.basis == NOT_DIAGNOSED]
    nodes = len({r.node for r in rows})
    coverage = field_coverage(stats)
    report.gpus_seen = len(rows)
    report.gpus_diagnosed = len(rows) - len(blind)
    report.gpus_per_field = coverage
    text = (f"{_plural(len(rows), 'GPU or MIG instance', 'GPUs or MIG instances')} seen in the window on "
            f"{_plural(nodes, 'node', 'nodes')}, {len(rows) - len(blind):,} diagnosed")
    if stats.found_by_union:
        found = sum(1 for r in rows if (r.uuid, r.gpu.partition("/")[2]) in stats.found_by_union)
        if found:
            text += (f" ({found:,} of them found on DCGM series other than the discovery's {stats.anchor or 'field'}"
                     ")")
    if blind:
        kinds = Counter(r.notes[0].partition("(only ")[2].rstrip(")") for r in blind)
        detail = "; ".join(f"{n:,} only {names}" if len(kinds) > 1 else f"only {names}"
                           for names, n in kinds.most_common())
        said = (f"{_plural(len(blind), 'GPU has', 'GPUs have')} {NO_RULE_FIELD} ({detail}): listed as "
                f"{NOT_DIAGNOSED} (docs/dcgm.md says which counters to export).")
        report.errors.append(said)
        text += f"; {said}"
    else:
        text += "."
    if coverage:
        text += " GPUs per field read: " + ", ".join(f"{name} {n:,}" for name, n in coverage.items()) + "."
    return text


# What can make redact() change a string: its patterns need one of these characters or token prefixes. A label
# value without any (almost every pod, node and model name) is published as it is without running them all: at
# 100,000 GPUs that is 2 s saved. tests/test_fleet_units.py holds the two equal.
_MAYBE_SECRET = re.compile(r"""[=:@\s"']|sk-|hf_|gh[pousr]_|github_pat_|glpat-|xox[abposr]-|AKIA|ASIA|AIza|eyJ""")


def publishable(value: str, cache: dict[str, str]) -> str:
    """A label value as reports may show it: secrets redacted the way the HTML report does (redact())."""
    if not value or _MAYBE_SECRET.search(value) is None:
        return value
    out = cache.get(value)
    if out is None:
        from diagnoser.reports.redact import redact

        out = cache[value] = redact(value)
    return out


def redact_identities(gpus: Iterable[GpuIdentity]) -> None:
    """Label values made publishable in place: a pod label holding a token must not reach --json, the terminal or
    the HTML (each GPU's description, notes and row are built from these)."""
    cache: dict[str, str] = {}
    for g in gpus:
        g.node, g.model, g.mig_profile = (publishable(g.node, cache), publishable(g.model, cache),
                                          publishable(g.mig_profile, cache))
        g.pods = [(publishable(ns, cache), publishable(pod, cache)) for ns, pod in g.pods]
        g.containers = [publishable(c, cache) for c in g.containers]


def _select(selector: GpuSelector, gpus: list[GpuIdentity]) -> list[GpuIdentity]:
    return select_gpus(drop_mig_parents(gpus), selector, many=True)


def _detail(client: PromClient, window: Window, stats: WindowStats, rows: list[FleetRow], *, points: int | None,
            usd_per_gpu_hour: float | None, thresholds: Thresholds | None, workers: int,
            report: FleetReport) -> dict[tuple[str, str], FleetRow]:
    """These GPUs read as points over the window and diagnosed from them; their rows by (UUID, gpu label)."""
    wanted = {(r.uuid, r.gpu) for r in rows}
    idents = [g for g in drop_mig_parents(stats.gpus.values()) if (g.uuid, g.label) in wanted]
    query = WindowQuery(client, window, points=points or DEFAULT_POINTS, workers=workers)
    step = window.length_s / query.points
    data = WindowData(window, step, step, window.start + step, query.points)
    data.gpus = {g.key: g for g in idents}
    data.samples = {g.key: stats.samples[stats.index[g.key]] for g in idents}
    data.scrape_interval_s = stats.scrape_interval_s
    keys = {g.key for g in idents}
    query.read_fields(data, matchers_for(idents), keys=keys)
    if not data.values:
        report.errors.append("the points of the GPUs with the most at stake could not be read: "
                             + next(iter(data.failed.values()), "no data") + " (their rows come from statistics).")
        return {}
    out = {}
    for g in idents:
        row = _row(data, g, usd_per_gpu_hour, thresholds)
        out[(row.uuid, row.gpu)] = row
    report.errors.extend(e for e in data.errors if e not in report.errors)
    return out


def diagnosis_dict(d: Diagnosis) -> dict[str, Any]:
    """`Diagnosis.to_dict()`, built by msgspec in C: the same dict (a test holds them equal), six times faster,
    which matters at 10,000 rows."""
    out = d.builtins() if isinstance(d, PackedDiagnosis) else msgspec.to_builtins(d)
    out["schema_version"] = SCHEMA_VERSION
    out["confidence_label"] = d.confidence_label
    out["verdict_label"] = d.limiter.label if d.limiter else Verdict.INCONCLUSIVE.value
    return out


def report_dict(report: FleetReport, limit: int | None = None) -> dict[str, Any]:
    """`FleetReport.to_dict()` with the fast diagnosis dicts; `limit` keeps the first rows only."""
    doc = {"source": report.source, "window_start": report.window_start, "window_end": report.window_end,
           "usd_per_gpu_hour": report.usd_per_gpu_hour, "errors": report.errors,
           "query_seconds": report.query_seconds, "gpus_seen": report.gpus_seen,
           "gpus_diagnosed": report.gpus_diagnosed, "gpus_per_field": report.gpus_per_field, "lost": report.lost}
    rows = report.rows if limit is None else report.rows[:limit]
    doc["rows"] = [{**{k: v for k, v in r.__dict__.items() if k != "diagnosis"},
                    "diagnosis": diagnosis_dict(r.diagnosis)} for r in rows]
    return doc


def dumps_json(doc: Any) -> bytes:
    """Indented JSON like the other commands print, encoded by msgspec (json.dumps takes seconds on 60 MB)."""
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


def iter_report_json(report: FleetReport, extra: dict[str, Any], limit: int | None = None,
                     batch: int = 1000) -> Iterator[bytes]:
    """The fleet report as indented JSON, in pieces: the rows are encoded a batch at a time, so the output of
    100,000 GPUs (about 1 GB) never sits in memory whole, as dicts or as bytes. Same content as
    dumps_json(report_dict(...) | extra)."""
    head = report_dict(report, limit=0)
    del head["rows"]
    text = dumps_json({**head, **extra})
    yield text[: text.rindex(b"}")].rstrip() + b',\n  "rows": ['
    rows = report.rows if limit is None else report.rows[:limit]
    for start in range(0, len(rows), batch):
        pieces = []
        for r in rows[start:start + batch]:
            one = {**{k: v for k, v in r.__dict__.items() if k != "diagnosis"},
                   "diagnosis": diagnosis_dict(r.diagnosis)}
            pieces.append(b"\n    " + dumps_json(one).replace(b"\n", b"\n    "))
        yield (b"," if start else b"") + b",".join(pieces)
    yield b"\n  ]\n}\n" if rows else b"]\n}\n"


@dataclass
class FleetGroup:
    name: str
    rows: list[FleetRow] = field(default_factory=list)

    @property
    def usd_per_hour_at_stake(self) -> float:
        return sum(r.usd_per_hour_at_stake for r in self.rows)

    @property
    def verdicts(self) -> Counter[str]:
        return Counter(r.diagnosis.verdict for r in self.rows)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "gpus": len(self.rows),
                "usd_per_hour_at_stake": round(self.usd_per_hour_at_stake, 4),
                "verdicts": dict(self.verdicts.most_common()), "uuids": [r.uuid for r in self.rows]}


def _group_key(row: FleetRow, by: str) -> str:
    if by == "node":
        return row.node or "(unknown node)"
    if by == "model":
        return row.model_name or "(unknown model)"
    if by == "namespace":
        return row.namespace or "(no namespace)"
    return "/".join(x for x in (row.namespace, row.pod) if x) or "(no pod)"


def group_rows(rows: Iterable[FleetRow], by: str) -> list[FleetGroup]:
    """Rows grouped by node, GPU model, namespace or pod; the groups with the most at stake first."""
    if by not in GROUPINGS:
        raise InputError(f"--group-by must be one of {', '.join(GROUPINGS)}, not '{by}'.")
    groups: dict[str, FleetGroup] = {}
    for row in rows:
        key = _group_key(row, by)
        groups.setdefault(key, FleetGroup(key)).rows.append(row)
    return sorted(groups.values(), key=lambda g: (-g.usd_per_hour_at_stake, -len(g.rows), g.name))


__all__ = ["DEFAULT_DETAIL", "GROUPINGS", "PRICE_SOURCE", "PRICE_USD_PER_GPU_HOUR", "FleetGroup", "build_rows",
           "diagnosis_dict", "dumps_json", "gc_paused", "gpu_price", "group_rows", "report_dict", "run_fleet",
           "stake_fraction", "triage_rows", "TRIAGE_CHUNK"]
