"""Reading a large trace on every core: the events array is cut into chunks at event boundaries, worker processes
decode each chunk and move its events into columns (tables.Tables), and the parent appends the parts in file order
(Tables.extend), which gives exactly what one pass would have built. The analysis then runs on the merged columns.

- A plain JSON file is memory-mapped: the parent finds the events array and cuts it into ranges at event boundaries
  (decode.first_cut: a boundary whose next event decodes on its own), and each worker reads its ranges from the
  mapping itself, chunk by chunk; nothing is copied between processes but the columns that come back.
- A gzip file cannot be read from the middle: the parent decompresses it and cuts the stream into chunks
  (decode.raw_chunks) while the workers decode the chunks already sent, so decompression overlaps decoding.

Memory is bounded per worker (one chunk and the columns of one range, RANGE_BYTES of JSON) and in the parent (the
merged columns, which a single pass holds too, plus at most 2 x workers chunks or parts in flight). Workers are
forked when the process has a single thread (they inherit the imported modules), spawned otherwise.
"""

from __future__ import annotations

import gc
import mmap
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
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        read_mapped(part, mm, start, end, last_mode, chunk_bytes, tf)
    return part, tf.stats


def read_mapped(t: Tables, mm: Any, start: int, end: int, last_mode: int, chunk_bytes: int, tf: TraceFile) -> None:
    """The events of mm[start:end] (whole events, comma-separated) into `t`. Each chunk (cut at event boundaries, as
    the ranges are) is read by the scan where it lies in the mapping; a chunk the scan finds not plain, and the end
    of a file cut short, as the single pass reads them (range_chunks: the typed decode, damage skipped and counted).
    The pages read are handed back as it goes, so the mapping does not grow the process by the file's size."""
    stats = tf.stats
    released = start - start % mmap.PAGESIZE
    was = gc.isenabled()
    gc.disable()  # nothing here forms cycles
    try:
        with memoryview(mm) as view:
            for a, b in _split(mm, start, end, chunk_bytes):
                mode = last_mode if b == end else WHOLE
                n = scan_chunk(t, view[a:b], bare=True) if mode == WHOLE else None
                if n is None:
                    for data, m in range_chunks(mm, a, b, mode, chunk_bytes, tf):
                        stats.events += read_chunk(t, data, m, stats, fast=False)
                else:
                    stats.events += n
                released = _hand_back(mm, released, b)
    finally:
        if was:
            gc.enable()


def _hand_back(mm: Any, released: int, upto: int) -> int:
    """Drop the mapped pages below `upto` from this process (they are the file's: a later read faults them in
    again); the new low mark."""
    hi = upto - upto % mmap.PAGESIZE
    if hi > released and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED, released, hi - released)
        except (OSError, ValueError):
            return released
        return hi
    return released


def range_chunks(mm: Any, start: int, end: int, last_mode: int, chunk_bytes: int,
                 tf: TraceFile) -> Iterator[tuple[bytes, int]]:
    """Chunks of whole events of mm[start:end], cut at event boundaries as a single pass cuts them (damage skipped
    the same way)."""
    blocks = (mm[i:min(end, i + _BLOCK)] for i in range(start, end, _BLOCK))
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
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):  # no address space for it (a limit on it), or a file that cannot be mapped
            mm = None
        if mm is None:
            return collect(path, chunk_bytes=chunk_bytes, max_bytes=limit)
        t = Tables(path=path)
        t.stats.bytes_in = t.stats.bytes_json = size
        with mm:
            span = _events_span(mm, size, path, tf)
            if span is None:  # a head the single pass must judge (and word the error for)
                return collect(path, chunk_bytes=chunk_bytes, max_bytes=limit)
            start, end, last_mode = span
            if jobs == 1:
                read = TraceFile(path=path)
                read_mapped(t, mm, start, end, last_mode, chunk_bytes, read)
                t.stats.merge(read.stats)
                return _finish_mapped(t, tf)
            ranges = _split(mm, start, end, max(range_bytes, (end - start) // (64 * jobs) + 1))
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


def _events_span(mm: Any, size: int, path: Path, tf: TraceFile) -> tuple[int, int, int] | None:
    """(start, end, mode of the last range) of the events in a mapped plain trace, the metadata in tf; None when the
    head is not a trace's (the single pass words the error)."""
    first = 0
    while first < size and mm[first] in _WS + b"\xef\xbb\xbf":
        first += 1
    if first >= size:
        return None
    if mm[first] == ord("["):  # the Chrome "JSON Array Format": events only
        start, in_object = first + 1, False
    elif mm[first] == ord("{"):
        m = _EVENTS_KEY.search(mm, first, min(size, MAX_EVENT_BYTES))
        if m is None:
            return None
        parse_head_metadata(mm[first:m.start()], tf)
        start, in_object = m.end(), True
    else:
        return None
    while start < size and mm[start] in _WS:
        start += 1
    tail_from = max(start, size - _TAIL_BYTES)
    closed = find_array_end(mm[tail_from:size], in_object)
    if closed is None and tail_from > start:
        tail_from = max(start, size - MAX_EVENT_BYTES)
        closed = find_array_end(mm[tail_from:size], in_object)
    if closed is None:
        tf.stats.truncated = True
        return start, size, CUT_SHORT
    i, meta = closed
    add_tail_metadata(tf, meta)
    return start, tail_from + i, WHOLE


def _split(mm: Any, start: int, end: int, range_bytes: int) -> list[tuple[int, int]]:
    """[start, end) cut into ranges of about range_bytes at event boundaries."""
    out: list[tuple[int, int]] = []
    pos = start
    while end - pos > range_bytes + range_bytes // 2:
        cut = first_cut(mm, pos + range_bytes, min(end, pos + range_bytes + MAX_EVENT_BYTES))
        if cut is None:
            break
        out.append((pos, cut[0] + 1))
        pos = cut[1]
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


__all__ = ["collect_parallel", "default_jobs", "each_file", "others_running", "range_chunks", "trace_jobs"]
