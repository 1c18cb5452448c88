"""Streaming decode of Kineto / Chrome-trace JSON (plain or gzip) into typed events, a chunk at a time.

Why not `json.load`: a multi-GB trace becomes tens of millions of dicts (5x the file size in RAM, most of the time in
the allocator and the garbage collector). Here the file is read (or gunzipped) in blocks, cut into chunks of whole
events at event boundaries, and each chunk is decoded by msgspec into small typed structs that keep only the fields
the analysis reads; unknown fields are skipped by the decoder without building objects. A chunk lives only while the
caller consumes it, so memory is bounded by the chunk size plus what the caller keeps.

Event boundaries: a '}' followed by ',' and the '{"' + letter that opens the next event. In valid JSON that
sequence cannot lie inside a string (the '"' would close the string, and a letter cannot follow a closed string), so
a candidate is either a real boundary or one between two objects nested inside an event; a cut is accepted only when
the event after it decodes on its own with a "ph" key (`_probe`). Chunks therefore always hold whole events, however
they are cut, which is what lets the parallel reader (parallel.py) split a file anywhere and get the same events.

Damage: a chunk that does not decode is re-read event by event with the standard library's parser (which accepts
NaN and Infinity), keeping every good event and skipping each bad one to the next boundary; what is skipped is
counted by reason (`DecodeStats.skips`). A file cut short yields every complete event before the cut. Size: a file
(or its gunzipped content) larger than the trace-size limit (`max_trace_bytes`) is refused before it is read, and a
gzip stream is refused as soon as it outgrows the limit or expands like a decompression bomb; devices, pipes and
sockets are refused outright.
"""

from __future__ import annotations

import enum
import gzip
import json
import math
import mmap
import os
import re
import stat
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import msgspec

from diagnoser.errors import InputError


class TraceError(InputError):
    """The file is not a readable trace; the message is one sentence for the user."""


_NO_RAW = msgspec.Raw()


class Args(msgspec.Struct, gc=False, omit_defaults=True):
    """The `args` keys the analysis reads; every other key is skipped by the decoder."""

    stream: int | str | None = None  # HIP runtime calls write it as a pointer string ("0x0")
    correlation: int | None = None
    device: int | None = None
    external_id: int | None = msgspec.field(default=None, name="External id")
    nbytes: int | None = msgspec.field(default=None, name="bytes")
    # Shapes stay raw JSON: most ops never need them and decoding lists of lists for every op is the slow part.
    # (msgspec.Raw cannot be optional; an empty Raw means absent.)
    input_dims: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Concrete Inputs")
    sync_kind: str | None = msgspec.field(default=None, name="cuda_sync_kind")
    wait_on_stream: int | None = None
    graph_id: int | None = msgspec.field(default=None, name="graph id")
    collective: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: int | None = msgspec.field(default=None, name="Out msg nelems")
    dtype: str | None = None
    group_size: int | None = msgspec.field(default=None, name="Group size")


class Cat(enum.Enum):
    """Every category Kineto (libkineto ActivityType) and older PyTorch profilers write; others decode to OTHER.

    Decoding into enum members is faster than building a new str per event, and members compare by identity in
    the hot loop."""

    CPU_OP = "cpu_op"
    OPERATOR = "operator"
    OPERATOR_OLD = "Operator"
    USER_ANNOTATION = "user_annotation"
    GPU_USER_ANNOTATION = "gpu_user_annotation"
    PYTHON_FUNCTION = "python_function"
    CUDA_RUNTIME = "cuda_runtime"
    CUDA_DRIVER = "cuda_driver"
    RUNTIME_OLD = "Runtime"
    DRIVER_OLD = "Driver"
    KERNEL = "kernel"
    KERNEL_OLD = "Kernel"
    GPU_MEMCPY = "gpu_memcpy"
    MEMCPY_OLD = "Memcpy"
    GPU_MEMSET = "gpu_memset"
    MEMSET_OLD = "Memset"
    CUDA_SYNC = "cuda_sync"
    TRACE = "Trace"
    AC2G = "ac2g"
    FWDBWD = "fwdbwd"
    ASYNC_CPU_TO_GPU = "async_cpu_to_gpu"
    ASYNC_GPU = "async_gpu"
    CPU_INSTANT_EVENT = "cpu_instant_event"
    OVERHEAD = "overhead"
    CUDA_PROFILER_RANGE = "cuda_profiler_range"
    EXTERNAL_CORRELATION = "external_correlation"
    GPU_PM_COUNTER = "gpu_pm_counter"
    COLLECTIVE_COMM = "collective_comm"
    PRIVATEUSE1_RUNTIME = "privateuse1_runtime"
    PRIVATEUSE1_DRIVER = "privateuse1_driver"
    XPU_RUNTIME = "xpu_runtime"
    XPU_DRIVER = "xpu_driver"
    MTIA_RUNTIME = "mtia_runtime"
    MTIA_CCP_EVENTS = "mtia_ccp_events"
    HPU_OP = "hpu_op"
    GLOW_RUNTIME = "glow_runtime"
    NONE = ""
    OTHER = "\x00other"

    __hash__ = object.__hash__  # members are singletons: identity hashing is right and fast

    @classmethod
    def _missing_(cls, value: object) -> Cat:
        return cls.OTHER


