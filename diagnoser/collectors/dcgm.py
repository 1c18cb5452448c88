"""DCGM counters as dcgm-exporter publishes them, read by scraping the exporter or (see prometheus_source.py) by
querying the Prometheus that keeps them.

This module holds what both ways in share: the field table (the legacy names dcgm-exporter emits today and the
DCGM 4.6 names), the labels that identify a GPU, a MIG instance and its Kubernetes pod, parsing the exporter's text,
selecting a target, and turning per-GPU samples into capture series. Scraping an exporter live is in
dcgm_exporter.py, querying Prometheus in prometheus_source.py, and `collect_dcgm_into` (dcgm_collect.py) is the one
entry point for attach and the dcgm command. It knows nothing of rules.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diagnoser.capture import Capture, GpuInfo, Series
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.signals import spec
from diagnoser.textsafe import one_line

SOURCE = "dcgm"
MIB = 1024 * 1024
COUNTERS_CSV = Path(__file__).resolve().parents[1] / "data" / "dcgm-counters.csv"
CSV_HINT = "see diagnoser/data/dcgm-counters.csv (docs/dcgm.md says how to load it into dcgm-exporter)"


@dataclass(frozen=True)
class DcgmField:
    """One DCGM field as a Prometheus metric, and how a window step of it becomes a diagnoser signal."""

    key: str
    names: tuple[str, ...]  # the legacy name (what dcgm-exporter emits today) first, then DCGM 4.6's, if renamed
    signal: str | None  # None: read for context only (free memory, the maximum clock)
    # How samples reduce to a value. Per step: "avg" (gauge), "rate" (counter per second), "increase" (counter).
    # Once for the whole window (Prometheus answers one number per GPU): "max" (only the worst value matters, as
    # for the last XID) and "last" (a constant: the maximum clock, the free memory that completes the total).
    reduce: str = "avg"
    scale: float = 1.0  # multiply the reduced value by this to get the signal's unit
    in_default_csv: bool = True  # active in dcgm-exporter's default-counters.csv
    fleet: bool = True  # read by `diagnoser fleet` (the rules use it)
    # Only wanted for GPUs that lack this other field (GPU_UTIL where GR_ENGINE_ACTIVE is missing, as on old
    # exporters): Prometheus drops the rest with `unless`, so they are not sent.
    fallback_for: str | None = None
    # A clock-event bit mask field: the value is 1 while any of these bits is set, else 0 (averaged over a step,
    # the share of samples with one set).
    bits: int = 0

    @property
    def name(self) -> str:
        return self.names[0] if self.names else self.key

    @property
    def query_names(self) -> tuple[str, ...]:
        """Every spelling a Prometheus may hold: the names, then lower case (some exporters and relabelings)."""
        return self.names + tuple(n.lower() for n in self.names)


# DCGM_CLOCKS_EVENT_REASON_* (dcgm_fields.h, "a 1:1 map to the NVML reasons"): SW power cap 0x4, HW slowdown 0x8,
# sync boost 0x10, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80; clocks setting 0x2 and display clocks 0x100.
# GPU idle (0x1) is no throttle. HW slowdown is thermal or power brake alike: "other".
CLOCK_EVENT_POWER = 0x4 | 0x80
CLOCK_EVENT_THERMAL = 0x20 | 0x40
CLOCK_EVENT_OTHER = 0x2 | 0x8 | 0x10 | 0x100
# The HW power brake, part of "power" above, told apart: it is asserted from outside the GPU (the power supply, the
# BMC), so its fix is the node's power, not the GPU's power limit.
CLOCK_EVENT_BRAKE = 0x80
CLOCK_EVENT_NAMES = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")


# Order matters where two fields feed one signal: the first one with data for a GPU wins (GR_ENGINE_ACTIVE works on
# MIG instances, GPU_UTIL does not). The fleet queries its fields in this order: activity first, so a Prometheus that
# dies half-way has still answered what matters most.
FIELDS: tuple[DcgmField, ...] = (
    DcgmField("gr_engine_active", ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"), "gpu.busy"),
    # Still a percent in DCGM 4.6 despite the _RATIO name (INT64 0-100).
    DcgmField("gpu_util", ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO"), "gpu.busy", scale=0.01,
              fallback_for="gr_engine_active"),
    DcgmField("sm_active", ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO"), "gpu.sm_active",
              in_default_csv=False),
    DcgmField("sm_occupancy", ("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO"), "gpu.sm_occupancy",
              in_default_csv=False, fleet=False),
    DcgmField("tensor_active", ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
              "gpu.tensor_active"),
    DcgmField("dram_active", ("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO"), "gpu.dram_active"),
    DcgmField("fp16_active", ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "DCGM_FI_PROF_FP16_UTIL_RATIO"), "gpu.fp16_active",
              in_default_csv=False, fleet=False),
    DcgmField("fp32_active", ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "DCGM_FI_PROF_FP32_UTIL_RATIO"), "gpu.fp32_active",
              in_default_csv=False, fleet=False),
    DcgmField("mem_copy_util", ("DCGM_FI_DEV_MEM_COPY_UTIL",), "gpu.mem_busy", scale=0.01, fleet=False),
    DcgmField("fb_used", ("DCGM_FI_DEV_FB_USED",), "gpu.mem_used_bytes", scale=MIB),
    DcgmField("fb_free", ("DCGM_FI_DEV_FB_FREE",), None, reduce="last", scale=MIB),
    DcgmField("sm_clock", ("DCGM_FI_DEV_SM_CLOCK",), "gpu.sm_clock_mhz"),
    DcgmField("max_sm_clock", ("DCGM_FI_DEV_MAX_SM_CLOCK",), None, reduce="last", in_default_csv=False),
    # Context only (no rule requires them): the fleet leaves them out, a query fewer each.
    DcgmField("power", ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"), "gpu.power_w", fleet=False),
    DcgmField("power_limit", ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_BOARD_POWER_LIMIT_ENFORCED_WATTS"),
              "gpu.power_limit_w", in_default_csv=False, fleet=False),
    DcgmField("temp", ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"), "gpu.temp_c", fleet=False),
    # Violation counters accumulate nanoseconds of throttling: their rate / 1e9 is the throttled share of time.
    DcgmField("power_violation", ("DCGM_FI_DEV_POWER_VIOLATION",), "gpu.throttle.power", reduce="rate", scale=1e-9,
              in_default_csv=False),
    DcgmField("thermal_violation", ("DCGM_FI_DEV_THERMAL_VIOLATION",), "gpu.throttle.thermal", reduce="rate",
              scale=1e-9, in_default_csv=False),
    # The clock event reasons, sampled: where the violation counters are not exported (DCGM 4.x renamed the field;
    # both names are read).
    DcgmField("reasons_power", CLOCK_EVENT_NAMES, "gpu.throttle.power", in_default_csv=False, bits=CLOCK_EVENT_POWER),
    DcgmField("reasons_thermal", CLOCK_EVENT_NAMES, "gpu.throttle.thermal", in_default_csv=False,
              bits=CLOCK_EVENT_THERMAL),
    DcgmField("reasons_other", CLOCK_EVENT_NAMES, "gpu.throttle.other", in_default_csv=False, bits=CLOCK_EVENT_OTHER),
    # (The fleet's triage reads the brake from the reasons_power statistics, fleet/triage.py.)
    DcgmField("reasons_brake", CLOCK_EVENT_NAMES, "gpu.throttle.power_brake", in_default_csv=False,
              bits=CLOCK_EVENT_BRAKE),
    DcgmField("power_default_limit",
              ("DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF", "DCGM_FI_DEV_BOARD_POWER_LIMIT_DEFAULT_WATTS"),
              "gpu.power_default_limit_w", reduce="last", in_default_csv=False, fleet=False),
    # The PROF PCIe/NVLink fields are exported as gauges in bytes per second (dcgm-exporter's HELP text).
    DcgmField("pcie_tx", ("DCGM_FI_PROF_PCIE_TX_BYTES",), "gpu.pcie_tx_bps"),
    DcgmField("pcie_rx", ("DCGM_FI_PROF_PCIE_RX_BYTES",), "gpu.pcie_rx_bps"),
    # DCGM 4.6 adds cumulative byte counters; used when the rate fields are absent.
    DcgmField("pcie_tx_total", ("DCGM_FI_PROF_PCIE_TX_BYTES_TOTAL",), "gpu.pcie_tx_bps", reduce="rate",
              in_default_csv=False),
    DcgmField("pcie_rx_total", ("DCGM_FI_PROF_PCIE_RX_BYTES_TOTAL",), "gpu.pcie_rx_bps", reduce="rate",
              in_default_csv=False),
    DcgmField("nvlink_tx", ("DCGM_FI_PROF_NVLINK_TX_BYTES",), "gpu.nvlink_tx_bps", in_default_csv=False, fleet=False),
    DcgmField("nvlink_rx", ("DCGM_FI_PROF_NVLINK_RX_BYTES",), "gpu.nvlink_rx_bps", in_default_csv=False, fleet=False),
    # The value of the last XID seen, not a count: any non-zero value is an error report (kept as a note).
    DcgmField("xid", ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"), "gpu.xid_errors", reduce="max"),
    DcgmField("ecc_dbe", ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",), "gpu.ecc_dbe", reduce="increase", in_default_csv=False),
    DcgmField("pcie_replay", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL"), "gpu.pcie_replays",
              reduce="increase", fleet=False),
)
FIELDS_BY_KEY: dict[str, DcgmField] = {f.key: f for f in FIELDS}
# A metric name feeds one field, or several (the clock event reasons: one field per group of bits).
FIELDS_OF_NAME: dict[str, tuple[DcgmField, ...]] = {}
for _f in FIELDS:
    for _name in _f.names:
        FIELDS_OF_NAME[_name] = (*FIELDS_OF_NAME.get(_name, ()), _f)
FIELD_OF_NAME: dict[str, DcgmField] = {name: fs[0] for name, fs in FIELDS_OF_NAME.items()}

# Signals the rules read, with the fields that feed them; a missing one is recorded as unavailable, with a hint.
WANTED_SIGNALS: dict[str, tuple[str, ...]] = {
    "gpu.busy": ("gr_engine_active", "gpu_util"),
    "gpu.sm_active": ("sm_active",),
    "gpu.tensor_active": ("tensor_active",),
    "gpu.dram_active": ("dram_active",),
    "gpu.mem_used_frac": ("fb_used", "fb_free"),
    "gpu.sm_clock_frac": ("sm_clock", "max_sm_clock"),
    "gpu.power_w": ("power",),
    "gpu.throttle.power": ("power_violation", "reasons_power"),
    "gpu.throttle.thermal": ("thermal_violation", "reasons_thermal"),
    "gpu.pcie_tx_bps": ("pcie_tx", "pcie_tx_total"),
    "gpu.pcie_rx_bps": ("pcie_rx", "pcie_rx_total"),
    "gpu.xid_errors": ("xid",),
}

# --- labels -----------------------------------------------------------------------------------------------------------

UUID_LABELS = ("UUID", "uuid")  # `uuid` under dcgm-exporter's --use-old-namespace
# A node label set by service discovery beats the exporter's own: under Kubernetes `hostname` is often the exporter
# pod's name. `Hostname` became `hostname` after dcgm-exporter 4.5.3-4.8.2.
NODE_LABELS = ("node", "kubernetes_node", "Hostname", "hostname", "instance")
# When Prometheus scrapes the exporter without honor_labels, the exporter's pod labels become exported_* and `pod`
# names the exporter itself.
POD_LABELS = ("exported_pod", "pod", "pod_name")
NAMESPACE_LABELS = ("exported_namespace", "namespace", "pod_namespace")
CONTAINER_LABELS = ("exported_container", "container", "container_name")
# Series of these entities are not per-GPU (NVLink, NVSwitch, CPU): they are skipped.
NON_GPU_LABELS = ("nvlink", "nvswitch", "cpu", "cpucore")
# Labels a GPU's series carry that say what and where it is (the Prometheus discovery query groups by these).
IDENTITY_LABELS = ("UUID", "uuid", "GPU_I_ID", "GPU_I_PROFILE", "gpu", "device", "modelName",
                   "DCGM_FI_DRIVER_VERSION", *NODE_LABELS, *POD_LABELS, *NAMESPACE_LABELS, *CONTAINER_LABELS)

GpuKey = tuple[str, str]  # (GPU UUID, MIG GPU instance id or "")


def _first(labels: Mapping[str, str], names: Sequence[str]) -> str:
    for name in names:
        value = labels.get(name)
        if value:
            return value
    return ""


def _node_of(labels: Mapping[str, str]) -> str:
    node = _first(labels, NODE_LABELS)
    if node and node == labels.get("instance"):
        host = node.rsplit(":", 1)[0]  # instance is host:port
        return host.strip("[]")
    return node


@dataclass
class GpuIdentity:
    """A GPU or MIG instance as its labels describe it, with the pods seen on it."""

    key: GpuKey
    index: int
    model: str
    node: str
    uuid_label: str = "UUID"
    mig_id: str = ""
    mig_profile: str = ""
    device: str = ""
    driver: str = ""
    pods: list[tuple[str, str]] = field(default_factory=list)  # (namespace, pod)
    containers: list[str] = field(default_factory=list)

    @property
    def uuid(self) -> str:
        return self.key[0]

    @property
    def label(self) -> str:
        """The GPU as a short string: "0", or "0/7" for MIG instance 7 of GPU 0."""
        return f"{self.index}/{self.mig_id}" if self.mig_id else str(self.index)

    @property
    def pod_names(self) -> list[str]:
        return [f"{ns}/{pod}" if ns else pod for ns, pod in self.pods]

    @property
    def namespaces(self) -> list[str]:
        return sorted({ns for ns, _ in self.pods if ns})

    def describe(self) -> str:
        where = f"gpu {self.label}" + (f" ({self.mig_profile})" if self.mig_profile else "")
        parts = [f"{where} {self.uuid}" if self.uuid else where]
        if self.node:
            parts.append(f"on {self.node}")
        if self.pods:
            parts.append("pod " + ", ".join(self.pod_names))
        return " ".join(parts)

    def merge(self, other: GpuIdentity) -> None:
        """Add the pods and containers of another series of the same GPU (time-sliced pods, restarts)."""
        for pod in other.pods:
            if pod not in self.pods:
                self.pods.append(pod)
        for container in other.containers:
            if container not in self.containers:
                self.containers.append(container)
        self.model = self.model or other.model
        self.node = self.node or other.node


def identity_from_labels(labels: Mapping[str, str], *, exported_pods: bool = False) -> GpuIdentity | None:
    """The GPU a series belongs to, or None for series of other entities (NVLink, NVSwitch, CPU).

    `exported_pods`: the source renamed the exporter's pod labels to exported_* (then `pod` names the exporter).
    """
    if any(labels.get(name) for name in NON_GPU_LABELS):
        return None
    uuid_label = next((name for name in UUID_LABELS if labels.get(name)), "")
    index_text = labels.get("gpu", "")
    if not uuid_label and not index_text:
        return None
    node = _node_of(labels)
    try:
        index = int(index_text)
    except ValueError:
        index = -1
    uuid = labels[uuid_label] if uuid_label else f"{node}/gpu{index_text}"
    mig_id = labels.get("GPU_I_ID", "")
    pod_names: tuple[str, ...]
    ns_names: tuple[str, ...]
    ct_names: tuple[str, ...]
    if exported_pods:
        pod_names, ns_names, ct_names = ("exported_pod",), ("exported_namespace",), ("exported_container",)
    else:
        pod_names, ns_names, ct_names = POD_LABELS[1:], NAMESPACE_LABELS[1:], CONTAINER_LABELS[1:]
    pod, namespace, container = _first(labels, pod_names), _first(labels, ns_names), _first(labels, ct_names)
    c = clean_label
    return GpuIdentity(
        key=(c(uuid), c(mig_id)), index=index, model=c(labels.get("modelName", "") or labels.get("model_name", "")),
        node=c(node), uuid_label=uuid_label or "UUID", mig_id=c(mig_id), mig_profile=c(labels.get("GPU_I_PROFILE", "")),
        device=c(labels.get("device", "")), driver=c(labels.get("DCGM_FI_DRIVER_VERSION", "")),
        pods=[(c(namespace), c(pod))] if pod else [], containers=[c(container)] if container else [],
    )


# Fields dcgm-exporter reports for a whole GPU even in MIG mode (no GPU_I_ID): a MIG instance inherits them from its
# parent. Activity and memory fields are per instance.
DEVICE_LEVEL_FIELDS = frozenset({"power", "power_limit", "power_default_limit", "temp", "sm_clock", "max_sm_clock",
                                 "power_violation", "thermal_violation", "reasons_power", "reasons_thermal",
                                 "reasons_other", "reasons_brake", "xid", "ecc_dbe", "pcie_replay"})


def parent_key(key: GpuKey) -> GpuKey:
    return (key[0], "")


def drop_mig_parents(gpus: Iterable[GpuIdentity]) -> list[GpuIdentity]:
    """A MIG GPU's own (instance-less) series only carry device fields for its instances: it is not a target."""
    gpus = list(gpus)
    with_instances = {g.uuid for g in gpus if g.mig_id}
    return [g for g in gpus if g.mig_id or g.uuid not in with_instances]


