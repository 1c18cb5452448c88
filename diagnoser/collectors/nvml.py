"""NVML collector: per-GPU utilisation, memory, clocks, clock event reasons, power, temperature, PCIe, errors, and
the target's own GPU processes.

Every NVML call is guarded. A reading that fails with NotSupported, NoPermission or a missing driver function is
turned off for that GPU and recorded with `Capture.mark_unavailable` (never a zero); a lost GPU stops being sampled
and the capture says when; MIG GPUs (no utilisation per instance) say so explicitly. NVML is reached only through
`nvml_seam.nvml()`, so the tests can swap in a fake with the same function names.

Rates: the fast readings run every sampler tick (10 Hz by default; NVML refreshes utilisation every 1/6 to 1 s
depending on the product, so faster sampling repeats values). The slow ones run once a second: the process list,
per-process utilisation, PCIe throughput (each call measures a 20 ms byte-counter window inside the driver), ECC,
PCIe replays and XID events.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from diagnoser import signals as S
from diagnoser.capture import Capture, GpuInfo
from diagnoser.collectors import nvml_seam as seam
from diagnoser.collectors.base import SeriesBook, gpu_labels
from diagnoser.collectors.pidmap import PidMapper, PidMapping, default_host_proc
from diagnoser.collectors.process import ProcessTree

SLOW_PERIOD_S = 1.0
# Consecutive unexplained NVML errors after which a reading is given up for the window.
MAX_TRANSIENT_FAILURES = 5
KIB = 1024

# Clock event reason bits (nvmlClocksEventReason*; DCGM documents the same values as a 1:1 map).
REASON_NAMES = {
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}
POWER_BITS = 0x4 | 0x80
THERMAL_BITS = 0x20 | 0x40
BRAKE_BITS = 0x80  # part of POWER_BITS: told apart because its fix is the node's power, not the GPU's limit
OTHER_BITS = 0x2 | 0x8 | 0x10 | 0x100  # GpuIdle (0x1) is not a throttle: the GPU has nothing to do

# What each guarded reading feeds, so a failure names the signals it leaves missing.
READING_SIGNALS = {
    "util": (S.GPU_BUSY, S.GPU_MEM_BUSY),
    "memory": (S.GPU_MEM_USED_BYTES,),
    "clock_sm": (S.GPU_SM_CLOCK_MHZ, S.GPU_SM_CLOCK_FRAC),
    "clock_mem": (S.GPU_MEM_CLOCK_FRAC,),
    "reasons": (S.GPU_THROTTLE_POWER, S.GPU_THROTTLE_BRAKE, S.GPU_THROTTLE_THERMAL, S.GPU_THROTTLE_OTHER),
    "power": (S.GPU_POWER_W,),
    "power_limit": (S.GPU_POWER_LIMIT_W,),
    "power_default_limit": (S.GPU_POWER_DEFAULT_LIMIT_W,),
    "temp": (S.GPU_TEMP_C,),
    "pcie": (S.GPU_PCIE_TX_BPS, S.GPU_PCIE_RX_BPS),
    "ecc": (S.GPU_ECC_DBE,),
    "replay": (S.GPU_PCIE_REPLAYS,),
    "xid": (S.GPU_XID_ERRORS,),
    "procs": (S.PROC_GPU_MEM_BYTES,),
    "proc_util": (S.PROC_GPU_BUSY,),
}

_HINTS = {
    "NoPermission": "run diagnoser as root (or with the permissions the NVIDIA driver requires for this query)",
    "MIG": "GPM (Hopper or newer) reads the instance's own activity; on older GPUs use dcgm-exporter's "
           "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "lost": "the GPU fell off the bus (look for Xid 79 in dmesg): drain the node and reset the GPU",
}


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine; `reason` is one sentence, `hint` how to fix it."""

    def __init__(self, reason: str, hint: str = "", *, no_gpu: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hint = hint
        self.no_gpu = no_gpu  # no driver or no GPU at all (not merely unreadable)


class _DeviceLost(Exception):
    pass


def text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def open_nvml() -> tuple[Any, int]:
    """Initialise NVML: (the module, device count). Raises NvmlUnavailable with a sentence for the user."""
    nv = seam.nvml()
    try:
        nv.nvmlInit()
    except seam.LibraryNotFound:
        raise NvmlUnavailable("no NVIDIA driver on this machine (NVML library libnvidia-ml.so.1 not found)",
                              "run diagnoser on the GPU's host, or in a container started with the NVIDIA "
                              "container toolkit (--gpus)", no_gpu=True) from None
    except seam.DriverNotLoaded:
        raise NvmlUnavailable("the NVIDIA driver is not loaded", "load the driver (nvidia-smi should work)") from None
    except seam.NoPermission:
        raise NvmlUnavailable("no permission to open the NVIDIA device files", _HINTS["NoPermission"]) from None
    except seam.NVMLError as exc:
        raise NvmlUnavailable(f"NVML failed to start ({seam.describe(exc)})") from None
    try:
        count = int(nv.nvmlDeviceGetCount())
    except seam.NVMLError as exc:
        shutdown_nvml(nv)
        raise NvmlUnavailable(f"NVML cannot count the GPUs ({seam.describe(exc)})") from None
    if count == 0:
        shutdown_nvml(nv)
        raise NvmlUnavailable("NVML sees no GPU on this machine",
                              "check the container's GPU assignment (NVIDIA_VISIBLE_DEVICES, --gpus)", no_gpu=True)
    return nv, count


def shutdown_nvml(nv: Any) -> None:
    try:
        nv.nvmlShutdown()
    except seam.NVMLError:
        pass


def _try(fn: Any, *args: Any) -> Any:
    """A reading for identity fields: None when NVML cannot give it (lost GPUs propagate)."""
    try:
        return fn(*args)
    except seam.GpuIsLost:
        raise
    except (seam.NVMLError, seam.LibraryMismatch, AttributeError):
        return None


def gpu_info(nv: Any, index: int, handle: Any) -> GpuInfo:
    """Identity and limits of one GPU; fields NVML cannot read stay empty."""
    info = GpuInfo(index=index, name=text(_try(nv.nvmlDeviceGetName, handle) or f"GPU {index}"))
    info.uuid = text(_try(nv.nvmlDeviceGetUUID, handle) or "")
    mem = _try(nv.nvmlDeviceGetMemoryInfo, handle)
    info.memory_total_bytes = int(mem.total) if mem is not None else None
    info.driver = text(_try(nv.nvmlSystemGetDriverVersion) or "")
    cc = _try(nv.nvmlDeviceGetCudaComputeCapability, handle)
    info.cuda_capability = f"{cc[0]}.{cc[1]}" if cc else ""
    sm_max = _try(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM)
    mem_max = _try(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_MEM)
    info.max_sm_clock_mhz = float(sm_max) if sm_max else None
    info.max_mem_clock_mhz = float(mem_max) if mem_max else None
    limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    info.power_limit_w = limit / 1000.0 if limit else None
    mig = _try(nv.nvmlDeviceGetMigMode, handle)
    info.mig_mode = bool(mig and mig[0] == nv.NVML_DEVICE_MIG_ENABLE)
    try:
        from diagnoser import physics

        matched = physics.match_gpu(info.name, info.memory_total_bytes)
        info.spec_name = getattr(matched, "name", None) if matched is not None else None
    except Exception:  # the physics table is optional for collection
        info.spec_name = None
    # Roofs `diagnoser calibrate` measured for this GPU and driver replace the datasheet's (never raises).
    from diagnoser.calibration.store import lookup

    info.measured = lookup(info.name, info.driver) or {}
    return info


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None
    gpu_instance: int | None = None


def running_processes(nv: Any, handle: Any) -> list[GpuProcess]:
    out = []
    for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
        gi = getattr(p, "gpuInstanceId", None)
        used = getattr(p, "usedGpuMemory", None)
        out.append(GpuProcess(int(p.pid), int(used) if used is not None else None,
                              int(gi) if gi is not None and gi != 0xFFFFFFFF else None))
    return out


@dataclass
class Device:
    index: int
    handle: Any
    info: GpuInfo
    mig_handle: Any | None = None
    gpu_instance: int | None = None
    lost_at: float | None = None
    disabled: set[str] = field(default_factory=set)
    failures: Counter[str] = field(default_factory=Counter)
    ecc_base: int | None = None
    replay_base: int | None = None
    xid_count: int = 0
    proc_util_ts: int = 0
    reasons_seen: Counter[str] = field(default_factory=Counter)
    reason_samples: int = 0
    pcie_from_gpm: bool = False

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.info.name})"


