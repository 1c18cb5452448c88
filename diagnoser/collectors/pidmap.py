"""Match the PIDs NVML reports to the target's processes, across PID namespaces.

The NVIDIA driver knows nothing of PID namespaces: NVML always reports host PIDs. When diagnoser runs in the same
namespace as NVML's PIDs (on the host, or in a container started with --pid=host) they match the target's directly.
When it runs inside the target's container they do not, and the only way back is a view of the host's /proc (mounted
into the container, e.g. at /host/proc): there `/proc/<host pid>/status` has an `NSpid:` line listing the process's
PID in every namespace from the host's inward, the last one being the PID the target has in its own namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

HOST_PROC_ENV = "DIAGNOSER_HOST_PROC"
_HOST_PROC_CANDIDATES = ("/host/proc", "/hostproc")


def read_nspid(proc: Path, pid: int) -> list[int] | None:
    """The `NSpid:` line of /proc/<pid>/status: the PID in each namespace, outermost (the procfs's) first."""
    try:
        with open(proc / str(pid) / "status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def pid_namespace(proc: Path, pid: int) -> str | None:
    """The PID namespace of a process ('pid:[4026531836]'), or None when it cannot be read (gone, no permission)."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None


def default_host_proc(our_proc: Path = Path("/proc")) -> Path | None:
    """A view of the host's /proc mounted into this container, if there is one (env DIAGNOSER_HOST_PROC first)."""
    candidates = [os.environ[HOST_PROC_ENV]] if os.environ.get(HOST_PROC_ENV) else list(_HOST_PROC_CANDIDATES)
    for candidate in candidates:
        path = Path(candidate)
        if (path / "1" / "status").is_file() and not _same_procfs(path, our_proc):
            return path
    return None


def _same_procfs(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


@dataclass
class PidMapping:
    """NVML PID -> the target's PID in our view; `problem` says why nothing matched when that is not just 'not on
    GPU'."""

    nvml_to_target: dict[int, int] = field(default_factory=dict)
    method: str = ""
    problem: str = ""
    hint: str = ""


class PidMapper:
    def __init__(self, our_proc: Path = Path("/proc"), host_proc: Path | None = None) -> None:
        self.our_proc = our_proc
        self.host_proc = host_proc

    def map(self, target_pids: set[int], nvml_pids: set[int]) -> PidMapping:
        if not nvml_pids or not target_pids:
            return PidMapping()
        direct = target_pids & nvml_pids
        if direct:
            return PidMapping({p: p for p in direct}, "same PID namespace")
        foreign = sorted(p for p in nvml_pids if not (self.our_proc / str(p)).exists())
        if not foreign:
            # Every NVML PID is a process we can see: we share NVML's namespace and the target is just not on a GPU.
            return PidMapping(method="same PID namespace")
        if self.host_proc is not None:
            mapped = self._through_host_proc(target_pids, nvml_pids)
            if mapped:
                return PidMapping(mapped, f"NSpid in {self.host_proc}")
            return PidMapping(method=f"NSpid in {self.host_proc}")  # the host view shows none of them is ours
        shown = ", ".join(str(p) for p in foreign[:3])
        return PidMapping(
            problem=f"NVML reports host PIDs ({shown}) that do not exist in this PID namespace, so the target's "
            "GPU processes cannot be identified",
            hint=f"run diagnoser on the host or in a container with --pid=host, or mount the host's /proc and set "
            f"{HOST_PROC_ENV} to it",
        )

    def _through_host_proc(self, target_pids: set[int], nvml_pids: set[int]) -> dict[int, int]:
        assert self.host_proc is not None
        verified: dict[int, int] = {}
        unverified: dict[int, list[int]] = {}
        for host_pid in nvml_pids:
            chain = read_nspid(self.host_proc, host_pid)
            if not chain or len(chain) < 2 or chain[-1] not in target_pids:
                continue
            inner = chain[-1]
            theirs = pid_namespace(self.host_proc, host_pid)
            ours = pid_namespace(self.our_proc, inner)
            if theirs is not None and ours is not None:
                if theirs == ours:
                    verified[host_pid] = inner
            else:
                unverified.setdefault(inner, []).append(host_pid)
        # Without namespace ids, an inner PID (1 in every container) is trusted only when exactly one host PID has it.
        for inner, hosts in unverified.items():
            if len(hosts) == 1 and inner not in verified.values():
                verified[hosts[0]] = inner
        return verified