def inherit_device_fields(values: dict[str, float], parent: Mapping[str, float] | None) -> dict[str, float]:
    if not parent:
        return values
    merged = dict(values)
    for key in DEVICE_LEVEL_FIELDS:
        if key not in merged and key in parent:
            merged[key] = parent[key]
    return merged


def uses_exported_pod_labels(label_sets: Iterable[Mapping[str, str]]) -> bool:
    return any("exported_pod" in labels or "exported_namespace" in labels for labels in label_sets)


# --- parsing the exporter's text --------------------------------------------------------------------------------------


@dataclass
class Scrape:
    """One reading of an exporter: the GPUs it lists and, per GPU, the value of each known field."""

    at: float
    gpus: dict[GpuKey, GpuIdentity] = field(default_factory=dict)
    values: dict[GpuKey, dict[str, float]] = field(default_factory=dict)
    metric_names: set[str] = field(default_factory=set)  # every DCGM_* metric present, known or not
    malformed: int = 0  # lines of known fields that did not parse (skipped)

    @property
    def fields_seen(self) -> set[str]:
        return {key for per_gpu in self.values.values() for key in per_gpu}


# One label pair of the text format: name="value" with \\, \" and \n escapes, then an optional comma.
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = re.compile(r"\\(.)")


def clean_label(value: str) -> str:
    """A label value with its control characters shown as escapes (textsafe): a modelName carrying ESC sequences
    must not reach a terminal, and a reader should still see that something was there."""
    return value if value.isprintable() else one_line(value)


