"""One rank cut short in a job's folder: the job's GPU busy and idle shares are of the ranks' device time together
(each rank's share weighed by its window times its devices), so a rank that kept a few milliseconds counts for those
and not as much as the whole rank beside it; the cut rank is named, with why it is not compared and how it counts."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import pytest

from diagnoser.traces.analysis import analyze_trace
from diagnoser.traces.trim import trim_trace

RANKS = Path(__file__).parent / "fixtures" / "traces" / "recsys-sampled-2of128"


def test_a_rank_cut_short_counts_for_the_time_it_kept(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(RANKS / "rank-0.json.gz", job / "rank-0.json.gz")
    whole1 = analyze_trace(RANKS / "rank-1.json.gz", jobs=1).summary
    trim_trace(RANKS / "rank-1.json.gz", job / "rank-1.json.gz", window_ms=whole1.window_s * 1e3 / 10, at=0.3)

    ranks = [analyze_trace(job / f"rank-{i}.json.gz", jobs=1) for i in range(2)]
    r0, r1 = (r.summary for r in ranks)
    assert r1.window_s < 0.2 * r0.window_s  # the second rank is the cut one
    assert r0.gpu_busy_frac is not None and r1.gpu_busy_frac is not None
    assert abs(r0.gpu_busy_frac - r1.gpu_busy_frac) > 0.02  # (else any weighing gives the same share)

    job_summary = analyze_trace(job, jobs=1).summary
    weights = [r.summary.window_s * max(1, len(r.timelines)) for r in ranks]
    by_time = (r0.gpu_busy_frac * weights[0] + r1.gpu_busy_frac * weights[1]) / sum(weights)
    assert job_summary.gpu_busy_frac == pytest.approx(by_time, rel=1e-12)
    assert abs(job_summary.gpu_busy_frac - statistics.fmean([r0.gpu_busy_frac, r1.gpu_busy_frac])) > 0.005
    idle = sum(job_summary.idle_frac_by_cause.values())
    assert idle == pytest.approx(sum(
        sum(r.summary.idle_frac_by_cause.values()) * w for r, w in zip(ranks, weights, strict=True)) / sum(weights))
    notes = [n for n in job_summary.skipped if "not compared with the other ranks" in n]
    assert len(notes) == 1 and "count it for the time it kept" in notes[0], job_summary.skipped
