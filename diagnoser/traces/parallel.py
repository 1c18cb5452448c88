"""Reading a large trace on every core: the events array is cut into chunks at event boundaries, worker processes
decode each chunk and move its events into columns (tables.Tables), and the parent appends the parts in file order
(Tables.extend), which gives exactly what one pass would have built. The analysis then runs on the merged columns.

- A plain JSON file is read by offset: the parent finds the events array and cuts it into ranges at event boundaries
  (decode.first_cut: a boundary whose next event decodes on its own), and each worker reads its ranges from the file
  itself, chunk by chunk, into one buffer it reuses; nothing is copied between processes but the columns that come
  back. Every read is checked whole: a file cut short while it is read is one error (TraceError, exit 2), where a
  memory map of it faulted (SIGBUS) or broke the worker pool.
- A gzip file cannot be read from the middle: the parent decompresses it and cuts the stream into chunks
  (decode.raw_chunks) while the workers decode the chunks already sent, so decompression overlaps decoding.

Memory is bounded per worker (one chunk and the columns of one range, RANGE_BYTES of JSON) and in the parent (the
merged columns, which a single pass holds too, plus at most 2 x workers chunks or parts in flight). Workers are
forked when the process has a single thread (they inherit the imported modules), spawned otherwise.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from diagnoser.cores import default_jobs
from diagnoser.traces.decode import (
    _EVENTS_KEY,
    CHUNK_BYTES,
    CUT_SHORT,
    MAX_EVENT_BYTES,
    WHOLE,
    DecodeStats,
    TraceError,
    TraceFile,
    _open_stream,
    add_tail_metadata,
    find_array_end,
    first_cut,
    max_trace_bytes,
    open_trace_file,
    parse_head_metadata,
    raw_chunks,
    read_head,
)
from diagnoser.traces.tables import Tables, read_chunk, scan_built, scan_chunk

# A range per worker task: large enough that a task's overhead is nil, small enough to balance the workers and
# bound what each holds.
RANGE_BYTES = 48 << 20
# Below this much JSON one process is faster than starting workers.
MIN_PARALLEL_BYTES = 64 << 20
_TAIL_BYTES = 8 << 20
_BLOCK = 4 << 20
GZIP_MIN_JOBS = 3  # a gzip trace is read in parallel by default only with two parsers beside the inflating process
_WS = b" \t\r\n"


def collect_parallel(path: str | Path, *, jobs: int | None = None, max_bytes: int | None = None,
                     chunk_bytes: int = CHUNK_BYTES, range_bytes: int = RANGE_BYTES,
                     min_bytes: int = MIN_PARALLEL_BYTES) -> Tables:
    """Tables of a trace read by `jobs` processes (default: trace_jobs(), the cores other work leaves idle). Falls
    back to one process (tables.collect) for small files, one job, or a trace that cannot be split."""
    from diagnoser.traces.tables import collect

    path = Path(path)
    limit = max_trace_bytes(max_bytes)
    f, size = open_trace_file(path, limit)
    with f:
        gz = f.read(2) == b"\x1f\x8b"
    # a gzip stream expands 10-50x: judge it by what it will be, not by its compressed size
    if size * (10 if gz else 1) < min_bytes:
        jobs = 1
    elif jobs is None:
        jobs = trace_jobs()  # (read only for a large trace: it takes a few tens of milliseconds)
        if gz and jobs < GZIP_MIN_JOBS:
            # One process inflates the stream for every parser: with one parser beside it the hand-over costs more
            # than the second core gives (x16 gzip trace on two cores: 5.36 s wall, 8.36 CPU s against 4.83 s and
            # 5.82 s in one process, benchmarks/TRACES.md).
            jobs = 1
    if gz:
        if jobs <= 1:
            return collect(path, chunk_bytes=chunk_bytes, max_bytes=max_bytes)
        return _collect_gzip(path, jobs, limit, chunk_bytes)
    if jobs <= 1 and not scan_built():
        return collect(path, chunk_bytes=chunk_bytes, max_bytes=max_bytes)
    # (one process too: the scan reads a mapped file's chunks where they lie, without copying them)
    return _collect_mapped(path, max(1, jobs), limit, chunk_bytes, range_bytes)


def trace_jobs(cores: int | None = None, load: float | None = None) -> int:
    """The default number of processes reading a trace: this process's own core plus the cores other work leaves
    idle, within the cores it may use (`cores`, default default_jobs(); `load`, default others_running(), else the
    1-minute load average). A second process only pays on an idle core: the parallel read costs 10-40 % more CPU
    (the workers' columns are pickled back and appended), so on cores busy with other work it finishes later than one
    process (benchmarks/TRACES.md)."""
    cores = default_jobs() if cores is None else max(1, cores)
    if load is None:
        load = others_running()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load figure on this system: every core, as before
            return cores
    idle = max(0.0, cores - load)
    return max(1, min(cores, int(idle) + 1))


_LOADAVG = Path("/proc/loadavg")


def others_running(samples: int = 5, pause_s: float = 0.01) -> float | None:
    """Threads running or waiting for a core on the whole system now, this one left out: the median of a few reads
    of /proc/loadavg's running count (the load average lags a minute: a command that just ended still counts there).
    None where that file cannot be read."""
    counts: list[int] = []
    for i in range(samples):
        try:
            running = _LOADAVG.read_text().split()[3].split("/")[0]
            counts.append(int(running) - 1)
        except (OSError, IndexError, ValueError):
            return None
        if i + 1 < samples:
            time.sleep(pause_s)
    return max(0.0, statistics.median(counts))


_T = TypeVar("_T")


def each_file(fn: Callable[[Path, int], _T], files: list[Path], jobs: int | None,
              min_bytes: int | None = None) -> list[_T]:
    """`fn(file, jobs_for_it)` for each file, results in file order: the ranks of one job, several files that are
    each read whole by one process. With at least as many files as jobs and at least `min_bytes` of JSON in all
    (default MIN_PARALLEL_BYTES: below it, starting workers costs more than it saves), each file gets one worker
    process (fn must be a module-level function); otherwise they are read in turn, each on every job."""
    floor = MIN_PARALLEL_BYTES if min_bytes is None else min_bytes
    total = sum(map(_json_bytes, files))
    if jobs is None:
        jobs = trace_jobs() if total >= floor else 1
    jobs = max(1, jobs)
    if jobs == 1 or len(files) < jobs or total < floor:
        return [fn(f, jobs) for f in files]
    with _pool(jobs) as pool:
        return list(pool.map(fn, files, [1] * len(files)))


def _json_bytes(path: Path) -> int:
    """About how much JSON a file holds (a gzip stream expands 10-50x); 0 for one that cannot be read (its reader
    words the error)."""
    try:
        if not path.is_file():  # never open a pipe or a device here: its reader refuses it
            return 0
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_size * (10 if f.read(2) == b"\x1f\x8b" else 1)
    except OSError:
        return 0


# --- workers ---------------------------------------------------------------------------------------------------

def _ingest_chunks(chunks: Iterator[tuple[bytes, int]], stats: DecodeStats) -> tuple[Tables, DecodeStats]:
    part = Tables()
    was = gc.isenabled()
    gc.disable()  # nothing here forms cycles
    try:
        for data, mode in chunks:
            stats.events += read_chunk(part, data, mode, stats)
    finally:
        if was:
            gc.enable()
    return part, stats


def _chunk_task(data: bytes, mode: int) -> tuple[Tables, DecodeStats]:
    return _ingest_chunks(iter([(data, mode)]), DecodeStats())


def _range_task(path: str, start: int, end: int, last_mode: int, chunk_bytes: int) -> tuple[Tables, DecodeStats]:
    """The columns of the events in bytes [start, end) of a plain trace (whole events, comma-separated)."""
    tf = TraceFile(path=Path(path))
    part = Tables()
    with PlainFile(Path(path)) as rd:
        read_mapped(part, rd, start, end, last_mode, chunk_bytes, tf)
    return part, tf.stats


# How far past a range's nominal end the next event boundary is looked for first (then up to MAX_EVENT_BYTES).
_PROBE_BYTES = 1 << 20
# A test seam: the size a plain trace is cut to once its events are found, before they are read (see
# tests/test_traces_truncated.py: a file cut short while it is read, the same way every time).
CUT_WHILE_READ_ENV = "DIAGNOSER_TEST_CUT_TRACE_AT"


class PlainFile:
    """A plain trace read by offset, every read checked whole: a file cut short while it is read is one TraceError
    (exit 2) in this process or a worker, never a fault on a mapped page."""

    def __init__(self, path: Path, size: int | None = None) -> None:
        self.path = path
        try:
            self._f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close / the with block)
        except OSError as exc:
            raise TraceError(f"cannot read {path}: {exc.strerror or exc}.") from None
        self.size = os.fstat(self._f.fileno()).st_size if size is None else size
        self._buf = bytearray()

    def __enter__(self) -> PlainFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def read(self, a: int, b: int) -> bytes:
        """Bytes [a, b) of the file (a copy)."""
        with self.view(a, b) as v:
            return bytes(v)

    def view(self, a: int, b: int) -> memoryview:
        """Bytes [a, b) of the file in this reader's buffer (valid until the next read; release it first)."""
        n = b - a
        if len(self._buf) < n:
            self._buf = bytearray(max(n, len(self._buf) + len(self._buf) // 2))
        view = memoryview(self._buf)[:n]
        got = 0
        try:
            self._f.seek(a)
            while got < n:
                k = self._f.readinto(view[got:])
                if not k:
                    break
                got += k
        except OSError as exc:
            view.release()
            raise TraceError(f"cannot read {self.path}: {exc.strerror or exc}.") from None
        if got < n:
            view.release()
            raise self.cut_short()
        return view

    def cut_short(self) -> TraceError:
        try:
            now = f"{os.fstat(self._f.fileno()).st_size:,} bytes"
        except OSError:
            now = "shorter"
        return TraceError(f"{self.path} was cut short while it was read (it was {self.size:,} bytes, it is now {now}); "
                          "analyse it again once whatever writes it has finished.")


def read_mapped(t: Tables, rd: PlainFile, start: int, end: int, last_mode: int, chunk_bytes: int,
                tf: TraceFile) -> None:
    """The events of bytes [start, end) of the file (whole events, comma-separated) into `t`. Each chunk (cut at
    event boundaries, as the ranges are) is read into the reader's buffer and scanned there; a chunk the scan finds
    not plain, and the end of a file cut short, as the single pass reads them (range_chunks: the typed decode,
    damage skipped and counted)."""
    stats = tf.stats
    was = gc.isenabled()
    gc.disable()  # nothing here forms cycles
    try:
        for a, b in _split(rd, start, end, chunk_bytes):
            mode = last_mode if b == end else WHOLE
            if b - a > 2 * chunk_bytes + MAX_EVENT_BYTES:
                # a range no event boundary could cut (a damaged or sparse stretch): streamed in blocks as the
                # single pass reads it, never held whole (the reader's buffer would be the whole stretch)
                blocks = (rd.read(i, min(b, i + _BLOCK)) for i in range(a, b, _BLOCK))
                for data, m in raw_chunks(b"", False, blocks, tf, chunk_bytes, ends=mode):
                    stats.events += read_chunk(t, data, m, stats, fast=False)
                continue
            with rd.view(a, b) as view:
                n = scan_chunk(t, view, bare=True) if mode == WHOLE else None
                if n is None:
                    for data, m in range_chunks(view, 0, b - a, mode, chunk_bytes, tf):
                        stats.events += read_chunk(t, data, m, stats, fast=False)
                else:
                    stats.events += n
    finally:
        if was:
            gc.enable()


def range_chunks(buf: Any, start: int, end: int, last_mode: int, chunk_bytes: int,
                 tf: TraceFile) -> Iterator[tuple[bytes, int]]:
    """Chunks of whole events of buf[start:end], cut at event boundaries as a single pass cuts them (damage skipped
    the same way)."""
    blocks = (bytes(buf[i:min(end, i + _BLOCK)]) for i in range(start, end, _BLOCK))
    return raw_chunks(b"", False, blocks, tf, chunk_bytes, ends=last_mode)


# --- the parent ----------------------------------------------------------------------------------------------------

def _pool(jobs: int) -> ProcessPoolExecutor:
    method = "fork" if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods() \
        else "spawn"
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method))


def _merge_in_order(submit: Callable[..., Future[tuple[Tables, DecodeStats]]], tasks: Iterator[tuple[Any, ...]],
                    window: int, t: Tables) -> None:
    """Submit tasks with at most `window` in flight and append their parts to `t` in task order."""
    pending: deque[Future[tuple[Tables, DecodeStats]]] = deque()
    for task in tasks:
        pending.append(submit(*task))
        while len(pending) >= window:
            _take(pending.popleft(), t)
    while pending:
        _take(pending.popleft(), t)


def _take(future: Future[tuple[Tables, DecodeStats]], t: Tables) -> None:
    part, stats = future.result()
    t.extend(part)
    t.stats.merge(stats)


def _collect_mapped(path: Path, jobs: int, limit: int, chunk_bytes: int, range_bytes: int) -> Tables:
    from diagnoser.traces.tables import collect

    tf = TraceFile(path=path)
    with PlainFile(path) as rd:
        size = rd.size
        if not size:
            return collect(path, chunk_bytes=chunk_bytes, max_bytes=limit)
        t = Tables(path=path)
        t.stats.bytes_in = t.stats.bytes_json = size
        span = _events_span(rd, size, tf)
        if span is None:  # a head the single pass must judge (and word the error for)
            return collect(path, chunk_bytes=chunk_bytes, max_bytes=limit)
        start, end, last_mode = span
        cut_at = os.environ.get(CUT_WHILE_READ_ENV)
        if cut_at:
            os.truncate(path, int(cut_at))
        if jobs == 1:
            read = TraceFile(path=path)
            read_mapped(t, rd, start, end, last_mode, chunk_bytes, read)
            t.stats.merge(read.stats)
            return _finish_mapped(t, tf)
        ranges = _split(rd, start, end, max(range_bytes, (end - start) // (64 * jobs) + 1))
    tasks = ((str(path), a, b, last_mode if b == end else WHOLE, chunk_bytes) for a, b in ranges)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with _pool(jobs) as pool:
            _merge_in_order(lambda *a: pool.submit(_range_task, *a), tasks, 2 * jobs, t)
    finally:
        if gc_was:
            gc.enable()
    return _finish_mapped(t, tf)


def _finish_mapped(t: Tables, tf: TraceFile) -> Tables:
    """The metadata and the head's and tail's notes (tf) with the events' columns (t)."""
    t.metadata = tf.metadata
    t.stats.notes[:0] = tf.stats.notes
    t.stats.truncated = t.stats.truncated or tf.stats.truncated
    return t


def _events_span(rd: PlainFile, size: int, tf: TraceFile) -> tuple[int, int, int] | None:
    """(start, end, mode of the last range) of the events in a plain trace, the metadata in tf; None when the head is
    not a trace's (the single pass words the error)."""
    head = rd.read(0, min(size, _PROBE_BYTES))
    first = _skip(head, 0, _WS + b"\xef\xbb\xbf")
    if first >= len(head):
        return None
    if head[first] == ord("["):  # the Chrome "JSON Array Format": events only
        start, in_object = first + 1, False
    elif head[first] == ord("{"):
        m = _EVENTS_KEY.search(head, first)
        if m is None and size > len(head):
            head = rd.read(0, min(size, MAX_EVENT_BYTES))
            m = _EVENTS_KEY.search(head, first)
        if m is None:
            return None
        parse_head_metadata(head[first:m.start()], tf)
        start, in_object = m.end(), True
    else:
        return None
    while start < size:  # the whitespace before the first event, however long
        block = rd.read(start, min(size, start + _PROBE_BYTES))
        k = _skip(block, 0, _WS)
        start += k
        if k < len(block):
            break
    tail_from = max(start, size - _TAIL_BYTES)
    closed = find_array_end(rd.read(tail_from, size), in_object)
    if closed is None and tail_from > start:
        tail_from = max(start, size - MAX_EVENT_BYTES)
        closed = find_array_end(rd.read(tail_from, size), in_object)
    if closed is None:
        tf.stats.truncated = True
        return start, size, CUT_SHORT
    i, meta = closed
    add_tail_metadata(tf, meta)
    return start, tail_from + i, WHOLE


def _skip(buf: bytes, i: int, chars: bytes) -> int:
    while i < len(buf) and buf[i] in chars:
        i += 1
    return i


def _split(rd: PlainFile, start: int, end: int, range_bytes: int) -> list[tuple[int, int]]:
    """[start, end) cut into ranges of about range_bytes at event boundaries."""
    out: list[tuple[int, int]] = []
    pos = start
    while end - pos > range_bytes + range_bytes // 2:
        at = pos + range_bytes
        cut = None
        for span in (_PROBE_BYTES, MAX_EVENT_BYTES):
            hi = min(end, at + span)
            window = rd.read(at, hi)
            cut = first_cut(window, 0, len(window))
            if cut is not None or hi == end:
                break
        if cut is None:
            break
        out.append((pos, at + cut[0] + 1))
        pos = at + cut[1]
    out.append((pos, end))
    return out


def _collect_gzip(path: Path, jobs: int, limit: int, chunk_bytes: int) -> Tables:
    tf = TraceFile(path=path)
    blocks = _open_stream(path, tf.stats, limit)
    head, in_object = read_head(blocks, path, tf)
    t = Tables(path=path)
    # the parent decompresses and cuts while the workers decode: one core's share for the parent
    workers = max(1, jobs - 1) if jobs > 2 else jobs
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with _pool(workers) as pool:
            chunks = raw_chunks(head, in_object, blocks, tf, chunk_bytes)
            _merge_in_order(lambda *a: pool.submit(_chunk_task, *a), chunks, 2 * workers, t)
    finally:
        if gc_was:
            gc.enable()
    t.metadata = tf.metadata
    stats = tf.stats  # bytes read, truncation and notes from the stream; events and skips from the workers
    stats.events += t.stats.events
    stats.dropped_bytes += t.stats.dropped_bytes
    stats.skips.update(t.stats.skips)
    stats.truncated = stats.truncated or t.stats.truncated
    stats.notes.extend(n for n in t.stats.notes if n not in stats.notes)
    t.stats = stats
    return t


__all__ = ["CUT_WHILE_READ_ENV", "PlainFile", "collect_parallel", "default_jobs", "each_file", "others_running",
           "range_chunks", "trace_jobs"]