def fields_of_name(name: str) -> tuple[DcgmField, ...]:
    """The fields a metric name feeds, in either case: some exporters and relabelings write `dcgm_fi_*`."""
    known = FIELDS_OF_NAME.get(name)
    if known is None and name[:5] == "dcgm_":
        known = FIELDS_OF_NAME.get(name.upper())
    return known or ()


def field_value(f: DcgmField, value: float) -> float:
    """A sample as the field reads it: a clock event mask becomes 1 when one of the field's bits is set."""
    return float(bool(int(value) & f.bits)) if f.bits else value


def _parse_labels(text: str) -> dict[str, str] | None:
    """The inside of {...}; None when it is not the text format."""
    labels: dict[str, str] = {}
    pos = 0
    end = len(text)
    while pos < end:
        found = _LABEL.match(text, pos)
        if found is None:
            return labels if not text[pos:].strip() else None
        value = found.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)
        labels[found.group(1)] = value
        pos = found.end()
    return labels


class _ScrapeBuilder:
    """Accumulates the known fields of an exporter page, line by line, as the bytes arrive."""

    def __init__(self, at: float) -> None:
        self.scrape = Scrape(at=at)
        self.sums: dict[GpuKey, dict[str, list[float]]] = {}
        self.lines = 0  # lines that were samples of the text format (any metric)

    def feed(self, line: bytes) -> None:
        if not line or line[:1] == b"#":
            return
        if line[:5] not in (b"DCGM_", b"dcgm_"):
            if line[:1].isalpha() or line[:1] == b"_":
                self.lines += 1
            return
        text = line.decode("utf-8", "replace").rstrip("\r")
        brace = text.find("{")
        if brace < 0:
            name, _, rest = text.partition(" ")
            labels: dict[str, str] | None = {}
        else:
            name = text[:brace]
            close = text.rfind("}")
            labels = _parse_labels(text[brace + 1:close]) if close > brace else None
            rest = text[close + 1:] if close > brace else ""
        self.lines += 1
        name = name.strip()
        if name.endswith("_total") and fields_of_name(name[:-6]):
            name = name[:-6]  # a counter a client library exposed with _total; the exporter's name has none
        self.scrape.metric_names.add(name.upper() if name[:5] == "dcgm_" else name)
        known = fields_of_name(name)
        if not known:
            # A field the rules do not read still says the GPU exists: one that exports only such fields is named
            # as such rather than "no GPU matches".
            ident = identity_from_labels(labels) if labels else None
            if ident is not None and ident.key not in self.scrape.gpus:
                self.scrape.gpus[ident.key] = ident
            return
        parts = rest.split()
        if labels is None or not parts:
            self.scrape.malformed += 1
            return
        try:
            value = float(parts[0])
        except ValueError:
            self.scrape.malformed += 1
            return
        ident = identity_from_labels(labels)
        if ident is None:
            return
        if ident.key in self.scrape.gpus:
            self.scrape.gpus[ident.key].merge(ident)
        else:
            self.scrape.gpus[ident.key] = ident
        if math.isnan(value) or math.isinf(value):
            return
        per_gpu = self.sums.setdefault(ident.key, {})
        for f in known:
            acc = per_gpu.setdefault(f.key, [0.0, 0.0])
            acc[0] += field_value(f, value)
            acc[1] += 1

    def finish(self) -> Scrape:
        for key, per_field in self.sums.items():
            self.scrape.values[key] = {name: total / count for name, (total, count) in per_field.items()}
        return self.scrape


