"""Damaged and hostile files: captures decoded against their typed schema (rejected in one sentence, or the bad part
left out with a note), and captures and configs read with bounded memory (a link to /dev/zero, a gzip bomb, a sparse
file), measured as the peak RSS of a real child process."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from diagnoser import capture as cap_mod
from diagnoser.capture import CaptureError, load, loads
from diagnoser.rules import diagnose
from tests import own_usage

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "nvidia-h100-80gb-hbm3-decode-b16.dgc"
# Peak resident memory allowed to a `diagnoser` child refusing a hostile file. The CLI itself is about 45 MiB; a gzip
# bomb is refused once its output passes the 256 MiB capture limit. Before the bounds: 20.9 GB (/dev/zero), 2.15 GB
# (a gzip bomb), 1.09 GB (a 1 GB sparse file).
PEAK_LIMIT_MIB = 512


def _doc() -> dict[str, Any]:
    return json.loads(gzip.decompress(FIXTURE.read_bytes()))


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def _run(*args: str) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, env=ENV, capture_output=True,
                            text=True, timeout=300, check=False)
    return result.returncode, result.stdout, result.stderr


def _peak_run(*args: str) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in MiB) of a diagnoser process: its own peak, not this test process's
    (tests/own_usage.py)."""
    with tempfile.TemporaryDirectory() as folder:
        usage_file = Path(folder) / "usage.json"
        proc = own_usage.start([sys.executable, "-m", "diagnoser", *args], usage_file, cwd=REPO, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()  # bounded: the CLI says one sentence
        proc.wait()
        usage = own_usage.read(usage_file)
        assert usage is not None, err
        return proc.returncode, err, int(usage.peak_rss_mib)


def one_sentence(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- typed decoding -------------------------------------------------------------------------------------------------

def test_series_as_a_string_is_rejected_in_one_sentence_not_exit_70(tmp_path: Path) -> None:
    doc = _doc()
    doc["capture"]["series"] = "gpu.busy"
    path = _write(tmp_path / "bad.dgc", doc)
    with pytest.raises(CaptureError, match=r"damaged capture .*Expected `array`, got `str` - at `\$.series`"):
        load(path)
    code, _, err = _run("diagnose", str(path))
    assert code == 2
    assert "damaged capture" in one_sentence(err)


@pytest.mark.parametrize("where,value,expect", [
    (("duration_s",), "10", "Expected `float`, got `str` - at `$.duration_s`"),
    (("gpus", 0, "index"), 1.5, "Expected `int`, got `float` - at `$.gpus[0].index`"),
    (("series", 0, "labels"), ["gpu", "0"], "Expected `object`, got `array` - at `$.series[0].labels`"),
    (("series", 0, "values", 1), "0.5", "at `$.series[0].values[1]`"),
    (("notes",), {"a": 1}, "Expected `array`, got `object` - at `$.notes`"),
    (("target",), None, "Expected `str`, got `null` - at `$.target`"),
    (("series", 0), 3, "Expected `object`, got `int` - at `$.series[0]`"),
])
def test_wrong_types_anywhere_are_rejected_naming_the_place(tmp_path: Path, where: tuple[Any, ...], value: Any,
                                                            expect: str) -> None:
    doc = _doc()
    node = doc["capture"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(CaptureError) as caught:
        load(_write(tmp_path / "bad.dgc", doc))
    assert expect in str(caught.value) and str(caught.value).count("\n") == 0


def test_a_negative_window_or_an_infinite_number_is_rejected(tmp_path: Path) -> None:
    doc = _doc()
    doc["capture"]["duration_s"] = -5.0
    with pytest.raises(CaptureError, match="not a finite, non-negative time"):
        load(_write(tmp_path / "negative.dgc", doc))
    text = json.dumps(_doc()).replace('"duration_s": ', '"duration_s": 1e999, "x": ', 1)
    (tmp_path / "inf.dgc").write_text(text)
    with pytest.raises(CaptureError, match="damaged capture .*Number out of range"):
        load(tmp_path / "inf.dgc")


def _busy(doc: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in doc["capture"]["series"] if s["name"] == "gpu.busy")


def test_null_points_are_left_out_with_a_note_that_the_verdict_repeats(tmp_path: Path) -> None:
    doc = _doc()
    busy = _busy(doc)
    n = len(busy["values"])
    for i in range(0, n, 2):
        busy["values"][i] = None
    busy["times"][1] = None
    capture = load(_write(tmp_path / "nulls.dgc", doc))
    kept = capture.series_named("gpu.busy")[0]
    assert len(kept.values) == len(kept.times) == n - (n + 1) // 2 - 1
    (note,) = [x for x in capture.notes if "null" in x]
    assert f"{(n + 1) // 2 + 1} points recorded as null (no reading) were left out" in note
    assert note in diagnose(capture).notes  # said with the verdict, not silently


def test_unpaired_series_are_dropped_whole_with_a_note(tmp_path: Path) -> None:
    doc = _doc()
    whole = loads(FIXTURE.read_bytes())
    busy = _busy(doc)
    busy["values"] = busy["values"][: len(busy["values"]) // 2]  # fewer values than times: pairing unknowable
    capture = load(_write(tmp_path / "unpaired.dgc", doc))
    assert not capture.series_named("gpu.busy")
    assert len(capture.series) == len(whole.series) - 1
    (note,) = [x for x in capture.notes if "do not pair up" in x]
    assert "gpu.busy" in note
    result = diagnose(capture)
    assert note in result.notes
    # The series with a mismatch was read as if whole before: the verdict now rests on what pairs, and says so.


def test_unpaired_nulls_are_not_repaired_into_a_wrong_pairing(tmp_path: Path) -> None:
    doc = _doc()
    busy = _busy(doc)
    busy["values"] = [None, *busy["values"][1:-1]]  # one value short and a null: no pairing can be trusted
    capture = load(_write(tmp_path / "x.dgc", doc))
    assert not capture.series_named("gpu.busy")
    assert any("do not pair up" in x for x in capture.notes)


def test_a_well_formed_capture_gets_no_note() -> None:
    capture = loads(FIXTURE.read_bytes())
    assert not [n for n in capture.notes if "left out" in n or "pair up" in n]


def test_uncompressed_and_multi_member_gzip_captures_load(tmp_path: Path) -> None:
    body = gzip.decompress(FIXTURE.read_bytes())
    assert loads(body).target == loads(FIXTURE.read_bytes()).target
    two = gzip.compress(body[:1000]) + gzip.compress(body[1000:])
    assert loads(two).target == loads(body).target
    with pytest.raises(CaptureError, match="gzip stream is damaged"):
        loads(gzip.compress(body)[:-100])


# --- bounded memory -------------------------------------------------------------------------------------------------

def _gzip_bomb(path: Path, gib: int = 4) -> Path:
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (16 << 20)
    with open(path, "wb") as f:
        f.writelines(co.compress(chunk) for _ in range(gib * 64))
        f.write(co.flush())
    return path


def test_gzip_bomb_is_refused_while_decompressing(tmp_path: Path) -> None:
    bomb = _gzip_bomb(tmp_path / "bomb.dgc")
    assert bomb.stat().st_size < 8 << 20
    code, err, peak = _peak_run("diagnose", str(bomb))
    assert code == 2 and "decompresses to more than 256 MiB" in one_sentence(err)
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_a_link_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    link = tmp_path / "zero.dgc"
    link.symlink_to("/dev/zero")
    code, err, peak = _peak_run("diagnose", str(link))
    assert code == 2 and "neither gzip nor JSON" in one_sentence(err)
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_a_sparse_file_is_refused_by_its_size(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.dgc"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
    code, err, peak = _peak_run("report", str(sparse))
    assert code == 2 and "is more than 256 MiB (1.0 GiB)" in one_sentence(err)
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_an_endless_json_stream_is_bounded(tmp_path: Path) -> None:
    """A pipe that never ends (here: a FIFO fed '{' then spaces) is cut at the limit, not read to the end."""
    fifo = tmp_path / "capture.fifo"
    os.mkfifo(fifo)
    feed = (f"f = open({str(fifo)!r}, 'wb')\nf.write(b'{{')\nchunk = b' ' * (1 << 20)\n"
            "try:\n    while True: f.write(chunk)\nexcept BrokenPipeError:\n    pass\n")
    feeder = subprocess.Popen([sys.executable, "-c", feed])
    try:
        code, err, peak = _peak_run("diagnose", str(fifo))
    finally:
        feeder.kill()
        feeder.wait()
    assert code == 2 and "more than 256 MiB" in one_sentence(err)
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


@pytest.mark.parametrize("command", [
    ["theory", "--gpu", "H100", "--model", "{cfg}"],
    ["diagnose", str(FIXTURE), "--rules-config", "{cfg}"],
    ["agent", "--once", "--config", "{cfg}"],
])
@pytest.mark.parametrize("kind", ["dev-zero", "sparse"])
def test_configs_are_read_bounded(tmp_path: Path, command: list[str], kind: str) -> None:
    cfg = tmp_path / ("config.json" if "theory" in command else "config.toml")
    if kind == "dev-zero":
        cfg.symlink_to("/dev/zero")
    else:
        with open(cfg, "wb") as f:
            f.truncate(1 << 30)
    code, err, peak = _peak_run(*[c.replace("{cfg}", str(cfg)) for c in command])
    line = one_sentence(err)
    assert code == 2, err
    assert ("not a text file" in line or "no config file" in line) if kind == "dev-zero" else "more than 16 MiB" in line
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_capture_limit_is_documented() -> None:
    assert cap_mod.MAX_CAPTURE_BYTES == 256 << 20
    assert "256 MiB" in (REPO / "docs" / "capture-format.md").read_text()


# --- the wrong kind of file ---------------------------------------------------------------------------------------------

def test_a_trace_given_for_a_capture_and_a_capture_for_a_trace_name_the_command_that_reads_each(tmp_path: Path) -> None:
    # A Kineto trace starts with metadata keys (an array among them) before its events; the Chrome form is an array.
    kineto = tmp_path / "trace.json"
    kineto.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "H100"}],
                                  "traceEvents": [{"ph": "X", "name": "k", "ts": 0, "dur": 1}]}))
    chrome = tmp_path / "events.json.gz"
    chrome.write_bytes(gzip.compress(b'[{"ph": "X", "name": "k", "ts": 0, "dur": 1}]'))
    for trace in (kineto, chrome):
        code, _, err = _run("diagnose", str(trace))
        line = one_sentence(err)
        assert code == 2 and "is a torch.profiler/Chrome trace, not a diagnoser capture" in line, line
        assert "diagnoser analyze" in line
    code, _, err = _run("analyze", str(FIXTURE))
    line = one_sentence(err)
    assert code == 2 and "is a diagnoser capture, not a trace" in line and "diagnoser diagnose" in line, line
    # Other JSON still reads as what it is: neither.
    other = _write(tmp_path / "other.json.gz", {"hello": 1})
    code, _, err = _run("diagnose", str(other))
    assert code == 2 and "is not a diagnoser capture" in one_sentence(err)


