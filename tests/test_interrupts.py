"""Signals and the end of a window, in-process: the sampler's last sample is awaited after Ctrl-C, the first SIGINT or
SIGTERM only ends the window, a second ends the command, and output paths are checked before a window starts."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import typer

from diagnoser.capture import Capture, new_capture
from diagnoser.collectors.session import Sampler, run_sampler
from diagnoser.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, InputError
from diagnoser.fileio import check_writable
from diagnoser.interrupts import Interrupted, StopOnSignals, arm, ends_window_on_signals


class SlowCollector:
    """Records the times it sampled at; from its fourth sample on each sample takes `slow_s` (a slow scrape), and
    `in_slow_sample` is set while one is under way, so a test can interrupt right then."""

    name = "slow"
    period_s: float | None = None

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.times: list[float] = []
        self.in_slow_sample = threading.Event()
        self.stopped_at: float | None = None

    def start(self, capture: Capture) -> None:
        self.capture = capture

    def sample(self, t: float) -> None:
        self.times.append(t)
        if len(self.times) >= 4:
            self.in_slow_sample.set()
            time.sleep(self.slow_s)

    def stop(self, t: float) -> None:
        self.stopped_at = t

    def latest(self) -> dict[str, float]:
        return {}


def _interrupt_when(event: threading.Event, signum: int = signal.SIGINT) -> threading.Thread:
    def fire() -> None:
        if event.wait(60):
            os.kill(os.getpid(), signum)  # delivered to the main thread, which is waiting in run_sampler

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


def test_ctrl_c_during_a_sample_waits_for_the_sampler_to_finish() -> None:
    """KeyboardInterrupt inside the wait for the sampler thread once made CPython mark that thread finished while it
    was still sampling: collect() returned a capture whose window had not ended ("ended early after 0.0 s")."""
    capture = new_capture("test")
    collector = SlowCollector(slow_s=1.0)
    sampler = Sampler(capture, [collector], duration_s=30.0, interval_s=0.05)
    _interrupt_when(collector.in_slow_sample)
    # Python's own Ctrl-C handling, as at a terminal: a suite started as a script's background job inherits SIGINT
    # ignored, and the window then ran its whole 30 s.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_sampler(sampler)  # the KeyboardInterrupt is absorbed: it ends the window
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sampler.finished.is_set(), "run_sampler returned while the sampler thread was still sampling"
    assert collector.stopped_at is not None
    assert capture.duration_s == math.ceil(collector.stopped_at * 1000) / 1000
    assert capture.duration_s >= max(collector.times)
    assert capture.duration_s - max(collector.times) < 30.0  # it ended early
    (note,) = [n for n in capture.notes if "ended early" in n]
    assert f"by Ctrl-C after {capture.duration_s:.1f} s of the 30 s asked for" in note


def test_stop_on_signals_first_ends_the_window_second_ends_the_command() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    guard = StopOnSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.event.wait(10)
        assert guard.terminated and guard.event.how == "by SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at the next bytecode boundary, long before this ends
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_the_window_of_a_sampler_ends_on_the_signal_event_with_its_name() -> None:
    capture = new_capture("test")
    collector = SlowCollector(slow_s=0.0)
    guard = StopOnSignals().install()
    try:
        sampler = Sampler(capture, [collector], duration_s=30.0, interval_s=0.05, stop_event=guard.event)
        _interrupt_when(collector.in_slow_sample, signal.SIGTERM)
        run_sampler(sampler)
    finally:
        guard.restore()
    assert any(f"ended early by SIGTERM after {capture.duration_s:.1f} s" in n for n in capture.notes), capture.notes
    assert capture.duration_s >= max(collector.times)


def test_a_signal_before_anything_was_captured_is_one_sentence_and_its_code() -> None:
    for signum, code in ((signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_TERMINATED)):
        guard = StopOnSignals()
        guard._handle(signum, None)
        with pytest.raises(Interrupted) as caught:
            guard.check_captured(False)
        assert caught.value.exit_code == code and "before anything was captured" in str(caught.value)
        guard.check_captured(True)  # something was: the command goes on to diagnose it


def test_a_command_ended_by_sigterm_exits_143_after_its_work() -> None:
    done: list[str] = []

    @ends_window_on_signals
    def command() -> None:
        stop = arm()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.event.wait(10)
        done.append("saved and diagnosed")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(typer.Exit) as caught:
        command()
    assert caught.value.exit_code == EXIT_TERMINATED and done == ["saved and diagnosed"]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored when the command returns


def test_an_inherited_ignored_sigint_stays_ignored_and_sigterm_still_ends_the_window() -> None:
    # A script's background job starts with SIGINT ignored, so that a Ctrl-C meant for the script's foreground does
    # not stop it; Python leaves it so at startup, and so does a window. SIGTERM (timeout, systemd) still ends it.
    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        guard = StopOnSignals().install()
        try:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing to wait for
            assert not guard.stopped
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.event.wait(10) and guard.terminated
        finally:
            guard.restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)


def test_arm_outside_a_command_installs_nothing() -> None:
    before = signal.getsignal(signal.SIGINT)
    arm()
    assert signal.getsignal(signal.SIGINT) is before


def test_output_paths_are_checked_without_creating_folders(tmp_path: Path) -> None:
    check_writable(tmp_path / "run.dgc", "--save")
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    missing = tmp_path / "nonexistent" / "dir" / "x.html"
    with pytest.raises(InputError, match="the folder .* does not exist"):
        check_writable(missing, "--html")
    assert not (tmp_path / "nonexistent").exists()
    with pytest.raises(InputError, match="is a folder"):
        check_writable(tmp_path, "--save")
    with pytest.raises(InputError, match="cannot be written"):
        check_writable("/sys/diagnoser-x.dgc", "--save")  # read-only for root too
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="is not a folder"):
        check_writable(tmp_path / "file" / "x.dgc", "--save")
