"""Per-GPU window statistics computed by the time-series engine: the fleet's triage reads one number per GPU and
statistic, never the samples.

Each statistic is one instant query at the window's end over the whole window (`avg_over_time(F[W])`,
`quantile_over_time(0.9, F[W])`, `max_over_time`, `rate`/`increase` for counters, `last_over_time` for constants,
the share of samples with a clock-event bit set), grouped by the GPU key labels (UUID, uuid, GPU_I_ID) so the answer
carries three labels per series instead of a dozen. Answers are decoded straight into one float array per statistic,
indexed like the discovered GPUs. The queries run in parallel with the discovery; a failed one marks its field
unavailable and the result partial.

When Prometheus already keeps these statistics (the rule group `diagnoser rules --prometheus-rules` writes, recorded
under names such as `gpu:dcgm_dram_active:avg_1h`), and the window has the recorded length, they are read instead:
each statistic read by its recorded name (a few at a time, each answer decoded while the engine writes the next)
and the GPUs' identities, with no pass over the samples. The PromQL of both ways comes from
`stat_expr`, so what is recorded is what would be queried.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from diagnoser.collectors.dcgm import (
    DEVICE_LEVEL_FIELDS,
    FIELDS_BY_KEY,
    IDENTITY_LABELS,
    GpuIdentity,
    GpuKey,
    parent_key,
)
from diagnoser.collectors.dcgm_stats import GPU_UTIL, Stat, bit_shares, stats_for
from diagnoser.collectors.prom_client import KeyedSeries, PromClient, PromError, vector_values
from diagnoser.collectors.prometheus_source import (
    ANCHORS,
    UNION_UNLISTED,
    Window,
    census_uuids,
    identify,
    index_identities,
    matchers_for,
    no_dcgm_series,
    reporting_at_end,
    typical_interval,
)
from diagnoser.errors import SourceUnavailable
from diagnoser.rules.ruleset import default_rules

KEY_LABELS = "UUID, uuid, GPU_I_ID"
Select = Callable[[list[GpuIdentity]], list[GpuIdentity]]
Census = tuple[dict[str, str], str | None]  # UUID -> its label, and why the listing failed
# Beyond this many selected GPUs the queries are not narrowed by a UUID regex (its matching costs more than it saves).
MAX_MATCHED_GPUS = 2000
# A constant (the maximum clock, free memory) needs only its latest value.
LAST_LOOKBACK_S = 300.0


# What the rules read from DCGM, as statistics: those the default rules' declared reads need through the fleet's table
# (dcgm_stats.py), in its order. The engine's fleet path builds each GPU's signals from these.
STATS: tuple[Stat, ...] = stats_for(default_rules().rules)
# GPU_UTIL stands in for GR_ENGINE_ACTIVE, asked only for the GPUs that lack the latter.
FALLBACK = GPU_UTIL
STATS_BY_KEY: dict[str, Stat] = {s.key: s for s in (*STATS, FALLBACK)}
_FUNCTION = {"avg": "avg_over_time", "max": "max_over_time", "min": "min_over_time", "last": "last_over_time",
             "rate": "rate", "increase": "increase"}


def duration(seconds: float) -> str:
    """PromQL's spelling of a duration: whole hours, minutes or seconds where exact ('1h', '30m', '90s')."""
    whole = round(seconds)
    if abs(seconds - whole) < 1e-3 and whole > 0:
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if whole % size == 0:
                return f"{whole // size}{unit}"
        return f"{whole}s"
    return f"{max(1, math.ceil(seconds * 1000))}ms"


def selector(names: Sequence[str], matchers: str = "") -> str:
    """The series of any of `names` (the spellings of one field), narrowed by `matchers`."""
    if len(names) == 1:
        return f"{names[0]}{{{matchers}}}" if matchers else names[0]
    inner = f'__name__=~"{"|".join(names)}"'
    return "{" + ", ".join(x for x in (inner, matchers) if x) + "}"


