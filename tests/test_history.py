"""The history store: rows in and out, retention by age and size, schema versions, refusal of foreign files, and
`kill -9` in the middle of writes (a real process killed at random moments; the store must open with everything
it had committed)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diagnoser.agent.history import ERROR, OK, SCHEMA_VERSION, HistoryStore, RunRecord, segments
from diagnoser.cli.app import app
from diagnoser.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def _run(target: str, t: float, verdict: str | None = "batching", status: str = OK, **kw: object) -> RunRecord:
    return RunRecord(target=target, started_at=t, finished_at=t + 10, status=status, verdict=verdict,
                     confidence=0.7 if verdict else None, **kw)  # type: ignore[arg-type]


def test_rows_round_trip(tmp_path: Path) -> None:
    diagnosis = {"verdict": "vram", "findings": [{"code": "VRAM001"}], "headline": "VRAM-limited: ..."}
    with HistoryStore(tmp_path / "h.db") as store:
        first = store.add(_run("a", 100.0, "vram", efficiency=0.42, top_fix="Store the KV cache in FP8",
                               top_fix_rule="VRAM001", top_fix_gain=1.6, gpu="0,1", pod="ns/llama-0",
                               report_dir="/r/a/1", problems=["nvml: no driver"], diagnosis=diagnosis))
        store.add(_run("a", 200.0, status=ERROR, verdict=None, error="no process with PID 7 is running."))
        store.add(_run("b", 150.0, "compute"))
        assert store.count() == 3 and store.targets() == ["a", "b"]
        a1, a2 = store.runs(target="a", with_diagnosis=True)
        assert a1.id == first and a1.diagnosis == diagnosis and a1.problems == ["nvml: no driver"]
        assert (a1.efficiency, a1.top_fix_rule, a1.top_fix_gain, a1.gpu, a1.pod) == (0.42, "VRAM001", 1.6, "0,1",
                                                                                       "ns/llama-0")
        assert a2.status == ERROR and a2.error.startswith("no process") and a2.diagnosis is None
        assert [r.target for r in store.runs(since=150.0)] == ["b", "a"]
        assert [r.started_at for r in store.runs(newest_first=True, limit=2)] == [200.0, 150.0]
        # The last verdict skips failed runs; it can skip inconclusive ones too.
        assert store.last_verdict("a") == "vram"
        store.add(_run("a", 300.0, "inconclusive"))
        assert store.last_verdict("a") == "inconclusive"
        assert store.last_verdict("a", include_inconclusive=False) == "vram"
        assert store.last_verdict("nobody") is None
        assert store.integrity_ok()
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_retention_by_age_keeps_recent_rows(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    with HistoryStore(tmp_path / "h.db") as store:
        for day in range(10):
            store.add(_run("a", now - day * 86400 - 1))
        pruned = store.prune(max_age_s=3 * 86400, max_bytes=None, now=now)
        assert pruned.by_age == 7 and store.count() == 3
        assert min(r.started_at for r in store.runs()) > now - 3 * 86400
        # Even when everything is old, the newest run stays so `history` is never blank.
        pruned = store.prune(max_age_s=1, max_bytes=None, now=now + 10 * 86400)
        assert store.count() == 1 and store.runs()[0].started_at == now - 1


def test_retention_by_size_shrinks_the_file(tmp_path: Path) -> None:
    rng = random.Random(1)
    # Incompressible diagnoses, so the store really grows: ~20 KB per run.
    blob = {"noise": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(30000))}
    path = tmp_path / "h.db"
    with HistoryStore(path) as store:
        for i in range(200):
            store.add(_run("a", 1000.0 + i, diagnosis=blob))
        store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        big = path.stat().st_size
        assert big > 3 << 20
        pruned = store.prune(max_age_s=None, max_bytes=1 << 20)
        assert pruned.by_size > 100 and store.live_bytes() <= 1 << 20
        kept = store.runs()
        # The oldest went first; what is left is the newest, in order.
        assert [r.started_at for r in kept] == [1000.0 + i for i in range(200 - len(kept), 200)]
        assert path.stat().st_size < big / 2  # freed pages went back to the file system
        assert store.file_bytes() < big / 2 and store.integrity_ok()


def test_housekeeping_empties_the_write_ahead_log(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    with HistoryStore(path) as store:
        for i in range(100):
            store.add(_run("a", float(i), diagnosis={"noise": os.urandom(20000).hex()}))
        wal = Path(str(path) + "-wal")
        assert wal.stat().st_size > 0  # the log holds the latest writes (cut back to 1 MiB at autocheckpoints)
        store.prune(max_age_s=None, max_bytes=None)  # nothing to delete; the log is still folded in
        assert wal.stat().st_size == 0 and store.count() == 100
        assert store.file_bytes() <= store.live_bytes() + 4096


def test_refuses_newer_schema_and_foreign_files(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    HistoryStore(newer).close()
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(InputError, match="newer than this diagnoser reads"):
        HistoryStore(newer)

    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (x TEXT)")
    db.commit()
    db.close()
    with pytest.raises(InputError, match="SQLite database of something else"):
        HistoryStore(other)

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(InputError, match="not a readable diagnoser history store"):
        HistoryStore(garbage)

    with pytest.raises(InputError, match="no history store at"):
        HistoryStore(tmp_path / "missing.db", create=False)
    assert not (tmp_path / "missing.db").exists()


def test_a_store_opened_while_another_process_creates_it(tmp_path: Path) -> None:
    """`diagnoser history` (or a second agent) opening the store while the agent creates it: the opener migrated the
    empty file first, and the creator then read version 0 before the commit and the new tables after it, and called
    its own store "an SQLite database of something else" (seen once in CI, under SIGTERM tests); or it failed with
    "database is locked", which SQLite answers at once, without its busy wait, to a journal-mode change."""
    import threading

    failures: list[BaseException] = []
    for i in range(60):
        path = tmp_path / f"h{i}.db"

        def opener(path: Path = path) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if not path.exists():
                    time.sleep(0)  # let the creator run
                    continue
                try:
                    with HistoryStore(path, create=False):
                        return
                except InputError as exc:
                    if "no history store" not in str(exc):
                        failures.append(exc)
                        return

        thread = threading.Thread(target=opener)
        thread.start()
        try:
            with HistoryStore(path, create=True) as store:
                assert store.integrity_ok()
        except InputError as exc:
            failures.append(exc)
        thread.join(60)
    assert not failures, failures[:3]


def test_schema_version_is_recorded(tmp_path: Path) -> None:
    HistoryStore(tmp_path / "h.db").close()
    db = sqlite3.connect(tmp_path / "h.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental


def test_segments_make_a_timeline() -> None:
    runs = [_run("a", 1, "batching"), _run("a", 2, "batching"), _run("a", 3, status=ERROR, verdict=None),
            _run("a", 4, "vram"), _run("a", 5, "vram"), _run("a", 6, "vram")]
    segs = segments(runs)
    assert [(s.outcome, s.runs, s.first_at, s.last_at) for s in segs] == \
        [("batching", 2, 1, 2), ("error", 1, 3, 3), ("vram", 3, 4, 6)]
    assert segs[0].confidence_mean == 0.7 and segs[1].confidence_mean is None


# --- kill -9 mid-write ---------------------------------------------------------------------------------------

# Writes rows as fast as it can (big diagnoses, so a kill often lands inside a transaction), prunes now and then
# (deletes and vacuums are writes too), and prints each id once its commit returned.
_WRITER = r"""
import json, os, random, sys, time
from diagnoser.agent.history import HistoryStore, RunRecord
store = HistoryStore(sys.argv[1])
rng = random.Random(os.getpid())
i = 0
while True:
    i += 1
    noise = os.urandom(rng.randint(500, 30000)).hex()  # cheap to make: most time is spent writing
    now = time.time()  # increasing across writers too, so pruning by age order is pruning by id order
    run = RunRecord(target=f"t{i % 3}", started_at=now, finished_at=now + 1, status="ok",
                    verdict="vram", confidence=0.5, diagnosis={"noise": noise})
    rid = store.add(run)
    print(rid, flush=True)
    if i % 25 == 0:
        store.prune(max_age_s=None, max_bytes=8 << 20)