class NvmlCollector:
    name = "nvml"
    period_s: float | None = None  # every tick

    def __init__(self, tree: ProcessTree | None = None, *, pid_mapper: PidMapper | None = None) -> None:
        self.tree = tree
        self.mapper = pid_mapper or PidMapper(host_proc=default_host_proc())
        self.nv: Any = None
        self.devices: list[Device] = []
        self.book: SeriesBook | None = None
        self.capture: Capture | None = None
        self.problem: NvmlUnavailable | None = None
        self.mapping = PidMapping()
        self._event_set: Any = None
        self._next_slow = 0.0
        self._foreign: set[int] = set()  # NVML PIDs known not to belong to the target
        self._held: set[int] = set()  # indices of the GPUs the target holds memory on

    # --- start --------------------------------------------------------------------------------------------

    def start(self, capture: Capture) -> None:
        self.capture = capture
        self.book = SeriesBook(capture, "nvml")
        try:
            self.nv, count = open_nvml()
        except NvmlUnavailable as exc:
            self.problem = exc
            capture.cpu_only = True
            capture.mark_unavailable("nvml", "gpu.*", exc.reason, exc.hint)
            capture.mark_unavailable("nvml", "proc.*", exc.reason, exc.hint)
            return
        nv = self.nv
        found: list[Device] = []
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                found.append(Device(index, handle, gpu_info(nv, index, handle)))
            except seam.NoPermission:
                capture.mark_unavailable("nvml", "gpu.*", f"no permission to open GPU {index}", _HINTS["NoPermission"])
            except seam.GpuIsLost:
                capture.notes.append(f"GPU {index} is lost (fell off the bus) and was not sampled.")
            except seam.NVMLError as exc:
                capture.notes.append(f"GPU {index} could not be opened ({seam.describe(exc)}) and was not sampled.")
        if not found:
            capture.cpu_only = True
            self.problem = NvmlUnavailable("no GPU could be opened")
            return
        self.devices = self._target_devices(found)
        capture.gpus = [d.info for d in self.devices]
        if capture.process is not None:
            capture.process.gpu_indices = sorted(self._held)
        self._open_events()
        for dev in self.devices:
            dev.ecc_base = self._read(dev, "ecc", nv.nvmlDeviceGetTotalEccErrors, dev.handle,
                                      nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            dev.replay_base = self._read(dev, "replay", nv.nvmlDeviceGetPcieReplayCounter, dev.handle)

    def _target_devices(self, devices: list[Device]) -> list[Device]:
        """The GPUs the target holds; all of them when there is no target or it holds none we can identify."""
        assert self.capture is not None
        if self.tree is None:
            return devices
        target = self.tree.pids(0.0)
        per_device: dict[int, list[GpuProcess]] = {}
        for dev in devices:
            try:
                listed = self._read(dev, "procs", running_processes, self.nv, dev.handle)
            except _DeviceLost:
                listed = None
            if listed is not None:
                per_device[dev.index] = listed
        nvml_pids = {p.pid for procs in per_device.values() for p in procs}
        self.mapping = self.mapper.map(target, nvml_pids)
        if self.mapping.problem:
            self.capture.mark_unavailable("nvml", S.PROC_GPU_MEM_BYTES, self.mapping.problem, self.mapping.hint)
        ours = set(self.mapping.nvml_to_target)
        self._foreign = nvml_pids - ours
        held = [d for d in devices if any(p.pid in ours for p in per_device.get(d.index, ()))]
        if not held:
            if not per_device:
                self.capture.notes.append("NVML would not list the GPU processes, so the target's GPUs are "
                                          "unknown: every visible GPU was sampled.")
            elif self.mapping.problem:
                self.capture.notes.append("The target's GPUs could not be identified (PID namespaces differ): "
                                          "every visible GPU was sampled.")
            else:
                self.capture.notes.append("The target holds no memory on any visible GPU: the GPU numbers are "
                                          "for the whole device(s), whatever runs on them.")
            return devices
        self._held = {d.index for d in held}
        for dev in held:
            if dev.info.mig_mode:
                self._bind_mig_instance(dev, [p for p in per_device[dev.index] if p.pid in ours])
        return held

    def _bind_mig_instance(self, dev: Device, procs: list[GpuProcess]) -> None:
        """Find the MIG device handle of the GPU instance the target runs in; memory and GPM are read there."""
        instances = {p.gpu_instance for p in procs if p.gpu_instance is not None}
        if len(instances) != 1:
            return
        gi = instances.pop()
        nv = self.nv
        try:
            for k in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(dev.handle))):
                try:
                    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(dev.handle, k)
                except seam.NotFound:
                    continue
                if int(nv.nvmlDeviceGetGpuInstanceId(mig)) == gi:
                    dev.mig_handle, dev.gpu_instance = mig, gi
                    name = _try(nv.nvmlDeviceGetName, mig)
                    dev.info.mig_instance = text(name) if name else f"GPU instance {gi}"
                    mem = _try(nv.nvmlDeviceGetMemoryInfo, mig)
                    if mem is not None:
                        dev.info.memory_total_bytes = int(mem.total)
                    return
        except seam.NVMLError as exc:
            assert self.capture is not None
            self.capture.notes.append(f"{dev.label} is in MIG mode but its instances could not be listed "
                                      f"({seam.describe(exc)}); memory is read for the whole GPU.")

    def _open_events(self) -> None:
        nv = self.nv
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except (seam.NVMLError, seam.LibraryMismatch) as exc:
            for dev in self.devices:
                self._disable(dev, "xid", exc)
            return
        for dev in self.devices:
            try:
                nv.nvmlDeviceRegisterEvents(dev.handle, nv.nvmlEventTypeXidCriticalError, self._event_set)
            except (seam.NVMLError, seam.LibraryMismatch) as exc:
                self._disable(dev, "xid", exc)

    # --- guarded reads ------------------------------------------------------------------------------------

    def _read(self, dev: Device, key: str, fn: Any, *args: Any) -> Any:
        if key in dev.disabled:
            return None
        try:
            value = fn(*args)
        except seam.GpuIsLost:
            raise _DeviceLost() from None
        except seam.NotFound:
            return None  # e.g. no process samples since the last call: nothing new, not a failure
        except (seam.NotSupported, seam.NoPermission, seam.FunctionNotFound, seam.LibraryMismatch) as exc:
            self._disable(dev, key, exc)
            return None
        except seam.NVMLError as exc:
            dev.failures[key] += 1
            if dev.failures[key] >= MAX_TRANSIENT_FAILURES:
                self._disable(dev, key, exc)
            return None
        dev.failures[key] = 0
        return value

    def _disable(self, dev: Device, key: str, exc: BaseException) -> None:
        assert self.capture is not None
        dev.disabled.add(key)
        reason, hint = self._explain(dev, key, exc)
        for signal in READING_SIGNALS.get(key, ()):
            self.capture.mark_unavailable("nvml", signal, reason, hint)

    def _explain(self, dev: Device, key: str, exc: BaseException) -> tuple[str, str]:
        what = seam.describe(exc)
        if isinstance(exc, seam.NotSupported):
            if key in ("util", "proc_util") and dev.info.mig_mode:
                return f"{dev.label} is in MIG mode: NVML reports no utilisation for MIG instances", _HINTS["MIG"]
            return f"{dev.label} does not support this NVML query ({what})", ""
        if isinstance(exc, seam.NoPermission):
            return f"{dev.label}: NVML refused the query ({what})", _HINTS["NoPermission"]
        if isinstance(exc, (seam.FunctionNotFound, seam.LibraryMismatch)):
            return f"the installed NVIDIA driver lacks this NVML function ({what})", "update the NVIDIA driver"
        return f"{dev.label}: NVML kept failing ({what}), so the reading was dropped for the window", ""

    # --- sampling -----------------------------------------------------------------------------------------

    def sample(self, t: float) -> None:
        if not self.devices:
            return
        slow = t >= self._next_slow
        if slow:
            self._next_slow = t + SLOW_PERIOD_S
            self._poll_events(t)
        for dev in self.devices:
            if dev.lost_at is not None:
                continue
            try:
                self._sample_fast(dev, t)
                if slow:
                    self._sample_slow(dev, t)
            except _DeviceLost:
                self._lost(dev, t)

    def _sample_fast(self, dev: Device, t: float) -> None:
        assert self.book is not None
        nv, h, labels, add = self.nv, dev.handle, gpu_labels(dev.index), self.book.add
        util = self._read(dev, "util", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            add(S.GPU_BUSY, t, util.gpu / 100.0, labels)
            add(S.GPU_MEM_BUSY, t, util.memory / 100.0, labels)
        mem = self._read(dev, "memory", nv.nvmlDeviceGetMemoryInfo, dev.mig_handle or h)
        if mem is not None:
            add(S.GPU_MEM_USED_BYTES, t, float(mem.used), labels)
        sm = self._read(dev, "clock_sm", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        if sm is not None:
            add(S.GPU_SM_CLOCK_MHZ, t, float(sm), labels)
            if dev.info.max_sm_clock_mhz:
                add(S.GPU_SM_CLOCK_FRAC, t, sm / dev.info.max_sm_clock_mhz, labels)
        mclk = self._read(dev, "clock_mem", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        if mclk is not None and dev.info.max_mem_clock_mhz:
            add(S.GPU_MEM_CLOCK_FRAC, t, mclk / dev.info.max_mem_clock_mhz, labels)
        reasons = self._read(dev, "reasons", nv.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is not None:
            reasons = int(reasons)
            add(S.GPU_THROTTLE_POWER, t, 1.0 if reasons & POWER_BITS else 0.0, labels)
            add(S.GPU_THROTTLE_BRAKE, t, 1.0 if reasons & BRAKE_BITS else 0.0, labels)
            add(S.GPU_THROTTLE_THERMAL, t, 1.0 if reasons & THERMAL_BITS else 0.0, labels)
            add(S.GPU_THROTTLE_OTHER, t, 1.0 if reasons & OTHER_BITS else 0.0, labels)
            dev.reason_samples += 1
            dev.reasons_seen.update(name for bit, name in REASON_NAMES.items() if reasons & bit)
        power = self._read(dev, "power", nv.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            add(S.GPU_POWER_W, t, power / 1000.0, labels)
        temp = self._read(dev, "temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            add(S.GPU_TEMP_C, t, float(temp), labels)

    def _sample_slow(self, dev: Device, t: float) -> None:
        assert self.book is not None
        nv, h, labels, add = self.nv, dev.handle, gpu_labels(dev.index), self.book.add
        limit = self._read(dev, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit, h)
        if limit is not None:
            add(S.GPU_POWER_LIMIT_W, t, limit / 1000.0, labels)
        # The board's default: a cap below it was lowered by someone, at it the GPU is simply power-bound.
        default = self._read(dev, "power_default_limit", nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
        if default is not None:
            add(S.GPU_POWER_DEFAULT_LIMIT_W, t, default / 1000.0, labels)
        if not dev.pcie_from_gpm:
            tx = self._read(dev, "pcie", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = self._read(dev, "pcie", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
            if tx is not None and rx is not None:
                add(S.GPU_PCIE_TX_BPS, t, tx * KIB, labels)  # NVML: KB/s
                add(S.GPU_PCIE_RX_BPS, t, rx * KIB, labels)
        if dev.ecc_base is not None:
            ecc = self._read(dev, "ecc", nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             nv.NVML_VOLATILE_ECC)
            if ecc is not None:
                add(S.GPU_ECC_DBE, t, float(max(0, int(ecc) - dev.ecc_base)), labels)
        if dev.replay_base is not None:
            replay = self._read(dev, "replay", nv.nvmlDeviceGetPcieReplayCounter, h)
            if replay is not None:
                add(S.GPU_PCIE_REPLAYS, t, float(max(0, int(replay) - dev.replay_base)), labels)
        if self._event_set is not None and "xid" not in dev.disabled:
            add(S.GPU_XID_ERRORS, t, float(dev.xid_count), labels)
        if self.tree is not None:
            self._sample_processes(dev, t)

    def _sample_processes(self, dev: Device, t: float) -> None:
        assert self.book is not None and self.tree is not None
        nv, labels = self.nv, gpu_labels(dev.index)
        procs = self._read(dev, "procs", running_processes, nv, dev.handle)
        if procs is None or self.mapping.problem:
            return
        target = self.tree.pids(t)
        # Re-map when the tree changed (a worker appeared) or NVML lists a PID we have not placed yet.
        nvml_pids = {p.pid for p in procs}
        if not nvml_pids <= set(self.mapping.nvml_to_target) | self._foreign:
            mapping = self.mapper.map(target, nvml_pids)
            self.mapping.nvml_to_target.update(mapping.nvml_to_target)
            self._foreign.update(nvml_pids - set(mapping.nvml_to_target))
        ours = [p for p in procs if p.pid in self.mapping.nvml_to_target]
        if any(p.used_bytes is None for p in ours):
            assert self.capture is not None
            self.capture.mark_unavailable("nvml", S.PROC_GPU_MEM_BYTES,
                                          f"{dev.label}: NVML does not report per-process memory here",
                                          "MIG without root, vGPU and WDDM hide per-process memory")
        else:
            self.book.add(S.PROC_GPU_MEM_BYTES, t, float(sum(p.used_bytes or 0 for p in ours)), labels)
        if "proc_util" in dev.disabled:
            return
        samples = self._read(dev, "proc_util", nv.nvmlDeviceGetProcessUtilization, dev.handle, dev.proc_util_ts)
        if not samples:
            return
        newest: dict[int, Any] = {}
        for s in samples:
            dev.proc_util_ts = max(dev.proc_util_ts, int(s.timeStamp))
            if int(s.pid) in self.mapping.nvml_to_target:
                if int(s.pid) not in newest or s.timeStamp > newest[int(s.pid)].timeStamp:
                    newest[int(s.pid)] = s
        if newest:
            self.book.add(S.PROC_GPU_BUSY, t, min(1.0, sum(s.smUtil for s in newest.values()) / 100.0), labels)

    def _poll_events(self, t: float) -> None:
        if self._event_set is None:
            return
        nv = self.nv
        for _ in range(64):  # drain what queued since the last poll, bounded
            try:
                event = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except seam.Timeout:
                return
            except seam.NVMLError:
                return
            if not int(event.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = int(nv.nvmlDeviceGetIndex(event.device))
            except seam.NVMLError:
                index = -1
            for dev in self.devices:
                if dev.index == index:
                    dev.xid_count += 1
            assert self.capture is not None
            self.capture.notes.append(f"XID {int(event.eventData)} on GPU {index} at {t:.1f} s into the window.")

    def _lost(self, dev: Device, t: float) -> None:
        assert self.capture is not None
        dev.lost_at = t
        reason = (f"{dev.label} was lost {t:.1f} s into the window (NVML: GPU is lost); its samples stop there")
        self.capture.mark_unavailable("nvml", "gpu.*", reason, _HINTS["lost"])
        self.capture.notes.append(reason + ".")

    # --- end ------------------------------------------------------------------------------------------------

    def stop(self, t: float) -> None:
        if self.nv is None:
            return
        assert self.capture is not None
        for dev in self.devices:
            if dev.reason_samples and dev.reasons_seen:
                parts = [f"{name} {n / dev.reason_samples:.0%}" for name, n in dev.reasons_seen.most_common()]
                self.capture.notes.append(f"{dev.label} clock event reasons (share of samples): {', '.join(parts)}.")
        if self._event_set is not None:
            try:
                self.nv.nvmlEventSetFree(self._event_set)
            except seam.NVMLError:
                pass
            self._event_set = None
        shutdown_nvml(self.nv)

    def latest(self) -> dict[str, float]:
        return dict(self.book.newest) if self.book else {}


# --- inventory for `diagnoser gpus` and `diagnoser doctor` ---------------------------------------------------------

@dataclass
class GpuRow:
    info: GpuInfo
    used_bytes: int | None = None
    busy: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def inventory() -> list[GpuRow]:
    """Every visible GPU with its current use and processes. Raises NvmlUnavailable when there is none."""
    nv, count = open_nvml()
    rows: list[GpuRow] = []
    try:
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                row = GpuRow(gpu_info(nv, index, handle))
            except seam.NVMLError as exc:
                rows.append(GpuRow(GpuInfo(index=index, name="?"), problems=[seam.describe(exc)]))
                continue
            for attr, fn, args, scale in (
                ("used_bytes", nv.nvmlDeviceGetMemoryInfo, (handle,), None),
                ("busy", nv.nvmlDeviceGetUtilizationRates, (handle,), None),
                ("temp_c", nv.nvmlDeviceGetTemperature, (handle, nv.NVML_TEMPERATURE_GPU), 1.0),
                ("power_w", nv.nvmlDeviceGetPowerUsage, (handle,), 1e-3),
            ):
                try:
                    value = fn(*args)
                except seam.NVMLError as exc:
                    row.problems.append(f"{attr}: {seam.describe(exc)}")
                    continue
                if attr == "used_bytes":
                    row.used_bytes = int(value.used)
                elif attr == "busy":
                    row.busy = value.gpu / 100.0
                else:
                    setattr(row, attr, float(value) * (scale or 1.0))
            try:
                row.processes = running_processes(nv, handle)
            except seam.NVMLError as exc:
                row.problems.append(f"processes: {seam.describe(exc)}")
            rows.append(row)
    finally:
        shutdown_nvml(nv)
    return rows
