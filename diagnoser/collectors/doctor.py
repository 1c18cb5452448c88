"""Which data sources work on this machine, and how to enable the ones that do not (`diagnoser doctor`)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from diagnoser.collectors import nvml_seam as seam
from diagnoser.collectors.nvml import (
    NvmlUnavailable,
    open_nvml,
    running_processes,
    shutdown_nvml,
    text,
)
from diagnoser.collectors.pidmap import HOST_PROC_ENV, default_host_proc
from diagnoser.collectors.server_metrics import MetricsError, probe
from diagnoser.collectors.stacks import (
    ENABLE_HINT,
    INSTALL_HINT,
    explain_failure,
    find_py_spy,
)
from diagnoser.collectors.target import kind_from_cmdline

OK, LIMITED, MISSING, NOT_CHECKED = "ok", "limited", "missing", "not checked"
NVIDIA_PARAMS = Path("/proc/driver/nvidia/params")
DCGM_HOSTENGINE_PORT = 5555
DCGM_EXPORTER_URL = "http://127.0.0.1:9400/metrics"


@dataclass
class SourceCheck:
    source: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def run_checks(port: int | None = None, metrics_url: str | None = None) -> list[SourceCheck]:
    checks = [*_gpu_checks(), counters_permission(), dcgm(), host(), stack_sampling(), server(port, metrics_url),
              profiler_settings(), torch_extra()]
    return checks


def _gpu_checks() -> list[SourceCheck]:
    """NVML, GPM and per-process attribution, from one NVML session."""
    try:
        nv, count = open_nvml()
    except NvmlUnavailable as exc:
        why = f"needs NVML: {exc.reason}"
        return [SourceCheck("NVML", MISSING, exc.reason, exc.hint),
                SourceCheck("GPM", NOT_CHECKED, why), SourceCheck("GPU processes", NOT_CHECKED, why)]
    try:
        handles, names = [], []
        for i in range(count):
            try:
                handles.append(nv.nvmlDeviceGetHandleByIndex(i))
                names.append(text(nv.nvmlDeviceGetName(handles[-1])))
            except seam.NVMLError as exc:
                names.append(f"GPU {i}: {seam.describe(exc)}")
        try:
            driver = text(nv.nvmlSystemGetDriverVersion())
        except seam.NVMLError:
            driver = "?"
        checks = [SourceCheck("NVML", OK, f"driver {driver}, {count} GPU(s): {', '.join(names)}")]
        checks.append(_gpm(nv, handles))
        checks.append(_processes(nv, handles))
        return checks
    finally:
        shutdown_nvml(nv)


def _gpm(nv: object, handles: list[object]) -> SourceCheck:
    supported, unsupported = 0, []
    for i, h in enumerate(handles):
        try:
            if nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:  # type: ignore[attr-defined]
                supported += 1
                continue
            unsupported.append(f"GPU {i}")
        except (seam.NVMLError, seam.LibraryMismatch, AttributeError) as exc:
            unsupported.append(f"GPU {i} ({seam.describe(exc)})")
    fix = ("GPM needs Hopper or newer; on older datacenter GPUs run NVIDIA dcgm-exporter for the DCGM_FI_PROF_* "
           "counters (SM, DRAM and tensor activity)")
    if not unsupported:
        return SourceCheck("GPM", OK, f"SM, DRAM, tensor-pipe activity on {supported} GPU(s)")
    status = LIMITED if supported else MISSING
    return SourceCheck("GPM", status, f"not available on {', '.join(unsupported)}", fix)


def _processes(nv: object, handles: list[object]) -> SourceCheck:
    pids: set[int] = set()
    for h in handles:
        try:
            pids.update(p.pid for p in running_processes(nv, h))
        except seam.NoPermission:
            return SourceCheck("GPU processes", MISSING, "NVML refused to list GPU processes",
                               "run diagnoser as root (MIG GPUs only list processes to root)")
        except seam.NVMLError as exc:
            return SourceCheck("GPU processes", MISSING, f"NVML cannot list GPU processes ({seam.describe(exc)})")
    foreign = sorted(p for p in pids if not Path(f"/proc/{p}").exists())
    if foreign:
        host_proc = default_host_proc()
        if host_proc is not None:
            return SourceCheck("GPU processes", OK, f"NVML reports host PIDs; mapped through {host_proc}")
        return SourceCheck("GPU processes", LIMITED,
                           f"NVML reports PIDs from another PID namespace ({', '.join(map(str, foreign[:3]))}): "
                           "the target's GPU memory cannot be attributed",
                           f"run on the host or with --pid=host, or mount the host's /proc and set {HOST_PROC_ENV}")
    return SourceCheck("GPU processes", OK, f"{len(pids)} GPU process(es) visible, same PID namespace")


def counters_permission() -> SourceCheck:
    try:
        params = NVIDIA_PARAMS.read_text()
    except OSError:
        return SourceCheck("profiling counters", NOT_CHECKED, f"{NVIDIA_PARAMS} is absent (no NVIDIA driver)")
    restricted = any(line.replace(" ", "").lower() == "rmprofilingadminonly:1" for line in params.splitlines())
    if restricted and os.geteuid() != 0:
        return SourceCheck("profiling counters", LIMITED,
                           "GPU performance counters are restricted to admins (RmProfilingAdminOnly: 1): Nsight "
                           "Compute and CUPTI counter collection need root",
                           "run as root, or load the driver with NVreg_RestrictProfilingToAdminUsers=0")
    return SourceCheck("profiling counters", OK,
                       "restricted to admins, and diagnoser runs as root" if restricted else "open to all users")


def dcgm() -> SourceCheck:
    exporter = _dcgm_exporter()
    if exporter:
        return SourceCheck("DCGM", OK, f"dcgm-exporter answers at {DCGM_EXPORTER_URL}")
    engine = _port_open("127.0.0.1", DCGM_HOSTENGINE_PORT)
    dcgmi = shutil.which("dcgmi")
    found = [x for x, ok in ((f"nv-hostengine on :{DCGM_HOSTENGINE_PORT}", engine), (f"dcgmi at {dcgmi}", dcgmi))
             if ok]
    fix = ("run NVIDIA dcgm-exporter (it listens on :9400) to read DCGM_FI_PROF_* counters, the way to see SM, "
           "DRAM and tensor activity on GPUs older than Hopper")
    if found:
        return SourceCheck("DCGM", LIMITED, f"{' and '.join(found)}, but no dcgm-exporter at {DCGM_EXPORTER_URL}", fix)
    return SourceCheck("DCGM", MISSING, "no dcgm-exporter, nv-hostengine or dcgmi on this machine", fix)


def _dcgm_exporter() -> bool:
    try:
        _, samples = probe(DCGM_EXPORTER_URL, timeout=1.0)
    except MetricsError:
        return False
    return any(name.startswith("DCGM_FI_") for name in samples)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def host() -> SourceCheck:
    try:
        threads = psutil.Process().threads()
    except psutil.Error as exc:
        return SourceCheck("host (psutil)", MISSING, f"per-thread CPU times unreadable ({exc})")
    detail = f"per-thread CPU readable ({len(threads)} thread(s) here), {psutil.cpu_count()} CPUs"
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
        if scope not in ("0", "") and os.geteuid() != 0:
            detail += f"; ptrace_scope={scope} (other users' processes cannot be attached)"
    except OSError:
        pass
    return SourceCheck("host (psutil)", OK, detail)


CAP_SYS_PTRACE = 19
PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")


def _has_cap_sys_ptrace() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def stack_sampling() -> SourceCheck:
    """Whether py-spy can read a Python process's stacks here: tried on a child Python process, then what the kernel
    allows for processes that are not diagnoser's children (Yama's ptrace_scope, CAP_SYS_PTRACE)."""
    binary = find_py_spy()
    if binary is None:
        return SourceCheck("Python stacks (py-spy)", MISSING, "py-spy is not installed", INSTALL_HINT)
    busy_loop = "import time\nprint('up', flush=True)\nwhile True: time.sleep(0.05)"
    child = subprocess.Popen([sys.executable, "-c", busy_loop],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the interpreter is up: its memory can be read
        try:
            done = subprocess.run([binary, "dump", "--pid", str(child.pid)], capture_output=True, text=True,
                                  timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return SourceCheck("Python stacks (py-spy)", MISSING, f"py-spy could not be run ({exc})", INSTALL_HINT)
    finally:
        child.kill()
        child.wait()
    if done.returncode != 0:
        reason, hint = explain_failure(done.stderr, child.pid)
        return SourceCheck("Python stacks (py-spy)", MISSING, reason, hint or ENABLE_HINT)
    try:
        scope = PTRACE_SCOPE.read_text().strip()
    except OSError:
        scope = ""
    privileged = os.geteuid() == 0 or _has_cap_sys_ptrace()
    if scope in ("", "0") or (scope in ("1", "2") and privileged):
        who = "any process of the same user" if not privileged else "any process (root or CAP_SYS_PTRACE)"
        return SourceCheck("Python stacks (py-spy)", OK, f"py-spy can read Python stacks of {who}")
    if scope == "3":
        return SourceCheck("Python stacks (py-spy)", LIMITED, "kernel.yama.ptrace_scope=3: no process may be traced "
                           "until reboot, so a running server's stacks cannot be read", ENABLE_HINT)
    return SourceCheck("Python stacks (py-spy)", LIMITED, f"kernel.yama.ptrace_scope={scope}: only diagnoser's own "
                       "child processes can be read, not a server started elsewhere", ENABLE_HINT)


def server(port: int | None, metrics_url: str | None) -> SourceCheck:
    if metrics_url or port:
        url = metrics_url or f"http://127.0.0.1:{port}/metrics"
        try:
            kind, _ = probe(url)
        except MetricsError as exc:
            return SourceCheck("server metrics", MISSING, str(exc).rstrip("."),
                               "start the server with its metrics on (SGLang: --enable-metrics; vLLM and TGI serve "
                               "/metrics by default; Triton on :8002)")
        if kind is None:
            return SourceCheck("server metrics", LIMITED, f"{url} serves metrics of no known inference server")
        return SourceCheck("server metrics", OK, f"{kind} metrics at {url}")
    found = find_servers()
    if not found:
        return SourceCheck("server metrics", NOT_CHECKED, "no vLLM, SGLang, TGI, Triton or demo server found "
                           "listening on this machine", "give --port PORT or --metrics-url URL to check one")
    return SourceCheck("server metrics", OK, "; ".join(f"{kind} pid {pid} at {url}" for pid, kind, url in found))


def profiler_settings(servers: list[tuple[int, str, str]] | None = None) -> SourceCheck:
    """Whether each vLLM found here can be traced through its own endpoints, and at what cost: its defaults record
    stacks and dump a summary table, which grew a CPU build's 769 MB trace to 12.3 GB and killed the engine."""
    from diagnoser.tracing.endpoints import VLLM_LIGHT_FLAGS, heavy_settings, vllm_profiler_flags

    found = [s for s in (find_servers() if servers is None else servers) if s[1] == "vllm"]
    if not found:
        return SourceCheck("vLLM profiler", NOT_CHECKED, "no vLLM found listening on this machine")
    off, heavy, light = [], [], []
    for pid, _, _ in found:
        flags = vllm_profiler_flags(pid)
        if flags is None:
            off.append(pid)
        elif costly := heavy_settings(flags):
            heavy.append(f"pid {pid} ({', '.join(costly)})")
        else:
            light.append(pid)
    if heavy:
        return SourceCheck("vLLM profiler", LIMITED, "profiler on with costly settings: " + "; ".join(heavy) + ": a "
                           "trace can grow to gigabytes after the stop and kill the engine",
                           f"restart with {VLLM_LIGHT_FLAGS} (a 15 s trace then costs most of the server's tokens/s "
                           "while it runs, nothing after)")
    if off:
        return SourceCheck("vLLM profiler", LIMITED, f"pid {', '.join(map(str, off))}: profiler endpoints off "
                           "(`diagnoser trace` needs them, or the hook)", f"restart with {VLLM_LIGHT_FLAGS}")
    return SourceCheck("vLLM profiler", OK, f"light settings on pid {', '.join(map(str, light))}: "
                       "`diagnoser trace PID` uses its endpoints")


def find_servers(limit: int = 5) -> list[tuple[int, str, str]]:
    """(pid, kind, metrics URL) of inference servers listening here whose /metrics answers."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return []
    found: list[tuple[int, str, str]] = []
    seen: set[tuple[int, int]] = set()
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.pid or not c.laddr or len(found) >= limit:
            continue
        try:
            kind = kind_from_cmdline(psutil.Process(c.pid).cmdline())
        except psutil.Error:
            continue
        if kind is None or (c.pid, c.laddr.port) in seen:
            continue
        seen.add((c.pid, c.laddr.port))
        ip = c.laddr.ip if c.laddr.ip not in ("0.0.0.0", "::", "") else "127.0.0.1"
        url = f"http://{f'[{ip}]' if ':' in ip else ip}:{c.laddr.port}/metrics"
        try:
            probe(url, timeout=1.0)
        except MetricsError:
            continue
        found.append((c.pid, kind, url))
    return found


def torch_extra() -> SourceCheck:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return SourceCheck("torch (demo, traces)", MISSING, "torch is not installed in diagnoser's environment",
                           "pip install 'diagnoser[torch]'")
    return SourceCheck("torch (demo, traces)", OK, f"torch {version}")
