"""Captures and /metrics pages bounded by counts and lengths, not only bytes (issue 32, item 5): a capture of
compressible points, 100,000 series, a million notes or a 10 MB model name is read within a memory cap and a
deadline, and each cut is said once in a note; a /metrics page of hundreds of thousands of series is read up to
exposition.MAX_PAGE_SERIES, with a note in the capture. Each hostile file is built with the project's own Capture
classes and run through the real CLI in a child process whose peak RSS is measured (tests/own_usage.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from diagnoser import capture as cap_mod
from diagnoser.capture import Capture, ProcessInfo, Series, load, save
from diagnoser.collectors.exposition import MAX_PAGE_SERIES, parse_text
from tests import own_usage
from tests.factories import llama_7b, make_capture
from tests.test_server_metrics import Endpoint, scrapes, vllm_text

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
# Generous: the CLI alone is about 45 MiB. Before the bounds: 8 million compressible points 1.1 GB, 100,000 series
# 973 MB (the count), a million notes 913 MB and over 200 s in `diagnose`.
PEAK_LIMIT_MIB = 400
DEADLINE_S = 240


def _base() -> Capture:
    return make_capture({"gpu.busy": 0.9, "gpu.dram_active": 0.5, "gpu.sm_active": 0.6}, model=llama_7b())


def _peak_run(*args: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, peak RSS in MiB) of a diagnoser child, killed past DEADLINE_S."""
    with tempfile.TemporaryDirectory() as folder:
        usage_file = Path(folder) / "usage.json"
        out, err = Path(folder) / "out", Path(folder) / "err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = own_usage.start([sys.executable, "-m", "diagnoser", *args], usage_file, cwd=REPO, env=ENV,
                                   stdout=fo, stderr=fe)
            try:
                proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                own_usage.kill(proc)
                pytest.fail(f"diagnoser {args[0]} ran past {DEADLINE_S} s")
        usage = own_usage.read(usage_file)
        assert usage is not None
        return proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), usage.peak_rss_mib


def _points(c: Capture) -> None:
    n = 8_000_000  # about 64 MB of JSON, 0.1 MB gzip-compressed: every point the same
    c.series[0].times, c.series[0].values = [0.0] * n, [0.5] * n


def _series(c: Capture) -> None:
    c.series += [Series(name="gpu.busy", unit="ratio", source="nvml", times=[0.0, 1.0], values=[0.5, 0.6],
                        labels={"gpu": str(i)}) for i in range(100_000)]


def _notes(c: Capture) -> None:
    c.notes = ["note"] * 1_000_000


