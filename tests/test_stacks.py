"""Python stack sampling with py-spy on real processes on the CPU: a process with a known hot function, the demo
server under load, processes py-spy cannot read, and the doctor's check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from diagnoser.capture import Capture, dumps, loads, new_capture
from diagnoser.collectors import doctor, stacks
from diagnoser.collectors.session import Sampler, run_sampler
from diagnoser.collectors.stacks import (
    ENABLE_HINT,
    StackCollector,
    explain_failure,
    reduce_speedscope,
)
from diagnoser.demo.loadgen import run_load
from diagnoser.stacks import hot_code, stack_summary

PY = sys.executable
needs_py_spy = pytest.mark.skipif(stacks.find_py_spy() is None, reason="py-spy is not installed (test extra)")

# A thread named "tokenizer" spins in hot_tokenize_loop; the main thread sleeps. It says "up" once both run.
KNOWN_HOT = """
import threading, time
def hot_tokenize_loop():
    n = 0
    while True:
        for i in range(2000):
            n += i * i
def main():
    threading.Thread(target=hot_tokenize_loop, name="tokenizer", daemon=True).start()
    print("up", flush=True)
    while True:
        time.sleep(0.05)
main()
"""


def sample(pid: int, seconds: float) -> Capture:
    capture = new_capture("test")
    sampler = Sampler(capture, [StackCollector(pid)], duration_s=seconds, interval_s=0.1)
    run_sampler(sampler)
    return capture


@pytest.fixture
def known_hot() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([PY, "-c", KNOWN_HOT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    proc.kill()
    proc.wait()


@needs_py_spy
def test_the_hot_function_of_a_busy_thread_is_named(known_hot):
    capture = sample(known_hot.pid, 2.5)
    assert capture.stacks is not None, capture.unavailable
    busiest = capture.stacks.threads[0]
    assert busiest.name == "tokenizer" and busiest.pid == known_hot.pid
    assert busiest.role == "tokenizer"  # by its frames: hot_tokenize_loop
    assert busiest.top[0].frame.function == "hot_tokenize_loop" and busiest.top[0].self_frac > 0.9
    assert busiest.active_frac > 0.3  # it spins; on a loaded 2-core machine it still runs a good part of the time
    assert all(t.name != "MainThread" or t.active_frac < busiest.active_frac for t in capture.stacks.threads)
    (hot, *_) = hot_code(capture)
    assert hot.function.startswith("hot_tokenize_loop (") and hot.thread == "tokenizer"
    assert "hot_tokenize_loop" in hot.cite() and "tokenizer" in hot.cite()
    assert "hot_tokenize_loop" in stack_summary(capture)
    assert loads(dumps(capture)).stacks == capture.stacks  # kept in the saved capture


@pytest.fixture(scope="module")
def demo_under_load() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([PY, "-m", "diagnoser.demo.server", "--port", "0", "--device", "cpu"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    found = re.search(r"ready on (http://[\d.]+:\d+)", proc.stdout.readline())
    assert found, "the demo server did not start"
    stop = threading.Event()
    load = threading.Thread(target=run_load, args=(found.group(1),),
                            kwargs={"concurrency": 8, "duration_s": 120, "max_tokens": (16, 32), "stop": stop})
    load.start()
    yield proc
    stop.set()
    load.join(60)
    proc.terminate()
    proc.wait(30)


@needs_py_spy
def test_the_demo_servers_engine_loop_is_named_in_its_own_code(demo_under_load):
    capture = sample(demo_under_load.pid, 3.0)
    assert capture.stacks is not None, capture.unavailable
    found = hot_code(capture, min_active=0.0)
    engine = [h for h in found if h.thread == "MainThread"]  # the demo's engine loop runs on the main thread
    assert engine, [h.cite() for h in found]
    path = " ".join(engine[0].path)
    assert "diagnoser/demo/" in path or "torch/" in engine[0].function, engine[0].cite()
    assert not any(part.split("(")[-1].startswith("/") for part in engine[0].path)  # files are relative in a report


def test_a_process_with_no_python_is_said_in_one_sentence():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        capture = sample(proc.pid, 0.5) if stacks.find_py_spy() else None
    finally:
        proc.kill()
        proc.wait()
    if capture is None:
        pytest.skip("py-spy is not installed (test extra)")
    assert capture.stacks is None
    (u,) = [u for u in capture.unavailable if u.source == "stacks"]
    assert u.what == "stacks.*"
    assert "run no Python interpreter" in u.reason or "found no Python code to sample" in u.reason


def test_without_py_spy_the_source_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(stacks, "find_py_spy", lambda: None)
    monkeypatch.setattr(doctor, "find_py_spy", lambda: None)
    capture = sample(1, 0.2)
    (u,) = [u for u in capture.unavailable if u.source == "stacks"]
    assert u.reason == "py-spy is not installed" and "pip install" in u.hint
    check = doctor.stack_sampling()
    assert check.status == doctor.MISSING and "pip install" in check.fix


def test_no_ptrace_permission_gives_the_sentence_that_enables_it():
    reason, hint = explain_failure("Error: Permission Denied: Try running again with elevated permissions by going "
                                   "'sudo env \"PATH=$PATH\" !!'", 4242)
    assert reason == "py-spy was not allowed to read process 4242 (no ptrace permission)"
    assert hint == ENABLE_HINT and "SYS_PTRACE" in hint and "ptrace_scope" in hint
    reason, _ = explain_failure("Error: Failed to get process executable name. Check that the process is running.\n"
                                "Caused by: No such file or directory (os error 2)", 7)
    assert reason == "process 7 was gone before its stacks could be sampled"


@needs_py_spy
def test_doctor_says_stack_sampling_works_here():
    check = doctor.stack_sampling()
    assert check.source == "Python stacks (py-spy)"
    assert check.status in (doctor.OK, doctor.LIMITED), check
    if check.status == doctor.LIMITED:
        assert "SYS_PTRACE" in check.fix


def test_speedscope_is_reduced_to_threads_functions_and_roles():
    doc = {
        "shared": {"frames": [
            {"name": "schedule", "file": "/usr/lib/python3/site-packages/vllm/v1/core/sched/scheduler.py", "line": 10},
            {"name": "step", "file": "/usr/lib/python3/site-packages/vllm/v1/engine/core.py", "line": 5},
            {"name": 'process 11:"python -m vllm"', "file": "", "line": 0},
            {"name": "detokenize_incrementally", "file": "/home/alice/app/detok.py", "line": 7},
        ]},
        "profiles": [
            {"type": "sampled", "name": 'Process 11 Thread 12 "EngineCore"', "unit": "seconds",
             "samples": [[2, 1, 0]] * 8 + [[2, 1]] * 2, "weights": [0.04] * 10},
            {"type": "sampled", "name": 'Process 11 Thread 13 "detok"', "unit": "seconds",
             "samples": [[2, 3]] * 4, "weights": [0.04] * 4},
            {"type": "sampled", "name": 'Process 11 Thread 14 "idle"', "unit": "seconds",
             "samples": [[2, 1]], "weights": [0.04]},
        ],
    }
    out = reduce_speedscope(json.dumps(doc).encode(), pid=11, rate_hz=25, duration_s=1.0)
    assert [t.name for t in out.threads] == ["EngineCore", "detok"]  # one sample says nothing: left out
    core, detok = out.threads
    assert (core.pid, core.tid, core.samples, core.active_frac) == (11, 12, 10, 0.4)
    assert core.role == "scheduler" and core.roles == {"scheduler": 0.8}
    assert core.top[0].frame.function == "schedule" and core.top[0].self_frac == 0.8
    assert core.top[0].frame.file == "vllm/v1/core/sched/scheduler.py"  # package-relative
    assert core.top[1].frame.function == "step" and core.top[1].total_frac == 1.0
    assert [f.function for f in core.stacks[0].frames] == ["schedule", "step"]  # innermost first, no pseudo-frame
    assert detok.role == "detokenizer" and detok.top[0].frame.file == "app/detok.py"  # no home directory
    assert out.samples == 15


@needs_py_spy
def test_a_saturated_serving_thread_finding_names_the_hot_function(known_hot):
    """HOST001 on a real process's sampled stacks: the finding and its first fix quote the hot function."""
    from diagnoser.rules import diagnose
    from tests.factories import make_capture

    capture = make_capture({"host.target_busiest_thread": 0.98, "gpu.busy": 0.35, "host.target_cpu": 1.0})
    capture.stacks = sample(known_hot.pid, 2.5).stacks
    assert capture.stacks is not None
    finding = next(f for f in diagnose(capture).findings if f.code == "HOST001")
    assert "hot_tokenize_loop (" in finding.message and "thread tokenizer" in finding.message
    fix = finding.fixes[0]
    assert fix.title == "Take the hot Python code off the serving loop" and "hot_tokenize_loop" in fix.action
    without = make_capture({"host.target_busiest_thread": 0.98, "gpu.busy": 0.35, "host.target_cpu": 1.0})
    plain = next(f for f in diagnose(without).findings if f.code == "HOST001")
    assert "Sampled stacks" not in plain.message  # no stacks: the finding says what it knows, nothing invented
