"""How long `diagnoser` takes to start: import time of the commands a user types most, against a bare interpreter.

Each command runs in a fresh interpreter with `python -X importtime`; the import time is the sum of the top-level
imports' cumulative times (what the interpreter spent importing before the command did any work). Goal (issue: a CLI
that starts at once): `--help`, `rules` and `diagnose --help` under 0.3 s of import time. Reported with the machine's
load, median of N runs, interleaved, and as a ratio to the bare interpreter measured in the same run.

    python benchmarks/cli_start.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.installed import compile_bytecode

COMMANDS = {
    "bare interpreter": ["-c", "pass"],
    "diagnoser --version": ["-m", "diagnoser", "--version"],
    "diagnoser --help": ["-m", "diagnoser", "--help"],
    "diagnoser rules": ["-m", "diagnoser", "rules"],
    "diagnoser rules BW001": ["-m", "diagnoser", "rules", "BW001"],
    "diagnoser diagnose --help": ["-m", "diagnoser", "diagnose", "--help"],
    "diagnoser analyze --help": ["-m", "diagnoser", "analyze", "--help"],
}
GOAL_S = 0.3


def import_seconds(args: list[str]) -> tuple[float, float]:
    """(import time, wall time) of one run, in seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - started
    total_us = 0
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue  # the header line
        name = parts[2]
        if len(name) - len(name.lstrip()) == 1:  # a top-level import: nested ones are in its cumulative time
            total_us += int(parts[1])
    return total_us / 1e6, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    compile_bytecode()  # as an installed package starts, not a checkout compiling itself each time
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in COMMANDS}
    for _ in range(runs):  # interleaved, so a load change hits every command alike
        for name, args in COMMANDS.items():
            times[name].append(import_seconds(args))
    load = os.getloadavg()
    print(f"{runs} runs each, interleaved; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} CPUs")
    bare = statistics.median(w for _, w in times["bare interpreter"])
    print(f"{'command':<28} {'imports (s)':>12} {'wall (s)':>9} {'wall / bare':>12}  goal")
    for name, samples in times.items():
        imp = statistics.median(i for i, _ in samples)
        wall = statistics.median(w for _, w in samples)
        goal = "" if name in ("bare interpreter", "diagnoser analyze --help") else \
            ("met" if imp < GOAL_S else "NOT met")
        print(f"{name:<28} {imp:>12.3f} {wall:>9.3f} {wall / bare:>12.2f}  {goal}")


if __name__ == "__main__":
    main()
