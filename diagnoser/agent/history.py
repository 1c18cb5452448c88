"""The agent's history: an embedded SQLite store of one row per diagnosis run.

Why SQLite in WAL mode: every run is one transaction, so a crash or `kill -9` mid-write leaves the store as it was
before that run (the write-ahead log is replayed or discarded on the next open) and nothing committed earlier is lost;
readers (`diagnoser history`) never block the agent. `synchronous=FULL` makes each commit durable against power loss
too; at one commit per target per interval that costs nothing.

The schema is versioned with `PRAGMA user_version`; `_MIGRATIONS[v]` upgrades version v to v + 1. A store written by
a newer diagnoser is refused rather than guessed at. Retention deletes rows older than an age, then the oldest rows
until the store's pages fit a size, and hands the freed pages back to the file system (auto_vacuum=INCREMENTAL).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.diagnosis import Verdict
from diagnoser.errors import InputError

SCHEMA_VERSION = 1
OK, ERROR, TIMEOUT = "ok", "error", "timeout"
_BUSY_TIMEOUT_MS = 10_000
_WAL_LIMIT_BYTES = 1 << 20

_SCHEMA_V1 = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    target TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    status TEXT NOT NULL,
    verdict TEXT,
    confidence REAL,
    efficiency REAL,
    top_fix TEXT,
    top_fix_rule TEXT NOT NULL DEFAULT '',
    top_fix_gain REAL,
    headline TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    gpu TEXT NOT NULL DEFAULT '',
    pod TEXT NOT NULL DEFAULT '',
    report_dir TEXT NOT NULL DEFAULT '',
    problems TEXT NOT NULL DEFAULT '[]',
    diagnosis BLOB
);
CREATE INDEX runs_target_time ON runs (target, started_at);
CREATE INDEX runs_time ON runs (started_at);
"""


def _create_v1(db: sqlite3.Connection) -> None:
    # One statement at a time: executescript() would COMMIT the migration's transaction half-way.
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            db.execute(statement)


# version -> function upgrading a store of that version by one; 0 is an empty file.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _create_v1}


@dataclass
class RunRecord:
    """One diagnosis run of one target: its verdict, or why there is none."""

    target: str
    started_at: float
    finished_at: float
    status: str  # ok | error | timeout
    verdict: str | None = None
    confidence: float | None = None
    efficiency: float | None = None  # theory.efficiency: achieved over the physical ceiling
    top_fix: str | None = None
    top_fix_rule: str = ""  # the rule code that proposed the top fix
    top_fix_gain: float | None = None
    headline: str = ""
    error: str = ""
    gpu: str = ""
    pod: str = ""
    report_dir: str = ""
    problems: list[str] = field(default_factory=list)  # sources that were down or unreadable
    diagnosis: dict[str, Any] | None = None
    id: int | None = None

    def summary(self) -> dict[str, Any]:
        """The row without the full diagnosis, for listings and JSON output."""
        return {k: v for k, v in self.__dict__.items() if k != "diagnosis"}


@dataclass
class PruneResult:
    by_age: int = 0
    by_size: int = 0


