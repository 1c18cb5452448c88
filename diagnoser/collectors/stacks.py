"""Python stacks of the target during the window, sampled from outside with py-spy: no restart, no code change.

py-spy reads the target's memory (ptrace permission: the same user with kernel.yama.ptrace_scope 0, or root, or
CAP_SYS_PTRACE in a container) without pausing it (--nonblocking), follows its child processes (vLLM's engine core
and SGLang's scheduler run in children), and samples only threads that are running, so a thread's sample count over
the window is the time it spent busy in Python. At the end of the window the samples are reduced to the busiest
threads, each with its hottest functions and stacks and a role guessed from the frames (scheduler, tokenizer,
detokenizer, sampling, data movement, serialization, http): that is what a host finding quotes.

py-spy is an optional dependency (`pip install 'diagnoser[stacks]'`); without it, or without permission, the source
is marked unavailable with one sentence on how to enable it, and the rest of the window is unaffected.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec

from diagnoser.capture import (
    Capture,
    HotFrame,
    HotStack,
    StackFrame,
    StackSamples,
    ThreadStacks,
)
from diagnoser.collectors.exposition import safe_excerpt

DEFAULT_RATE_HZ = 25
STOP_TIMEOUT_S = 20.0  # py-spy writes its file after SIGINT; a loaded machine can take a while
KEEP_THREADS = 6
KEEP_FUNCTIONS = 5
KEEP_STACKS = 3
STACK_DEPTH = 8
MIN_THREAD_SAMPLES = 3  # fewer than this says nothing about a thread

ENABLE_HINT = ("stack sampling needs ptrace permission on the target: run diagnoser as root or as the server's user "
               "with kernel.yama.ptrace_scope=0 (sysctl), and in a container add the SYS_PTRACE capability "
               "(docker run --cap-add SYS_PTRACE; Kubernetes securityContext.capabilities.add: [SYS_PTRACE])")
INSTALL_HINT = "pip install 'diagnoser[stacks]' (or pip install py-spy) to name the Python code a busy thread runs"

# (role, pattern over "function file"): the innermost frame that matches names the role of a sample. Checked in
# order: detokenizing is decoding tokens, so it is tested before tokenizing.
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((role, re.compile(p, re.IGNORECASE)) for role, p in (
    ("detokenizer", r"detokeni[sz]|convert_ids_to_tokens|decode_token|incremental_decode|decode_batch"),
    ("tokenizer", r"tokeni[sz]|encode_batch|apply_chat_template|\bencode\b"),
    ("sampling", r"sampler|sampling|\bsample|logits_process|top_[kp]|penalt|logprob"),
    ("scheduler", (r"schedul|get_next_batch|_schedule|kv_cache_manager|block_pool|allocate_slots|radix_cache|"
                   r"prefix_cache|batch_queue")),
    ("model forward", r"torch/nn/modules|\bforward\b|torch/_dynamo|torch/_inductor|cuda_graph|graph_runner"),
    ("data movement", (r"prepare_input|_prepare|tolist|to_device|\bcopy|pin_memory|numpy|input_batch|make_tensor|"
                       r"_update_states|\bpad|collate|\bstack\b|torch/tensor|__array__")),
    ("serialization", r"msgpack|msgspec|pickle|serial|\bzmq|protobuf|json"),
    ("http", r"uvicorn|starlette|fastapi|aiohttp|http|h11|asyncio/(?:base_events|selector_events)"),
))


class StackSamplingError(Exception):
    """Stack sampling cannot run here; the message is one sentence."""


def find_py_spy() -> str | None:
    """The py-spy binary: beside this Python (a virtual environment's bin/) first, then on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def explain_failure(stderr: str, pid: int) -> tuple[str, str]:
    """(reason, hint) for a py-spy run that produced nothing, from its own error text."""
    text = " ".join(stderr.split())
    lower = text.lower()
    if "permission" in lower or "operation not permitted" in lower or "eperm" in lower:
        return f"py-spy was not allowed to read process {pid} (no ptrace permission)", ENABLE_HINT
    if not lower:  # interrupted at the window's end while still looking for a Python process
        return f"py-spy found no Python code to sample in process {pid} or its children during the window", ""
    if "no python processes found" in lower or "failed to find python version" in lower or \
            "failed to find a python interpreter" in lower or "failed to get python version" in lower:
        return f"process {pid} and its children run no Python interpreter py-spy can read", ""
    if "no such file" in lower or "not running" in lower or "failed to get process executable" in lower:
        return f"process {pid} was gone before its stacks could be sampled", ""
    first = next((part for part in re.split(r"(?<=\.)\s|Caused by:|Stack backtrace:", text) if part.strip()), text)
    return f"py-spy failed ({safe_excerpt(first.strip(), 160) or 'no error text'})", ""


class StackCollector:
    """Runs `py-spy record` on the target for the window; `stop` reduces its samples into Capture.stacks."""

    name = "stacks"
    period_s: float | None = 3600.0  # py-spy samples on its own; the sampler only starts and stops it

    def __init__(self, pid: int, rate_hz: int = DEFAULT_RATE_HZ, binary: str | None = None) -> None:
        self.pid = pid
        self.rate_hz = rate_hz
        self.binary = binary or find_py_spy()
        self.capture: Capture | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._out: Path | None = None
        self._started = 0.0

    def start(self, capture: Capture) -> None:
        self.capture = capture
        if self.binary is None:
            capture.mark_unavailable("stacks", "stacks.*", "py-spy is not installed", INSTALL_HINT)
            return
        self._dir = tempfile.TemporaryDirectory(prefix="diagnoser-stacks-")
        self._out = Path(self._dir.name) / "stacks.json"
        cmd = [self.binary, "record", "--pid", str(self.pid), "--rate", str(self.rate_hz), "--format", "speedscope",
               "--output", str(self._out), "--nonblocking", "--subprocesses"]
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            capture.mark_unavailable("stacks", "stacks.*", f"py-spy could not be started ({exc.strerror or exc})",
                                     INSTALL_HINT)
            self._cleanup()
            return
        self._started = time.monotonic()

    def sample(self, t: float) -> None:
        pass  # py-spy samples by itself for the whole window

    def stop(self, t: float) -> None:
        capture, proc = self.capture, self._proc
        if capture is None or proc is None:
            return
        try:
            self._finish(capture, proc)
        finally:
            self._cleanup()

    def _finish(self, capture: Capture, proc: subprocess.Popen[bytes]) -> None:
        elapsed = time.monotonic() - self._started
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        try:
            _, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            capture.mark_unavailable("stacks", "stacks.*",
                                     f"py-spy did not write its samples within {STOP_TIMEOUT_S:g} s of the window's "
                                     "end")
            return
        stderr = err.decode("utf-8", "replace")
        if self._out is None or not self._out.is_file() or self._out.stat().st_size == 0:
            reason, hint = explain_failure(stderr, self.pid)
            capture.mark_unavailable("stacks", "stacks.*", reason, hint)
            return
        try:
            capture.stacks = reduce_speedscope(self._out.read_bytes(), pid=self.pid, rate_hz=self.rate_hz,
                                               duration_s=elapsed, errors=_errors(stderr))
        except ValueError as exc:
            capture.mark_unavailable("stacks", "stacks.*", f"py-spy's output could not be read ({exc})")

    def _cleanup(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def latest(self) -> dict[str, float]:
        return {}


def _errors(stderr: str) -> int:
    found = re.search(r"Errors:\s*(\d+)", stderr)
    return int(found.group(1)) if found else 0


# --- reducing py-spy's speedscope file -------------------------------------------------------------------------

class _Frame(msgspec.Struct):
    name: str
    file: str = ""
    line: int | None = None


class _Shared(msgspec.Struct):
    frames: list[_Frame]


class _Profile(msgspec.Struct):
    name: str
    samples: list[list[int]] = msgspec.field(default_factory=list)
    weights: list[float] = msgspec.field(default_factory=list)


class _Speedscope(msgspec.Struct):
    shared: _Shared
    profiles: list[_Profile]


_PROFILE_NAME = re.compile(r'(?:Process (\d+) )?Thread (\d+)(?: "(.*)")?')


_SITE = re.compile(r".*/(?:site|dist)-packages/")
_HOME = re.compile(r"^/(?:home|Users)/[^/]+/|^/root/")


def short_file(path: str) -> str:
    """A frame's file as a citation shows it: package-relative for installed code (vllm/v1/core/sched/...), the last
    three parts otherwise (no home directories in a report)."""
    if not path:
        return ""
    cut = _SITE.sub("", path)
    if cut != path:
        return cut
    path = _HOME.sub("", path)
    parts = Path(path).parts
    return "/".join(parts[-3:]) if len(parts) > 3 else path


def role_of(frame: StackFrame) -> str:
    text = f"{frame.function} {frame.file}"
    for role, pattern in _ROLES:
        if pattern.search(text):
            return role
    return ""


def reduce_speedscope(data: bytes, *, pid: int, rate_hz: float, duration_s: float, errors: int = 0) -> StackSamples:
    """py-spy's speedscope file -> the busiest threads with their hottest functions, stacks and roles."""
    try:
        doc = msgspec.json.decode(data, type=_Speedscope)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    frames = [StackFrame(function=safe_excerpt(f.name, 120), file=safe_excerpt(short_file(f.file), 160),
                         line=f.line or 0) for f in doc.shared.frames]
    # py-spy --subprocesses puts a "process PID:cmdline" pseudo-frame at the root of each stack
    real = [not (f.file == "" and f.function.startswith("process ")) for f in frames]
    threads: list[ThreadStacks] = []
    total = 0
    for profile in doc.profiles:
        stacks = [[i for i in reversed(s) if 0 <= i < len(frames) and real[i]] for s in profile.samples]
        stacks = [s for s in stacks if s]  # innermost first
        total += len(stacks)
        if len(stacks) < MIN_THREAD_SAMPLES:
            continue
        threads.append(_thread(profile.name, stacks, frames, pid=pid, rate_hz=rate_hz, duration_s=duration_s))
    threads.sort(key=lambda th: th.samples, reverse=True)
    return StackSamples(rate_hz=rate_hz, duration_s=round(duration_s, 3), samples=total, errors=errors,
                        threads=threads[:KEEP_THREADS])


def _thread(name: str, stacks: list[list[int]], frames: list[StackFrame], *, pid: int, rate_hz: float,
            duration_s: float) -> ThreadStacks:
    found = _PROFILE_NAME.search(name)
    proc = int(found.group(1)) if found and found.group(1) else pid
    tid = int(found.group(2)) if found else None
    thread_name = safe_excerpt(found.group(3) or "", 60) if found else safe_excerpt(name, 60)
    n = len(stacks)
    # A function is one (name, file) whatever line it was on; it is shown at its most sampled line.
    func = [(f.function, f.file) for f in frames]
    self_counts = Counter(func[s[0]] for s in stacks)
    line_counts = Counter(s[0] for s in stacks)
    shown: dict[tuple[str, str], int] = {}
    for i, _ in line_counts.most_common():
        shown.setdefault(func[i], i)
    total_counts: Counter[tuple[str, str]] = Counter()
    for s in stacks:
        total_counts.update({func[i] for i in s})
    paths = Counter(tuple(s[:STACK_DEPTH]) for s in stacks)
    roles: Counter[str] = Counter()
    frame_roles = [role_of(f) for f in frames]
    for s in stacks:
        roles[next((frame_roles[i] for i in s if frame_roles[i]), "")] += 1
    named = {r: c / n for r, c in roles.items() if r}
    role = max(named, key=lambda r: named[r]) if named and max(named.values()) >= 0.3 else ""
    return ThreadStacks(
        pid=proc, tid=tid, name=thread_name, samples=n,
        active_frac=round(min(1.0, n / max(rate_hz * duration_s, 1e-9)), 4),
        role=role, roles={r: round(v, 4) for r, v in sorted(named.items(), key=lambda kv: -kv[1])},
        top=[HotFrame(frame=frames[shown[key]], self_frac=round(c / n, 4), total_frac=round(total_counts[key] / n, 4))
             for key, c in self_counts.most_common(KEEP_FUNCTIONS)],
        stacks=[HotStack(frames=[frames[i] for i in path], frac=round(c / n, 4))
                for path, c in paths.most_common(KEEP_STACKS)],
    )
