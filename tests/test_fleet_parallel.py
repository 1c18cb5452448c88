"""The fleet's triage in forked worker processes: the same rows as one process makes, diagnoses kept packed until
something reads them, and a worker that dies costing only time."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import msgspec
import pytest

from diagnoser.capture import Unavailable
from diagnoser.diagnosis import Diagnosis, Verdict
from diagnoser.fleet import run as fleet
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.fleet.pack import PackedDiagnosis, RowPacker, unpack_rows
from diagnoser.fleet.run import diagnosis_dict, gc_paused, iter_report_json, triage_rows
from diagnoser.reports.model import build_fleet_view
from tests.test_fleet_units import PLANTED, _stats

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the triage workers are forked")


def _fleet(n: int) -> Any:
    """n GPUs, the planted classes in turn, each GPU's activity moved a little so no two diagnoses are equal."""
    names = list(PLANTED)
    rnd = random.Random(7)
    profiles = []
    for i in range(n):
        p = dict(PLANTED[names[i % len(names)]][0])
        for k in p:
            if k.endswith("active.avg"):
                p[k] = min(1.0, max(0.0, p[k] + rnd.uniform(-0.02, 0.02)))
        profiles.append(p)
    return _stats(profiles)


def _json(rows: list[FleetRow]) -> bytes:
    report = FleetReport(source="http://prometheus:9090", window_start=1e9, window_end=1e9 + 3600, rows=rows)
    return b"".join(iter_report_json(report, {}))


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON: msgpack gives lists where to_builtins keeps a dataclass's tuples."""
    return msgspec.json.encode(a) == msgspec.json.encode(b)


@pytest.fixture(scope="module")
def one_and_two() -> tuple[list[FleetRow], Any, list[FleetRow], Any]:
    stats = _fleet(250)
    with gc_paused():
        alone, t1 = triage_rows(stats, processes=1)
        forked, t2 = triage_rows(stats, processes=3, chunk=40)  # this process and two workers
    return alone, t1, forked, t2


def test_workers_make_the_rows_one_process_makes(one_and_two) -> None:  # type: ignore[no-untyped-def]
    alone, t1, forked, t2 = one_and_two
    assert t1.processes == 1 and t2.processes == 3
    packed = sum(isinstance(r.diagnosis, PackedDiagnosis) for r in forked)
    assert 0 < packed < len(forked)  # the workers' rows packed, this process's not
    assert not any(isinstance(r.diagnosis, PackedDiagnosis) for r in alone)
    assert [(r.uuid, r.gpu) for r in forked] == [(r.uuid, r.gpu) for r in alone]  # same order, most at stake first
    assert t2.spec_clock_models == t1.spec_clock_models == {"NVIDIA H100 80GB HBM3"}  # merged from the workers
    assert _json(forked) == _json(alone)  # --json: byte for byte
    for a, f in zip(alone, forked, strict=True):
        assert dataclasses.replace(f, diagnosis=a.diagnosis) == a  # every field of the row
        assert f.diagnosis.verdict == a.diagnosis.verdict and f.diagnosis.confidence == a.diagnosis.confidence
        assert f.diagnosis.limiter is a.diagnosis.limiter
        assert f.diagnosis.confidence_label == a.diagnosis.confidence_label


def test_the_verdicts_and_the_table_need_no_unpacking(one_and_two) -> None:  # type: ignore[no-untyped-def]
    from io import StringIO

    from rich.console import Console

    from diagnoser.cli.fleet import render_fleet

    _, _, forked, _ = one_and_two
    report = FleetReport(source="http://prometheus:9090", window_start=1e9, window_end=1e9 + 3600, rows=forked)
    out = StringIO()
    render_fleet(report, Console(file=out, width=80, no_color=True), groups=fleet.group_rows(forked, "node"))
    assert "Verdicts: " in out.getvalue()
    assert all(r.diagnosis._full is None for r in forked if isinstance(r.diagnosis, PackedDiagnosis))


