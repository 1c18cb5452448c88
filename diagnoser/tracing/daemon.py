"""Kineto's on-demand (daemon) mode: a process started with KINETO_USE_DAEMON=1 registers with a local dynolog
daemon, and `dyno gputrace` asks it for a duration-based trace (inference servers have no optimizer step for the
iteration-based mode). See shared/research/data-sources.md §5.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from diagnoser.errors import SourceUnavailable
from diagnoser.tracing.endpoints import environ_of, wait_for_traces
from diagnoser.tracing.hook_client import process_tree

DYNO_HOWTO = ("install dynolog, run `dynolog --enable_ipc_monitor` on this host, and keep the server started with "
              "KINETO_USE_DAEMON=1")


def daemon_pids(pid: int) -> list[int]:
    """Processes of the target started with KINETO_USE_DAEMON=1 (readable environments only)."""
    return [p for p in process_tree(pid) if environ_of(p).get("KINETO_USE_DAEMON", "") not in ("", "0")]


def trace_via_daemon(pids: list[int], seconds: float, out_dir: Path) -> list[Path]:
    dyno = shutil.which("dyno")
    if dyno is None:
        raise SourceUnavailable(f"process {pids[0]} runs with KINETO_USE_DAEMON=1 but the `dyno` command is not on "
                                f"PATH: {DYNO_HOWTO}.")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = (out_dir / f"kineto-trace-{stamp}").resolve()
    dest.mkdir()
    log_file = dest / "trace.json"
    cmd = [dyno, "gputrace", "--pids", ",".join(map(str, pids)), "--duration-ms", str(int(seconds * 1000)),
           "--log-file", str(log_file), "--record-shapes"]
    since = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"`dyno gputrace` did not run: {exc}.") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SourceUnavailable(f"`dyno gputrace` failed ({last[0]}): {DYNO_HOWTO}.")
    # libkineto writes <stem>_<pid>.json per process once the window ends.
    files = wait_for_traces(dest, since, timeout=seconds + 120)
    if not files:
        raise SourceUnavailable(f"dynolog accepted the request but no trace appeared in {dest}; is the server "
                                "registered with the daemon (its log says 'Registering daemon config loader')?")
    return files
