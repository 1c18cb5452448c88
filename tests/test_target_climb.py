"""The one climb of the process tree (collectors/target.server_parents): attach climbs from a worker's PID to the
API server above it, the agent's discovery from a GPU process to the top of its server; both through this."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from diagnoser.agent.worker import _server_root
from diagnoser.collectors.target import server_parents

# A parent that starts a sleeping child and prints its PID: a tree of two under the test runner.
TREE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(c.pid, flush=True); time.sleep(600)")


@pytest.fixture()
def tree() -> Iterator[tuple[int, int]]:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        yield parent.pid, child
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()


def test_the_climb_goes_where_through_lets_it_and_never_to_pid_1(tree: tuple[int, int]) -> None:
    parent, child = tree
    seen: list[tuple[int, int]] = []

    def anything(c: psutil.Process, p: psutil.Process) -> bool:
        seen.append((c.pid, p.pid))
        return True

    everything = server_parents(child, anything)
    assert everything[:2] == [parent, os.getpid()] and 1 not in everything
    assert seen[0] == (child, parent) and seen[1] == (parent, os.getpid())  # each step asked of (child, parent)
    assert server_parents(child, anything, limit=1) == [parent]
    assert server_parents(child, lambda c, p: p.pid != os.getpid()) == [parent]  # stops below the test runner
    assert server_parents(child, lambda c, p: False) == []


def test_a_process_that_cannot_be_read_ends_the_climb() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert server_parents(gone.pid, lambda c, p: True) == []


# A parent that forks a worker (same command line, not exec'd, as an engine's workers are) and prints its PID.
FORKED = ("import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(600)\n    os._exit(0)\n"
          "print(child, flush=True)\ntime.sleep(600)")


def test_discovery_climbs_to_the_top_of_the_server(tree: tuple[int, int]) -> None:
    """Discovery's climb (agent/worker._server_root) goes through the same function: a forked worker is climbed to
    the process that forked it, and no further (the test runner above is no server); a child its parent exec'd,
    naming no engine, is its own server's top."""
    parent, child = tree
    assert _server_root(child) == child
    server = subprocess.Popen([sys.executable, "-c", FORKED], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        worker = int(server.stdout.readline())
        assert _server_root(worker) == server.pid
    finally:
        for p in psutil.Process(server.pid).children(recursive=True):
            p.kill()
        server.kill()
        server.wait()
