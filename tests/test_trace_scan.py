"""The compiled scan (diagnoser/traces/_scan.c, issue 28.7) reads a chunk of events straight into the columns the
typed decode and `_ingest` build, or says the chunk is not plain and leaves it to them. Held here: the same Tables,
column for column and in the same order, on every public trace and on random chunks full of what real traces and
damaged ones hold (odd numbers, escapes, strings for ints, missing fields, other phases, duplicate keys); the mapped
one-process reader gives the stream's analysis; and the scan really is what reads the public traces."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgspec
import pytest

from diagnoser.traces import parallel, tables
from diagnoser.traces.analysis import analyze_tables
from diagnoser.traces.decode import WHOLE, DecodeStats, decode_chunk
from diagnoser.traces.parallel import collect_parallel
from diagnoser.traces.tables import Tables, _ingest, collect, scan_chunk

# Every test here holds the compiled scan against the typed decode: without it (no C compiler, or DIAGNOSER_NO_C=1,
# CI's pure-Python job) there is only the typed decode, which the rest of the suite runs.
pytestmark = pytest.mark.skipif(not tables.scan_built(),
                                reason="diagnoser/traces/_scan.c is not built (no C compiler) or DIAGNOSER_NO_C is set: "
                                       "only the typed decode is here, nothing to compare it with")

HERE = Path(__file__).resolve().parent
PUBLIC = sorted((HERE / "fixtures" / "traces").rglob("*.json.gz")) + sorted(
    (HERE / "fixtures" / "gpu" / "traces").glob("*.json.gz"))


def _columns(t: Tables) -> dict[str, Any]:
    """Every field of the tables, counters as ordered item lists (their order is most_common's tie order)."""
    out: dict[str, Any] = {}
    for f in fields(Tables):
        v = getattr(t, f.name)
        if f.name == "stats":
            v = (v.events, sorted(v.skips.items()), v.notes, v.truncated, v.dropped_bytes)
        elif f.name in ("counts", "skips", "op_names", "runtime_names"):
            v = list(v.items())
        elif f.name == "costed":
            v = [vars(op) for op in v]
        out[f.name] = v
    return out


def _same(a: Tables, b: Tables) -> None:
    ca, cb = _columns(a), _columns(b)
    assert ca.keys() == cb.keys()
    for key in ca:
        assert ca[key] == cb[key], key


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each chunk read from now on was read by the scan (True) or left to the typed decode."""
    read: list[bool] = []
    real = tables.scan_chunk

    def counting(t: Tables, data: Any, *, bare: bool = False) -> int | None:
        n = real(t, data, bare=bare)
        read.append(n is not None)
        return n

    monkeypatch.setattr(tables, "scan_chunk", counting)
    monkeypatch.setattr(parallel, "scan_chunk", counting)
    return read


def test_the_scan_is_built() -> None:
    # The project's install compiles it (setup.py); without a C compiler every chunk is typed-decoded, slower (and
    # this file is skipped: pytestmark above).
    assert tables.scan_built()


@pytest.mark.parametrize("path", PUBLIC, ids=[p.name for p in PUBLIC])
def test_the_scan_builds_the_typed_decodes_tables_on_every_public_trace(path: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    read = _count_scans(monkeypatch)
    for chunk_bytes in (64 << 10, 8 << 20):
        _same(collect(path, chunk_bytes=chunk_bytes), collect(path, chunk_bytes=chunk_bytes, fast=False))
    assert read and all(read), f"{sum(read)} of {len(read)} chunks read by the scan"  # real traces are plain
    # one process on a plain file: the chunks are scanned where they lie in the mapping
    plain = tmp_path / path.name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    read.clear()
    mapped = collect_parallel(plain, jobs=1, chunk_bytes=64 << 10)
    assert read and all(read)
    assert _canonical(mapped) == _canonical(collect(path, fast=False))


def _canonical(t: Tables) -> bytes:
    d = analyze_tables(t).to_dict()
    d["decode"].pop("bytes_in")
    d.pop("path")
    d["summary"].pop("path")
    return msgspec.json.encode(d, order="deterministic")


def test_without_the_scan_the_typed_decode_reads_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = PUBLIC[0]
    plain = tmp_path / "t.json"
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    with_scan = _canonical(collect_parallel(plain, jobs=1))
    monkeypatch.setattr(tables, "_scan", None)
    assert scan_chunk(Tables(), b"[]") is None
    assert _canonical(collect_parallel(plain, jobs=1)) == with_scan


# --- random chunks ------------------------------------------------------------------------------------------------

_CATS = ["cpu_op", "cuda_runtime", "cuda_driver", "Runtime", "kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset",
         "cuda_sync", "user_annotation", "gpu_user_annotation", "python_function", "Trace", "ac2g", "fwdbwd",
         "cpu_instant_event", "something_else", ""]
_NAMES = ["aten::mm", "aten::add", "aten::copy_", "cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
          "cudaGraphLaunch", "hipLaunchKernel", "record_param_comms", "c10d::allreduce_", "ProfilerStep#3",
          "execute_context_1(7)_generation_2(2)", "nccl:all_reduce", "Stream Sync", "Event Sync", "Stream Wait Event",
          "void gemm<float, 128>(Params)", "ncclKernel_AllReduce", "Memcpy HtoD (Pageable -> Device)",
          "_C::onednn_mm", "aten::linear", "naïve ∑ op", "k\\\"quoted\\\"", "tab\\tname", "\\u00e9t\\u00e9", ""]


def _number(rng: random.Random, odd: float, *, time: bool = False) -> str:
    """A JSON number as real traces spell it, or (with probability `odd`) as odd writers and damage do."""
    if rng.random() < odd:
        return rng.choice(["0", "0.0", "1e3", "2.5E-3", "1E+2", "123456789012345678", "9007199254740993",
                           "12345678901234567890", "0.000001", "1.7976931348623157e308", "4503599627370497.5",
                           "-0", "-1.5", "1e400", "NaN", "01", "1.", ".5", "-", "1e", '"12"', "null", "true",
                           str(-rng.randrange(0, 10 ** 12)) if not time else "-3"])
    kind = rng.random()
    if kind < 0.5:
        return repr(round(rng.uniform(0, 5e12), rng.choice([0, 1, 3, 6])))  # Kineto: microseconds, ns digits
    if kind < 0.8:
        return str(rng.randrange(0, 10 ** rng.randint(1, 17)))
    return repr(rng.uniform(0, 1e3))  # 17 significant digits


def _int_value(rng: random.Random, odd: float) -> str:
    if rng.random() >= odd:
        return str(rng.randrange(0, 1 << 31))
    return rng.choice(["-7", '"128"', '"0x0"', '"abc"', "1.0", "1e2", "null", "99999999999999999999", '"-5"', '"007"',
                       "true", "[1]", "{}"])


def _event(rng: random.Random, odd: float) -> str:
    def sometimes(p: float = 1.0) -> bool:
        return rng.random() < odd * p

    cat = rng.choice(_CATS)
    members: list[tuple[str, str]] = []
    ph = "X" if not sometimes() else rng.choice(["i", "s", "f", "M", "B", "\\u0058", None])
    if ph is not None:
        members.append(("ph", f'"{ph}"'))
    if not sometimes(0.1):
        members.append(("cat", json.dumps(cat) if not sometimes(0.1) else '"cpu\\u005fop"'))
    name = rng.choice(_NAMES)
    if not sometimes(0.1):
        members.append(("name", f'"{name}"' if "\\" in name else json.dumps(name, ensure_ascii=rng.random() < 0.5)))
    if not sometimes(0.1):
        members.append(("pid", str(rng.randrange(0, 5000)) if not sometimes() else
                        rng.choice(['"Spans"', "0", "null", "-1", "1.5"])))
    if not sometimes(0.1):
        members.append(("tid", str(rng.randrange(0, 1 << 31)) if not sometimes() else
                        rng.choice([str(-rng.randrange(1, 1 << 31)), '"stream 7"', "7", "null", "3.0"])))
    if not sometimes(0.1):
        members.append(("ts", _number(rng, odd, time=True)))
    if not sometimes(0.2):
        members.append(("dur", _number(rng, odd, time=True)))
    if not sometimes(0.3):
        members.append(("args", _args(rng, odd)))
    for extra in ("id", "bp", "s", "flow"):
        if rng.random() < 0.05:
            members.append((extra, rng.choice(['"e"', "12", '{"a": [1, {"b": null}]}', "[]", '"x\\ny"'])))
    if sometimes(0.05) and members:
        members.append(rng.choice(members))  # a key twice
    rng.shuffle(members)
    sep = rng.choice([", ", ",", ",\n    ", " ,\t"])
    return "{" + sep.join(f'"{k}": {v}' for k, v in members) + "}"


def _args(rng: random.Random, odd: float) -> str:
    if rng.random() < odd * 0.1:
        return rng.choice(["null", "[]", '"args"', "{}"])
    members: list[tuple[str, str]] = []
    for key, p in (("External id", 0.7), ("correlation", 0.9), ("device", 0.9), ("stream", 0.9), ("bytes", 0.2),
                   ("graph id", 0.1), ("wait_on_stream", 0.05), ("Group size", 0.05), ("In msg nelems", 0.05)):
        if rng.random() < p:
            members.append((key, _int_value(rng, odd) if key != "stream" or rng.random() < 0.95 else '"0x7f00"'))
    if rng.random() < 0.2:
        members.append(("Collective name", '"allreduce"' if rng.random() >= odd else
                        rng.choice(['""', "null", '"all\\"reduce"', "7"])))
    if rng.random() < 0.2:
        members.append(("cuda_sync_kind", rng.choice(['"Event Sync"', '"Stream Wait Event"', '"Other"', '""', "null"])
                        if rng.random() >= odd else rng.choice(['"Stream\\u0020Sync"', "3"])))
    if rng.random() < 0.2:
        members.append(("Input Dims", rng.choice(["[[2, 3], [3, 4]]", "[]", "[[1, 16, 64], [64, 64], []]", "null"])))
        members.append(("Input type", '["float", "float"]'))
    if rng.random() < 0.1:
        members.append(("Concrete Inputs", '["", "1"]'))
    if rng.random() < 0.1:
        members.append(("dtype", '"Float"' if rng.random() >= odd else rng.choice(["null", "5"])))
    if rng.random() < 0.3:
        members.append(("cbid", str(rng.randrange(300))))
    if rng.random() < odd * 0.05:
        members.append(("deep", "[" * 70 + "]" * 70))
    if rng.random() < odd * 0.05 and members:
        members.append(rng.choice(members))
    rng.shuffle(members)
    return "{" + ", ".join(f'"{k}": {v}' for k, v in members) + "}"


def _typed(data: bytes) -> tuple[Tables, DecodeStats, int]:
    t, stats = Tables(), DecodeStats()
    events = decode_chunk(data, WHOLE, stats)
    if events:
        _ingest(t, events)
    return t, stats, len(events)


def test_the_scan_builds_the_same_tables_as_the_typed_decode_on_random_chunks() -> None:
    rng = random.Random(28_7)
    scanned = 0
    trials = 1500
    for trial in range(trials):
        size = rng.choice([1, 1, 2, 5, 20, 80])
        odd = rng.choice([0.0, 0.0, 0.002, 0.02, 0.3])  # clean chunks, a rare oddity, many
        data = ("[" + rng.choice([",", ",\n  "]).join(_event(rng, odd) for _ in range(size)) + "]").encode()
        t = Tables()
        n = scan_chunk(t, data)
        if n is None:
            continue
        scanned += 1
        typed, stats, count = _typed(data)
        assert n == count, (trial, data)
        assert not stats.skips and not stats.dropped_bytes, (trial, data)  # what the scan takes, the decode keeps
        try:
            _same(t, typed)
        except AssertionError as exc:
            raise AssertionError(f"trial {trial}: {exc}: {data!r}") from None
    # the generator is meant to give the scan work, not only refusals
    assert scanned > trials // 5, f"only {scanned} of {trials} random chunks were plain"


def test_a_bare_range_reads_as_its_listed_chunk() -> None:
    rng = random.Random(7)
    for _ in range(300):
        events = [_event(rng, rng.choice([0.0, 0.01])) for _ in range(rng.randint(1, 30))]
        body = ",\n".join(events).encode()
        listed, bare = Tables(), Tables()
        n = scan_chunk(listed, b"[" + body + b"]")
        m = scan_chunk(bare, body, bare=True)
        assert n == m
        if n is not None:
            _same(listed, bare)
    assert scan_chunk(Tables(), b"", bare=True) == 0
    assert scan_chunk(Tables(), b"[]") == 0
    for text in (b"[", b"]", b"[{}", b'[{"ph": "X"},]', b"[{}] x", b"{}", b'[{"ph": "X"} {"ph": "X"}]'):
        assert scan_chunk(Tables(), text) is None, text


def test_times_are_read_to_the_last_bit() -> None:
    # The scan's own float path (a mantissa up to 2^53 over a power of ten) and Python's for the rest must give
    # exactly what the typed decode gives.
    rng = random.Random(53)
    spellings = []
    for _ in range(4000):
        x = rng.uniform(0, 10 ** rng.randint(0, 16))
        spellings.append(rng.choice([repr(x), f"{x:.3f}", f"{x:.6f}", f"{x:.1f}", f"{x:.9e}", str(int(x)),
                                     f"{x / 1e9:.20f}", f"{x:.12f}", f"{x * 1e6:.4f}"]))  # (runs of 8 digits)
    spellings += ["9007199254740992.0", "9007199254740993", "0.1", "0.30000000000000004", "5e-324", "1e-7",
                  "12345678.12345678", "0.000000001234567812345678", "99999999999999999999.99999999",
                  "10000000000000000000000", "0.00000000", "1234567812345678", "12345678123456781",
                  "4458677000933.188", "1683564901992914", "123456789.123456789", "0.0000000000000000000001"]
    body = ",".join(f'{{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": {s}, "dur": {s}}}'
                    for s in spellings)
    data = f"[{body}]".encode()
    t = Tables()
    assert scan_chunk(t, data) == len(spellings)
    typed, _, _ = _typed(data)
    assert list(t.h_ts) == list(typed.h_ts) == [float(s) for s in spellings]
    assert list(t.h_end) == list(typed.h_end)


def test_a_damaged_chunk_is_left_to_the_typed_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace with one event of negative time: its chunk is left to the typed decode (which skips and counts the
    # event); every other chunk is scanned; the analysis is the stream's.
    ops = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 9}", "pid": 1, "tid": 2, "ts": 10.0 * i,
            "dur": 4.0, "args": {"External id": i}} for i in range(20_000)]
    text = json.dumps({"traceEvents": ops})
    assert '"ts": 100000.0' in text
    path = tmp_path / "t.json"
    path.write_text(text.replace('"ts": 100000.0', '"ts": -1.0', 1))
    plain = _count_scans(monkeypatch)
    mapped = collect_parallel(path, jobs=1, chunk_bytes=64 << 10)
    assert plain.count(False) == 1 and len(plain) > 10
    serial = collect(path, fast=False)
    assert sum(serial.stats.skips.values()) == 1 and serial.counts["cpu_op"] == 19_999
    assert _canonical(mapped) == _canonical(serial)
    assert _canonical(collect(path)) == _canonical(serial)