def stat_expr(stat: Stat, names: Sequence[str], window_s: float, *, matchers: str = "",
              extra_names: Sequence[str] = (), unless_names: Sequence[str] = ()) -> str:
    """The PromQL of one statistic over a window ending at the query's time, one series per GPU key.

    `names` are the field's metric names (for fb_total, FB_USED's; `extra_names` FB_FREE's); `unless_names` the
    better field's, whose GPUs are left out (GPU_UTIL only where GR_ENGINE_ACTIVE is missing).
    """
    w = duration(window_s)
    sel = selector(names, matchers)
    if stat.field == "fb_total":
        last = duration(min(window_s, LAST_LOOKBACK_S))
        free = selector(extra_names, matchers)
        return (f"avg by ({KEY_LABELS}) (last_over_time({sel}[{last}])) + "
                f"avg by ({KEY_LABELS}) (last_over_time({free}[{last}]))")
    if stat.stat == "p90":
        inner = f"quantile_over_time(0.9, {sel}[{w}])"
    elif stat.stat == "last":
        inner = f"last_over_time({sel}[{duration(min(window_s, LAST_LOOKBACK_S))}])"
    else:
        inner = f"{_FUNCTION[stat.stat]}({sel}[{w}])"
    expr = f"avg by ({KEY_LABELS}) ({inner})"
    if unless_names:
        better = f"count_over_time({selector(unless_names, matchers)}[{w}])"
        expr += f" unless on ({KEY_LABELS}) count by ({KEY_LABELS}) ({better})"
    return expr


def identity_expr(names: Sequence[str], window_s: float, matchers: str = "") -> str:
    """Every GPU's identity labels with its number of samples of the anchor field over the window."""
    return (f"max by ({', '.join(IDENTITY_LABELS)}) "
            f"(count_over_time({selector(names, matchers)}[{duration(window_s)}]))")


# --- recorded statistics ------------------------------------------------------------------------------------------

RECORD_PREFIX = "gpu:dcgm_"


def record_name(stat: Stat, window_s: float) -> str:
    """The recorded series of a statistic: `gpu:dcgm_<field>:<stat>_<window>` (level:metric:operations)."""
    return f"{RECORD_PREFIX}{stat.field}:{stat.stat}_{duration(window_s)}"


def identity_record_name(window_s: float) -> str:
    return f"{RECORD_PREFIX}identity:count_{duration(window_s)}"


# --- the data --------------------------------------------------------------------------------------------------------


@dataclass
class WindowStats:
    """Every GPU's statistics over one window: arrays indexed like `keys` (NaN: no value)."""

    window: Window
    gpus: dict[GpuKey, GpuIdentity] = field(default_factory=dict)
    keys: list[GpuKey] = field(default_factory=list)
    index: dict[GpuKey, int] = field(default_factory=dict)
    samples: array = field(default_factory=lambda: array("d"))
    values: dict[str, array] = field(default_factory=dict)  # Stat.key -> one value per GPU, in the field's unit
    fields_present: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # field key -> why its query failed
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scrape_interval_s: float | None = None
    recorded: bool = False  # read from the rule group's recorded series
    recorded_stale: str = ""  # why the recorded series were not read although they exist (a note), else ""
    query_seconds: float = 0.0
    # The union (StatsQuery._complete): GPU keys answers held that the anchor had not listed (-> their UUID label),
    # the GPUs found that way, the DCGM names each of those reports, and the UUIDs a selection left out.
    unlisted: dict[GpuKey, str] = field(default_factory=dict)
    found_by_union: set[GpuKey] = field(default_factory=set)
    names_seen: dict[GpuKey, set[str]] = field(default_factory=dict)
    deselected: set[str] = field(default_factory=set)
    no_uuid: int = 0  # series without a UUID label, left out
    anchor: str = ""  # the metric name that listed the GPUs before the union
    # The GPUs with no sample of the anchor field in the window's last `quiet_s` (a few scrape intervals): they
    # stopped reporting, every one of them marked whether or not the others stopped too.
    silent: set[GpuKey] = field(default_factory=set)
    quiet_s: float = 0.0

    def expected_samples(self) -> float:
        """The samples a GPU scraped all window long has: the window over the scrape interval (the most any GPU has
        when the interval is unknown)."""
        if self.scrape_interval_s:
            return self.window.length_s / self.scrape_interval_s
        return max(self.samples, default=0.0)

    def get(self, stat_key: str, i: int) -> float:
        """One GPU's statistic; a MIG instance without its own takes its board's (power, clocks, throttling)."""
        column = self.values.get(stat_key)
        if column is None:
            return math.nan
        v = column[i]
        if math.isnan(v):
            key = self.keys[i]
            if key[1] and STATS_BY_KEY[stat_key].field in DEVICE_LEVEL_FIELDS:
                j = self.index.get(parent_key(key))
                if j is not None:
                    return column[j]
        return v


