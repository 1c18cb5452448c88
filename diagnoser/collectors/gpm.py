"""GPM collector (Hopper and newer): SM activity and occupancy, DRAM bandwidth, tensor/FP16/FP32 pipes, PCIe and
NVLink bandwidth, through NVML's GPU Performance Monitoring API, without DCGM.

These are the counters that separate a bandwidth-bound GPU (DRAM busy, tensor pipes idle) from a compute-bound one.
GPM metrics are computed between two samples taken more than 100 ms apart (nvml.h: "due to the internal sample
refresh rate"); this collector samples every 200 ms at most so that every pair stays valid under scheduling jitter.
GPM gives percents (divided by 100 here) and MiB/s (converted to B/s).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from diagnoser import signals as S
from diagnoser.capture import Capture
from diagnoser.collectors import nvml_seam as seam
from diagnoser.collectors.base import SeriesBook, gpu_labels
from diagnoser.collectors.nvml import Device, NvmlCollector

MIN_PERIOD_S = 0.2
MIB = 1 << 20


@dataclass(frozen=True)
class GpmMetric:
    attr: str  # pynvml constant name
    signal: str
    percent: bool  # percent -> ratio; otherwise MiB/s -> B/s


METRICS = (
    GpmMetric("NVML_GPM_METRIC_SM_UTIL", S.GPU_SM_ACTIVE, True),
    GpmMetric("NVML_GPM_METRIC_SM_OCCUPANCY", S.GPU_SM_OCCUPANCY, True),
    GpmMetric("NVML_GPM_METRIC_DRAM_BW_UTIL", S.GPU_DRAM_ACTIVE, True),
    GpmMetric("NVML_GPM_METRIC_ANY_TENSOR_UTIL", S.GPU_TENSOR_ACTIVE, True),
    GpmMetric("NVML_GPM_METRIC_FP16_UTIL", S.GPU_FP16_ACTIVE, True),
    GpmMetric("NVML_GPM_METRIC_FP32_UTIL", S.GPU_FP32_ACTIVE, True),
    GpmMetric("NVML_GPM_METRIC_PCIE_TX_PER_SEC", S.GPU_PCIE_TX_BPS, False),
    GpmMetric("NVML_GPM_METRIC_PCIE_RX_PER_SEC", S.GPU_PCIE_RX_BPS, False),
    GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", S.GPU_NVLINK_TX_BPS, False),
    GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", S.GPU_NVLINK_RX_BPS, False),
)
# Graphics-engine activity stands in for NVML utilisation where NVML has none (MIG instances).
BUSY_FALLBACK = GpmMetric("NVML_GPM_METRIC_GRAPHICS_UTIL", S.GPU_BUSY, True)
_PROFILING_SIGNALS = (S.GPU_SM_ACTIVE, S.GPU_SM_OCCUPANCY, S.GPU_DRAM_ACTIVE, S.GPU_TENSOR_ACTIVE,
                      S.GPU_FP16_ACTIVE, S.GPU_FP32_ACTIVE, S.GPU_NVLINK_TX_BPS, S.GPU_NVLINK_RX_BPS)
_NO_GPM_HINT = ("dcgm-exporter's DCGM_FI_PROF_* fields give the same counters on Volta and newer datacenter GPUs "
                "(attach --dcgm-exporter)")


@dataclass
class _GpmState:
    dev: Device
    prev: Any
    cur: Any
    metrics: tuple[GpmMetric, ...]
    failed: set[str]


class GpmCollector:
    name = "gpm"

    def __init__(self, nvml: NvmlCollector, period_s: float = MIN_PERIOD_S) -> None:
        self.nvml = nvml
        self.period_s: float | None = max(MIN_PERIOD_S, period_s)
        self.book: SeriesBook | None = None
        self.capture: Capture | None = None
        self.states: list[_GpmState] = []

    def start(self, capture: Capture) -> None:
        """Runs after the NVML collector's start: it uses the devices NVML chose."""
        self.capture = capture
        self.book = SeriesBook(capture, "gpm")
        if self.nvml.nv is None or not self.nvml.devices:
            return  # NVML already said why; GPM cannot do better
        nv = self.nvml.nv
        unsupported: list[str] = []
        for dev in self.nvml.devices:
            try:
                support = nv.nvmlGpmQueryDeviceSupport(dev.handle)
                if not support.isSupportedDevice:
                    unsupported.append(dev.label)
                    continue
                prev, cur = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
                self._take(dev, prev)
            except (seam.NVMLError, seam.LibraryMismatch, AttributeError) as exc:
                unsupported.append(f"{dev.label} ({seam.describe(exc)})")
                continue
            metrics = METRICS + ((BUSY_FALLBACK,) if "util" in dev.disabled or dev.info.mig_mode else ())
            self.states.append(_GpmState(dev, prev, cur, metrics, set()))
            dev.pcie_from_gpm = True  # GPM's PCIe rates replace NVML's blocking 20 ms PCIe query
        if unsupported:
            reason = f"GPM is not available on {', '.join(unsupported)} (it needs Hopper or newer)"
            for signal in _PROFILING_SIGNALS:
                capture.mark_unavailable("gpm", signal, reason, _NO_GPM_HINT)

    def _take(self, dev: Device, sample: Any) -> None:
        nv = self.nvml.nv
        if dev.gpu_instance is not None:
            nv.nvmlGpmMigSampleGet(dev.handle, dev.gpu_instance, sample)
        else:
            nv.nvmlGpmSampleGet(dev.handle, sample)

    def sample(self, t: float) -> None:
        for state in self.states:
            dev = state.dev
            if dev.lost_at is not None:
                continue
            try:
                self._take(dev, state.cur)
            except seam.GpuIsLost:
                self.nvml._lost(dev, t)
                continue
            except seam.NVMLError:
                continue
            self._metrics(state, t)
            state.prev, state.cur = state.cur, state.prev

    def _metrics(self, state: _GpmState, t: float) -> None:
        assert self.book is not None and self.capture is not None
        nv = self.nvml.nv
        wanted = [(m, getattr(nv, m.attr, None)) for m in state.metrics if m.signal not in state.failed]
        wanted = [(m, mid) for m, mid in wanted if mid is not None]
        if not wanted:
            return
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1, request.sample2 = state.prev, state.cur
        for i, (_, mid) in enumerate(wanted):
            request.metrics[i].metricId = mid
        try:
            nv.nvmlGpmMetricsGet(request)
        except seam.NVMLError:
            return
        labels = gpu_labels(state.dev.index)
        for i, (metric, _) in enumerate(wanted):
            result = request.metrics[i]
            if int(result.nvmlReturn) != 0:
                state.failed.add(metric.signal)
                if metric.signal.startswith("gpu.pcie"):
                    state.dev.pcie_from_gpm = False  # fall back to NVML's own PCIe query
                self.capture.mark_unavailable(
                    "gpm", metric.signal,
                    f"{state.dev.label}: GPM could not compute {metric.attr.removeprefix('NVML_GPM_METRIC_')} "
                    f"(NVML return code {int(result.nvmlReturn)})")
                continue
            value = float(result.value)
            self.book.add(metric.signal, t, value / 100.0 if metric.percent else value * MIB, labels)

    def stop(self, t: float) -> None:
        nv = self.nvml.nv
        for state in self.states:
            for sample in (state.prev, state.cur):
                try:
                    nv.nvmlGpmSampleFree(sample)
                except (seam.NVMLError, ctypes.ArgumentError):
                    pass
        self.states = []

    def latest(self) -> dict[str, float]:
        return dict(self.book.newest) if self.book else {}
