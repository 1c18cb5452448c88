"""Streaming decode of Kineto / Chrome-trace JSON (plain or gzip) into typed events, a chunk at a time.

Why not `json.load`: a multi-GB trace becomes tens of millions of dicts (5x the file size in RAM, most of the time in
the allocator and the garbage collector). Here the file is gunzipped in blocks, cut into chunks of whole events at
`}, {` boundaries, and each chunk is decoded by msgspec into small typed structs that keep only the fields the
analysis reads; unknown fields are skipped by the decoder without building objects. A chunk lives only while the
caller consumes it, so memory is bounded by the chunk size plus what the caller keeps.

Robustness: a boundary found inside a string makes its chunk invalid JSON, which the decoder reports as truncated;
the cut then moves to an earlier boundary, so a wrong cut can never yield wrong events. A chunk with a value of an
unexpected type is decoded leniently event by event and the bad events are counted, not fatal. A file cut short
yields every complete event before the cut and says how much was dropped.
"""

from __future__ import annotations

import enum
import gzip
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from diagnoser.errors import InputError


# Malformed JSON: msgspec raises UnicodeDecodeError, not DecodeError, for bytes that are not UTF-8 inside a string.
_MALFORMED = (msgspec.DecodeError, UnicodeDecodeError)


class TraceError(InputError):
    """The file is not a readable trace; the message is one sentence for the user."""


_NO_RAW = msgspec.Raw()


class Args(msgspec.Struct, gc=False, omit_defaults=True):
    """The `args` keys the analysis reads; every other key is skipped by the decoder."""

    stream: int | None = None
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


class Event(msgspec.Struct, gc=False, omit_defaults=True):
    """One trace event. `ts`/`dur` are microseconds (floats carry nanoseconds); pid/tid may be strings."""

    ph: Ph = Ph.OTHER
    cat: Cat = Cat.NONE
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float | None = None
    dur: float | None = None
    args: Args | None = None


_EVENTS = msgspec.json.Decoder(list[Event], strict=False)
_EVENT = msgspec.json.Decoder(Event, strict=False)
_ANY = msgspec.json.Decoder()

# Default chunk: large enough that per-chunk overhead is nil, small enough to keep memory flat.
CHUNK_BYTES = 8 << 20
# One event larger than this is not a trace event (a corrupt file or a decompression bomb of one string).
MAX_EVENT_BYTES = 256 << 20
# Real traces compress 10-30x; a gzip stream that expands over this ratio (past MIN_BOMB_BYTES) is refused.
MAX_GZIP_RATIO = 1000
MIN_BOMB_BYTES = 256 << 20
_READ_BYTES = 4 << 20

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_AFTER_CLOSE_BRACE = re.compile(rb"\s*,\s*\{")
_ARRAY_END = re.compile(rb"\}\s*,?\s*\]")
_WS = b" \t\r\n"


@dataclass
class DecodeStats:
    """What the decoder read and what it had to leave out (shown to the user as `skipped`)."""

    bytes_in: int = 0  # file bytes (compressed when gzip)
    bytes_json: int = 0  # decompressed JSON bytes
    events: int = 0
    bad_events: int = 0  # dropped: a field of an unexpected type
    dropped_bytes: int = 0  # dropped: malformed JSON or a truncated tail
    truncated: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class TraceFile:
    """The metadata around `traceEvents` (deviceProperties, distributedInfo, baseTimeNanoseconds, ...)."""

    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: DecodeStats = field(default_factory=DecodeStats)