class StatsQuery:
    """Runs the statistics for one window: discovery and statistics in parallel, then the GPU_UTIL fallback where
    GR_ENGINE_ACTIVE is missing.

    The GPUs are the union over every DCGM series of the window (prometheus_source.py, "the union"): the anchor's
    identities, every GPU key a statistic's answer holds (a GPU with activity but no memory field, say), and the UUIDs
    the label index shows on any other DCGM series; those the anchor did not list are then read by UUID."""

    def __init__(self, client: PromClient, window: Window, *, workers: int = 4, matchers: str = "") -> None:
        self.client = client
        self.window = window
        self.workers = max(1, workers)
        self.matchers = matchers
        self.anchor = FIELDS_BY_KEY["fb_used"].name  # the field whose series list the GPUs first (_discover)

    def run(self, *, use_recorded: bool = True, select: Select | None = None) -> WindowStats:
        """The statistics of every GPU, or of those `select` keeps from the discovered ones (then the discovery
        runs first and the statistics are asked for those GPUs only)."""
        t0 = time.perf_counter()
        w = self.window
        try:
            existing: set[str] | None = set(self.client.label_values("__name__", w.start, w.end))
        except PromError as exc:
            if exc.kind in ("unreachable", "timeout", "not_prometheus"):
                raise
            existing = None  # a proxy without the label API: ask for every name
        data = WindowStats(w)
        recorded = use_recorded and existing is not None and self._recorded_present(existing)
        if recorded:
            stale = self._recorded_staleness()
            if stale is not None:
                data.notes.append(stale)
                data.recorded_stale = stale
                recorded = False
        if recorded:
            assert existing is not None
            self._read_recorded(data, existing)
        elif select is not None:
            self._discover_all(data, existing)
            self.check_found(data)
            self._prune(data, select, layout=True)
            if len(data.gpus) <= MAX_MATCHED_GPUS:
                self.matchers = matchers_for(list(data.gpus.values()))
            self._query(data, existing, indexed=True)
        else:
            self._query(data, existing)
        self.check_found(data)
        if select is not None:
            self._prune(data, select)
        self._reporting(data, existing)
        data.anchor = self.anchor
        data.query_seconds = time.perf_counter() - t0
        return data

    # --- ad hoc statistics ------------------------------------------------------------------------------------------

    def _names(self, field_key: str, existing: set[str] | None) -> list[str]:
        f = FIELDS_BY_KEY[field_key]
        if existing is None:
            return list(f.names)
        return [n for n in f.query_names if n in existing]

    def _plan(self, existing: set[str] | None) -> list[tuple[Stat, str]]:
        jobs = []
        for stat in STATS:
            if stat.field == "fb_total":
                used, free = self._names("fb_used", existing), self._names("fb_free", existing)
                if used and free:
                    jobs.append((stat, stat_expr(stat, used, self.window.length_s, matchers=self.matchers,
                                                 extra_names=free)))
                continue
            names = self._names(stat.field, existing)
            if names:
                jobs.append((stat, stat_expr(stat, names, self.window.length_s, matchers=self.matchers)))
        return jobs

    def _discover(self, existing: set[str] | None) -> list[dict]:
        """The anchor's identities: the first of FB_USED, GR_ENGINE_ACTIVE, GPU_UTIL with any series."""
        for anchor in ANCHORS:
            names = self._names(anchor, existing)
            if not names:
                continue
            result = self.client.instant(identity_expr(names, self.window.length_s, self.matchers), self.window.end)
            if result:
                self.anchor = FIELDS_BY_KEY[anchor].name
                return result
        return []

    def _census(self, existing: set[str] | None = None, shown: Sequence[str] = ()) -> Census:
        """The UUIDs on DCGM series other than the `shown` names (those a statistic reads, whose answers show each
        GPU key they have), asked of the label index."""
        names = None if existing is None else sorted(n for n in existing if n[:5].lower() == "dcgm_" and
                                                     n not in set(shown))
        return census_uuids(self.client, self.window, self.matchers, names)

    def _discover_all(self, data: WindowStats, existing: set[str] | None) -> None:
        """Every GPU of the window before any statistic (to select some): the anchor's, and those other DCGM series
        name, read by UUID."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            # Without the label API (a proxy) the index cannot be asked either: the anchor's GPUs and the answers'.
            census = pool.submit(self._census, existing) if existing is not None else None
            self._index(data, self._discover(existing))
            self._complete(data, census.result() if census is not None else ({}, None))

    def _query(self, data: WindowStats, existing: set[str] | None, *, indexed: bool = False) -> None:
        jobs = self._plan(existing)
        end = self.window.end
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            found = None if indexed else pool.submit(self._discover, existing)
            answers: list[tuple[Stat, Future[list[KeyedSeries]]]] = [
                (stat, pool.submit(self.client.instant_points, expr, end)) for stat, expr in jobs]
            # Last in the queue: the statistics that matter most are asked first.
            shown = [n for stat, _ in jobs if stat.field != "fb_total" for n in self._names(stat.field, existing)]
            census = None if indexed or existing is None else pool.submit(self._census, existing, shown)
            if found is not None:
                self._index(data, found.result())
            for (stat, answer), (_, expr) in zip(answers, jobs, strict=True):
                self._take(data, stat, answer.result, retry=partial(self.client.instant_points, expr, end))
            got = census.result() if census is not None else ({}, None)
            known = self._known_uuids(data)
            self._fallback(data, existing, more=any(u not in known for u in got[0]))
            self._complete(data, got)
        self._report_failures(data)

    def _take(self, data: WindowStats, stat: Stat, answer: Callable[[], list[KeyedSeries]],
              retry: Callable[[], list[KeyedSeries]] | None = None) -> None:
        try:
            result = answer()
        except PromError:
            # Asked once more, alone: one statistic lost to the engine's query timeout while the others ran beside it
            # turned every VRAM-limited GPU of a 10,000-GPU fleet inconclusive.
            try:
                if retry is None:
                    raise
                result = retry()
            except PromError as exc:
                data.failed.setdefault("fb_used" if stat.field == "fb_total" else stat.field, str(exc))
                return
        unlisted: list[KeyedSeries] = []
        column = vector_values(result, data.index, len(data.keys), unlisted)
        if unlisted and self._add_unlisted(data, unlisted):
            column = vector_values(result, data.index, len(data.keys))
        data.values[stat.key] = column
        if result:
            data.fields_present.add(stat.field)
            if stat.field == "fb_total":
                data.fields_present |= {"fb_used", "fb_free"}

    def _fallback(self, data: WindowStats, existing: set[str] | None, *, more: bool = False) -> None:
        """GPU_UTIL (percent) for the GPUs without GR_ENGINE_ACTIVE: one more query, made only when some lack it
        (or, `more`, when GPUs the statistics did not show are still to be read: they may report GPU_UTIL alone)."""
        busy = data.values.get("gr_engine_active.avg")
        # A MIG board's own slot has no activity of its own: only GPUs and instances count as lacking it.
        lacking = [i for i, key in enumerate(data.keys) if (key in data.gpus or key in data.unlisted)
                   and (busy is None or math.isnan(busy[i]))]
        names = self._names("gpu_util", existing)
        if not (lacking or more) or not names:
            return
        better = self._names("gr_engine_active", existing)
        expr = stat_expr(FALLBACK, names, self.window.length_s, matchers=self.matchers, unless_names=better)
        ask = partial(self.client.instant_points, expr, self.window.end)
        self._take(data, FALLBACK, ask, retry=ask)

    # --- recorded statistics ---------------------------------------------------------------------------------------

    def _recorded_present(self, existing: set[str]) -> bool:
        return identity_record_name(self.window.length_s) in existing and \
            record_name(STATS[0], self.window.length_s) in existing

    def _newest(self, query: str, at: float) -> dict[str, float]:
        """A small answer's values by its `what` label ("" when it has none)."""
        out: dict[str, float] = {}
        for series in self.client.instant(query, at):
            try:
                value = float(series["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if not math.isnan(value):
                out[series.get("metric", {}).get("what", "")] = value
        return out

    def _recorded_staleness(self) -> str | None:
        """None when the rule group's recorded statistics are fresh at the window's end: their newest sample is
        at most one and a half evaluation intervals (measured between the last two samples) older than the newest
        scrape the engine shows (`up`: an engine that shows data late, as VictoriaMetrics' 30 s latency offset,
        shows both late). Otherwise why not, as a note: they stopped (the group removed, its ruler down, its
        evaluations failing) or lag, and statistics recorded for a window that ended earlier are not the window's."""
        w = self.window
        name = identity_record_name(w.length_s)
        what = f"The recorded statistics ({RECORD_PREFIX}*_{duration(w.length_s)}, the diagnoser rule group's)"
        newest_of = (f'label_replace(max(timestamp({name})), "what", "recorded", "", "") or '
                     f'label_replace(max(timestamp(up)), "what", "scraped", "", "")')
        try:
            found = self._newest(newest_of, w.end)
            newest = found.get("recorded")
            if newest is None:
                step = max(1.0, w.length_s / 60)
                last = self._newest(f"max(max_over_time(timestamp({name})[{duration(w.length_s)}:"
                                    f"{duration(step)}]))", w.end).get("")
                old = (f"their newest sample is {_age(w.end - last)} old" if last is not None else
                       "they have no sample")
                return (f"{what} have none at the window's end ({old}): the rule group has stopped; statistics "
                        "computed from the samples instead.")
            previous = self._newest(f"max(timestamp({name}))", newest - 0.001).get("")
        except PromError as exc:
            return f"{what} could not be checked for freshness ({exc}): statistics computed from the samples instead."
        interval = newest - previous if previous is not None and newest > previous else None
        age = max(0.0, w.end - newest)
        lag = max(0.0, w.end - found.get("scraped", w.end))
        # A second or two of slack: an evaluation takes time, and so does this query.
        allowed = 1.5 * interval + 2.0 if interval else 0.05 * w.length_s + 2.0
        if age - lag <= allowed:
            return None
        every = f", and the group records every {_age(interval)}" if interval else ""
        return (f"{what} are stale: the newest is {_age(age)} old at the window's end{every}; statistics computed "
                "from the samples instead.")

    def _read_recorded(self, data: WindowStats, existing: set[str]) -> None:
        """The recorded identities, and each recorded statistic of this window length by its name: plain reads, no
        computing, `workers` at a time, each answer decoded while the engine writes the next. (All statistics in
        one query came back as one 168 MB answer at 100,000 GPUs, decoded only once the engine had written all of
        it: 2-3 s slower than computing them ad hoc.)"""
        length = self.window.length_s
        recorded = [(s, record_name(s, length)) for s in (*STATS, FALLBACK) if record_name(s, length) in existing]
        end = self.window.end
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            found = pool.submit(self.client.instant, identity_record_name(length), end)
            answers = [(stat, pool.submit(self.client.instant_points, name, end)) for stat, name in recorded]
            # Each recorded answer shows every GPU key its field has (GPU_UTIL's, those without GR_ENGINE_ACTIVE).
            shown = [n for stat, _ in recorded if stat.field != "fb_total" for n in self._names(stat.field, existing)]
            census = pool.submit(self._census, existing, shown)
            self._index(data, found.result())
            for (stat, answer), (_, name) in zip(answers, recorded, strict=True):
                self._take(data, stat, answer.result, retry=partial(self.client.instant_points, name, end))
            self._complete(data, census.result())
        data.recorded = True
        data.notes.append(f"Statistics read from the series the diagnoser rule group records ({duration(length)} "
                          "windows, evaluated up to the window's end).")
        self._report_failures(data)

    # --- shared ----------------------------------------------------------------------------------------------------

    def _index(self, data: WindowStats, result: list[dict]) -> None:
        """The anchor's identities (possibly none: the union may still find GPUs) as the GPUs' slots."""
        counts: dict[GpuKey, float] = {}
        data.no_uuid += index_identities(result, data.gpus, counts)
        # A MIG board's own series carry its device fields (clocks, power, throttling) for its instances: its key
        # gets a slot although it is no target.
        boards = {parent_key(k) for k in data.gpus if k[1]} - set(data.gpus)
        data.keys = [*data.gpus, *sorted(boards)]
        data.index = {k: i for i, k in enumerate(data.keys)}
        data.samples = array("d", (counts.get(k, 0.0) for k in data.keys))
        self._interval(data)

    def _interval(self, data: WindowStats) -> None:
        """A first estimate (the window over the most samples); `_reporting` replaces it by the spacing of points."""
        most = max(data.samples, default=0.0)
        data.scrape_interval_s = self.window.length_s / most if most >= 2 else None

    def _reporting(self, data: WindowStats, existing: set[str] | None) -> None:
        """The scrape interval from the spacing of the points of the GPU with the most samples, and the GPUs that
        stopped reporting before the window's end (two small queries, and one series' points)."""
        anchor = next((k for k in ANCHORS if FIELDS_BY_KEY[k].name == self.anchor), ANCHORS[0])
        names = self._names(anchor, existing)
        listed = [k for k in data.gpus if k not in data.found_by_union and data.samples[data.index[k]] > 0]
        if not names or not listed:
            return
        best = max(listed, key=lambda k: data.samples[data.index[k]])
        if data.samples[data.index[best]] >= 2:
            found = typical_interval(self.client, self.window, names, data.gpus[best], self.matchers)
            data.scrape_interval_s = found or data.scrape_interval_s
        if not data.scrape_interval_s:
            return
        reporting = reporting_at_end(self.client, self.window, names, data.scrape_interval_s, self.matchers)
        if reporting is not None:
            keys, data.quiet_s = reporting
            data.silent = {k for k in listed if k not in keys}

    @staticmethod
    def _slot(data: WindowStats, key: GpuKey) -> int:
        """A new GPU key's place in every array."""
        i = data.index[key] = len(data.keys)
        data.keys.append(key)
        data.samples.append(0.0)
        for column in data.values.values():
            column.append(math.nan)
        return i

    @staticmethod
    def _known_uuids(data: WindowStats) -> set[str]:
        return {k[0] for k in data.keys} | data.deselected

    def _add_unlisted(self, data: WindowStats, series: list[KeyedSeries]) -> bool:
        """Slots for the GPU keys an answer holds that the anchor did not list (read by UUID later, _complete)."""
        added = False
        for s in series:
            m = s.metric
            key = (m.UUID or m.uuid, m.GPU_I_ID)
            if not key[0] or key in data.index or key[0] in data.deselected:
                continue
            self._slot(data, key)
            data.unlisted[key] = "UUID" if m.UUID else "uuid"
            added = True
        return added

    def _complete(self, data: WindowStats, census: Census) -> None:
        """The union: the GPUs the statistics' answers hold and those the label index shows on other DCGM series,
        that the anchor did not list, read by UUID (identities, samples, which DCGM names each reports)."""
        uuids, failed = census
        known = self._known_uuids(data)
        wanted = {u: label for u, label in uuids.items() if u not in known}
        for key, label in data.unlisted.items():
            if key not in data.gpus:
                wanted.setdefault(key[0], label)
        if failed:
            data.errors.append(f"{UNION_UNLISTED[0].upper()}{UNION_UNLISTED[1:]} could not be listed: {failed}")
        if not wanted:
            return
        found = identify(self.client, self.window, wanted, matchers=self.matchers, workers=self.workers)
        data.errors.extend(f"some of {UNION_UNLISTED} could not be read: {e}" for e in found.errors)
        new: dict[GpuKey, GpuIdentity] = {}
        counts: dict[GpuKey, float] = {}
        data.no_uuid += index_identities(found.result, new, counts)
        for key, ident in new.items():
            known_ident = data.gpus.get(key)
            if known_ident is not None:
                known_ident.merge(ident)
                continue
            i = data.index.get(key)
            if i is None:
                i = self._slot(data, key)
            data.gpus[key] = ident
            data.samples[i] = max(data.samples[i], counts.get(key, 0.0))
            data.found_by_union.add(key)
        for key, names in found.names.items():
            if key in data.found_by_union:
                data.names_seen.setdefault(key, set()).update(names)
        self._interval(data)

    def _prune(self, data: WindowStats, select: Select, *, layout: bool = False) -> None:
        """Only the GPUs `select` keeps (it raises when none matches); with `layout`, the arrays are laid out again
        for them and their boards only (before the statistics are asked for them)."""
        if not data.gpus:
            return
        kept = {g.key for g in select(list(data.gpus.values()))}
        # A MIG instance's board stays: it carries the instance's device fields.
        kept |= {parent_key(k) for k in kept if k[1] and parent_key(k) in data.gpus}
        data.deselected |= {k[0] for k in data.gpus if k not in kept} - {k[0] for k in kept}
        data.gpus = {k: g for k, g in data.gpus.items() if k in kept}
        if layout:
            samples = {k: data.samples[i] for k, i in data.index.items()}
            boards = {parent_key(k) for k in data.gpus if k[1]} - set(data.gpus)
            data.keys = [*data.gpus, *sorted(boards)]
            data.index = {k: i for i, k in enumerate(data.keys)}
            data.samples = array("d", (samples.get(k, 0.0) for k in data.keys))
            data.unlisted = {}

    def _report_failures(self, data: WindowStats) -> None:
        if data.failed:
            names = ", ".join(FIELDS_BY_KEY[k].name for k in data.failed if k in FIELDS_BY_KEY)
            first = next(iter(data.failed.values()))
            data.errors.append(f"{len(data.failed)} statistic queries failed ({names}): {first}")

    def check_found(self, data: WindowStats) -> None:
        """Raise when the window holds no GPU at all."""
        said = f"{data.no_uuid} series without a UUID label were ignored."
        if data.no_uuid and said not in data.errors:
            data.errors.append(said)
        if not data.gpus:
            if data.no_uuid:
                raise SourceUnavailable(f"Prometheus at {self.client.url} has DCGM series but none with a GPU UUID "
                                        "label.")
            raise SourceUnavailable(no_dcgm_series(self.client.url, self.window))


def _age(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


__all__ = [
    "FALLBACK",
    "STATS",
    "STATS_BY_KEY",
    "Stat",
    "StatsQuery",
    "WindowStats",
    "bit_shares",
    "duration",
    "identity_expr",
    "identity_record_name",
    "record_name",
    "selector",
    "stat_expr",
]