def parse_exporter_lines(lines: Iterable[bytes], at: float | None = None, *,
                         origin: str = "dcgm-exporter") -> Scrape:
    """Parse dcgm-exporter's text (Prometheus exposition format) line by line, keeping only the known DCGM fields:
    other metrics are skipped at the first bytes of their line, so a large page costs little beyond reading it.

    Several series of one GPU (one per pod when pods time-share it) carry the same device value; they are averaged.
    A malformed line of a known field is skipped and counted; a page with DCGM lines none of which parse is not
    the text format."""
    builder = _ScrapeBuilder(time.time() if at is None else at)
    for line in lines:
        builder.feed(line)
    scrape = builder.finish()
    if scrape.malformed and not scrape.values and not scrape.gpus:
        raise SourceUnavailable(f"{origin} did not return Prometheus text format ({scrape.malformed} lines of DCGM "
                                "fields did not parse).")
    return scrape


def parse_exporter_text(text: str, at: float | None = None, *, origin: str = "dcgm-exporter") -> Scrape:
    """parse_exporter_lines over a whole page held in memory."""
    return parse_exporter_lines((line.encode() for line in text.splitlines()), at, origin=origin)


# --- choosing the target ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSelector:
    """Which GPU(s) to diagnose. Empty: the only GPU there is."""

    gpu: int | None = None
    uuid: str | None = None
    pod: str | None = None  # "pod" or "namespace/pod"; a unique prefix of a pod name also matches
    node: str | None = None
    mig_instance: str | None = None
    uuids: tuple[str, ...] = ()  # resolved from a PID
    indices: tuple[int, ...] = ()  # resolved from a PID's CUDA_VISIBLE_DEVICES
    pid: int | None = None

    def is_empty(self) -> bool:
        return not any((self.gpu is not None, self.uuid, self.pod, self.node, self.mig_instance, self.uuids,
                        self.indices, self.pid is not None))

    def describe(self) -> str:
        parts = []
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.pod:
            parts.append(f"pod {self.pod}")
        if self.uuid:
            parts.append(f"uuid {self.uuid}")
        if self.node:
            parts.append(f"node {self.node}")
        if self.gpu is not None:
            parts.append(f"gpu {self.gpu}")
        if self.mig_instance:
            parts.append(f"MIG instance {self.mig_instance}")
        return ", ".join(parts) or "any GPU"