# --- numbers and nesting no writer produces (they reached arithmetic or the decoder's recursion: exit 70) -------------

def _limited() -> None:
    """In the child: an address-space limit, so that a regression that grows without end fails, not the machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _cli(*args: str, cwd: Path = REPO) -> tuple[int, str]:
    """(exit code, stderr) of a diagnoser process with a deadline and a memory limit."""
    result = subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=cwd, env=ENV, capture_output=True,
                            text=True, timeout=120, check=False, preexec_fn=_limited)
    return result.returncode, result.stderr


def _deep(depth: int = 5000) -> str:
    return "[" * depth + "]" * depth


def _all_values(value: float) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        for series in doc["capture"]["series"]:
            series["values"] = [value if i % 2 else -value for i in range(len(series["values"]))]
    return edit


@pytest.mark.parametrize("damage,expect", [
    (lambda d: d["capture"].__setitem__("x_unknown", json.loads(_deep(500))), None),  # deep but readable: fine
    ("deep-unknown-field", "nests arrays or objects more than about 1,000 levels deep"),
    ("deep-envelope", "nests arrays or objects more than about 1,000 levels deep"),
    (_all_values(1.7e308), "holds -1.7e+308, larger than any measurement (1e30)"),
    (lambda d: _busy(d)["values"].__setitem__(0, -1.7e308), "series gpu.busy ($.series[0].values) holds -1.7e+308"),
    (lambda d: d["capture"]["gpus"][0].__setitem__("power_limit_w", 1.7e308),
     "$.gpus[0].power_limit_w is 1.7e+308, larger than any measurement (1e30)"),
    (lambda d: _busy(d)["times"].__setitem__(1, 1e300), "more than ten years from its window's start"),
    (lambda d: d["capture"].__setitem__("started_at", 1e300), "starts at 1e+300 s after 1970"),
    (lambda d: d["capture"].__setitem__("started_at", -1e15), "not between 1970 and the year 3000"),
    (lambda d: d["capture"].__setitem__("duration_s", 1e12), "its window lasts 1e+12 s, over ten years"),
])
def test_captures_beyond_what_any_writer_makes_are_one_sentence_exit_2(tmp_path: Path, damage: Any,
                                                                       expect: str | None) -> None:
    """diagnose, report and compare each refuse in one sentence (they exited 70, "a bug in diagnoser": a RecursionError
    in the decoder, math.fsum overflowing, `(v - mean) ** 2` overflowing in compare, a date past the year 9999)."""
    path = tmp_path / "bad.dgc"
    if damage == "deep-unknown-field":
        text = json.dumps(_doc()).replace('"duration_s": ', f'"x_unknown": {_deep()}, "duration_s": ', 1)
        path.write_bytes(gzip.compress(text.encode()))
    elif damage == "deep-envelope":
        path.write_bytes(gzip.compress((json.dumps(_doc())[:-1] + f', "x_unknown": {_deep()}}}').encode()))
    else:
        doc = _doc()
        damage(doc)
        _write(path, doc)
    out = tmp_path / "out.html"
    for args in (("diagnose", str(path)), ("report", str(path), "-o", str(out)), ("compare", str(path), str(FIXTURE)),
                 ("compare", str(FIXTURE), str(path))):
        code, err = _cli(*args)
        if expect is None:
            assert code == 0, err
            continue
        line = one_sentence(err)
        assert code == 2, (args, line)
        assert line.startswith(f"diagnoser: {path} ") and expect in line, (args, line)
    assert expect is None or not out.exists()


def test_report_of_a_directory_is_one_sentence(tmp_path: Path) -> None:
    # `report .` took the folder's empty name for the report's (ValueError, exit 70).
    for target in (".", str(tmp_path)):
        code, err = _cli("report", target, cwd=tmp_path)
        assert code == 2 and one_sentence(err) == f"diagnoser: {target} is a directory, not a capture file."
    assert list(tmp_path.iterdir()) == []
