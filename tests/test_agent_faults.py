"""The agent when things go wrong: a target that exits, one that hangs, a source that is down, the agent itself
killed with -9 and restarted, and GPU discovery with no GPU. The loop must go on and record each error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pynvml
import pytest

from diagnoser.agent.history import ERROR, OK, TIMEOUT
from diagnoser.agent.worker import discover_servers, find_by_match, pod_of
from diagnoser.collectors import nvml_seam
from diagnoser.errors import SourceUnavailable
from tests.reference import TRICKLE_SERVER
from tests.test_agent_loop import ENV, AgentProcess, DemoServer, agent_cmd, free_port, metric, rows, scrape, wait_until


# Serves HTTP headers promising a big body, then trickles it a byte at a time: every read returns before the
# socket timeout, so a client without an overall deadline waits forever. A hung server, as seen from outside.
def workers_of(agent_pid: int) -> list[psutil.Process]:
    """Live worker processes started by one agent (other agents on this machine are not ours to count)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        if ("diagnoser.agent.worker" in " ".join(p.info["cmdline"] or [])
                and (p.info["environ"] or {}).get("DIAGNOSER_AGENT_PID") == str(agent_pid)
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(p)
    return found


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_exits_hangs_and_down_sources_are_recorded_and_the_loop_goes_on(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES tells the DCGM source which GPU a server uses when NVML cannot (no GPU here).
    steady = DemoServer(kv_tokens=2048, env={"CUDA_VISIBLE_DEVICES": "0"})
    leaving = DemoServer(kv_tokens=2048, env={"CUDA_VISIBLE_DEVICES": "0"})
    trickle = subprocess.Popen([sys.executable, "-c", TRICKLE_SERVER], stdout=subprocess.PIPE, text=True)
    assert trickle.stdout is not None
    hung_port = int(trickle.stdout.readline())
    db, port = tmp_path / "history.db", free_port()
    dcgm_down = f"http://127.0.0.1:{_closed_port()}/metrics"
    agent = AgentProcess("--every", "1s", "--jitter", "0", "--window", "1s", "--grace", "4s",
                         "--targets", f"steady={steady.port},leaving={leaving.port},"
                                      f"hung=url:http://127.0.0.1:{hung_port}/metrics",
                         "--dcgm-exporter", dcgm_down, "--db", str(db), "--metrics-port", str(port))
    try:
        wait_until(lambda: any(r.status == OK for r in rows(db, "leaving")), 120, "a first run of 'leaving'")
        leaving.stop()  # the target exits; the next runs cannot find it
        wait_until(lambda: any(r.status == ERROR for r in rows(db, "leaving")), 120, "an error row for 'leaving'")
        wait_until(lambda: any(r.status == TIMEOUT for r in rows(db, "hung")), 120, "a timeout row for 'hung'")
        # The loop went on: the steady target kept getting diagnosed after both failures.
        first_error = min(r.finished_at for r in rows(db) if r.status != OK)
        wait_until(lambda: sum(r.status == OK and r.started_at > first_error for r in rows(db, "steady")) >= 2,
                   120, "two more good runs of 'steady' after the first failure")
        samples = wait_until(lambda: scrape(port) or None, 30, "the metrics endpoint")
        assert metric(samples, "diagnoser_run_errors_total", target="leaving", kind="error") >= 1
        assert metric(samples, "diagnoser_run_errors_total", target="hung", kind="timeout") >= 1
        assert metric(samples, "diagnoser_last_run_ok", target="steady") == 1.0
        assert metric(samples, "diagnoser_source_unavailable", target="steady", source="dcgm") == 1.0
        assert agent.terminate() == 0
    finally:
        agent.kill()
        steady.stop()
        leaving.stop()
        trickle.kill()
        trickle.wait()
    # Each error says what happened, in one sentence.
    left = next(r for r in rows(db, "leaving") if r.status == ERROR)
    assert "no process" in left.error or "nothing is listening" in left.error, left.error
    hung = next(r for r in rows(db, "hung") if r.status == TIMEOUT)
    assert "no result within 5 s" in hung.error
    # The source that was down is recorded on every run of a reachable target, which still got its verdict.
    good = [r for r in rows(db, "steady") if r.status == OK]
    assert good and all(any(p.startswith("dcgm:") and "unreachable" in p for p in r.problems) for r in good)
    # No worker outlived the agent (the hung one was killed with its process group).
    assert not workers_of(agent.proc.pid)


@pytest.mark.slow
def test_kill_9_of_the_agent_then_restart(tmp_path: Path) -> None:
    server = DemoServer(kv_tokens=2048)
    db = tmp_path / "history.db"
    try:
        agent = AgentProcess("--every", "1s", "--jitter", "0", "--window", "2s", "--targets",
                             f"demo={server.port}", "--db", str(db), "--metrics-port", "0")
        try:
            wait_until(lambda: len(rows(db, "demo")) >= 2, 120, "two runs")
            # Kill it while a worker is sampling (it runs every second with a two-second window).
            wait_until(lambda: list(db.parent.glob(".agent-work-*/run-*/job.json")), 30, "a run in flight")
            before = [r.id for r in rows(db, "demo")]
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(30)
        finally:
            agent.kill()
        # The orphaned worker does not outlive its agent for long (the kernel sends it SIGTERM).
        wait_until(lambda: not workers_of(agent.proc.pid), 30, "the orphaned worker to exit")
        result = subprocess.run(agent_cmd("--once", "--targets", f"demo={server.port}", "--window", "1s",
                                          "--db", str(db)), capture_output=True, text=True, env=ENV, timeout=180)
        assert result.returncode == 0, result.stderr
        after = [r.id for r in rows(db, "demo")]
        assert after[:len(before)] == before and len(after) > len(before)
        assert not list(db.parent.glob(".agent-work-*"))  # the killed agent's scratch was cleared on restart
    finally:
        server.stop()


def test_once_without_targets_or_gpu_says_why(tmp_path: Path) -> None:
    result = subprocess.run(agent_cmd("--once", "--db", str(tmp_path / "h.db")), capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert result.returncode == 3
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("diagnoser: nothing to diagnose: cannot discover GPU processes")
    assert "Traceback" not in result.stderr
    assert '"event":"discovery_failed"' in result.stderr


# --- discovery, with NVML faked at its seam over real processes -------------------------------------------------

class FakeNvml:
    """Only what discovery calls; every other NVML function answers NotSupported, as a bare GPU would."""

    def __init__(self, pids_per_gpu: list[list[int]]) -> None:
        self.pids_per_gpu = pids_per_gpu

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.pids_per_gpu)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in self.pids_per_gpu[handle]]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML_"):
            return 0

        def not_supported(*args: Any) -> Any:
            raise pynvml.NVMLError_NotSupported()

        return not_supported


SERVER_TREE = r"""
import multiprocessing as mp, sys, time
def worker(ready):
    ready.set()
    time.sleep(600)
if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])  # workers of one server, forked or spawned as engines start them
    ready = [ctx.Event() for _ in range(2)]
    kids = [ctx.Process(target=worker, args=(r,)) for r in ready]
    for k in kids:
        k.start()
    # Running, not starting: a spawned worker's command line is empty for a moment while it execs.
    for r in ready:
        r.wait(120)
    print(" ".join(str(k.pid) for k in kids), flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_discovery_groups_gpu_processes_under_their_server(start: str, tmp_path: Path) -> None:
    """Two GPU worker processes of one server (as vLLM's per-GPU workers) and a separate single-process server:
    discovery climbs from NVML's PIDs to each server's top process."""
    script = tmp_path / "server.py"  # a file, so spawned children can import its main module
    script.write_text(SERVER_TREE)
    tree = subprocess.Popen([sys.executable, str(script), start], stdout=subprocess.PIPE, text=True)
    single = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert tree.stdout is not None
        w0, w1 = (int(x) for x in tree.stdout.readline().split())
        with nvml_seam.use(FakeNvml([[w0], [w1], [single.pid]])):
            servers = discover_servers()
        assert [(s["pid"], s["gpus"]) for s in servers] == [(tree.pid, [0, 1]), (single.pid, [2])]
    finally:
        for p in (tree, single):
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
            p.kill()
            p.wait()


def test_discovery_without_nvml_is_one_sentence() -> None:
    with pytest.raises(SourceUnavailable, match="cannot discover GPU processes: no NVIDIA driver"):
        discover_servers()


def test_match_targets_find_the_top_process() -> None:
    marker = f"diagnoser-match-test-{os.getpid()}"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]]);"
                               " time.sleep(600)", marker])
    try:
        wait_until(lambda: psutil.Process(parent.pid).children(), 30, "the child process")
        pid, note = find_by_match(marker)
        assert pid == parent.pid and note == ""
        with pytest.raises(SourceUnavailable, match="no running process matches"):
            find_by_match(marker + "-nobody")
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_pod_uid_from_cgroup(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        "1b2c3d4e_aaaa_bbbb_cccc_0123456789ab.slice/cri-containerd-abc.scope\n")
    assert pod_of(42, proc) == "1b2c3d4e-aaaa-bbbb-cccc-0123456789ab"
    (proc / "43").mkdir()
    (proc / "43" / "cgroup").write_text("0::/user.slice/user-1000.slice/session-2.scope\n")
    assert pod_of(43, proc) == "" and pod_of(44, proc) == "" and pod_of(None) == ""


@pytest.mark.slow
def test_a_live_exporter_names_the_pod_of_the_gpu(tmp_path: Path) -> None:
    # The agent reads the GPU its target uses from a live dcgm-exporter (the target's CUDA_VISIBLE_DEVICES, as NVML
    # is absent here) and records the pod the exporter labels that GPU with.
    from tests.prom_harness import ExporterProcess, SimFleet

    fleet = SimFleet(n_gpus=1, gpus_per_node=1, profiles=("compute",), pods={0: "llm-decode-0"})
    exporter = ExporterProcess(fleet, tmp_path).start()
    server = DemoServer(kv_tokens=2048, env={"CUDA_VISIBLE_DEVICES": "0"})
    db, port = tmp_path / "history.db", free_port()
    agent = AgentProcess("--every", "1s", "--jitter", "0", "--window", "2s", "--targets", f"llm={server.port}",
                         "--dcgm-exporter", exporter.url(0), "--db", str(db), "--metrics-port", str(port))
    try:
        wait_until(lambda: any(r.status == OK for r in rows(db, "llm")), 120, "a first run of 'llm'")
        assert agent.terminate() == 0
    finally:
        agent.kill()
        server.stop()
        exporter.stop()
    run = next(r for r in rows(db, "llm") if r.status == OK)
    assert run.pod == "team-0/llm-decode-0", run.problems
    assert not any(p.startswith("dcgm:") for p in run.problems), run.problems