def _open_stream(path: Path, stats: DecodeStats) -> Iterator[bytes]:
    """Yield decompressed blocks of the file; gzip is detected by its magic bytes, not the suffix."""
    try:
        f: BinaryIO = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"no trace file at {path}.") from None
    except IsADirectoryError:
        raise TraceError(f"{path} is a directory; pass the folder to analyze_trace, not to the file reader.") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}.") from None
    with f:
        first = f.read(_READ_BYTES)
        if first[:2] != b"\x1f\x8b":
            stats.bytes_in += len(first)
            stats.bytes_json += len(first)
            if first:
                yield first
            while block := f.read(_READ_BYTES):
                stats.bytes_in += len(block)
                stats.bytes_json += len(block)
                yield block
            return
        yield from _gunzip(f, first, path, stats)


def _gunzip(f: BinaryIO, first: bytes, path: Path, stats: DecodeStats) -> Iterator[bytes]:
    inflater = zlib.decompressobj(wbits=31)
    data = first
    stats.bytes_in += len(first)
    while True:
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
                             "likely decompression bomb (a real trace compresses 10-30x).")
        if out:
            yield out


def iter_event_chunks(path: str | Path, *, chunk_bytes: int = CHUNK_BYTES) -> tuple[TraceFile, Iterator[list[Event]]]:
    """Open a trace and return its metadata holder and an iterator over lists of events.

    Metadata that comes after `traceEvents` in the file is filled in once the iterator is exhausted.
    """
    path = Path(path)
    tf = TraceFile(path=path)
    blocks = _open_stream(path, tf.stats)
    head, rest = _read_head(blocks, path, tf)
    return tf, _event_chunks(head, rest, blocks, tf, chunk_bytes)


def _read_head(blocks: Iterator[bytes], path: Path, tf: TraceFile) -> tuple[bytes, bool]:
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
            _parse_head_metadata(buf[: m.start()], tf)
            return buf[m.end():], True
        if len(buf) > 64 << 20:
            break
    if not buf:
        raise TraceError(f"{path} is empty.")
    raise TraceError(f"{path} is JSON without a traceEvents array: not a torch.profiler/Chrome trace.")


def _parse_head_metadata(head: bytes, tf: TraceFile) -> None:
    text = head.rstrip(_WS)
    if text.endswith(b","):
        text = text[:-1]
    text = text.lstrip(_WS + b"\xef\xbb\xbf")
    if text == b"{":
        return
    try:
        meta = _ANY.decode(text + b"}")
    except _MALFORMED:
        tf.stats.notes.append("the metadata before traceEvents is malformed and was ignored")
        return
    if isinstance(meta, dict):
        tf.metadata.update(meta)


def _parse_tail_metadata(tail: bytes, tf: TraceFile) -> None:
    text = tail.strip(_WS)
    if not text or text == b"}":
        return
    if text.startswith(b","):
        text = text[1:]
    try:
        meta = _ANY.decode(b"{" + text)
    except _MALFORMED:
        tf.stats.notes.append("the metadata after traceEvents is malformed and was ignored")
        return
    if isinstance(meta, dict):
        tf.metadata.update(meta)


def _event_chunks(head: bytes, in_object: bool, blocks: Iterator[bytes], tf: TraceFile,
                  chunk_bytes: int) -> Iterator[list[Event]]:
    stats = tf.stats
    # One spare byte in front so every chunk has a byte before its first '{' to turn into '['.
    buf = bytearray(b" ") + head
    start = _skip_ws(buf, 1)
    exhausted = False
    while True:
        while not exhausted and len(buf) - start < chunk_bytes:
            block = next(blocks, None)
            if block is None:
                exhausted = True
                break
            buf += block
        if exhausted:
            yield from _final_chunk(bytes(buf[start:]), in_object, tf)
            return
        cut = _last_boundary(buf, start, len(buf))
        events = None
        while cut is not None:
            nxt = _AFTER_CLOSE_BRACE.match(buf, cut + 1)  # before the decode overwrites the ','
            events = _decode_in_place(buf, start, cut, stats)
            if events is not None:
                break
            cut = _last_boundary(buf, start, cut)  # the cut fell inside a string: try an earlier one
        if events is not None and cut is not None and nxt is not None:
            # A new buffer for what is left: the decoded events may still reference the old one (Raw fields),
            # and a bytearray with live views cannot be resized.
            buf = bytearray(b" ") + buf[nxt.end() - 1:]
            start = 1
            stats.events += len(events)
            yield events
            continue
        if len(buf) - start > MAX_EVENT_BYTES:
            raise TraceError(f"{tf.path} has a single event over {MAX_EVENT_BYTES >> 20} MB: not a trace, or "
                             "a damaged one.")
        chunk_bytes *= 2  # one event spans the whole buffer: read more before cutting again