@pytest.mark.parametrize("build,said", [
    (_points, "1 series held more than 250,000 points"),
    (_series, "The capture holds 100,003 series"),
    (_notes, "The capture holds 1,000,000 notes: the first 200 were read"),
])
def test_hostile_counts_are_read_within_a_memory_cap_and_the_cut_is_said(tmp_path: Path,
                                                                          build: Callable[[Capture], None],
                                                                          said: str) -> None:
    c = _base()
    build(c)
    path = save(c, tmp_path / "hostile.dgc")
    assert path.stat().st_size < 3 << 20
    code, out, err, peak = _peak_run("diagnose", str(path), "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert [n for n in notes if said in n], notes  # said with the verdict, once
    assert sum(said in n for n in notes) == 1
    assert len(notes) < 300
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"
    code, out, err, peak = _peak_run("report", str(path), "-o", str(tmp_path / "r.html"))
    assert code == 0, err
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"


def test_a_million_notes_are_not_all_printed(tmp_path: Path) -> None:
    c = _base()
    _notes(c)
    code, out, err, _ = _peak_run("diagnose", str(save(c, tmp_path / "notes.dgc")))
    assert code == 0, err
    assert out.count("note") < 1000 and "1,000,000 notes" in out.replace("\n", " ").replace("  ", " ")


def test_a_ten_megabyte_model_name_is_cut_with_a_visible_marker(tmp_path: Path) -> None:
    c = _base()
    assert c.model is not None
    c.model.name = "m" * 10_000_000
    c.gpus[0].name = "G" * 100_000
    c.process = ProcessInfo(pid=1, name="python", cmdline=["vllm", "serve", "--chat-template", "x" * 50_000])
    c.series[0].labels["model"] = "l" * 5_000
    path = save(c, tmp_path / "name.dgc")
    loaded = load(path)
    assert loaded.model is not None
    assert loaded.model.name == "m" * 256 + "... (cut, 10000000 chars)"
    assert loaded.gpus[0].name.endswith("... (cut, 100000 chars)") and len(loaded.gpus[0].name) < 300
    assert loaded.process is not None and loaded.process.cmdline[3].endswith("... (cut, 50000 chars)")
    assert loaded.series[0].labels["model"].endswith("... (cut, 5000 chars)")
    (note,) = [n for n in loaded.notes if "cut, N chars" in n]
    assert note.startswith("4 text fields") and "$.model.name, held 10,000,000" in note
    html = tmp_path / "name.html"
    code, _, err, peak = _peak_run("report", str(path), "-o", str(html))
    assert code == 0, err
    assert html.stat().st_size < 2 << 20  # 31 MB before
    assert "(cut, 10000000 chars)" in html.read_text()


def test_thinning_keeps_the_window_and_its_statistics(tmp_path: Path) -> None:
    """Past MAX_POINTS the long series are thinned to evenly spaced points, the last kept: the mean and the window's
    span stay what they were."""
    c = _base()
    n = 120_000
    for s in c.series:
        s.times = [i * 0.01 for i in range(n)]
        s.values = [(i * 7919 % 1000) / 999 for i in range(n)]  # spread over 0..1, mean 0.5
    c.series += [Series(name="gpu.busy", unit="ratio", source="nvml", times=s.times, values=s.values,
                        labels={"gpu": str(g)}) for g in range(1, 7) for s in c.series[:1]]
    loaded = load(save(c, tmp_path / "long.dgc"))
    total = sum(len(s.values) for s in loaded.series)
    assert total <= cap_mod.MAX_POINTS + len(loaded.series) < 9 * n
    for s in loaded.series:
        assert s.times[-1] == pytest.approx((n - 1) * 0.01) and s.times[0] == 0.0
        assert 0.45 < sum(s.values) / len(s.values) < 0.55
    (note,) = [x for x in loaded.notes if "thinned" in x]
    assert f"{9 * n:,} points" in note


def test_what_is_within_the_bounds_gets_no_note() -> None:
    fixture = REPO / "tests" / "fixtures" / "gpu" / "nvidia-h100-80gb-hbm3-decode-b16.dgc"
    notes = load(fixture).notes
    assert not [n for n in notes if "cut" in n or "left out" in n or "thinned" in n]


def test_a_capture_of_millions_of_objects_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    c = _base()
    c.unavailable = []
    body = json.dumps({"format": "diagnoser-capture", "version": 2,
                       "capture": {"target": "t", "started_at": 1.7e9, "duration_s": 1.0,
                                   "series": [{"name": "a", "unit": "", "source": ""}] * 300_000}})
    path = tmp_path / "objects.dgc"
    path.write_text(body)
    with pytest.raises(cap_mod.CaptureError, match="holds 300,00[0-9] JSON objects, more than 250,000"):
        load(path)


# --- /metrics -------------------------------------------------------------------------------------------------------

def test_a_page_is_read_up_to_max_page_series() -> None:
    page = "".join(f'x_total{{i="{i}"}} 1\n' for i in range(MAX_PAGE_SERIES + 1234))
    samples, report = parse_text(page)
    assert len(samples["x_total"]) == MAX_PAGE_SERIES and report.unread == 1234
    assert "1,234 more lines were not read" in report.cut_note("The page")
    _, report = parse_text(page[: page.index(f'x_total{{i="{MAX_PAGE_SERIES}"')])
    assert report.unread == 0


def test_attach_says_when_a_metrics_page_was_cut() -> None:
    ttft = {"0.01": 0, "0.1": 5, "+Inf": 10}
    junk = "".join(f'vllm:x_junk{{i="{i}"}} 1\n' for i in range(120_000))
    bodies = [vllm_text(prompt=100 * k, gen=1000 * k, steps=50 * k, ttft=ttft) + junk for k in range(1, 4)]
    ep = Endpoint()
    try:
        capture, _ = scrapes(ep, None, bodies, [0.0, 1.0, 2.0])
    finally:
        ep.close()
    cut = [n for n in capture.notes if "series on one page" in n]
    assert len(cut) == 1 and f"more than {MAX_PAGE_SERIES:,}" in cut[0], capture.notes
    assert values(capture, "server.gen_tokens_per_s")  # the engine's own series come first and are still read


def values(capture: Capture, name: str) -> list[float]:
    found = capture.series_named(name)
    return found[0].values if found else []