def _norm_uuid(text: str) -> str:
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _node_matches(node: str, wanted: str) -> bool:
    node, wanted = node.lower(), wanted.lower()
    return node == wanted or node.split(".")[0] == wanted.split(".")[0]


def _pod_filter(gpus: list[GpuIdentity], wanted: str) -> list[GpuIdentity]:
    namespace, _, pod = wanted.rpartition("/")

    def names(g: GpuIdentity) -> list[str]:
        return [p for ns, p in g.pods if not namespace or ns == namespace]

    exact = [g for g in gpus if pod in names(g)]
    if exact:
        return exact
    prefixed = [g for g in gpus if any(p.startswith(pod) for p in names(g))]
    distinct = sorted({p for g in prefixed for p in names(g) if p.startswith(pod)})
    if len(distinct) > 1:
        raise InputError(f"pod prefix '{wanted}' matches {len(distinct)} pods ({', '.join(distinct[:6])}"
                         f"{', ...' if len(distinct) > 6 else ''}); give the full pod name.")
    return prefixed


def _uuid_filter(gpus: list[GpuIdentity], wanted: str) -> list[GpuIdentity]:
    """The GPUs with this UUID, or else the one GPU whose UUID starts with it (as `nvidia-smi -L` prints a prefix)."""
    norm = _norm_uuid(wanted)
    exact = [g for g in gpus if _norm_uuid(g.uuid) == norm]
    if exact or not norm:
        return exact
    prefixed = [g for g in gpus if _norm_uuid(g.uuid).startswith(norm)]
    distinct = sorted({g.uuid for g in prefixed})
    if len(distinct) > 1:
        raise InputError(f"uuid prefix '{wanted}' matches {len(distinct)} GPUs ({', '.join(distinct[:6])}"
                         f"{', ...' if len(distinct) > 6 else ''}); give more of the UUID.")
    return prefixed


