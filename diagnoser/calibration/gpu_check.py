"""Before calibrating a GPU: which GPU it is (read by the NVML collector's own `gpu_info`, so the store key is
exactly what `attach` later looks up), and whether another process is using it. A benchmark on a shared GPU measures
the sharing, not the GPU, so a busy GPU is refused unless the user forces it.

The check runs before this process touches CUDA, so any compute process NVML lists belongs to someone else. NVML is
reached only through the collectors' seam (diagnoser.collectors.nvml_seam), which the tests replace with a fake.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.capture import GpuInfo
from diagnoser.collectors import nvml_seam as seam
from diagnoser.collectors.nvml import NvmlUnavailable, gpu_info, open_nvml, running_processes
from diagnoser.errors import SourceUnavailable

# Mean NVML utilisation.gpu at or above which the GPU counts as busy even when NVML lists no process (a process in
# another container, or one NVML cannot see).
BUSY_UTILISATION = 0.10
UTILISATION_READS = 3
UTILISATION_GAP_S = 0.1


@dataclass
class GpuCheck:
    """The outcome of the pre-flight check: the GPU as NVML describes it (None when NVML could not be read), and
    why the run went ahead anyway when it was forced."""

    gpu: GpuInfo | None
    forced: str = ""
    busy_with: list[str] = field(default_factory=list)


def nvml_handle(nv: Any, cuda_index: int) -> tuple[int, Any]:
    """(NVML index, handle) of CUDA device `cuda_index`, honouring CUDA_VISIBLE_DEVICES (indices or UUIDs).

    CUDA orders devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; on a machine of identical GPUs that is
    NVML's PCI order, which is what this assumes. A UUID entry keeps `cuda_index` as the index it reports.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if cuda_index >= len(entries):
            raise SourceUnavailable(f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible}.")
        entry = entries[cuda_index]
        if entry.isdigit():
            return int(entry), nv.nvmlDeviceGetHandleByIndex(int(entry))
        return cuda_index, nv.nvmlDeviceGetHandleByUUID(entry)
    return cuda_index, nv.nvmlDeviceGetHandleByIndex(cuda_index)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _other_processes(nv: Any, handle: Any, own_pid: int) -> list[str]:
    """'pid 123 (python, 40.0 GiB)' for every compute process on the GPU other than this one."""
    found = []
    for p in running_processes(nv, handle):
        if p.pid == own_pid:
            continue
        parts = [x for x in (_process_name(p.pid), f"{p.used_bytes / 2**30:.1f} GiB" if p.used_bytes else "") if x]
        found.append(f"pid {p.pid}" + (f" ({', '.join(parts)})" if parts else ""))
    return found


def _utilisation(nv: Any, handle: Any) -> float | None:
    """Mean utilisation.gpu over a few reads (0..1), or None where NVML cannot give it (MIG, old GPUs)."""
    reads = []
    for i in range(UTILISATION_READS):
        if i:
            time.sleep(UTILISATION_GAP_S)
        try:
            reads.append(float(nv.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0)
        except (seam.NVMLError, seam.LibraryMismatch):
            return None
    return sum(reads) / len(reads)


def check_gpu(cuda_index: int, *, force: bool = False) -> GpuCheck:
    """Identify CUDA device `cuda_index` and refuse (SourceUnavailable) if another process is using it, unless
    `force`. Without NVML the GPU cannot be checked, which is refused the same way."""
    try:
        nv, _count = open_nvml()
    except NvmlUnavailable as exc:
        if exc.no_gpu:  # --force cannot help: there is nothing to calibrate
            raise SourceUnavailable(f"calibrate needs an NVIDIA GPU and there is none here ({exc.reason}); "
                                    "`diagnoser calibrate --device cpu` runs the same benchmarks on the CPU "
                                    "(labelled CPU, never used as GPU roofs).") from None
        if not force:
            raise SourceUnavailable(f"cannot check that GPU {cuda_index} is idle: {exc.reason}; pass --force to "
                                    "calibrate without the check.") from None
        return GpuCheck(None, forced=f"not checked for other processes: {exc.reason}")
    try:
        try:
            index, handle = nvml_handle(nv, cuda_index)
        except seam.NVMLError as exc:
            raise SourceUnavailable(f"NVML has no GPU for CUDA device {cuda_index} ({seam.describe(exc)}).") from None
        info = gpu_info(nv, index, handle)
        unlisted = ""
        try:
            busy = _other_processes(nv, handle, os.getpid())
        except (seam.NVMLError, seam.LibraryMismatch) as exc:
            busy, unlisted = [], f"NVML cannot list its processes ({seam.describe(exc)})"
        util = _utilisation(nv, handle)
        if util is not None and util >= BUSY_UTILISATION:
            busy.append(f"{util:.0%} utilisation from processes NVML does not list" if not busy
                        else f"{util:.0%} utilisation")
        label = f"GPU {cuda_index} ({info.name})"
        if busy:
            if not force:
                raise SourceUnavailable(f"{label} is busy with {'; '.join(busy)}: a calibration now would measure a "
                                        "shared GPU; wait until it is idle, or pass --force to calibrate anyway.")
            return GpuCheck(info, forced=f"ran on a busy GPU: {'; '.join(busy)}", busy_with=busy)
        if unlisted:
            if not force:
                raise SourceUnavailable(f"cannot check that {label} is idle: {unlisted}; pass --force to calibrate "
                                        "without the check.")
            return GpuCheck(info, forced=f"not checked for other processes: {unlisted}")
        return GpuCheck(info)
    except seam.GpuIsLost:
        raise SourceUnavailable(f"GPU {cuda_index} is lost (fell off the bus); it cannot be calibrated.") from None
    finally:
        try:
            nv.nvmlShutdown()
        except seam.NVMLError:
            pass


def power_capped(cuda_index: int, *, below: float = 0.9) -> tuple[bool, str]:
    """Whether the GPU's enforced power limit is under `below` x its board default, and a sentence saying so (the
    throttling self-test needs a capped GPU: it cannot cap one itself without root)."""
    try:
        nv, _count = open_nvml()
    except NvmlUnavailable as exc:
        return False, exc.reason
    try:
        _index, handle = nvml_handle(nv, cuda_index)
        enforced = nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
        default = nv.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0
    except (seam.NVMLError, seam.LibraryMismatch, AttributeError) as exc:
        return False, f"NVML cannot read the power limits ({seam.describe(exc)})"
    finally:
        try:
            nv.nvmlShutdown()
        except seam.NVMLError:
            pass
    if default > 0 and enforced < below * default:
        return True, f"power limit {enforced:.0f} W, under the board default {default:.0f} W"
    return False, (f"power limit {enforced:.0f} W is the board default ({default:.0f} W); cap it (nvidia-smi -pl) to "
                   "run this scenario")


_NVRM = re.compile(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)")


def driver_from_proc(path: str = "/proc/driver/nvidia/version") -> str:
    """The driver version from the kernel module's banner, for when NVML cannot be read."""
    try:
        found = _NVRM.search(Path(path).read_text())
    except OSError:
        return ""
    return found.group(1) if found else ""