class Ph(enum.Enum):
    """Chrome trace event phases; unknown ones decode to OTHER."""

    X = "X"
    B = "B"
    E = "E"
    I_LOWER = "i"
    I_UPPER = "I"
    M = "M"
    C = "C"
    S_LOWER = "s"
    T_LOWER = "t"
    F_LOWER = "f"
    B_LOWER = "b"
    N_LOWER = "n"
    E_LOWER = "e"
    OTHER = "\x00other"

    __hash__ = object.__hash__

    @classmethod
    def _missing_(cls, value: object) -> Ph:
        return cls.OTHER


# Times are checked by the decoder itself (in C): a negative value fails the chunk's fast decode, and the chunk is then
# read event by event so that only the bad event is left out (and counted). JSON cannot carry NaN or infinity, and
# msgspec refuses a number beyond float range, so a decoded time is finite.
Micros = Annotated[float, msgspec.Meta(ge=0)]


class Event(msgspec.Struct, gc=False, omit_defaults=True):
    """One trace event. `ts`/`dur` are microseconds (floats carry nanoseconds), finite and >= 0; pid/tid may be
    strings."""

    ph: Ph = Ph.OTHER
    cat: Cat = Cat.NONE
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: Micros | None = None
    dur: Micros | None = None
    args: Args | None = None


class _Probe(msgspec.Struct):
    """Enough of an event to tell it from an object nested inside one."""

    ph: str | None = None
    cat: str | None = None
    ts: float | None = None


_EVENTS = msgspec.json.Decoder(list[Event], strict=False)
_EVENT = msgspec.json.Decoder(Event, strict=False)
_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_PROBE = msgspec.json.Decoder(list[_Probe])
_ANY = msgspec.json.Decoder()
_PY_JSON = json.JSONDecoder()  # the damage path: accepts NaN/Infinity and reports where the text breaks
Buffer = bytes | bytearray | mmap.mmap  # what the boundary search and the decoder read from

# Default chunk: large enough that per-chunk overhead is nil, small enough to keep memory flat.
CHUNK_BYTES = 8 << 20
# One event larger than this is not a trace event (a corrupt file or a decompression bomb of one string).
MAX_EVENT_BYTES = 64 << 20
# Real traces compress 10-50x; a gzip stream that expands over this ratio (past MIN_BOMB_BYTES) is refused.
MAX_GZIP_RATIO = 1000
MIN_BOMB_BYTES = 256 << 20
# The largest trace read by default (JSON bytes, after gunzip): a 10 s window of a CUDA-graph decode on an H100 is
# about 2.3 GB. The analysis keeps about half the JSON size in memory. Raise it with --max-trace-size or the
# environment variable below.
DEFAULT_MAX_TRACE_BYTES = 4 << 30
MAX_BYTES_ENV = "DIAGNOSER_TRACE_MAX_BYTES"
_READ_BYTES = 4 << 20

# Skip reasons (DecodeStats.skips, TraceSummary.skip_reasons).
SKIP_MALFORMED = "malformed_json"  # text that is not JSON (one count per damaged stretch)
SKIP_BAD_TYPE = "bad_field_type"  # valid JSON, a field of an unexpected type (a string ts, a list for args...)
SKIP_TRUNCATED = "truncated_tail"  # the incomplete last event of a file cut short
SKIP_NON_FINITE = "non_finite_time"  # ts or dur NaN or infinite
SKIP_NEGATIVE_TIME = "negative_time"
SKIP_NEGATIVE_DURATION = "negative_duration"
SKIP_MISSING_TIME = "missing_time"  # a complete ('X') event without ts or dur
SKIP_REASONS = (SKIP_MALFORMED, SKIP_BAD_TYPE, SKIP_TRUNCATED, SKIP_NON_FINITE, SKIP_NEGATIVE_TIME,
                SKIP_NEGATIVE_DURATION, SKIP_MISSING_TIME)

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
# '}' that ends an event, then the separator; the lookahead needs the next event's '{"' and the first letter of a key.
_BOUNDARY = re.compile(rb'\}\s*,\s*(?=\{\s*"[A-Za-z_])')
_BOUNDARY_STR = re.compile(r'\}\s*,\s*(?=\{\s*"[A-Za-z_])')
_NON_FINITE_TOKEN = re.compile(r"-?(?:NaN|nan|Infinity|inf|INF)")
_WS = b" \t\r\n"