def _skip_ws(buf: bytearray | bytes, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _last_boundary(buf: bytearray, start: int, end: int) -> int | None:
    """Index of the last '}' in buf[start:end] that is followed by ', {' (a candidate event boundary)."""
    while True:
        i = buf.rfind(b"}", start, end)
        if i < 0:
            return None
        if _AFTER_CLOSE_BRACE.match(buf, i + 1):
            return i
        end = i


def _decode_in_place(buf: bytearray, start: int, cut: int, stats: DecodeStats) -> list[Event] | None:
    """Events in buf[start:cut+1] without copying: the delimiters on either side become '[' and ']'.

    None when the cut is not a real boundary (the chunk is then truncated JSON)."""
    before, after = buf[start - 1], buf[cut + 1]
    buf[start - 1], buf[cut + 1] = 0x5B, 0x5D  # '[' and ']'
    try:
        return _EVENTS.decode(memoryview(buf)[start - 1 : cut + 2])
    except msgspec.ValidationError:
        events = _decode_leniently(bytes(buf[start - 1 : cut + 2]), stats)
        return events if events is not None else _salvage(bytes(buf[start - 1 : cut + 2]), stats)
    except _MALFORMED as exc:
        if "truncated" in str(exc):
            buf[start - 1], buf[cut + 1] = before, after
            return None
        return _salvage(bytes(buf[start - 1 : cut + 2]), stats)


def _decode_chunk(buf: bytearray | bytes, start: int, cut: int, stats: DecodeStats) -> list[Event] | None:
    """Events in buf[start:cut+1] (a copy); None when the cut is not a real boundary."""
    data = b"[" + bytes(buf[start : cut + 1]) + b"]"
    try:
        return _EVENTS.decode(data)
    except msgspec.ValidationError:
        events = _decode_leniently(data, stats)
        return events if events is not None else _salvage(data, stats)
    except _MALFORMED as exc:
        if "truncated" in str(exc):
            return None
        return _salvage(data, stats)


def _decode_leniently(data: bytes, stats: DecodeStats) -> list[Event] | None:
    """Decode event by event, dropping those whose fields have unexpected types; None when the chunk is malformed
    too (the typed decoder can stop at a wrong type before it reaches the damage): the caller salvages it."""
    try:
        raw = _ANY.decode(data)
    except _MALFORMED:
        return None
    out: list[Event] = []
    for item in raw if isinstance(raw, list) else ():
        try:
            # Through JSON again rather than msgspec.convert: Raw fields can only be filled by the JSON decoder.
            out.append(_EVENT.decode(msgspec.json.encode(item)))
        except msgspec.ValidationError:
            stats.bad_events += 1
    return out


def _salvage(data: bytes, stats: DecodeStats) -> list[Event]:
    """Malformed JSON inside a chunk: keep the events before the damage, skip to the next boundary after it."""
    body = bytearray(data[1:-1])
    out: list[Event] = []
    start = 0
    while start < len(body):
        cut = _last_boundary(body, start, len(body))
        end = len(body) - 1 if body.rstrip(_WS).endswith(b"}") else None
        for candidate in ([end] if end is not None else []) + ([cut] if cut is not None else []):
            events = _try_decode(body, start, candidate, stats)
            if events is not None:
                out.extend(events)
                nxt = _AFTER_CLOSE_BRACE.match(body, candidate + 1)
                if nxt is None:
                    return out
                start = _skip_ws(body, nxt.end() - 1)
                break
        else:
            # No clean prefix: drop the first event-sized piece and resynchronise at the next boundary.
            nxt_i = body.find(b"}", start)
            while nxt_i >= 0 and not _AFTER_CLOSE_BRACE.match(body, nxt_i + 1):
                nxt_i = body.find(b"}", nxt_i + 1)
            if nxt_i < 0:
                stats.dropped_bytes += len(body) - start
                return out
            nxt = _AFTER_CLOSE_BRACE.match(body, nxt_i + 1)
            assert nxt is not None
            new_start = _skip_ws(body, nxt.end() - 1)
            stats.dropped_bytes += new_start - start
            start = new_start
            continue
    return out


def _try_decode(body: bytearray, start: int, end: int, stats: DecodeStats) -> list[Event] | None:
    """Decode body[start:end+1] greedily from the largest prefix that is valid; None if even one event fails."""
    cut: int | None = end
    while cut is not None and cut >= start:
        data = b"[" + bytes(body[start : cut + 1]) + b"]"
        try:
            return _EVENTS.decode(data)
        except msgspec.ValidationError:
            events = _decode_leniently(data, stats)
            if events is not None:
                return events
        except _MALFORMED:
            pass
        cut = _last_boundary(body, start, cut)
    return None


def _final_chunk(rest: bytes, in_object: bool, tf: TraceFile) -> Iterator[list[Event]]:
    """The last events, the close of the array and the metadata after it; salvage a file cut short."""
    stats = tf.stats
    if not rest.strip(_WS):
        stats.truncated = True
        stats.notes.append("the file ends before the events array is closed")
        return
    if rest.lstrip(_WS).startswith(b"]"):  # empty events array (or the previous chunk ended the array)
        after = rest.lstrip(_WS)[1:]
        if in_object:
            _parse_tail_metadata(after, tf)
        return
    for m in _ARRAY_END.finditer(rest):
        events = _decode_chunk(rest, 0, m.start(), stats)
        if events is None:
            continue
        stats.events += len(events)
        if in_object:
            _parse_tail_metadata(rest[m.end():], tf)
        yield events
        return
    # No close of the array: the file was cut short. Keep every complete event before the cut.
    stats.truncated = True
    buf = bytearray(rest)
    cut = _last_boundary(buf, 0, len(buf))
    while cut is not None:
        events = _decode_chunk(buf, 0, cut, stats)
        if events is not None:
            stats.events += len(events)
            stats.dropped_bytes += len(buf) - cut - 1
            stats.notes.append(f"the file is truncated: the last {len(buf) - cut - 1} bytes (an incomplete event) "
                               "were ignored")
            yield events
            return
        cut = _last_boundary(buf, 0, cut)
    stats.dropped_bytes += len(buf)
    stats.notes.append(f"the file is truncated inside its first event chunk; {len(buf)} bytes were ignored")


class _Whole(msgspec.Struct):
    traceEvents: list[Event] = msgspec.field(default_factory=list)


def read_json_bytes(path: str | Path) -> bytes:
    """A whole trace's JSON (plain or gzip, with the reader's bomb guard); TraceError when it is cut short."""
    stats = DecodeStats()
    data = b"".join(_open_stream(Path(path), stats))
    if stats.truncated:
        raise TraceError(f"{path} is cut short ({'; '.join(stats.notes)}).")
    return data


def decode_whole(path: str | Path) -> list[Event]:
    """Bare typed decode of a whole trace in one call (the benchmark's reference; needs the file in memory)."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return msgspec.json.decode(data, type=_Whole, strict=False).traceEvents


__all__ = ["Args", "Cat", "DecodeStats", "Event", "Ph", "TraceError", "TraceFile", "decode_whole",
           "iter_event_chunks", "read_json_bytes"]
