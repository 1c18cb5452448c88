"""Reports of past runs on disk: one folder per run, the newest N kept per target.

    <reports dir>/<target>/<UTC stamp>/capture.dgc      the capture (the ground truth; `diagnoser diagnose` reads it)
                                       diagnosis.json   the diagnosis as `diagnose --json` prints it
                                       report.html      the HTML report, when wanted

A run is assembled in a hidden `.partial-*` folder and renamed into place when complete, and each file in it is
written to a temporary name, flushed and renamed, so a crash or kill leaves either a complete run folder or none.
Rotation removes the oldest complete folders beyond `keep` and any `.partial-*` left by a killed run; at start the
agent sweeps complete folders that no history row names (the agent was killed between a worker's rename and the
row's commit).

Modes: files 0600 and folders 0700 (what the history and captures get: runs hold command lines, pods and verdicts)
unless `[reports] mode` says otherwise; a folder gets an execute bit for each read bit of the file mode. The reports
folder belongs to one history: a marker file in it names the history, and a second history is refused rather than
let its sweep or rotation delete the first's folders.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from diagnoser.errors import InputError

_PARTIAL = ".partial-"
_STAMP = re.compile(r"^\d{8}T\d{6}Z(-\d+)?$")
DEFAULT_MODE = 0o600
# In the reports folder: the history (resolved path) whose runs it holds.
OWNER_FILE = ".diagnoser-history"


def dir_mode(file_mode: int) -> int:
    """The folder mode that goes with a file mode: an execute (search) bit for each read bit."""
    return file_mode | ((file_mode & 0o444) >> 2)


def _disk_error(exc: BaseException) -> OSError | None:
    """The OSError behind an error (itself, or what a one-sentence error was raised from)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def write_error(doing: str, exc: BaseException) -> str:
    """One sentence for a write that failed ("cannot " + `doing`): a full disk (or quota) said as such, else the
    system's reason. `exc` is the OSError, or a one-sentence error raised while handling one (capture.save's)."""
    os_error = _disk_error(exc)
    code = os_error.errno if os_error is not None else None
    if code == errno.ENOSPC:
        return f"the disk is full (no space left on the device): cannot {doing}."
    if code == errno.EDQUOT:
        return f"the disk quota is used up: cannot {doing}."
    if os_error is None:
        return str(exc).rstrip(".") + "."
    return f"cannot {doing}: {os_error.strerror or os_error}."


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

    def __init__(self, root: str | Path, keep: int, mode: int = DEFAULT_MODE) -> None:
        self.root = Path(root)
        self.keep = keep
        self.mode = mode

    @property
    def dir_mode(self) -> int:
        return dir_mode(self.mode)

    def target_dir(self, target: str) -> Path:
        return self.root / target_slug(target)

    def _make_dir(self, folder: Path) -> None:
        """Create a folder (and the missing ones above it, up to the root) with the reports' folder mode; one that
        exists is left as it is (an operator may have opened it on purpose)."""
        missing = []
        here = folder
        while not here.exists() and here != here.parent:
            missing.append(here)
            here = here.parent
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                continue  # another worker made it just now
            os.chmod(path, self.dir_mode)  # mkdir's mode is cut by the umask; this is exact

    def claim(self, history: str | Path) -> bool:
        """Make the reports folder this history's (a marker names it); False when it was not yet (a new folder, or
        one an older version wrote without a marker). Raises InputError when it belongs to another history that
        still exists: that history's sweep and rotation would remove this one's folders, and this one's the other's."""
        mine = os.path.realpath(history)
        marker = self.root / OWNER_FILE
        try:
            owner = marker.read_text().strip()
        except FileNotFoundError:
            owner = ""
        except OSError as exc:
            raise InputError(f"cannot read {marker}: {exc.strerror or exc}.") from None
        if owner == mine:
            return True
        if owner and os.path.exists(owner):
            raise InputError(f"the reports folder {self.root} holds the runs of the history {owner}; give the "
                             f"history {mine} its own reports folder ([reports] dir or --reports-dir).")
        from diagnoser.fileio import write_atomic

        try:
            self._make_dir(self.root)
            write_atomic(marker, (mine + "\n").encode(), mode=self.mode)
        except OSError as exc:
            raise InputError(write_error(f"write {marker}", exc)) from None
        return False

    def staging(self, target: str) -> Path:
        """A fresh hidden folder to assemble one run in."""
        folder = self.target_dir(target)
        try:
            self._make_dir(folder)
            return Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=folder))
        except OSError as exc:
            raise InputError(write_error(f"create a report folder under {folder}", exc)) from None

    def finalize(self, staging: Path, started_at: float) -> Path:
        """Rename a complete staging folder to its UTC start stamp (with -2, -3... if that second is taken)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_at))
        final = staging.parent / stamp
        n = 1
        while final.exists():
            n += 1
            final = staging.parent / f"{stamp}-{n}"
        try:
            # Every file gets the reports' mode, whoever wrote it (the capture is saved 0600, the HTML 0644).
            for item in staging.iterdir():
                if item.is_file() and not item.is_symlink():
                    os.chmod(item, self.mode)
            os.chmod(staging, self.dir_mode)
            os.rename(staging, final)
        except OSError as exc:
            raise InputError(write_error(f"finish the report folder {final}", exc)) from None
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