@dataclass
class DecodeStats:
    """What the decoder read and what it had to leave out (shown to the user as `skipped`)."""

    bytes_in: int = 0  # file bytes (compressed when gzip)
    bytes_json: int = 0  # decompressed JSON bytes
    events: int = 0  # events decoded (every phase and category)
    dropped_bytes: int = 0  # bytes of damaged text skipped
    truncated: bool = False
    skips: Counter[str] = field(default_factory=Counter)  # events left out, by reason (SKIP_*)
    notes: list[str] = field(default_factory=list)

    @property
    def bad_events(self) -> int:
        return self.skips[SKIP_BAD_TYPE]

    def merge(self, other: DecodeStats) -> None:
        """Add another part's counts (the parallel reader decodes ranges of one file apart)."""
        self.events += other.events
        self.dropped_bytes += other.dropped_bytes
        self.truncated = self.truncated or other.truncated
        self.skips.update(other.skips)
        self.notes.extend(n for n in other.notes if n not in self.notes)


@dataclass
class TraceFile:
    """The metadata around `traceEvents` (deviceProperties, distributedInfo, baseTimeNanoseconds, ...)."""

    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: DecodeStats = field(default_factory=DecodeStats)


# --- limits and opening ------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: str) -> int:
    """Bytes from '4G', '512MB', '8GiB', '1.5T' or a bare number of bytes (K/M/G/T are powers of 1024 here: a
    limit, not a measurement)."""
    m = _SIZE.match(value)
    if m is None:
        raise TraceError(f"a trace size limit must be a size such as 4G, 512M or 8GiB, not '{value}'.")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise TraceError(f"a trace size limit must be positive, not '{value}'.")
    return size


def max_trace_bytes(override: int | None = None) -> int:
    """The trace-size limit: the override, else $DIAGNOSER_TRACE_MAX_BYTES, else DEFAULT_MAX_TRACE_BYTES."""
    if override is not None:
        return override
    env = os.environ.get(MAX_BYTES_ENV)
    return parse_size(env) if env else DEFAULT_MAX_TRACE_BYTES


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _too_big(path: Path, what: str, limit: int) -> TraceError:
    return TraceError(f"{path} {what}, over the {_fmt_bytes(limit)} trace-size limit; if it is a real trace, raise "
                      f"the limit with --max-trace-size or {MAX_BYTES_ENV} (the analysis keeps about half of it in "
                      "memory).")


def open_trace_file(path: Path, limit: int) -> tuple[BinaryIO, int]:
    """Open a trace for reading after checking it is a regular file within the size limit; (file, size)."""
    try:
        st = os.stat(path)  # follows links: a link to /dev/zero is judged by what it points to
    except FileNotFoundError:
        raise TraceError(f"no trace file at {path}.") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceError(f"{path} is a directory; pass the folder to analyze_trace, not to the file reader.")
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{path} is not a regular file (a device, pipe or socket); a trace is a .json or .json.gz "
                         "file.")
    if st.st_size > limit:
        raise _too_big(path, f"is {_fmt_bytes(st.st_size)}", limit)
    try:
        return open(path, "rb"), st.st_size
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}.") from None


def _open_stream(path: Path, stats: DecodeStats, limit: int) -> Iterator[bytes]:
    """Yield decompressed blocks of the file; gzip is detected by its magic bytes, not the suffix."""
    f, _ = open_trace_file(path, limit)
    with f:
        first = f.read(_READ_BYTES)
        if first[:2] != b"\x1f\x8b":
            block = first
            while block:
                stats.bytes_in += len(block)
                stats.bytes_json += len(block)
                if stats.bytes_json > limit:  # the file grew while being read
                    raise _too_big(path, "grew while it was read", limit)
                yield block
                block = f.read(_READ_BYTES)
            return
        # A stream that may outgrow the limit below the bomb ratio is measured ahead of the parse, which reads it at a
        # tenth of the inflate's pace: refused when the count passes the limit, not when the parse gets there.
        size = os.fstat(f.fileno()).st_size
        guard = InflateGuard(path, limit) if size * MAX_GZIP_RATIO > limit else None
        try:
            yield from _gunzip(f, first, path, stats, limit, guard)
        finally:
            if guard is not None:
                guard.stop()


# The inflate guard's output per call: large, so that its Python work per byte is nil and it takes the GIL rarely.
GUARD_OUT_BYTES = 64 << 20


