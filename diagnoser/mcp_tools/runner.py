"""One tool call: the CLI command run as the user would run it (`python -m diagnoser COMMAND ... --json`), in its own
process and session, with its time and output bounded.

A process of its own, rather than the command called in this one: stdout is the MCP wire here, and attach arms
SIGINT/SIGTERM for its window (interrupts.py), fleet forks workers, a trace can take gigabytes; none of that may
reach the server, and a call past its time is ended (SIGTERM: attach still diagnoses what it captured, then SIGKILL
to the whole process group). The command's answer is its stdout, byte for byte; its failure is the one sentence it
printed (`diagnoser: ...` on stderr, cli/common.handles_errors), never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import anyio
from anyio.abc import ByteReceiveStream, Process

from diagnoser.textsafe import one_line

STDERR_KEEP = 64 * 1024  # the tail of the command's stderr kept for its last sentence
GRACE_S = 10.0  # from SIGTERM to SIGKILL
MAX_SENTENCE = 1000


# The process groups of the calls running now: ended with the server (end_all), never left behind it.
_RUNNING: set[int] = set()


def end_all(signum: int, frame: object = None) -> None:
    """A signal handler for the server: SIGKILL every running call's process group (nobody is left to read what it
    would print), then die of the signal as the server would have without the handler."""
    for pgid in list(_RUNNING):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def end_with_the_server() -> None:
    """Install end_all for the signals that end a server (its client's SIGTERM, a closed terminal, Ctrl-C)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, end_all)


class ToolFailed(Exception):
    """A call that gave no document: its message is the one sentence the assistant sees."""


@dataclass
class _Read:
    data: bytearray
    over: bool = False


async def _drain(stream: ByteReceiveStream | None, out: _Read, cap: int, keep_tail: bool,
                 on_over: anyio.Event) -> None:
    if stream is None:
        return
    async for chunk in stream:
        out.data += chunk
        if len(out.data) > cap:
            if keep_tail:
                del out.data[:-cap]
            else:
                out.over = True
                on_over.set()
                return


def _signal_group(process: Process, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the command and any worker it forked
    except (ProcessLookupError, PermissionError):
        pass


async def _end(process: Process) -> None:
    """SIGTERM, then SIGKILL after the grace period, to the command's process group."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            _signal_group(process, signal.SIGTERM)
            with anyio.move_on_after(GRACE_S):
                await process.wait()
        _signal_group(process, signal.SIGKILL)
        await process.wait()


def last_sentence(stderr: bytes, argv: list[str], code: int | None) -> str:
    """The command's own one-sentence error (its last `diagnoser: ...` line), or what is known of its end."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines()]
    said = [line for line in lines if line.startswith("diagnoser: ")]
    if said:
        sentence = said[-1].removeprefix("diagnoser: ")
    elif code is not None and code < 0:
        sentence = f"diagnoser {argv[0]} was ended by signal {-code}."
    else:
        sentence = f"diagnoser {argv[0]} failed (exit {code}) without saying why."
    sentence = one_line(sentence)
    return sentence if len(sentence) <= MAX_SENTENCE else sentence[:MAX_SENTENCE - 3] + "..."


async def run_cli(argv: list[str], *, timeout_s: float, max_output_bytes: int,
                  ok_codes: tuple[int, ...] = (0,)) -> str:
    """The JSON document `diagnoser ARGV` prints, or ToolFailed with one sentence."""
    env = {k: v for k, v in os.environ.items() if k != "DIAGNOSER_DEBUG"}  # never a traceback
    env["PYTHONWARNINGS"] = "ignore"
    process = await anyio.open_process([sys.executable, "-m", "diagnoser", *argv], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                       start_new_session=True)
    _RUNNING.add(process.pid)
    out, err = _Read(bytearray()), _Read(bytearray())
    over = anyio.Event()
    timed_out = False
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal timed_out
                with anyio.move_on_after(timeout_s) as scope:
                    await over.wait()
                timed_out = scope.cancelled_caught
                await _end(process)

            tg.start_soon(watch)
            async with anyio.create_task_group() as readers:  # to the end of both pipes: every byte printed
                readers.start_soon(_drain, process.stdout, out, max_output_bytes, False, over)
                readers.start_soon(_drain, process.stderr, err, STDERR_KEEP, True, over)
            await process.wait()
            tg.cancel_scope.cancel()
    finally:
        await _end(process)  # cancelled (the client gave up) or done: nothing of it outlives the call
        _RUNNING.discard(process.pid)
    if out.over:
        raise ToolFailed(f"the result of {argv[0]} is over {max_output_bytes:,} bytes ([limits] max_output_bytes); "
                         "ask for less (one rule, fewer fleet rows, a narrower selection) or raise the limit.")
    if timed_out:
        raise ToolFailed(f"{argv[0]} did not finish within {timeout_s:g} s ([limits] timeout_s) and was stopped.")
    code = process.returncode
    if code not in ok_codes or not out.data.strip():
        raise ToolFailed(last_sentence(bytes(err.data), argv, code))
    return out.data.decode("utf-8").rstrip("\n")
