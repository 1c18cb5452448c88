"""A thin stand-in for the pynvml module, for machines without a GPU.

It has the same function names as pynvml, returns pynvml's own structure types, and fails the way pynvml fails:
`raise pynvml.NVMLError(code)` with NVML's return codes (which pynvml turns into its subclasses such as
NVMLError_NotSupported). Constants and classes are pynvml's own; a function this fake does not implement raises
NVMLError_FunctionNotFound, as an old driver would. Install it with `diagnoser.collectors.nvml_seam.use(fake)`.
"""

from __future__ import annotations

import ctypes
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pynvml

GIB = 1 << 30


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None = 1 * GIB
    gpu_instance: int | None = None


@dataclass
class FakeMig:
    gpu_instance: int
    name: str = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    memory_total: int = 10 * GIB
    memory_used: int = 5 * GIB


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-fake"
    memory_total: int = 80 * GIB
    memory_used: int = 40 * GIB
    util_gpu: int = 50
    util_memory: int = 30
    sm_clock: int = 1755
    max_sm_clock: int = 1980
    mem_clock: int = 2619
    max_mem_clock: int = 2619
    reasons: int = 0
    power_mw: int = 450_000
    limit_mw: int = 700_000
    default_limit_mw: int = 700_000
    temp_c: int = 60
    pcie_tx_kbps: int = 1000
    pcie_rx_kbps: int = 2000
    ecc_uncorrected: int = 0
    replays: int = 0
    capability: tuple[int, int] = (9, 0)
    processes: list[FakeProcess] = field(default_factory=list)
    process_util: dict[int, int] = field(default_factory=dict)  # pid -> smUtil %
    mig: list[FakeMig] = field(default_factory=list)  # non-empty: MIG mode on
    gpm_supported: bool = True
    gpm: dict[int, float] = field(default_factory=dict)  # GPM metric id -> value (percent or MiB/s)
    gpm_failing: set[int] = field(default_factory=set)  # metric ids whose nvmlReturn is NOT_SUPPORTED
    fail: dict[str, int] = field(default_factory=dict)  # function name -> NVML return code raised on every call
    lose_after: int | None = None  # the GPU falls off the bus after this many utilisation reads
    xids: list[int] = field(default_factory=list)  # XID events queued for the event set


