"""The collective over a kernel on its stream (kernels._GpuCollectives): found by bisecting the annotations sorted
by start, it is the one a scan of every annotation in file order finds, ties included."""

from __future__ import annotations

import random

from diagnoser.traces.kernels import _GpuCollectives, collective_kind
from diagnoser.traces.tables import Tables

KINDS = ["nccl:all_reduce", "nccl:all_gather", "nccl:reduce_scatter", "nccl:broadcast", "nccl:send", "something"]


def _brute(spans: list[tuple[int, int, float, float, str]], t: Tables, device: int, stream: int, ts: float,
           dur: float) -> str | None:
    best, covered = None, 0.0
    for dev, st, s, e, coll in spans:
        if (dev, st) != (device, stream):
            continue
        c = min(e, ts + dur) - max(s, ts)
        if c > covered:
            best, covered = collective_kind(coll) or "other", c
    return best if covered >= 0.5 * dur else None


def test_the_bisected_collective_is_the_scanned_one() -> None:
    rng = random.Random(11)
    for _ in range(60):
        t = Tables()
        for _ in range(rng.randint(0, 60)):
            s = float(rng.randrange(0, 1000))
            e = s + rng.choice([0.0, 1.0, 5.0, 40.0, 300.0, float(rng.randrange(1, 100))])
            t.gpu_comm.append((rng.randint(0, 1), rng.choice([7, 13]), s, e, rng.choice(KINDS)))
        t.gpu_comm.extend(t.gpu_comm[: rng.randint(0, 5)])  # exact duplicates: ties in file order
        found = _GpuCollectives(t)
        for _ in range(200):
            dev, stream = rng.randint(0, 1), rng.choice([7, 13, 99])
            ts, dur = float(rng.randrange(-50, 1100)), rng.choice([0.0, 1.0, 10.0, 100.0, 500.0])
            assert found.at(dev, stream, ts, dur) == _brute(t.gpu_comm, t, dev, stream, ts, dur)