class InflateGuard:
    """Inflates a gzip file on a thread of its own, counting the bytes and keeping none, and says when the count
    passes the limit. zlib releases the GIL while it inflates, so the count runs at a plain inflate's pace beside the
    parse, and an over-limit stream is refused after about one plain inflate of `limit` bytes. It stops at the
    limit, at the end of the stream, on damage (the reader reports that) or when stopped."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit
        self.inflated = 0
        self.over = threading.Event()
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diagnoser-inflate-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            with open(self.path, "rb") as f:
                self._count(f)
        except (OSError, zlib.error):
            pass  # the reader meets the same trouble and says what it is
        finally:
            self.done.set()

    def _count(self, f: BinaryIO) -> None:
        inflater = zlib.decompressobj(wbits=31)
        data = b""
        while not self._stop.is_set():
            if not data:
                data = f.read(_READ_BYTES)
                if not data:
                    return
            if inflater.eof:
                if not data.strip(b"\x00"):
                    data = b""
                    continue
                inflater = zlib.decompressobj(wbits=31)
            self.inflated += len(inflater.decompress(data, GUARD_OUT_BYTES))
            data = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
            if self.inflated > self.limit:
                self.over.set()
                return


def _gunzip(f: BinaryIO, first: bytes, path: Path, stats: DecodeStats, limit: int,
            guard: InflateGuard | None = None) -> Iterator[bytes]:
    inflater = zlib.decompressobj(wbits=31)
    data = first
    stats.bytes_in += len(first)
    while True:
        if guard is not None and guard.over.is_set():
            raise _too_big(path, f"expands past {_fmt_bytes(limit)} when decompressed", limit)
        if not data:
            data = f.read(_READ_BYTES)
            if not data:
                if not inflater.eof:
                    stats.truncated = True
                    stats.notes.append("the gzip stream ends early (the file was cut short)")
                return
            stats.bytes_in += len(data)
        if inflater.eof:
            if not data.strip(b"\x00"):  # zero padding after the last member
                data = b""
                continue
            inflater = zlib.decompressobj(wbits=31)  # concatenated gzip members are valid gzip
        try:
            out = inflater.decompress(data, _READ_BYTES)
        except zlib.error as exc:
            stats.truncated = True
            stats.notes.append(f"the gzip stream is damaged after {stats.bytes_json} bytes ({exc})")
            return
        data = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
        stats.bytes_json += len(out)
        if stats.bytes_json > MIN_BOMB_BYTES and stats.bytes_json > MAX_GZIP_RATIO * max(1, stats.bytes_in):
            raise TraceError(f"{path} expands more than {MAX_GZIP_RATIO}x when decompressed; refusing it as a "
                             "likely decompression bomb (a real trace compresses 10-50x).")
        if stats.bytes_json > limit:
            raise _too_big(path, f"expands past {_fmt_bytes(limit)} when decompressed", limit)
        if out:
            yield out


# --- the events array --------------------------------------------------------------------------------------------

def iter_event_chunks(path: str | Path, *, chunk_bytes: int = CHUNK_BYTES,
                      max_bytes: int | None = None) -> tuple[TraceFile, Iterator[list[Event]]]:
    """Open a trace and return its metadata holder and an iterator over lists of events.

    Metadata that comes after `traceEvents` in the file is filled in once the iterator is exhausted.
    """
    path = Path(path)
    tf = TraceFile(path=path)
    blocks = _open_stream(path, tf.stats, max_trace_bytes(max_bytes))
    head, in_object = read_head(blocks, path, tf)
    return tf, _event_chunks(head, in_object, blocks, tf, chunk_bytes)


def open_events(path: str | Path, *, chunk_bytes: int = CHUNK_BYTES,
                max_bytes: int | None = None) -> tuple[TraceFile, Iterator[tuple[bytes, int]]]:
    """As iter_event_chunks, but the chunks undecoded: (a JSON list of whole events, mode) for decode_chunk or the
    scan (tables.read_chunk)."""
    path = Path(path)
    tf = TraceFile(path=path)
    blocks = _open_stream(path, tf.stats, max_trace_bytes(max_bytes))
    head, in_object = read_head(blocks, path, tf)
    return tf, raw_chunks(head, in_object, blocks, tf, chunk_bytes)


def read_head(blocks: Iterator[bytes], path: Path, tf: TraceFile) -> tuple[bytes, bool]:
    """Consume up to the start of the events array; return the bytes after '[' and whether the top is an object."""
    buf = b""
    for block in blocks:
        if not buf:
            block = block.lstrip(_WS + b"\xef\xbb\xbf")  # leading whitespace (and a BOM) never accumulates
            if not block:
                continue
            if block[:1] == b"[":  # the Chrome "JSON Array Format": events only, no metadata
                return block[1:], False
            if block[:1] != b"{":
                raise TraceError(f"{path} is not a JSON trace (it starts with {block[:16]!r}).")
        searched = max(0, len(buf) - 64)
        buf += block
        m = _EVENTS_KEY.search(buf, searched)
        if m is not None:
            parse_head_metadata(buf[: m.start()], tf)
            return buf[m.end():], True
        if len(buf) > MAX_EVENT_BYTES:
            break
    if not buf:
        raise TraceError(f"{path} is empty.")
    if _CAPTURE_TAG.match(buf) is not None:
        raise TraceError(f"{path} is a diagnoser capture, not a trace: `diagnoser diagnose` (or `report`) reads it.")
    raise TraceError(f"{path} is JSON without a traceEvents array: not a torch.profiler/Chrome trace.")


# What `diagnoser attach --save` writes (capture.py's envelope), handed to a command that reads traces.
_CAPTURE_TAG = re.compile(rb'\{\s*"format"\s*:\s*"diagnoser-capture"')


def parse_head_metadata(head: bytes, tf: TraceFile) -> None:
    text = head.rstrip(_WS)
    if text.endswith(b","):
        text = text[:-1]
    text = text.lstrip(_WS + b"\xef\xbb\xbf")
    if text == b"{":
        return
    try:
        meta = _ANY.decode(text + b"}")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # nested past the decoder's depth too
        tf.stats.notes.append("the metadata before traceEvents is malformed and was ignored")
        return
    if isinstance(meta, dict):
        tf.metadata.update(meta)


def _parse_tail(tail: bytes, in_object: bool) -> dict[str, Any] | None:
    """The metadata after the events array's ']', or None when `tail` is not what follows the array's end."""
    text = tail.strip(_WS)
    if not in_object:
        return {} if not text else None
    if text.startswith(b","):
        text = text[1:]
    if not text.endswith(b"}"):
        return None
    try:
        meta = _ANY.decode(b"{" + text)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    except RecursionError:
        return {_DEEP_TAIL: True}
    return meta if isinstance(meta, dict) else None


# The metadata after the events nests past the decoder's depth: the events are read, the metadata is left out.
_DEEP_TAIL = "\0diagnoser: nested too deeply"


def add_tail_metadata(tf: TraceFile, meta: dict[str, Any]) -> None:
    """The metadata after the events array into tf.metadata; metadata nested too deeply to read is left out, with a
    note."""
    if meta.pop(_DEEP_TAIL, None):
        tf.stats.notes.append("the metadata after traceEvents nests too deeply to read and was ignored")
    tf.metadata.update(meta)


def find_array_end(rest: bytes, in_object: bool) -> tuple[int, dict[str, Any]] | None:
    """The index of the ']' closing the events array in `rest` (the end of the file), with the metadata after it;
    None when the array is never closed (a file cut short, or damaged at its end).

    The events are followed from the last event boundary (a ']' is not searched from the end: metadata after the
    events, such as Kineto's "INFO" log lines, holds arrays of its own)."""
    cut = last_cut(rest, 0, len(rest))
    base = cut[1] if cut is not None else 0
    text = rest[base:].decode("utf-8", "surrogateescape")
    i, n = 0, len(text)
    while True:
        i = _skip_ws_str(text, i)
        if i < n and text[i] == "]":
            break
        try:
            _, i = _PY_JSON.raw_decode(text, i)
        except (ValueError, RecursionError) as exc:  # a damaged event: on to the next boundary, or to the close
            err = max(getattr(exc, "pos", i), i + 1)
            m = _BOUNDARY_STR.search(text, err)
            if m is not None:
                i = m.end()
                continue
            if isinstance(exc, RecursionError):  # nested too deeply to follow: the close is among the last ']'
                return _close_before_end(rest, base + len(text[:i].encode("utf-8", "surrogateescape")), in_object)
            return _close_after(rest, base + len(text[:err].encode("utf-8", "surrogateescape")), in_object)
        i = _skip_ws_str(text, i)
        if i < n and text[i] == ",":  # the next event, or a trailing comma before ']'
            i += 1
            continue
        if i < n and text[i] == "]":
            break
        return None
    close = base + len(text[:i].encode("utf-8", "surrogateescape"))
    meta = _parse_tail(rest[close + 1:], in_object)
    return None if meta is None else (close, meta)


def _close_after(rest: bytes, pos: int, in_object: bool, tries: int = 64) -> tuple[int, dict[str, Any]] | None:
    """After damage in the last event: the first ']' past `pos` that the file's end follows."""
    for _ in range(tries):
        i = rest.find(b"]", pos)
        if i < 0:
            return None
        meta = _parse_tail(rest[i + 1:], in_object)
        if meta is not None:
            return i, meta
        pos = i + 1
    return None


def _close_before_end(rest: bytes, pos: int, in_object: bool, tries: int = 64) -> tuple[int, dict[str, Any]] | None:
    """After an event nested too deeply to follow (its ']' are countless): of the last ']' past `pos`, the first that
    the file's end follows (a later one may close an array in the metadata after the events)."""
    found: tuple[int, dict[str, Any]] | None = None
    hi = len(rest)
    for _ in range(tries):
        i = rest.rfind(b"]", pos, hi)
        if i < 0:
            break
        meta = _parse_tail(rest[i + 1:], in_object)
        if meta is not None:
            found = (i, meta)
        hi = i
    return found


_WS_RUN = re.compile(rb"[ \t\r\n]*")


def _skip_ws(buf: Buffer, i: int, end: int | None = None) -> int:
    # One regex match, not a loop over bytes: a stream of whitespace (a gzip bomb's favourite) cost a Python step per
    # byte, 30x the inflate itself.
    m = _WS_RUN.match(buf, i, len(buf) if end is None else end)
    return m.end() if m is not None else i


def probe_cut(buf: Buffer, cut: int, limit: int) -> int | None:
    """If the '}' at `cut` ends an event (the event after it decodes alone, with a "ph" key), the index where that
    next event starts; else None. Only bytes before `limit` are read."""
    m = _BOUNDARY.match(buf, cut, limit)
    if m is None:
        return None
    nxt = m.end()
    # the next event's own end: the next candidate boundary, or the end of the data if it has none
    j = nxt
    for _ in range(16):
        k = _BOUNDARY.search(buf, j + 1, limit)
        if k is None:
            return None
        try:
            probed = _PROBE.decode(b"".join((b"[", buf[nxt:k.start() + 1], b"]")))
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
            j = k.start()  # that '}' closed an object nested in the event: try the next one
            continue
        p = probed[0] if len(probed) == 1 else None
        return nxt if p is not None and (p.ph is not None or p.cat is not None or p.ts is not None) else None
    return None


def last_cut(buf: Buffer, start: int, end: int) -> tuple[int, int] | None:
    """The last event boundary in buf[start:end] whose next event is complete in the buffer: (index of the '}' that
    ends the chunk, index where the next event starts)."""
    hi = end
    checked = 0
    while checked < 256:
        i = buf.rfind(b"}", start, hi)
        if i < 0:
            return None
        if _BOUNDARY.match(buf, i, end):
            checked += 1
            nxt = probe_cut(buf, i, end)
            if nxt is not None:
                return i, nxt
        hi = i
    return None


def first_cut(buf: Buffer, start: int, end: int) -> tuple[int, int] | None:
    """The first event boundary at or after `start` (same result shape as last_cut)."""
    pos = start
    for _ in range(256):
        m = _BOUNDARY.search(buf, pos, end)
        if m is None:
            return None
        nxt = probe_cut(buf, m.start(), end)
        if nxt is not None:
            return m.start(), nxt
        pos = m.start() + 1
    return None


def decode_events(buf: Buffer, stats: DecodeStats, start: int = 0, end: int | None = None, *,
                  at_eof: bool = False) -> list[Event]:
    """The events in buf[start:end]: whole events separated by commas (what lies between two event boundaries, or up
    to the end of a file cut short when `at_eof`). Damaged events are skipped and counted in `stats.skips`."""
    with memoryview(buf) as view:
        data = b"".join((b"[", view[start:end], b"]"))  # one copy; the events' Raw fields may point into it
    return decode_list(data, stats, at_eof=at_eof)


def decode_list(data: bytes, stats: DecodeStats, *, at_eof: bool = False) -> list[Event]:
    """The events of `data`, a JSON list of events ('[' ... ']'): one typed decode when all is well; valid JSON with a
    bad value (a negative time, a string for a number) is decoded event by event, each bad one counted; text that
    is not JSON goes to the standard library's parser (_salvage)."""
    try:
        return _EVENTS.decode(data)
    except msgspec.ValidationError:
        pass
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # an event nested past the decoder's depth
        return _salvage(data[1:-1], stats, at_eof)                      # is damage: skipped, counted
    try:
        raws = _RAWS.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return _salvage(data[1:-1], stats, at_eof)
    out: list[Event] = []
    decode = _EVENT.decode
    for raw in raws:
        try:
            out.append(decode(raw))
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            stats.skips[_reason_of(bytes(raw))] += 1
    return out


def _reason_of(raw: bytes) -> str:
    """Why one valid-JSON event did not decode: its times, or a field of another type."""
    try:
        obj = _PY_JSON.decode(raw.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return SKIP_MALFORMED
    return _time_reason(obj) or SKIP_BAD_TYPE


def _time_reason(obj: object) -> str | None:
    """The skip reason of an event's times (non-finite, negative), or None when they are fine or absent."""
    if not isinstance(obj, dict):
        return None
    ts, dur = obj.get("ts"), obj.get("dur")
    for v in (ts, dur):
        if isinstance(v, float) and not math.isfinite(v):
            return SKIP_NON_FINITE
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts < 0:
        return SKIP_NEGATIVE_TIME
    if isinstance(dur, (int, float)) and not isinstance(dur, bool) and dur < 0:
        return SKIP_NEGATIVE_DURATION
    return None


def _salvage(data: bytes, stats: DecodeStats, at_eof: bool) -> list[Event]:
    """Event by event with the standard library's parser: keep the good events, skip each bad one to the next
    boundary and count it by reason."""
    text = data.decode("utf-8", "surrogateescape")
    n = len(text)
    out: list[Event] = []
    pos = _skip_ws_str(text, 0)
    in_damage = False
    while pos < n:
        try:
            obj, end = _PY_JSON.raw_decode(text, pos)
        except (ValueError, RecursionError) as exc:
            err = getattr(exc, "pos", pos)
            m = _BOUNDARY_STR.search(text, max(err, pos + 1))
            if m is None:  # the damage runs to the end of the data
                reason = SKIP_TRUNCATED if at_eof and _looks_cut(exc, text) else _damage_reason(text, err)
                if reason == SKIP_TRUNCATED:
                    stats.truncated = True
                if not in_damage or reason != SKIP_MALFORMED:
                    stats.skips[reason] += 1
                stats.dropped_bytes += len(text[pos:].encode("utf-8", "surrogateescape"))
                return out
            reason = _damage_reason(text, err)
            if not (in_damage and reason == SKIP_MALFORMED):  # one count per damaged stretch
                stats.skips[reason] += 1
            in_damage = reason == SKIP_MALFORMED
            stats.dropped_bytes += len(text[pos:m.end()].encode("utf-8", "surrogateescape"))
            pos = m.end()
            continue
        in_damage = False
        event = _to_event(obj, stats)
        if event is not None:
            out.append(event)
        pos = _skip_ws_str(text, end)
        if pos < n:
            if text[pos] != ",":  # junk after an event: skip to the next boundary
                m = _BOUNDARY_STR.search(text, pos)
                stats.skips[SKIP_MALFORMED] += 1
                stop = m.end() if m is not None else n
                stats.dropped_bytes += len(text[pos:stop].encode("utf-8", "surrogateescape"))
                pos = stop
                continue
            pos = _skip_ws_str(text, pos + 1)
    return out


def _skip_ws_str(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _looks_cut(exc: BaseException, text: str) -> bool:
    """Whether the parser stopped only because the text ends (an event cut short), not at a bad character."""
    err = getattr(exc, "pos", -1)
    return err >= len(text.rstrip()) - 1 or str(exc).startswith("Unterminated string")


def _damage_reason(text: str, err: int) -> str:
    return SKIP_NON_FINITE if _NON_FINITE_TOKEN.match(text, err) else SKIP_MALFORMED


def _to_event(obj: object, stats: DecodeStats) -> Event | None:
    """A parsed event (a dict from the standard library's parser) as an Event, or None (counted) when it is not one."""
    if not isinstance(obj, dict):
        stats.skips[SKIP_MALFORMED] += 1
        return None
    reason = _time_reason(obj)
    if reason is not None:
        stats.skips[reason] += 1
        return None
    try:
        # Through JSON again rather than msgspec.convert: Raw fields can only be filled by the JSON decoder.
        data = msgspec.json.encode(obj)
    except (msgspec.EncodeError, UnicodeError, OverflowError, TypeError, ValueError,  # text that is not UTF-8
            RecursionError):
        stats.skips[SKIP_MALFORMED] += 1
        return None
    try:
        return _EVENT.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        stats.skips[SKIP_BAD_TYPE] += 1
        return None


# What a raw chunk holds (raw_chunks -> decode_chunk).
WHOLE = 0  # whole events, between two event boundaries or up to the close of the array
CUT_SHORT = 1  # the rest of a file cut short: its last event may be incomplete
DAMAGED = 2  # data with damage and no event boundary after it: only the events before the damage are read


def _event_chunks(head: bytes, in_object: bool, blocks: Iterator[bytes], tf: TraceFile,
                  chunk_bytes: int) -> Iterator[list[Event]]:
    for data, mode in raw_chunks(head, in_object, blocks, tf, chunk_bytes):
        events = decode_chunk(data, mode, tf.stats)
        tf.stats.events += len(events)
        if events:
            yield events


def decode_chunk(data: bytes, mode: int, stats: DecodeStats) -> list[Event]:
    """The events of a raw chunk; what is left out is counted in `stats` (not the events read: the caller adds
    those, as the parallel reader's workers each have their own stats)."""
    if mode == DAMAGED:
        stats.skips[SKIP_MALFORMED] += 1
        return _salvage(data[1:-1], DecodeStats(), at_eof=False)  # the events before the damage, if any
    if mode == CUT_SHORT:
        before = stats.skips[SKIP_TRUNCATED]
        events = decode_list(data, stats, at_eof=True)
        stats.truncated = True
        if stats.skips[SKIP_TRUNCATED] == before and events:
            stats.notes.append("the file is truncated: the events array is never closed")
        else:
            stats.notes.append("the file is truncated: its last, incomplete event was ignored")
        return events
    return decode_list(data, stats)


def _listed(*parts: Buffer | memoryview) -> bytes:
    """The bytes of a JSON list around `parts` (one copy)."""
    return b"".join((b"[", *parts, b"]"))


def _tail(rest: bytes, in_object: bool, tf: TraceFile, ends: int | None) -> Iterator[tuple[bytes, int]]:
    """What is left once every block is read: the array's end (and the metadata after it), or the end of a part of
    the array (raw_chunks' `ends`), without a separator left after its last event."""
    if ends is None:
        yield from _final_chunk(rest, in_object, tf)
        return
    rest = rest.rstrip(_WS)
    if ends != CUT_SHORT and rest.endswith(b","):
        rest = rest[:-1]
    if rest.strip(_WS):
        yield _listed(rest), ends


def raw_chunks(head: bytes, in_object: bool, blocks: Iterator[bytes], tf: TraceFile, chunk_bytes: int,
               ends: int | None = None) -> Iterator[tuple[bytes, int]]:
    """Cut the events array (from just after its '[') into chunks of whole events, as (a JSON list of them, mode);
    the metadata after the array goes to tf.metadata. Damaged stretches with no boundary are skipped as they arrive.

    `ends` is for a part of the array (the parallel reader's ranges): the blocks end at an event boundary (WHOLE) or
    where the file was cut short (CUT_SHORT), not with the array's close."""
    stats = tf.stats
    buf = bytearray(head)
    start = _skip_ws(buf, 0)
    exhausted = False
    dropping = False  # inside damaged data with no event boundary yet: its bytes are skipped as they arrive
    want = chunk_bytes
    while True:
        while not exhausted and len(buf) - start < want:
            block = next(blocks, None)
            if block is None:
                exhausted = True
                break
            buf += block
        if dropping:
            found = first_cut(buf, start, len(buf))
            if found is None:
                keep = max(start, len(buf) - 4096)  # a boundary may straddle two blocks
                stats.dropped_bytes += keep - start
                del buf[:keep]
                start = 0
                if exhausted:
                    stats.dropped_bytes += len(buf)
                    stats.truncated = True
                    stats.notes.append("the file ends inside damaged data; the events array is never closed")
                    return
                want = len(buf) + 1  # read on
                continue
            stats.dropped_bytes += found[1] - start
            start = found[1]
            dropping = False
            want = chunk_bytes
            continue
        if exhausted:
            yield from _tail(bytes(buf[start:]), in_object, tf, ends)
            return
        cut = last_cut(buf, start, len(buf))
        if cut is not None:
            with memoryview(buf) as view:
                chunk = _listed(view[start:cut[0] + 1])
            yield chunk, WHOLE
            start = cut[1]
            want = chunk_bytes
            if start > len(buf) // 2:
                del buf[:start]
                start = 0
            continue
        # No boundary: one long event still arriving, the end of the array, or damaged data.
        start = _skip_ws(buf, start)
        if start == len(buf):  # whitespace between events never accumulates
            del buf[:]
            start = 0
            want = chunk_bytes
            continue
        pending = bytes(buf[start:])
        if len(pending) > MAX_EVENT_BYTES:
            raise TraceError(f"{tf.path} has {MAX_EVENT_BYTES >> 20} MB without an event boundary: not a trace, or "
                             "a damaged one.")
        if _is_valid_prefix(pending):
            want = 2 * len(pending)
            continue
        yield _listed(pending), DAMAGED
        stats.notes.append("part of the file is not JSON (damaged); it was skipped up to the next event")
        dropping = True


def _is_valid_prefix(data: bytes) -> bool:
    """Whether data could be the start of a valid events list (the decoder stops only because it ends)."""
    try:
        _PROBE.decode(b"[" + data)
    except msgspec.DecodeError as exc:
        return "truncated" in str(exc) or "trailing characters" in str(exc)  # (the array ends inside data)
    except (msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return False
    return True


def _final_chunk(rest: bytes, in_object: bool, tf: TraceFile) -> Iterator[tuple[bytes, int]]:
    """The last events, the close of the array and the metadata after it; a file cut short as CUT_SHORT."""
    stats = tf.stats
    if not rest.strip(_WS):
        stats.truncated = True
        stats.notes.append("the file ends before the events array is closed")
        return
    closed = find_array_end(rest, in_object)
    if closed is not None:
        i, meta = closed
        add_tail_metadata(tf, meta)
        body = rest[:i].rstrip(_WS)
        if body.endswith(b","):  # a trailing comma after the last event
            body = body[:-1]
        if body.strip(_WS):
            yield _listed(body), WHOLE
        return
    yield _listed(rest), CUT_SHORT  # no close of the array: every complete event before the cut is kept


class _Whole(msgspec.Struct):
    traceEvents: list[Event] = msgspec.field(default_factory=list)


def read_json_bytes(path: str | Path, *, max_bytes: int | None = None) -> bytes:
    """A whole trace's JSON (plain or gzip, with the reader's size and bomb guards); TraceError when it is cut
    short."""
    stats = DecodeStats()
    data = b"".join(_open_stream(Path(path), stats, max_trace_bytes(max_bytes)))
    if stats.truncated:
        raise TraceError(f"{path} is cut short ({'; '.join(stats.notes)}).")
    return data


def decode_whole(path: str | Path) -> list[Event]:
    """Bare typed decode of a whole trace in one call (the benchmark's reference; needs the file in memory)."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return msgspec.json.decode(data, type=_Whole, strict=False).traceEvents


__all__ = [
    "SKIP_REASONS",
    "Args",
    "Cat",
    "DecodeStats",
    "Event",
    "Ph",
    "TraceError",
    "TraceFile",
    "decode_events",
    "decode_whole",
    "iter_event_chunks",
    "open_events",
    "max_trace_bytes",
    "parse_size",
    "read_json_bytes",
]