@dataclass(frozen=True)
class FakeHandle:
    index: int
    gpu_instance: int | None = None  # set for MIG device handles


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None, driver: str = "550.54.15") -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.calls: Counter[str] = Counter()
        self.initialised = 0
        self._lost: set[int] = set()
        self._util_reads: Counter[int] = Counter()
        self._samples: dict[int, tuple[int, int]] = {}  # sample address -> (gpu index, reading number)
        self._reading = 0
        self._registered: set[int] = set()
        self._allocated: list[Any] = []  # GPM samples stay alive while their addresses are keys

    # pynvml's constants and structure classes are the real ones; unknown functions fail like an old driver.
    def __getattr__(self, name: str) -> Any:
        real = getattr(pynvml, name)
        if isinstance(real, types.FunctionType):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real

    def _enter(self, name: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        self.calls[name] += 1
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = self.gpus[handle.index]
        if handle.index in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[name])
        return gpu

    # --- library -------------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._check(FakeHandle(index), "nvmlDeviceGetHandleByIndex")

    def _check(self, handle: FakeHandle, name: str) -> FakeHandle:
        gpu = self.gpus[handle.index]
        if name in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[name])
        return handle

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    # --- identity ------------------------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        gpu = self._enter("nvmlDeviceGetName", handle)
        assert gpu is not None
        return self._mig(gpu, handle).name if handle.gpu_instance is not None else gpu.name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        gpu = self._enter("nvmlDeviceGetUUID", handle)
        assert gpu is not None
        return gpu.uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        gpu = self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        assert gpu is not None
        return gpu.capability

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock: int) -> int:
        gpu = self._enter("nvmlDeviceGetMaxClockInfo", handle)
        assert gpu is not None
        return gpu.max_sm_clock if clock == pynvml.NVML_CLOCK_SM else gpu.max_mem_clock

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetEnforcedPowerLimit", handle)
        assert gpu is not None
        return gpu.limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetPowerManagementDefaultLimit", handle)
        assert gpu is not None
        return gpu.default_limit_mw

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._enter("nvmlDeviceGetMigMode", handle)
        assert gpu is not None
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    # --- readings ------------------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        if gpu.mig:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # nvml.h: not supported on MIG-enabled GPUs
        self._util_reads[handle.index] += 1
        if gpu.lose_after is not None and self._util_reads[handle.index] > gpu.lose_after:
            self._lost.add(handle.index)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: Any = None) -> Any:
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        if handle.gpu_instance is not None:
            mig = self._mig(gpu, handle)
            total, used = mig.memory_total, mig.memory_used
        else:
            total, used = gpu.memory_total, gpu.memory_used
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock: int) -> int:
        gpu = self._enter("nvmlDeviceGetClockInfo", handle)
        assert gpu is not None
        return gpu.sm_clock if clock == pynvml.NVML_CLOCK_SM else gpu.mem_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        assert gpu is not None
        return gpu.reasons

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        return gpu.power_mw

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        gpu = self._enter("nvmlDeviceGetTemperature", handle)
        assert gpu is not None
        return gpu.temp_c

    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        gpu = self._enter("nvmlDeviceGetPcieThroughput", handle)
        assert gpu is not None
        return gpu.pcie_tx_kbps if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else gpu.pcie_rx_kbps

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", handle)
        assert gpu is not None
        return gpu.ecc_uncorrected

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetPcieReplayCounter", handle)
        assert gpu is not None
        return gpu.replays

    # --- processes -----------------------------------------------------------------------------------------
    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        assert gpu is not None
        return [pynvml.nvmlFriendlyObject({
            "pid": p.pid, "usedGpuMemory": p.used_bytes, "computeInstanceId": 0xFFFFFFFF,
            "gpuInstanceId": p.gpu_instance if p.gpu_instance is not None else 0xFFFFFFFF,
        }) for p in gpu.processes]

    def nvmlDeviceGetProcessUtilization(self, handle: FakeHandle, last_seen: int) -> list[Any]:
        gpu = self._enter("nvmlDeviceGetProcessUtilization", handle)
        assert gpu is not None
        self._reading += 1
        stamp = 1_000_000 * self._reading
        if not gpu.process_util:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # "no valid sample entries"
        return [pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=0, encUtil=0,
                                                        decUtil=0) for pid, sm in gpu.process_util.items()]

    # --- MIG -----------------------------------------------------------------------------------------------
    def _mig(self, gpu: FakeGpu, handle: FakeHandle) -> FakeMig:
        return next(m for m in gpu.mig if m.gpu_instance == handle.gpu_instance)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        assert gpu is not None
        return 7 if gpu.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        assert gpu is not None
        if index >= len(gpu.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(handle.index, gpu.mig[index].gpu_instance)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        if handle.gpu_instance is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.gpu_instance

    # --- events --------------------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> object:
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, types_mask: int, event_set: object) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        self._registered.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait_v2")
        for index in sorted(self._registered):
            gpu = self.gpus[index]
            if gpu.xids:
                return pynvml.nvmlFriendlyObject({"device": FakeHandle(index), "eventData": gpu.xids.pop(0),
                                                  "eventType": pynvml.nvmlEventTypeXidCriticalError,
                                                  "gpuInstanceId": 0, "computeInstanceId": 0})
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._enter("nvmlEventSetFree")

    # --- GPM -----------------------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, handle: FakeHandle) -> Any:
        gpu = self._enter("nvmlGpmQueryDeviceSupport", handle)
        assert gpu is not None
        support = pynvml.c_nvmlGpmSupport_t()
        support.version, support.isSupportedDevice = pynvml.NVML_GPM_SUPPORT_VERSION, int(gpu.gpm_supported)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        sample = ctypes.pointer(pynvml.struct_c_nvmlGpmSample_t())
        self._samples[ctypes.addressof(sample.contents)] = (-1, 0)
        self._allocated.append(sample)
        return sample

    def _take(self, handle: FakeHandle, sample: Any) -> Any:
        self._reading += 1
        self._samples[ctypes.addressof(sample.contents)] = (handle.index, self._reading)
        return sample

    def nvmlGpmSampleGet(self, handle: FakeHandle, sample: Any) -> Any:
        self._enter("nvmlGpmSampleGet", handle)
        return self._take(handle, sample)

    def nvmlGpmMigSampleGet(self, handle: FakeHandle, gpu_instance: int, sample: Any) -> Any:
        self._enter("nvmlGpmMigSampleGet", handle)
        return self._take(handle, sample)

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self._enter("nvmlGpmMetricsGet")
        first = self._samples.get(ctypes.addressof(request.sample1.contents))
        second = self._samples.get(ctypes.addressof(request.sample2.contents))
        if not first or not second or first[0] != second[0] or first[0] < 0 or second[1] <= first[1]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[first[0]]
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in gpu.gpm_failing or metric.metricId not in gpu.gpm:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = gpu.gpm[metric.metricId]
        return request

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._enter("nvmlGpmSampleFree")


def hopper_gpm(**overrides: float) -> dict[int, float]:
    """GPM readings of a busy, bandwidth-heavy H100 (percent and MiB/s, as GPM reports them)."""
    values = {
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 95.0,
        pynvml.NVML_GPM_METRIC_SM_UTIL: 90.0,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 85.0,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 20.0,
        pynvml.NVML_GPM_METRIC_FP16_UTIL: 5.0,
        pynvml.NVML_GPM_METRIC_FP32_UTIL: 3.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 200.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1000.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 1000.0,
    }
    for name, value in overrides.items():
        values[getattr(pynvml, f"NVML_GPM_METRIC_{name.upper()}")] = value
    return values