class HistoryStore:
    """Open (creating if asked) a history store; one connection, used from one thread at a time."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise InputError(f"no history store at {self.path}; the agent creates it on its first run "
                             "(diagnoser agent --once), or pass --db.")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the folder for the history store {self.path}: "
                             f"{exc.strerror or exc}.") from None
        if create:
            _make_private(self.path)
        try:
            self._db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                       check_same_thread=False)
            self._setup()
        except sqlite3.DatabaseError as exc:
            raise InputError(f"{self.path} is not a readable diagnoser history store: {exc}.") from None

    def _setup(self) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        # The version and the tables read in one snapshot: read apart, a store another process was creating could
        # show version 0 (before its commit) and its tables (after), and be taken for a database of something else.
        db.execute("BEGIN")
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        finally:
            db.execute("COMMIT")
        if version > SCHEMA_VERSION:
            raise InputError(f"{self.path} is a history store of schema version {version}, newer than this "
                             f"diagnoser reads (up to {SCHEMA_VERSION}); upgrade diagnoser.")
        if version == 0:
            if tables:
                raise InputError(f"{self.path} is an SQLite database of something else, not a diagnoser history "
                                 "store; pass another --db.")
            # Must precede the first table.
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = self._wal()
        if str(mode).lower() != "wal":
            raise InputError(f"{self.path}: the history store needs WAL journaling, which this file system "
                             f"refused (journal mode stays '{mode}').")
        db.execute("PRAGMA synchronous = FULL")
        # After a checkpoint the log is cut back to this, so the store on disk stays near its live size.
        db.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT_BYTES}")
        db.execute("PRAGMA foreign_keys = ON")
        while version < SCHEMA_VERSION:
            with self._transaction():
                # Re-read inside the write lock: another process may have migrated meanwhile.
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version >= SCHEMA_VERSION:
                    break
                _MIGRATIONS[version](db)
                db.execute(f"PRAGMA user_version = {version + 1}")
            version += 1
        if db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is None:
            raise InputError(f"{self.path} is an SQLite file but not a diagnoser history store (no runs table).")

    def _wal(self) -> str:
        """Switch to WAL journaling, which needs the file to itself: SQLite answers "locked" at once, without its
        busy wait, while another process holds it (creating the store too), so wait here, as long as the busy
        timeout allows."""
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() == "wal":
                    return str(mode)
                return str(self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # BEGIN IMMEDIATE takes the write lock up front, so two writers queue instead of failing mid-transaction.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing ---------------------------------------------------------------------------------------------

    def add(self, run: RunRecord) -> int:
        """Store one run in its own transaction; returns its id. Committed means it survives a crash."""
        blob = zlib.compress(json.dumps(run.diagnosis).encode(), 6) if run.diagnosis is not None else None
        row = (run.target, run.started_at, run.finished_at, run.status, run.verdict, run.confidence, run.efficiency,
               run.top_fix, run.top_fix_rule, run.top_fix_gain, run.headline, run.error, run.gpu, run.pod,
               run.report_dir, json.dumps(run.problems), blob)
        try:
            with self._transaction() as db:
                cur = db.execute(
                    "INSERT INTO runs (target, started_at, finished_at, status, verdict, confidence, efficiency, "
                    "top_fix, top_fix_rule, top_fix_gain, headline, error, gpu, pod, report_dir, problems, diagnosis) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.Error as exc:
            raise InputError(f"cannot write to the history store {self.path}: {exc}.") from None
        run.id = int(cur.lastrowid or 0)
        return run.id

    def prune(self, *, max_age_s: float | None, max_bytes: int | None, now: float | None = None) -> PruneResult:
        """Delete runs older than max_age_s, then the oldest runs until the live pages fit max_bytes, and
        checkpoint the write-ahead log (so the files on disk are about the live size; called once per cycle).

        The newest run is always kept, however large, so `diagnoser history` never goes blank.
        """
        now = time.time() if now is None else now
        result = PruneResult()
        try:
            if max_age_s is not None:
                with self._transaction() as db:
                    row = db.execute("SELECT id FROM runs ORDER BY started_at DESC, id DESC LIMIT 1").fetchone()
                    newest = row[0] if row else None
                    result.by_age = db.execute("DELETE FROM runs WHERE started_at < ? AND id != ?",
                                               (now - max_age_s, newest or -1)).rowcount
            if max_bytes is not None:
                while self.live_bytes() > max_bytes:
                    with self._transaction() as db:
                        count = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
                        if count <= 1:
                            break
                        # A tenth at a time: a few rounds converge without deleting far more than needed.
                        batch = max(1, min(count - 1, count // 10))
                        result.by_size += db.execute(
                            "DELETE FROM runs WHERE id IN (SELECT id FROM runs ORDER BY started_at, id LIMIT ?)",
                            (batch,)).rowcount
            if result.by_age or result.by_size:
                # execute() would step the pragma once and free one page; executescript() runs it to the end.
                self._db.executescript("PRAGMA incremental_vacuum;")
            # Fold the write-ahead log into the file and empty it (a reader in the way just leaves it for later).
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            raise InputError(f"cannot prune the history store {self.path}: {exc}.") from None
        return result

    # --- reading ---------------------------------------------------------------------------------------------

    def live_bytes(self) -> int:
        """Bytes of pages holding data (the file shrinks to this after the freed pages are vacuumed)."""
        page_size = self._db.execute("PRAGMA page_size").fetchone()[0]
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * page_size)

    def file_bytes(self) -> int:
        """The store's size on disk: the database file and its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += Path(str(self.path) + suffix).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def integrity_ok(self) -> bool:
        return self._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    def runs(self, *, target: str | None = None, since: float | None = None, limit: int | None = None,
             with_diagnosis: bool = False, newest_first: bool = False) -> list[RunRecord]:
        where: list[str] = []
        args: list[object] = []
        if target is not None:
            where.append("target = ?")
            args.append(target)
        if since is not None:
            where.append("started_at >= ?")
            args.append(since)
        columns = ("id, target, started_at, finished_at, status, verdict, confidence, efficiency, top_fix, "
                   "top_fix_rule, top_fix_gain, headline, error, gpu, pod, report_dir, problems, "
                   + ("diagnosis" if with_diagnosis else "NULL"))
        sql = f"SELECT {columns} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at DESC, id DESC" if newest_first else " ORDER BY started_at, id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        try:
            rows = self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise InputError(f"cannot read the history store {self.path}: {exc}.") from None
        return [_record(r) for r in rows]

    def report_dirs(self) -> set[str]:
        """The report folders the stored runs name."""
        try:
            return {r[0] for r in self._db.execute("SELECT DISTINCT report_dir FROM runs WHERE report_dir != ''")}
        except sqlite3.Error as exc:
            raise InputError(f"cannot read the history store {self.path}: {exc}.") from None

    def targets(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT DISTINCT target FROM runs ORDER BY target")]

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def last_verdict(self, target: str, *, include_inconclusive: bool = True) -> str | None:
        """The verdict of the target's newest successful run (optionally skipping inconclusive ones)."""
        sql = "SELECT verdict FROM runs WHERE target = ? AND status = ? AND verdict IS NOT NULL"
        if not include_inconclusive:
            sql += " AND verdict != ?"
        params = (target, OK) if include_inconclusive else (target, OK, Verdict.INCONCLUSIVE.value)
        try:
            row = self._db.execute(sql + " ORDER BY started_at DESC, id DESC LIMIT 1", params).fetchone()
        except sqlite3.Error as exc:
            raise InputError(f"cannot read the history store {self.path}: {exc}.") from None
        return row[0] if row else None


def _make_private(path: Path) -> None:
    """Create the store (and its -wal and -shm files, which SQLite creates with the database file's mode) readable
    by its owner only: runs hold command lines, pod names and verdicts. A store an older version left 0644 is made
    private too; one we do not own is left as it is (the open then says whether it can be used)."""
    for suffix in ("", "-wal", "-shm"):
        name = Path(str(path) + suffix)
        try:
            if suffix == "":
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600))
            if name.exists() and name.stat().st_uid == os.geteuid() and name.stat().st_mode & 0o077:
                os.chmod(name, 0o600)
        except OSError:
            continue  # no permission: sqlite3.connect says so in its own words