def select_gpus(gpus: Iterable[GpuIdentity], selector: GpuSelector, *, many: bool = False) -> list[GpuIdentity]:
    """The GPUs the selector names. Several GPUs are one target only for a pod or a process that uses them all
    (or with `many`, as the fleet filters); otherwise an ambiguous selector is an error that lists the candidates."""
    pool = sorted(gpus, key=lambda g: (g.node, g.index, g.mig_id))
    if not pool:
        raise SourceUnavailable("the source lists no GPUs.")
    chosen = pool
    if selector.node:
        chosen = [g for g in chosen if _node_matches(g.node, selector.node)]
    if selector.uuid:
        chosen = _uuid_filter(chosen, selector.uuid)
    if selector.uuids:
        wanted = {_norm_uuid(u) for u in selector.uuids}
        chosen = [g for g in chosen if _norm_uuid(g.uuid) in wanted]
    if selector.indices:
        chosen = [g for g in chosen if g.index in selector.indices]
    if selector.gpu is not None:
        chosen = [g for g in chosen if g.index == selector.gpu]
    if selector.mig_instance:
        chosen = [g for g in chosen if g.mig_id == selector.mig_instance]
    if selector.pod:
        chosen = _pod_filter(chosen, selector.pod)
    if not chosen:
        raise InputError(f"no GPU matches {selector.describe()}; the source has: {_listing(pool)}.")
    if many:
        return chosen
    if len(chosen) > 1 and selector.is_empty():
        raise InputError(f"the source lists {len(chosen)} GPUs or MIG instances: {_listing(chosen)}; pick one with "
                         "--gpu, --uuid, --pod or --mig-instance.")
    if len(chosen) > 1 and not (selector.pod or selector.pid is not None):
        parents = {g.uuid for g in chosen}
        if len(parents) == 1 and all(g.mig_id for g in chosen):
            raise InputError(f"{selector.describe()} has {len(chosen)} MIG instances "
                             f"({', '.join(g.mig_id for g in chosen)}); pick one with --mig-instance.")
        raise InputError(f"{len(chosen)} GPUs match {selector.describe()}: {_listing(chosen)}; narrow it with "
                         "--uuid, --pod, or --node and --gpu.")
    return chosen


def _listing(gpus: Sequence[GpuIdentity], limit: int = 8) -> str:
    shown = "; ".join(g.describe() for g in gpus[:limit])
    return shown + (f"; and {len(gpus) - limit} more" if len(gpus) > limit else "")