def test_a_packed_diagnosis_unpacks_to_the_one_made(one_and_two) -> None:  # type: ignore[no-untyped-def]
    alone, _, forked, _ = one_and_two
    pairs = [(a, f) for a, f in zip(alone, forked, strict=True) if isinstance(f.diagnosis, PackedDiagnosis)]
    for a, f in pairs[:60]:
        assert isinstance(f.diagnosis, PackedDiagnosis)
        assert _same(f.diagnosis.builtins(), msgspec.to_builtins(a.diagnosis))  # straight from the bytes
        assert f.diagnosis.findings == a.diagnosis.findings  # an attribute it lacks unpacks it
        assert f.diagnosis.unpack() == a.diagnosis and isinstance(f.diagnosis.unpack(), Diagnosis)
        assert f.diagnosis.to_dict() == a.diagnosis.to_dict()
        assert _same(diagnosis_dict(f.diagnosis), diagnosis_dict(a.diagnosis))
    # Rows share their skipped rules and missing fields; unpacked, each has lists of its own.
    shared = {id(f.diagnosis._shared) for _, f in pairs}  # type: ignore[union-attr]
    assert len(shared) <= 7 * 7  # at most one per planted class and task (250 GPUs in 7 tasks)
    idle = [f.diagnosis for _, f in pairs if f.diagnosis.verdict == "idle"]
    first, second = idle[0].unpack(), idle[1].unpack()  # type: ignore[union-attr]
    assert first.skipped == second.skipped and first.skipped is not second.skipped and first.skipped
    assert first.unavailable == second.unavailable and first.unavailable[0] is not second.unavailable[0]


def test_the_html_report_reads_packed_rows(one_and_two) -> None:  # type: ignore[no-untyped-def]
    alone, _, forked, _ = one_and_two
    a, f = build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=alone)), \
        build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=forked))
    assert f.rows == a.rows and f.summary == a.summary


def test_rows_packed_and_unpacked_by_hand() -> None:
    stats = _fleet(14)
    rows, _ = triage_rows(stats, processes=1)
    expected = [msgspec.to_builtins(r.diagnosis) for r in rows]
    packer = RowPacker()
    for r in rows:
        packer.add(dataclasses.replace(r, diagnosis=dataclasses.replace(r.diagnosis)))
    back, extra = unpack_rows(packer.finish(["x"]))
    assert extra == ["x"] and [r.uuid for r in back] == [r.uuid for r in rows]
    assert all(_same(r.diagnosis.builtins(), e) for r, e in zip(back, expected, strict=True))  # type: ignore[union-attr]
    packed = back[0].diagnosis
    assert type(packed.verdict) is Verdict and packed.limiter == rows[0].diagnosis.limiter
    assert packed.unpack().unavailable and all(type(u) is Unavailable for u in packed.unpack().unavailable)


class _DyingPacker(RowPacker):
    def add(self, row: FleetRow) -> None:
        os._exit(3)  # a worker killed mid-task (the OOM killer, a signal)


def test_a_worker_that_dies_leaves_the_triage_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = _fleet(60)
    alone, _ = triage_rows(stats, processes=1)
    monkeypatch.setattr(fleet, "RowPacker", _DyingPacker)  # the forked workers inherit it
    rows, triage = triage_rows(stats, processes=2, chunk=10)
    assert triage.processes == 1 and _json(rows) == _json(alone)  # every task done here, none lost


def test_processes_asked_for_are_capped_at_four_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "default_jobs", lambda: 1)
    _, triage = triage_rows(_fleet(40), processes=1000)
    assert triage.processes == 4


def test_by_default_a_small_fleet_stays_in_one_process() -> None:
    _, triage = triage_rows(_fleet(30))
    assert triage.processes == 1


def test_by_default_no_fork_beside_other_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    stats = _fleet(60)
    monkeypatch.setattr(fleet, "default_jobs", lambda: 4)
    _, triage = triage_rows(stats, chunk=10)
    alone = threading.active_count() == 1
    assert triage.processes == (5 if alone else 1)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        _, triage = triage_rows(stats, chunk=10)
        assert triage.processes == 1  # an embedding program's thread: no fork unless asked for
        _, triage = triage_rows(stats, chunk=10, processes=2)
        assert triage.processes == 2
    finally:
        stop.set()
        other.join()


def test_a_packed_diagnosis_survives_copy_and_pickle(one_and_two) -> None:  # type: ignore[no-untyped-def]
    import copy
    import pickle

    _, _, forked, _ = one_and_two
    packed = next(r.diagnosis for r in forked if isinstance(r.diagnosis, PackedDiagnosis))
    for clone in (copy.copy(packed), pickle.loads(pickle.dumps(packed))):
        assert clone.verdict == packed.verdict and clone.unpack() == packed.unpack()
