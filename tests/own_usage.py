"""A command's own CPU time and peak RSS, for the tests and benchmarks that report them.

The kernel's ru_maxrss survives fork and exec: a `python -c pass` started by a process that once held 600 MB reports
611 MiB. A command started directly by a test (hundreds of MiB late in a full run) or a benchmark (which may have built
a large trace or held a fleet's series) would report its parent's peak. So the command runs as the only child of a
small interpreter that waits for it with wait4 and writes the command's own usage to a file. This adds the start of
one bare interpreter (about 0.03 s) to the wall time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_USAGE_OF = ("import json, os, subprocess, sys\n"
             "proc = subprocess.Popen(sys.argv[2:])\n"
             "_, status, u = os.wait4(proc.pid, 0)\n"
             "json.dump({'user_s': u.ru_utime, 'sys_s': u.ru_stime, 'maxrss_kib': u.ru_maxrss}, open(sys.argv[1], 'w'))\n"
             "sys.exit(os.waitstatus_to_exitcode(status))\n")


@dataclass(frozen=True)
class Usage:
    user_s: float
    sys_s: float
    peak_rss_mib: float

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


def start(cmd: list[str], usage_file: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """Start `cmd` under the small interpreter, in a session of its own so that `kill` reaches both."""
    return subprocess.Popen([sys.executable, "-c", _USAGE_OF, str(usage_file), *cmd], start_new_session=True,
                            **popen)


def kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command and the interpreter waiting for it (a command past its time limit)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def read(usage_file: Path) -> Usage | None:
    """The command's usage, or None when it was killed before it ended (nothing was written)."""
    try:
        u = json.loads(usage_file.read_text())
    except (OSError, ValueError):
        return None
    return Usage(user_s=u["user_s"], sys_s=u["sys_s"], peak_rss_mib=u["maxrss_kib"] / 1024)