def _record(row: tuple[Any, ...]) -> RunRecord:
    (id_, target, started, finished, status, verdict, conf, eff, fix, fix_rule, gain, headline, error, gpu, pod,
     report, problems, blob) = row
    try:
        diagnosis = json.loads(zlib.decompress(blob)) if blob is not None else None
    except (zlib.error, ValueError):
        diagnosis = None  # one damaged blob must not hide the rest of the timeline
    return RunRecord(id=id_, target=target, started_at=started, finished_at=finished, status=status, verdict=verdict,
                     confidence=conf, efficiency=eff, top_fix=fix, top_fix_rule=fix_rule or "", top_fix_gain=gain,
                     headline=headline, error=error, gpu=gpu, pod=pod, report_dir=report,
                      problems=json.loads(problems or "[]"), diagnosis=diagnosis)


@dataclass
class Segment:
    """Consecutive runs of one target with the same outcome: a verdict, or 'error'/'timeout'."""

    target: str
    outcome: str
    first_at: float
    last_at: float
    runs: int
    confidence_mean: float | None
    last: RunRecord

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "outcome": self.outcome, "first_at": self.first_at, "last_at": self.last_at,
                "runs": self.runs, "confidence_mean": self.confidence_mean, "last": self.last.summary()}


def outcome(run: RunRecord) -> str:
    return (run.verdict or "unknown") if run.status == OK else run.status


def segments(runs: list[RunRecord]) -> list[Segment]:
    """The timeline of one target's runs (oldest first) as spans of the same outcome."""
    out: list[Segment] = []
    confidences: list[float] = []
    for run in runs:
        if out and out[-1].outcome == outcome(run) and out[-1].target == run.target:
            seg = out[-1]
            seg.last_at, seg.runs, seg.last = run.started_at, seg.runs + 1, run
        else:
            confidences = []
            seg = Segment(run.target, outcome(run), run.started_at, run.started_at, 1, None, run)
            out.append(seg)
        if run.confidence is not None and run.status == OK:
            confidences.append(run.confidence)
            seg.confidence_mean = round(sum(confidences) / len(confidences), 3)
    return out
