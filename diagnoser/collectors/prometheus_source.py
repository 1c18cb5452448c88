"""DCGM counters from the Prometheus that scrapes dcgm-exporter, over the attach window or a past one.

Prometheus does the reduction: each field is one range query that averages (or rates) every GPU's samples per step
server-side (`avg_over_time(F[R])` at step S = window / points, R = max(S, 2 scrape intervals)), so the answer holds
`points` numbers per GPU and field however long the window: the mean of the step values is the window mean, and
their spread stands in for the samples' spread. There is no `avg by (...)` in the queries: for 10,000 GPUs the
grouping costs Prometheus as much again as the query; the series of one GPU (one per pod sharing it) are merged here.
A discovery query first lists the GPUs with their labels and sample counts (the scrape interval), and one
label-values call says which metric names exist, so absent fields cost no query.

Queries go through collectors/prom_client.py (bounded HTTP, a timeout on both sides: the whole answer's deadline and
Prometheus's own `timeout` parameter). A failed field query marks that field unavailable and the result partial;
only a failed discovery (or no DCGM data at all) is fatal.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

from diagnoser import units
from diagnoser.capture import Capture
from diagnoser.collectors.dcgm import (
    DEVICE_LEVEL_FIELDS,
    FIELDS,
    FIELDS_BY_KEY,
    IDENTITY_LABELS,
    UUID_LABELS,
    DcgmField,
    GpuIdentity,
    GpuKey,
    GpuSelector,
    GpuWindow,
    add_gpu_window,
    describe_target,
    drop_mig_parents,
    identity_from_labels,
    mark_missing,
    parent_key,
    select_gpus,
    uses_exported_pod_labels,
)
from diagnoser.collectors.prom_client import KeyedSeries, PromClient, PromError
from diagnoser.errors import InputError, SourceUnavailable

# --- windows ---------------------------------------------------------------------------------------------------------

def parse_duration(text: str, *, option: str = "duration") -> float:
    """A window length: a positive duration ('90s', '30m', '1h30m', '2d' or seconds)."""
    return units.parse_duration(text, option, positive=True)


def parse_time(text: str, *, option: str = "time", now: float | None = None) -> float:
    """A moment: unix seconds, ISO 8601 ('2026-11-21T03:00', '...Z', '+02:00'; no zone = UTC), 'now', or
    'now-2h' / '-2h' / '2h ago'."""
    now = time.time() if now is None else now
    raw = text.strip()
    low = raw.lower()
    if low == "now":
        return now
    relative = re.fullmatch(r"(?:now\s*)?-\s*(\S+)|(\S+)\s+ago", low)
    if relative:
        return now - parse_duration(relative.group(1) or relative.group(2), option=option)
    try:
        return float(raw)
    except ValueError:
        pass
    iso = raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise InputError(f"{option} '{text}' is not a time: use ISO 8601 (2026-11-21T03:00Z), unix seconds, "
                         "or now-2h.") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


@dataclass(frozen=True)
class Window:
    start: float  # unix seconds
    end: float

    @property
    def length_s(self) -> float:
        return self.end - self.start

    def describe(self) -> str:
        fmt = "%Y-%m-%d %H:%M:%S"
        a = datetime.fromtimestamp(self.start, timezone.utc).strftime(fmt)
        b = datetime.fromtimestamp(self.end, timezone.utc).strftime(fmt)
        return f"{a} to {b} UTC ({_human_s(self.length_s)})"


def _human_s(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def resolve_window(*, since: str | None = None, start: str | None = None, end: str | None = None,
                   at: str | None = None, default_s: float = 3600.0, now: float | None = None) -> Window:
    """--since D (a window of length D ending now, or ending at --at), or --start/--end (--end defaults to now)."""
    now = time.time() if now is None else now
    if start is not None and since is not None:
        raise InputError("give either --since or --start/--end, not both.")
    if start is not None and at is not None:
        raise InputError("--at sets the end of a --since window; with --start use --end.")
    if start is not None:
        w_start = parse_time(start, option="--start", now=now)
        w_end = parse_time(end, option="--end", now=now) if end is not None else now
    else:
        if end is not None:
            raise InputError("--end needs --start (or use --at with --since).")
        w_end = parse_time(at, option="--at", now=now) if at is not None else now
        w_start = w_end - (parse_duration(since, option="--since") if since is not None else default_s)
    if w_end <= w_start:
        raise InputError("the window ends before it starts.")
    if w_start > now:
        raise InputError("the window lies in the future.")
    return Window(w_start, min(w_end, now))


# --- the query plan ---------------------------------------------------------------------------------------------------

BY = "UUID, uuid, GPU_I_ID"
UNION_UNLISTED = "the GPUs the discovery's field does not show (found on their other DCGM series)"


def no_dcgm_series(url: str, window: Window) -> str:
    return (f"Prometheus at {url} has no DCGM series from {window.describe()}: is dcgm-exporter scraped, and is the "
            "window right?")
# The discovery anchor: a field every dcgm-exporter configuration exports, MIG instances included.
ANCHORS = ("fb_used", "gr_engine_active", "gpu_util")


def _duration(seconds: float) -> str:
    return f"{max(1, int(math.ceil(seconds * 1000)))}ms"


def _selector(matchers: str, name: str) -> str:
    return f"{name}{{{matchers}}}" if matchers else name


_FUNCTIONS = {"avg": "avg_over_time", "rate": "rate", "increase": "increase", "max": "max_over_time",
              "last": "last_over_time"}
WHOLE_WINDOW = ("max", "last")  # reduces answered by one instant query over the window


def field_query(f: DcgmField, name: str, lookback_s: float, matchers: str = "", unless: Sequence[str] = ()) -> str:
    """One metric name of a field, reducing the samples of the last lookback_s (per step, or over the window).

    No aggregation: grouping 10,000 series by label at every step costs Prometheus about as much again as
    the query itself; the duplicates (one series per pod sharing a GPU) are merged here instead. `unless` names
    metrics whose GPUs are left out (those have a better field).
    """
    if f.bits:
        # The share of samples with one of the field's clock-event bits set (a subquery: PromQL tests bits only
        # on instant vectors).
        inner = bits_expr(_selector(matchers, name), f.bits)
        query = f"avg_over_time(({inner})[{_duration(lookback_s)}:{_duration(max(1.0, lookback_s / 10))}])"
    else:
        query = f"{_FUNCTIONS[f.reduce]}({_selector(matchers, name)}[{_duration(lookback_s)}])"
    if unless:
        inner = ", ".join(x for x in (f'__name__=~"{"|".join(unless)}"', matchers) if x)
        query += f" unless on ({BY}) {{{inner}}}"
    return query


def bits_expr(selector: str, mask: int) -> str:
    """1 where any bit of `mask` is set in the selected clock-event mask, else 0: PromQL has no bitwise operators,
    so each bit is floor(x / bit) % 2."""
    terms = [f"floor({selector} / {1 << b}) % 2" for b in range(mask.bit_length()) if mask >> b & 1]
    return terms[0] if len(terms) == 1 else f"clamp_max({' + '.join(terms)}, 1)"


def discovery_query(f: DcgmField, window_s: float, matchers: str = "") -> str:
    """Every label set of the anchor field over the window, with its number of samples (an instant query)."""
    labels = ", ".join(IDENTITY_LABELS)
    return " or ".join(f"max by ({labels}) (count_over_time({_selector(matchers, name)}[{_duration(window_s)}]))"
                       for name in f.query_names)


# --- the union: every GPU any DCGM series names -------------------------------------------------------------------
#
# The anchor above lists the GPUs cheaply, but a GPU (or MIG instance) without the anchor field is still a GPU: a T4
# without DCP fields, a MIG instance that reports activity but no memory, an exporter with a custom counter list. So
# the GPUs of the window are the union over every DCGM series: the UUIDs any DCGM series carries come from the label
# index (no sample decoded), and the GPUs among them the anchor did not list are then read by UUID (a cost in
# proportion to them: usually none).

DCGM_NAMES = "DCGM_.+|dcgm_.+"
# UUIDs per identity query when the GPUs the anchor missed are read by UUID.
IDENTIFY_BATCH = 400


def census_selector(matchers: str = "", names: Sequence[str] | None = None) -> str:
    """Every DCGM series (any field, known to the diagnoser or not), or those of `names`, narrowed by `matchers`."""
    which = f'__name__=~"{"|".join(_regex_escape(n) for n in names)}"' if names else f'__name__=~"{DCGM_NAMES}"'
    return "{" + ", ".join(x for x in (which, matchers) if x) + "}"


def census_uuids(client: PromClient, window: Window, matchers: str = "",
                 names: Sequence[str] | None = None) -> tuple[dict[str, str], str | None]:
    """UUID -> the label that names it (UUID or, under --use-old-namespace, uuid), for every GPU any DCGM series
    (or any series of `names`: an empty list asks nothing) names in the window: label-values calls answered from
    the index alone. The engine may answer for a somewhat longer span (a block, a day): the GPUs are then read over
    the window itself, and those without a sample in it dropped. Returns the UUIDs and, when a call failed, why."""
    out: dict[str, str] = {}
    if names is not None and not names:
        return out, None
    for label in UUID_LABELS:
        try:
            values = client.label_values(label, window.start, window.end, match=census_selector(matchers, names))
        except PromError as exc:
            return out, str(exc)
        for value in values:
            if value:
                out.setdefault(value, label)
    return out, None


def _by_uuid(label: str, uuids: Sequence[str], matchers: str, name: str | None = None) -> str:
    pattern = "|".join(_regex_escape(u) for u in uuids)
    names = f'__name__="{name}"' if name else f'__name__=~"{DCGM_NAMES}"'
    return "{" + ", ".join(x for x in (names, f'{label}=~"{pattern}"', matchers) if x) + "}"


def identify_expr(label: str, uuids: Sequence[str], window_s: float, matchers: str = "") -> str:
    """These GPUs' (by UUID) identity labels with each DCGM metric name they have in the window (the names kept:
    `last_over_time` keeps them, where counting samples across names would make series of one label set collide)."""
    return (f"count by (__name__, {', '.join(IDENTITY_LABELS)}) "
            f"(last_over_time({_by_uuid(label, uuids, matchers)}[{_duration(window_s)}]))")


def samples_expr(name: str, label: str, uuids: Sequence[str], window_s: float, matchers: str = "") -> str:
    """The samples of one metric name per GPU key of these GPUs over the window (as discovery counts the anchor's)."""
    return (f"max by ({BY}) (count_over_time({_by_uuid(label, uuids, matchers, name)}"
            f"[{_duration(window_s)}]))")


@dataclass
class Identified:
    """GPUs read by UUID: the identity answer (as discovery's, each series valued at its GPU key's samples), the
    DCGM names of each GPU key, what failed."""

    result: list[dict] = field(default_factory=list)
    names: dict[GpuKey, set[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _sample_name(names: set[str]) -> str:
    """The name whose samples count a GPU's: a field the fleet reads first (the anchors first), any other else."""
    for f in (*(FIELDS_BY_KEY[k] for k in ANCHORS), *FIELDS):
        for name in f.query_names:
            if name in names:
                return name
    return min(names)


def identify(client: PromClient, window: Window, uuids: dict[str, str], *, matchers: str = "",
             workers: int = 4) -> Identified:
    """The identities, DCGM names and samples of these GPUs over the window, IDENTIFY_BATCH UUIDs a query: first
    which names each GPU key has (with its labels), then the samples of one of its names."""
    out = Identified()
    batches = [(label, chosen[lo:lo + IDENTIFY_BATCH])
               for label in UUID_LABELS
               for chosen in [sorted(u for u, lab in uuids.items() if lab == label)]
               for lo in range(0, len(chosen), IDENTIFY_BATCH)]
    if not batches:
        return out

    def ask(query: str) -> list[dict] | str:
        try:
            return client.instant(query, window.end)
        except PromError as exc:
            return str(exc)

    label_of: dict[GpuKey, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(batches)))) as pool:
        answers = list(pool.map(ask, [identify_expr(label, chosen, window.length_s, matchers)
                                      for label, chosen in batches]))
        for (label, _), answer in zip(batches, answers, strict=True):
            if isinstance(answer, str):
                out.errors.append(answer)
                continue
            for series in answer:
                metric = dict(series.get("metric", {}))
                name = metric.pop("__name__", "")
                key = _key_of(metric)
                if name:
                    out.names.setdefault(key, set()).add(name)
                label_of[key] = label
                out.result.append({"metric": metric, "value": [window.end, "0"]})
        # The samples of one name per GPU key, the keys grouped by that name.
        groups: dict[tuple[str, str], list[str]] = {}
        for key, names in out.names.items():
            uuids_of = groups.setdefault((_sample_name(names), label_of[key]), [])
            if key[0] not in uuids_of:
                uuids_of.append(key[0])
        jobs = [samples_expr(name, label, chosen[lo:lo + IDENTIFY_BATCH], window.length_s, matchers)
                for (name, label), chosen in groups.items() for lo in range(0, len(chosen), IDENTIFY_BATCH)]
        samples: dict[GpuKey, float] = {}
        for answer in pool.map(ask, jobs):
            if isinstance(answer, str):
                out.errors.append(answer)
                continue
            for series in answer:
                try:
                    count = float(series["value"][1])
                except (KeyError, IndexError, TypeError, ValueError):
                    continue
                key = _key_of(series.get("metric", {}))
                samples[key] = max(count, samples.get(key, 0.0))
    for series in out.result:
        series["value"] = [window.end, str(samples.get(_key_of(series["metric"]), 0.0))]
    out.errors = list(dict.fromkeys(out.errors))
    return out


def _key_of(metric: dict[str, str]) -> GpuKey:
    return (metric.get("UUID") or metric.get("uuid") or "", metric.get("GPU_I_ID", ""))


# --- how often the GPUs were scraped, and which stopped reporting ---------------------------------------------------
#
# The scrape interval is the typical spacing of one series' points (the median gap of the GPU with the most samples),
# not the window over the most samples any GPU has: that mean grows with an outage every GPU shares (all silent for
# the window's last 110 s read 11 s for a 5 s scrape) or a GPU that appeared mid-window. A GPU with no sample in the
# window's last SILENT_INTERVALS scrape intervals (SILENT_MIN_S at least: a loaded engine scrapes a second or two
# late) stopped reporting, whether or not every other GPU stopped too.

SILENT_INTERVALS = 3
SILENT_MIN_S = 10.0
# An engine may show data this much later than it scrapes (VictoriaMetrics' default latency offset is 30 s).
LATE_ENGINE_S = 120.0


def _anchor_selector(names: Sequence[str], matchers: str = "", extra: str = "") -> str:
    which = f'__name__="{names[0]}"' if len(names) == 1 else f'__name__=~"{"|".join(names)}"'
    return "{" + ", ".join(x for x in (which, extra, matchers) if x) + "}"


def typical_interval(client: PromClient, window: Window, names: Sequence[str], gpu: GpuIdentity,
                     matchers: str = "") -> float | None:
    """The median gap between one GPU's samples of the anchor field (`names`) over the window; None when it has
    fewer than two or the query fails (the caller keeps its estimate)."""
    value = gpu.uuid.replace("\\", "\\\\").replace('"', '\\"')
    one = f'{gpu.uuid_label}="{value}"'
    if gpu.mig_id:
        one += f', GPU_I_ID="{gpu.key[1]}"'
    try:
        result = client.instant(f"{_anchor_selector(names, matchers, one)}[{_duration(window.length_s)}]",
                                window.end)
    except PromError:
        return None
    gaps: list[float] = []
    for series in result:
        try:
            times = sorted(float(point[0]) for point in series.get("values", []))
        except (TypeError, ValueError, IndexError):
            continue
        gaps += [b - a for a, b in itertools.pairwise(times) if b > a]
    return statistics.median(gaps) if gaps else None


def reporting_at_end(client: PromClient, window: Window, names: Sequence[str], interval_s: float,
                     matchers: str = "") -> tuple[set[GpuKey], float] | None:
    """The GPU keys with a sample of the anchor field in the window's last SILENT_INTERVALS scrape intervals (at
    least SILENT_MIN_S), and that stretch in seconds; None when the window is too short to tell or the query fails.
    The stretch ends at the newest scrape the engine shows (`up`) when that is a little earlier than the window's
    end (an engine that shows data late), so the engine's own delay is not read as every GPU falling silent."""
    quiet = max(SILENT_INTERVALS * interval_s, SILENT_MIN_S)
    if not interval_s > 0 or quiet >= window.length_s:
        return None
    at = window.end
    try:
        newest = client.instant("max(timestamp(up))", window.end)
        if newest:
            scraped = float(newest[0]["value"][1])
            if window.end - LATE_ENGINE_S <= scraped < window.end:
                at = scraped
        result = client.instant(f"max by ({BY}) (count_over_time({_anchor_selector(names, matchers)}"
                                f"[{_duration(quiet)}]))", at)
    except (PromError, KeyError, IndexError, TypeError, ValueError):
        return None
    return {_key_of(series.get("metric", {})) for series in result}, quiet



def index_identities(result: list[dict], gpus: dict[GpuKey, GpuIdentity],
                     samples: dict[GpuKey, float]) -> int:
    """A discovery answer (one series per GPU and label set, its value the samples counted) into `gpus`, the label
    sets of one GPU merged (time-sliced pods, restarts), and `samples` (the most any of its series has). Returns how
    many series had no UUID label, which are left out."""
    exported = uses_exported_pod_labels(s.get("metric", {}) for s in result)
    no_uuid = 0
    for series in result:
        metric = series.get("metric", {})
        ident = identity_from_labels(metric, exported_pods=exported)
        if ident is None or not _key_of(metric)[0]:
            no_uuid += 1
            continue
        known = gpus.get(ident.key)
        if known is None:
            gpus[ident.key] = ident
        else:
            known.merge(ident)
        try:
            count = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        samples[ident.key] = max(count, samples.get(ident.key, 0.0))
    return no_uuid


@dataclass
class WindowData:
    """Every GPU's step values over one window, as Prometheus aggregated them."""

    window: Window
    step_s: float
    lookback_s: float
    grid_start: float  # time of the first step (its value covers the lookback before it)
    n_steps: int
    gpus: dict[GpuKey, GpuIdentity] = field(default_factory=dict)
    values: dict[str, dict[GpuKey, array]] = field(default_factory=dict)  # field -> GPU -> value per step (NaN: none)
    samples: dict[GpuKey, float] = field(default_factory=dict)  # samples of the anchor field in the window
    scrape_interval_s: float | None = None
    fields_present: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # field key -> why its query failed
    _grid: list[float] | None = field(default=None, repr=False)
    errors: list[str] = field(default_factory=list)  # failures: shown as errors, results partial
    notes: list[str] = field(default_factory=list)  # how the data was read
    query_seconds: float = 0.0
    # The DCGM metric names of the GPUs the anchor field missed (read by UUID): what they report.
    names_seen: dict[GpuKey, set[str]] = field(default_factory=dict)

    def step_time(self, i: int) -> float:
        return self.grid_start + i * self.step_s

    def grid_times(self) -> list[float]:
        """Each step's time in seconds since the window start (cached: every GPU shares the grid)."""
        if self._grid is None or len(self._grid) != self.n_steps:
            offset = self.grid_start - self.window.start
            self._grid = [round(offset + i * self.step_s, 3) for i in range(self.n_steps)]
        return self._grid

    def gpu_window(self, key: GpuKey) -> GpuWindow:
        """One GPU's fields as times since the window start and values; a MIG instance inherits device fields."""
        gw = GpuWindow(self.gpus[key])
        grid = self.grid_times()
        for f_key, per_gpu in self.values.items():
            steps = per_gpu.get(key)
            if steps is None and key[1] and f_key in DEVICE_LEVEL_FIELDS:
                steps = per_gpu.get(parent_key(key))
            if steps is None:
                continue
            scale = FIELDS_BY_KEY[f_key].scale
            if not math.isnan(math.fsum(steps)):  # every step has a value: the common case, kept cheap
                times, values = list(grid), steps.tolist()
            else:
                kept = [i for i, v in enumerate(steps) if not math.isnan(v)]
                times, values = [grid[i] for i in kept], [steps[i] for i in kept]
            if scale != 1.0:
                values = [v * scale for v in values]
            if values:
                gw.fields[f_key] = (times, values)
        return gw

    def present_steps(self, key: GpuKey) -> list[int]:
        """Steps at which any per-step field had a sample for this GPU (or, for device fields, its MIG parent).

        The clock-event fields count only when nothing else is there: their subquery reads instant values, which the
        engine carries up to its lookback delta (5 min) past the last sample where no staleness marker ends them
        (data written with its own times, a restarted Prometheus), so they showed a GPU silent for 110 s as whole."""
        present: set[int] = set()
        for bits in (False, True):
            found = False
            for f_key, per_gpu in self.values.items():
                f = FIELDS_BY_KEY[f_key]
                if f.reduce in WHOLE_WINDOW or bool(f.bits) is not bits:
                    continue  # one value for the whole window, placed at the last step: says nothing of gaps
                steps = per_gpu.get(key)
                if steps is None and key[1] and f_key in DEVICE_LEVEL_FIELDS:
                    steps = per_gpu.get(parent_key(key))
                if steps is None:
                    continue
                found = True
                if not math.isnan(math.fsum(steps)):
                    return list(range(self.n_steps))
                present.update(i for i, v in enumerate(steps) if not math.isnan(v))
            if found:
                break
        return sorted(present)

    def gaps(self, key: GpuKey) -> str | None:
        """A sentence on missing stretches of this GPU's series (gaps, reporting stopped or started late).

        Each step averages the last `lookback_s` (at least two scrape intervals), so a step without a value means
        the series really had no sample for that long, not one late scrape.
        """
        present = self.present_steps(key)
        if len(present) == self.n_steps:
            return None
        if not present:
            return "no samples of the queried fields in the window"
        step = self.step_s
        problems = []
        first, last = present[0], present[-1]
        if first > 0:
            problems.append(f"no data for the first {_human_s(self.step_time(first) - self.window.start - step)}")
        holes = [(b - a - 1) * step for a, b in itertools.pairwise(present) if b - a > 1]
        if holes:
            problems.append(f"{len(holes)} gap{'s' if len(holes) > 1 else ''} (longest {_human_s(max(holes))})")
        if last < self.n_steps - 1:
            at = datetime.fromtimestamp(self.step_time(last), timezone.utc).strftime("%H:%M:%S")
            problems.append(f"no data after {at} UTC (exporter or GPU gone for the last "
                            f"{_human_s(self.window.end - self.step_time(last))})")
        return "; ".join(problems)


def _values_by_step(result: list[KeyedSeries], start: float, step_s: float, n_steps: int) -> dict[GpuKey, array]:
    """Series -> per GPU one value per step; several series of one GPU (pods sharing it, a pod replaced during
    the window) are averaged where they overlap."""
    sums: dict[GpuKey, array] = {}
    counts: dict[GpuKey, array] = {}
    full: dict[GpuKey, array] = {}
    for series in result:
        key = series.key
        if not key[0]:
            continue
        points = series.points
        if len(points) == n_steps and key not in full and key not in sums and points[0][0] == start:
            # The common case: one series with every step, on the grid. NaN and infinities cannot come from the
            # reductions used here except as "no samples", which Prometheus leaves out rather than sends.
            full[key] = array("d", [v for _, v in points])
            continue
        if key in full:  # a second series of this GPU: fold the first into the general path
            first = full.pop(key)
            sums[key] = array("d", (0.0 if math.isnan(v) else v for v in first))
            counts[key] = array("d", (0.0 if math.isnan(v) else 1.0 for v in first))
        total = sums.get(key)
        if total is None:
            total = sums[key] = array("d", [0.0]) * n_steps
            counts[key] = array("d", [0.0]) * n_steps
        count = counts[key]
        for ts, value in points:
            i = int(round((ts - start) / step_s))
            if 0 <= i < n_steps:
                if not math.isnan(value) and not math.isinf(value):
                    total[i] += value
                    count[i] += 1
    out: dict[GpuKey, array] = full
    for key, total in sums.items():
        count = counts[key]
        out[key] = array("d", (t / c if c else math.nan for t, c in zip(total, count, strict=True)))
    return out


def _merge_into(mine: dict[GpuKey, array], more: dict[GpuKey, array]) -> None:
    """Fill the steps a field still lacks from another of its metric names (legacy, then DCGM 4.6)."""
    for key, steps in more.items():
        have = mine.get(key)
        if have is None:
            mine[key] = steps
            continue
        for i, v in enumerate(steps):
            if math.isnan(have[i]) and not math.isnan(v):
                have[i] = v


class WindowQuery:
    """Runs the plan for one window: discovery, then one range query per field (in parallel)."""

    def __init__(self, client: PromClient, window: Window, *, points: int = 30, workers: int = 4,
                 fields: Sequence[DcgmField] | None = None) -> None:
        if window.length_s < 2:
            raise InputError("the window is too short to read from Prometheus (under 2 s).")
        self.client = client
        self.window = window
        self.points = max(2, points)
        self.workers = max(1, workers)
        self.fields = list(fields) if fields is not None else [f for f in FIELDS if f.fleet]

    def discover(self, matchers: str = "") -> WindowData:
        """The GPUs with samples in the window, their labels, and the scrape interval (from the samples counted)."""
        result: list[dict] = []
        anchor = FIELDS_BY_KEY[ANCHORS[0]]
        for key in ANCHORS:
            anchor = FIELDS_BY_KEY[key]
            result = self.client.instant(discovery_query(anchor, self.window.length_s, matchers), self.window.end)
            if result:
                break
        step = self.window.length_s / self.points
        data = WindowData(self.window, step, step, self.window.start + step, self.points)
        no_uuid = index_identities(result, data.gpus, data.samples)
        # The union: the GPUs other DCGM series name that the anchor field does not.
        census, failed = census_uuids(self.client, self.window, matchers)
        known = {k[0] for k in data.gpus}
        missing = {u: label for u, label in census.items() if u not in known}
        if missing:
            found = identify(self.client, self.window, missing, matchers=matchers, workers=self.workers)
            no_uuid += index_identities(found.result, data.gpus, data.samples)
            data.names_seen.update(found.names)
            data.errors.extend(f"some of {UNION_UNLISTED} could not be read: {e}" for e in found.errors)
        if failed:
            data.errors.append(f"{UNION_UNLISTED[0].upper()}{UNION_UNLISTED[1:]} could not be listed: {failed}")
        if no_uuid:
            data.errors.append(f"{no_uuid} series without a UUID label were ignored.")
        if not data.gpus:
            if result or census:
                raise SourceUnavailable(f"Prometheus at {self.client.url} has DCGM series but none with a GPU UUID "
                                        "label.")
            raise SourceUnavailable(no_dcgm_series(self.client.url, self.window))
        most = max(data.samples.values(), default=0.0)
        # A first estimate; the spacing of the points of the GPU with the most samples replaces it (an outage all
        # GPUs share, or a GPU that started late, stretches this one).
        data.scrape_interval_s = self.window.length_s / most if most >= 2 else None
        best = max(data.samples, key=lambda k: data.samples[k], default=None)
        if best is not None and most >= 2 and best in data.gpus:
            data.scrape_interval_s = typical_interval(self.client, self.window, anchor.query_names,
                                                      data.gpus[best], matchers) or data.scrape_interval_s
        return data

    def read_fields(self, data: WindowData, matchers: str = "", keys: set[GpuKey] | None = None) -> WindowData:
        """Query each field at step max(window/points, scrape interval); fills data in place.

        Only metric names Prometheus has are queried (one cheap label-values call tells which): a field none of
        whose names exist is known to be absent without a query.
        """
        t0 = time.perf_counter()
        interval = data.scrape_interval_s or 0.0
        self._set_grid(data, interval)
        step, n_steps = data.step_s, data.n_steps
        grid_end = data.grid_start + (n_steps - 1) * step
        try:
            existing: set[str] | None = set(self.client.label_values("__name__", self.window.start, self.window.end))
        except PromError:
            existing = None  # older or proxied Prometheus: ask for every name
        jobs = [(f, name, matchers) for f in self.fields
                for name in (f.query_names if existing is not None else f.names)
                if existing is None or name in existing]
        allowed = None if keys is None else set(keys) | {parent_key(k) for k in keys}
        # A constant needs only its latest value: a short lookback reads a fraction of the samples.
        last_lookback = min(self.window.length_s, max(300.0, 4 * interval))

        def run(job: tuple[DcgmField, str, str]) -> tuple[DcgmField, dict[GpuKey, array] | None, str]:
            f, name, where = job
            better = FIELDS_BY_KEY[f.fallback_for].query_names if f.fallback_for else ()
            unless = [n for n in better if existing is None or n in existing]
            try:
                if f.reduce in WHOLE_WINDOW:  # one value per GPU, placed at the last step
                    lookback = last_lookback if f.reduce == "last" else self.window.length_s
                    result = self.client.instant_points(field_query(f, name, lookback, where, unless), grid_end)
                    for series in result:
                        series.value = (grid_end, series.value[1] if series.value else math.nan)
                else:
                    query = field_query(f, name, data.lookback_s, where, unless)
                    result = self.client.range_points(query, data.grid_start, grid_end + 0.001, step)
            except PromError as exc:
                return f, None, str(exc)
            values = _values_by_step(result, data.grid_start, step, n_steps)
            del result  # the parsed JSON is the bulky part; drop it before the next query lands
            if allowed is not None:
                values = {k: v for k, v in values.items() if k in allowed}
            return f, values, ""

        def collect(batch: list[tuple[DcgmField, str, str]]) -> None:
            if not batch:
                return
            with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(batch)))) as pool:
                for f, values, error in pool.map(run, batch):
                    if values is None:
                        data.failed.setdefault(f.key, error)
                        continue
                    if values:
                        _merge_into(data.values.setdefault(f.key, {}), values)
                        data.fields_present.add(f.key)

        collect([j for j in jobs if not j[0].fallback_for])
        # Fallbacks (GPU_UTIL) only for the GPUs their better field left without data: usually none, and then the
        # query, which would scan every GPU's series to send nothing back, is not made.
        candidates = set(keys) if keys is not None else {g.key for g in drop_mig_parents(data.gpus.values())}
        collect(_fallback_jobs(data, [j for j in jobs if j[0].fallback_for], candidates))
        if data.failed:
            names = ", ".join(FIELDS_BY_KEY[k].name for k in data.failed)
            first = next(iter(data.failed.values()))
            data.errors.append(f"{len(data.failed)} of {len({j[0].key for j in jobs})} field queries failed "
                               f"({names}): {first}")
        data.query_seconds += time.perf_counter() - t0
        return data

    def _set_grid(self, data: WindowData, interval: float) -> None:
        """The step (at least the scrape interval), the grid of points ending at the window's end, the lookback."""
        # Whole seconds: an integer grid comes back exactly where it was asked for, whatever rounding a proxy
        # in front of the engine applies to start and end.
        step = float(max(1, round(max(self.window.length_s / self.points, interval))))
        n_steps = max(1, int(self.window.length_s // step))
        data.step_s, data.n_steps = step, n_steps
        data.grid_start = math.floor(self.window.end) - (n_steps - 1) * step
        data.lookback_s = max(step, 2 * interval)
        if data.lookback_s > step:
            data.notes.append(f"Prometheus scraped these GPUs every ~{interval:.3g} s: each point averages the "
                              f"last {data.lookback_s:.3g} s.")


def _fallback_jobs(data: WindowData, jobs: Sequence[tuple[DcgmField, str, str]],
                   candidates: set[GpuKey]) -> list[tuple[DcgmField, str, str]]:
    """The fallback fields' queries, each only for the GPUs its better field left without data (by UUID when they
    are few enough to name); none for a field whose better one covered every GPU."""
    out = []
    for f, name, where in jobs:
        lacking = candidates - set(data.values.get(f.fallback_for or "", {}))
        if not lacking:
            continue
        uuids = sorted({k[0] for k in lacking})
        if len(uuids) <= 200:
            label = data.gpus[next(iter(lacking))].uuid_label if next(iter(lacking)) in data.gpus else "UUID"
            where = ", ".join(x for x in (where, f'{label}=~"{"|".join(_regex_escape(u) for u in uuids)}"') if x)
        out.append((f, name, where))
    return out


def _regex_escape(value: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", value).replace('"', '\\"')


def matchers_for(gpus: Sequence[GpuIdentity]) -> str:
    """Label matchers that narrow the field queries to these GPUs (and their MIG parents); exact filtering follows."""
    labels = {g.uuid_label for g in gpus}
    if len(labels) != 1:
        return ""
    uuids = sorted({g.uuid for g in gpus})
    return f'{labels.pop()}=~"{"|".join(_regex_escape(u) for u in uuids)}"'


# --- one target -------------------------------------------------------------------------------------------------------


def collect_target(capture: Capture, client: PromClient, window: Window, selector: GpuSelector, *,
                   points: int = 60) -> list[GpuIdentity]:
    """Fill `capture` with the selected GPU(s)' DCGM series over `window`; returns the GPUs."""
    query = WindowQuery(client, window, points=points, fields=FIELDS)
    data = query.discover()
    candidates = drop_mig_parents(data.gpus.values())
    targets = select_gpus(candidates, selector)
    wanted = {g.key for g in targets}
    query.read_fields(data, matchers_for(targets), keys=wanted)
    if not any(k in per_gpu for per_gpu in data.values.values() for k in wanted):
        reason = next(iter(data.failed.values()), "no field had data for it")
        raise SourceUnavailable(f"Prometheus listed {describe_target(targets)} but returned no counters for it: "
                                f"{reason}")
    fill_capture(capture, data, targets)
    return targets


def fill_capture(capture: Capture, data: WindowData, targets: Sequence[GpuIdentity]) -> None:
    produced: set[str] = set()
    for g in targets:
        produced |= set(add_gpu_window(capture, data.gpu_window(g.key)))
        gaps = data.gaps(g.key)
        if gaps:
            capture.notes.append(f"DCGM series of {g.describe()} are partial: {gaps}.")
    mark_missing(capture, produced, fields_in_source=data.fields_present, failed=data.failed,
                 mig=any(g.mig_id for g in targets))
    capture.notes.extend(e for e in data.errors + data.notes if e not in capture.notes)


__all__ = ["PromClient", "PromError", "Identified", "Window", "WindowData", "WindowQuery", "census_uuids",
           "collect_target", "fill_capture", "field_query", "identify", "matchers_for", "no_dcgm_series",
           "parse_duration", "parse_time", "resolve_window"]