"""


def _written_ids(proc: subprocess.Popen[str]) -> set[int]:
    assert proc.stdout is not None
    return {int(line) for line in proc.stdout.read().split()}


@pytest.mark.slow
def test_kill_9_during_writes_loses_nothing_committed(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    committed: set[int] = set()
    for round_ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                                env=env)
        # Let it write for a while (it must have committed something), then kill it with no warning.
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.strip(), f"writer produced nothing (exit {proc.poll()})"
        committed.add(int(first))
        time.sleep(rng.uniform(0.2, 1.0))
        assert time.monotonic() < deadline
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        committed |= _written_ids(proc)
        with HistoryStore(path) as store:
            assert store.integrity_ok(), f"store damaged after kill #{round_ + 1}"
            present = {r.id for r in store.runs()}
            # Rows pruned by size are gone on purpose; every other committed row must be there.
            pruned_floor = min(present) if present else 0
            missing = {i for i in committed if i >= pruned_floor} - present
            assert not missing, f"kill #{round_ + 1} lost committed rows {sorted(missing)[:5]}"
            # The newest committed row is always there (pruning never takes the newest).
            assert max(committed) in present
            # And the store takes new rows after the crash.
            store.add(_run("after-crash", time.time()))


@pytest.mark.slow
def test_reader_sees_rows_while_the_agent_writes(tmp_path: Path) -> None:
    """`diagnoser history` reads while a writer is busy: WAL readers neither block nor see half a row."""
    path = tmp_path / "h.db"
    HistoryStore(path).close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        seen = 0
        for _ in range(20):
            result = CliRunner().invoke(app, ["history", "--db", str(path), "--since", "0", "--json"])
            assert result.exit_code == 0, result.output
            data = json.loads(result.output)
            now = sum(len(t["runs"]) for t in data["targets"].values())
            assert now >= 1
            seen = max(seen, now)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    assert seen >= 1


def test_history_command(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    now = time.time()
    with HistoryStore(path) as store:
        for i, verdict in enumerate(["batching", "batching", "vram"]):
            store.add(_run("llama", now - 3600 + i * 60, verdict, top_fix="Raise max_num_seqs", top_fix_gain=1.8))
        store.add(_run("llama", now - 3400, status=ERROR, verdict=None, error="no process with PID 7 is running."))
        store.add(_run("old", now - 40 * 86400, "compute"))
    runner = CliRunner()
    result = runner.invoke(app, ["history", "--db", str(path)])
    assert result.exit_code == 0, result.output
    assert "llama" in result.output and "batching" in result.output and "vram" in result.output
    assert "old" not in result.output  # older than the default --since 7d
    result = runner.invoke(app, ["history", "--db", str(path), "--json", "--target", "llama"])
    data = json.loads(result.output)
    timeline = data["targets"]["llama"]["timeline"]
    assert [(s["outcome"], s["runs"]) for s in timeline] == [("batching", 2), ("vram", 1), ("error", 1)]
    assert len(data["targets"]["llama"]["runs"]) == 4
    result = runner.invoke(app, ["history", "--db", str(path), "--since", "60d", "--runs", "--target", "old"])
    assert result.exit_code == 0 and "compute" in result.output
    result = runner.invoke(app, ["history", "--db", str(tmp_path / "none.db")])
    assert result.exit_code == 2 and "no history store at" in result.output
    result = runner.invoke(app, ["history", "--db", str(path), "--since", "whenever"])
    assert result.exit_code == 2 and "--since must be a duration" in result.output