def selector_for_pid(pid: int) -> GpuSelector:
    """The GPUs a process uses (NVML first, then its CUDA_VISIBLE_DEVICES). UUIDs name a GPU anywhere, so they
    carry no node; indices are this node's (`this_node`)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        family = {pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        raise SourceUnavailable(f"no process with pid {pid}.") from None
    except psutil.AccessDenied:
        raise SourceUnavailable(f"no permission to inspect pid {pid}.") from None
    uuids = _nvml_uuids_of(family)
    if uuids:
        return GpuSelector(pid=pid, uuids=tuple(uuids))
    try:
        env = proc.environ()
    except psutil.AccessDenied:
        raise SourceUnavailable(f"cannot tell which GPU pid {pid} uses: NVML is not available here and reading its "
                                "environment needs more permission; pass --uuid, or --node and --gpu.") from None
    except psutil.NoSuchProcess:
        raise SourceUnavailable(f"pid {pid} exited.") from None
    visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("NVIDIA_VISIBLE_DEVICES") or ""
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if not items or any(v.lower() in ("all", "none", "void") for v in items):
        raise SourceUnavailable(f"cannot tell which GPU pid {pid} uses: NVML is not available here and its "
                                "environment names no devices (CUDA_VISIBLE_DEVICES); pass --uuid, or --node and "
                                "--gpu.")
    if all(v.isdigit() for v in items):
        return GpuSelector(pid=pid, node=this_node(), indices=tuple(int(v) for v in items))
    return GpuSelector(pid=pid, uuids=tuple(v for v in items if not v.isdigit()))


def this_node() -> str:
    """The name dcgm-exporter gives this node (its Hostname label). In a Kubernetes pod the host name is the pod's,
    so NODE_NAME (the downward API's spec.nodeName, as deploy/kubernetes sets it) comes first."""
    return os.environ.get("NODE_NAME", "").strip() or os.uname().nodename


def _nvml_uuids_of(pids: set[int]) -> list[str]:
    """UUIDs of the GPUs on which NVML lists one of `pids`; empty when NVML is not there (no driver)."""
    try:
        from diagnoser.collectors import nvml_seam
        from diagnoser.collectors.pidmap import PidMapper, default_host_proc
    except ImportError:
        return []
    n = nvml_seam.nvml()
    try:
        n.nvmlInit()
    except nvml_seam.NVMLError:
        return []
    found: list[str] = []
    try:
        for i in range(n.nvmlDeviceGetCount()):
            handle = n.nvmlDeviceGetHandleByIndex(i)
            nvml_pids: set[int] = set()
            for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    nvml_pids |= {p.pid for p in getattr(n, call)(handle)}
                except nvml_seam.NVMLError:
                    continue
            if PidMapper(host_proc=default_host_proc()).map(pids, nvml_pids).nvml_to_target:
                uuid = n.nvmlDeviceGetUUID(handle)
                found.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    except nvml_seam.NVMLError:
        return found
    finally:
        try:
            n.nvmlShutdown()
        except nvml_seam.NVMLError:
            pass
    return found


# --- per-GPU samples into a capture -----------------------------------------------------------------------------------


@dataclass
class GpuWindow:
    """What one GPU reported over the window: per field key, times (s since the window start) and values (already
    scaled into the signal's unit; counters already turned into rates or increases; never NaN)."""

    identity: GpuIdentity
    fields: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    def add(self, key: str, t: float, value: float) -> None:
        if math.isnan(value):
            return
        times, values = self.fields.setdefault(key, ([], []))
        times.append(round(t, 3))
        values.append(value)

    def last(self, key: str) -> float | None:
        data = self.fields.get(key)
        return data[1][-1] if data and data[1] else None


def gpu_info(identity: GpuIdentity, window: GpuWindow | None = None) -> GpuInfo:
    used, free = (window.last("fb_used"), window.last("fb_free")) if window else (None, None)
    max_clock = window.last("max_sm_clock") if window else None
    limit = window.last("power_limit") if window else None
    name = identity.model or "unknown GPU"
    if identity.mig_profile:
        name = f"{name} MIG {identity.mig_profile}"  # physics sizes a slice from its parent and profile
    return GpuInfo(
        index=identity.index, name=name, uuid=identity.uuid, driver=identity.driver,
        memory_total_bytes=int(used + free) if used is not None and free is not None else None,
        max_sm_clock_mhz=max_clock or None, power_limit_w=limit or None,
        mig_mode=bool(identity.mig_id), mig_instance=identity.mig_id,
    )


def _series(signal: str, labels: dict[str, str], times: list[float], values: list[float]) -> Series:
    """A series that owns `times` and `values`: callers pass lists made for it (GpuWindow makes them per GPU)."""
    return Series(name=signal, unit=spec(signal).unit, source=SOURCE, labels=dict(labels), times=times,
                  values=values)


def add_gpu_window(capture: Capture, window: GpuWindow) -> list[str]:
    """Add one GPU's GpuInfo and series to the capture; returns the signals it produced."""
    ident = window.identity
    capture.gpus.append(gpu_info(ident, window))
    labels = {"gpu": ident.label, "uuid": ident.uuid}
    if ident.node:
        labels["node"] = ident.node
    produced: list[str] = []
    taken: set[str] = set()
    for f in FIELDS:
        data = window.fields.get(f.key)
        if f.signal is None or f.signal in taken or not data or not data[1]:
            continue
        times, values = data
        if f.key == "xid":
            codes = sorted({int(v) for v in values if v > 0})
            if codes:
                capture.notes.append(f"DCGM reports XID {', '.join(map(str, codes))} on {ident.describe()} "
                                     "(DCGM_FI_DEV_XID_ERRORS holds the last XID seen, which may predate the window).")
            values = [float(v > 0) for v in values]
        if f.signal.startswith("gpu.throttle."):
            values = [min(1.0, max(0.0, v)) for v in values]
        capture.series.append(_series(f.signal, labels, times, values))
        taken.add(f.signal)
        produced.append(f.signal)
    produced += _derived(capture, window, labels)
    return produced


def _aligned(window: GpuWindow, a: str, b: str) -> tuple[list[float], list[float], list[float]]:
    """Times present in both fields a and b, with the two values at each."""
    if a not in window.fields or b not in window.fields:
        return [], [], []
    other = dict(zip(*window.fields[b], strict=True))
    times, va, vb = [], [], []
    for t, v in zip(*window.fields[a], strict=True):
        w = other.get(t)
        if w is not None:
            times.append(t)
            va.append(v)
            vb.append(w)
    return times, va, vb


def _derived(capture: Capture, window: GpuWindow, labels: dict[str, str]) -> list[str]:
    """Total memory from used + free (DCGM's own used fraction is used / (total - reserved)), and the SM clock over
    its maximum when the maximum is exported."""
    produced = []
    times, used, free = _aligned(window, "fb_used", "fb_free")
    if not times and window.last("fb_used") is not None and window.last("fb_free") is not None:
        # used + free is the board (or MIG slice) less its reserve: constant, so the last of each will do
        last_used, last_free = window.last("fb_used"), window.last("fb_free")
        assert last_used is not None and last_free is not None
        times, used, free = [window.fields["fb_used"][0][-1]], [last_used], [last_free]
    if times:
        capture.series.append(_series("gpu.mem_total_bytes", labels, times,
                                      [u + f for u, f in zip(used, free, strict=True)]))
        produced.append("gpu.mem_total_bytes")
    max_clock = window.last("max_sm_clock") or capture.gpus[-1].max_sm_clock_mhz
    clock = window.fields.get("sm_clock")
    if clock and not max_clock:
        max_clock, named = spec_max_clock(window.identity.model)
        if max_clock:
            note = (f"DCGM_FI_DEV_MAX_SM_CLOCK is not exported: SM clocks are compared with the {named}'s "
                    f"{max_clock:g} MHz maximum from the spec table.")
            if note not in capture.notes:
                capture.notes.append(note)
    if max_clock and clock:
        capture.series.append(_series("gpu.sm_clock_frac", labels, list(clock[0]), [v / max_clock for v in clock[1]]))
        produced.append("gpu.sm_clock_frac")
    return produced


def spec_max_clock(model: str) -> tuple[float | None, str]:
    """The spec table's maximum SM clock for a GPU model name, and the table's name for the GPU."""
    from diagnoser.physics import match_gpu

    found = match_gpu(model) if model else None
    if found is None or not found.max_sm_clock_mhz:
        return None, ""
    return found.max_sm_clock_mhz, found.name


def missing_reason(signal: str, *, fields_in_source: set[str], failed: Mapping[str, str] | None = None,
                   mig: bool = False) -> tuple[str, str]:
    """Why a wanted signal is absent, and how to get it: (reason, hint)."""
    keys = WANTED_SIGNALS.get(signal, ())
    failed = failed or {}
    for key in keys:
        if key in failed:
            return f"the query for {FIELDS_BY_KEY[key].name} failed: {failed[key]}", "retry, or raise --timeout"
    absent = [FIELDS_BY_KEY[k] for k in keys if k not in fields_in_source and FIELDS_BY_KEY[k].names]
    if signal == "gpu.sm_clock_frac" and "max_sm_clock" not in fields_in_source and "sm_clock" in fields_in_source:
        return ("the maximum SM clock (DCGM_FI_DEV_MAX_SM_CLOCK) is not exported and the GPU model is not in the "
                "spec table, so the clock cannot be compared with it",
                f"add DCGM_FI_DEV_MAX_SM_CLOCK to the counters CSV: {CSV_HINT}")
    if signal == "gpu.busy" and mig:
        return ("DCGM_FI_DEV_GPU_UTIL is not reported for MIG instances and DCGM_FI_PROF_GR_ENGINE_ACTIVE is not "
                "exported", f"enable DCGM_FI_PROF_GR_ENGINE_ACTIVE: {CSV_HINT}")
    names = " / ".join(f.name for f in absent) or signal
    if absent and not any(f.in_default_csv for f in absent):
        return (f"not exported by dcgm-exporter ({names} is commented out of, or absent from, its "
                f"default-counters.csv)", f"enable {absent[0].name} in the counters CSV: {CSV_HINT}")
    hint = f"check the exporter's -f counters file; {CSV_HINT}"
    if absent and absent[0].name.startswith("DCGM_FI_PROF_"):
        return (f"{names} is not in this exporter's output (profiling fields need a data-center GPU from Volta on, "
                "and before Hopper only one DCGM client may read them)", hint)
    shipped = [f for f in absent if f.in_default_csv]
    if shipped:
        # Fields the default counters file exports, absent from this page: the exporter's counters file leaves them
        # out (the GPU is not the reason: a T4 reports its SM clock).
        return (f"{' / '.join(f.name for f in shipped)} is not in this exporter's output: its counters file (-f) "
                "leaves out what the default one exports", f"add {shipped[0].name} to the counters CSV: {CSV_HINT}")
    return f"{names} is not in this exporter's output for this GPU", hint


def mark_missing(capture: Capture, produced: set[str], *, fields_in_source: set[str],
                 failed: Mapping[str, str] | None = None, mig: bool = False) -> None:
    if {"gpu.mem_used_bytes", "gpu.mem_total_bytes"} <= produced:
        produced = produced | {"gpu.mem_used_frac"}  # the evidence layer derives it
    for signal in WANTED_SIGNALS:
        if signal not in produced:
            reason, hint = missing_reason(signal, fields_in_source=fields_in_source, failed=failed, mig=mig)
            capture.mark_unavailable(SOURCE, signal, reason, hint)


def describe_target(identities: Sequence[GpuIdentity]) -> str:
    if len(identities) == 1:
        return identities[0].describe()
    pods = sorted({p for g in identities for p in g.pod_names})
    head = f"pod {', '.join(pods)}: " if pods else ""
    return head + f"{len(identities)} GPUs (" + ", ".join(f"{g.node or '?'} gpu {g.label}" for g in identities) + ")"


__all__ = [
    "FIELDS", "FIELD_OF_NAME", "FIELDS_BY_KEY", "WANTED_SIGNALS", "DcgmField", "GpuIdentity", "GpuSelector",
    "GpuWindow", "Scrape", "parse_exporter_text", "identity_from_labels",
    "select_gpus", "selector_for_pid", "add_gpu_window", "mark_missing", "gpu_info", "describe_target",
]
