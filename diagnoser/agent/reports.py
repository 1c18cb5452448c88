"""Reports of past runs on disk: one folder per run, the newest N kept per target.

    <reports dir>/<target>/<UTC stamp>/capture.dgc      the capture (the ground truth; `diagnoser diagnose` reads it)
                                       diagnosis.json   the diagnosis as `diagnose --json` prints it
                                       report.html      the HTML report, when wanted

A run is assembled in a hidden `.partial-*` folder and renamed into place when complete, and each file in it is
written to a temporary name, flushed and renamed, so a crash or kill leaves either a complete run folder or none.
Rotation removes the oldest complete folders beyond `keep` and any `.partial-*` left by a killed run; at start the
agent sweeps complete folders that no history row names (the agent was killed between a worker's rename and the
row's commit).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from diagnoser.errors import InputError

_PARTIAL = ".partial-"
_STAMP = re.compile(r"^\d{8}T\d{6}Z(-\d+)?$")


def target_slug(target: str) -> str:
    """A folder name for a target name: path separators and odd characters become '-'."""
    slug = re.sub(r"[^A-Za-z0-9_.@-]+", "-", target).strip("-.")
    return slug[:120] or "target"


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the folder holding it is synced.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class RunReports:
    """The reports folder of the agent."""

    def __init__(self, root: str | Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep

    def target_dir(self, target: str) -> Path:
        return self.root / target_slug(target)

    def staging(self, target: str) -> Path:
        """A fresh hidden folder to assemble one run in."""
        folder = self.target_dir(target)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=folder))
        except OSError as exc:
            raise InputError(f"cannot create a report folder under {folder}: {exc.strerror or exc}.") from None

    def finalize(self, staging: Path, started_at: float) -> Path:
        """Rename a complete staging folder to its UTC start stamp (with -2, -3... if that second is taken)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_at))
        final = staging.parent / stamp
        n = 1
        while final.exists():
            n += 1
            final = staging.parent / f"{stamp}-{n}"
        try:
            os.chmod(staging, 0o755)  # mkdtemp made it private; the finished run is as readable as the rest
            os.rename(staging, final)
        except OSError as exc:
            raise InputError(f"cannot finish the report folder {final}: {exc.strerror or exc}.") from None
        _fsync_dir(staging.parent)
        return final

    def runs(self, target: str) -> list[Path]:
        """Complete run folders of a target, oldest first."""
        folder = self.target_dir(target)
        if not folder.is_dir():
            return []
        found = [p for p in folder.iterdir() if p.is_dir() and _STAMP.match(p.name)]
        return sorted(found, key=_stamp_key)

    def rotate(self, target: str, *, busy: Path | None = None) -> list[Path]:
        """Remove run folders beyond `keep` (oldest first) and stale staging folders; returns what was removed.

        `busy` is a staging folder still being written (never removed)."""
        removed: list[Path] = []
        folder = self.target_dir(target)
        if not folder.is_dir():
            return removed
        for p in folder.iterdir():
            if p.name.startswith(_PARTIAL) and p != busy:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        complete = self.runs(target)
        excess = len(complete) - self.keep
        for p in complete[:max(0, excess)]:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        return removed


    def all_runs(self) -> list[Path]:
        """Complete run folders of every target under the root (the folders `finalize` names)."""
        if not self.root.is_dir():
            return []
        return [run for folder in self.root.iterdir() if folder.is_dir() and not folder.is_symlink()
                for run in folder.iterdir() if run.is_dir() and not run.is_symlink() and _STAMP.match(run.name)]

    def sweep(self, recorded: set[str]) -> list[Path]:
        """Remove complete run folders that no history row names (`recorded`: the rows' report_dir values).

        A worker renames its folder into place before the agent stores the run's row; an agent killed between the
        two (kill -9, a power cut) leaves a report the history does not know, which rotation would count against
        `keep` and `diagnoser history` would never show. Called once at start, before any worker runs."""
        known = {os.path.realpath(p) for p in recorded if p}
        removed = []
        for run in self.all_runs():
            if os.path.realpath(run) not in known:
                shutil.rmtree(run, ignore_errors=True)
                removed.append(run)
        return removed


def _stamp_key(p: Path) -> tuple[str, int]:
    stamp, _, n = p.name.partition("-")
    return stamp, int(n) if n else 1
