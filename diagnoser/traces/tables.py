"""The events the analysis needs, held as columns (typed arrays) rather than millions of objects.

`collect(path)` streams the trace once. For each event it keeps a handful of numbers: GPU work (kernels, copies,
memsets) with device, stream, start, duration, name id and correlation; the runtime/driver calls that launch or
wait; host activity intervals per thread (to tell a busy host from an idle one); profiler steps; and, for ops
whose FLOPs can be derived, their shapes. Names are interned to small integers. Everything else is dropped as
soon as its chunk is processed.
"""

from __future__ import annotations

import gc
from array import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import compress
from operator import add, attrgetter
from pathlib import Path
from typing import Any

import msgspec

from diagnoser.traces.classify import (
    COMM_ANNOTATION_PREFIX,
    COMM_OP_NAMES,
    COMM_OP_PREFIX,
    COPY_CALLS,
    GRAPH_LAUNCHES,
    HOST_SYNC_KINDS,
    KERNEL_LAUNCHES,
    STEP_PREFIX,
    STREAM_WAIT_KIND,
    SYNC_CALLS,
    runtime_kind,
)
from diagnoser.traces.compiled import require_compiled
from diagnoser.traces.decode import (
    CHUNK_BYTES,
    SKIP_BAD_TYPE,
    SKIP_MISSING_TIME,
    WHOLE,
    Cat,
    DecodeStats,
    Event,
    Ph,
    TraceFile,
    decode_chunk,
    open_events,
)
from diagnoser.traces.engine_steps import CPU_OP_CLASS, VLLM_STEP_PREFIX, parse_step
from diagnoser.traces.flops import COSTED_OPS

try:
    require_compiled()  # (DIAGNOSER_NO_C=1: the Python path, as without a compiler)
    from diagnoser.traces._scan import scan as _scan
except ImportError:  # installed without a C compiler: the typed decode reads every chunk (same answers, slower)
    _scan = None  # type: ignore[assignment]

GPU_KERNEL = 0
GPU_MEMCPY = 1
GPU_MEMSET = 2

_GPU_CATS = {Cat.KERNEL: GPU_KERNEL, Cat.KERNEL_OLD: GPU_KERNEL, Cat.GPU_MEMCPY: GPU_MEMCPY,
             Cat.MEMCPY_OLD: GPU_MEMCPY, Cat.GPU_MEMSET: GPU_MEMSET, Cat.MEMSET_OLD: GPU_MEMSET}
_RUNTIME_CATS = {Cat.CUDA_RUNTIME, Cat.CUDA_DRIVER, Cat.RUNTIME_OLD, Cat.DRIVER_OLD}
_OTHER_HOST_CATS = {Cat.PYTHON_FUNCTION, Cat.OPERATOR, Cat.OPERATOR_OLD}
_REST_CATS = _OTHER_HOST_CATS | {Cat.USER_ANNOTATION, Cat.GPU_USER_ANNOTATION, Cat.CUDA_SYNC, Cat.TRACE}
_CAT_OF = attrgetter("cat")
_PH = attrgetter("ph")
_PH_X = Ph.X
_TS = attrgetter("ts")
_DUR = attrgetter("dur")
_TID = attrgetter("tid")
_NAME = attrgetter("name")
_DEVICE = attrgetter("args.device")
_STREAM = attrgetter("args.stream")
_CORR = attrgetter("args.correlation")
_NBYTES = attrgetter("args.nbytes")
_GRAPH = attrgetter("args.graph_id")


@dataclass
class CostedOp:
    """An op whose FLOPs can be derived; shapes kept as raw JSON until needed."""

    name: str
    tid: int
    ts: float
    dur: float
    external_id: int | None
    dims: bytes
    types: bytes
    concrete: bytes


# A CPU op at least this long is kept with its name (Tables.long_ops), to say which ops hold the GPU's idle time.
LONG_OP_US = 500.0
# The External ids of the first this many CPU ops tell whether the trace is a sample (facts.sampling); later ones
# are not kept.
SAMPLE_IDS = 200_000


@dataclass
class Tables:
    """Columns of the events the analysis reads. Times are trace microseconds (floats keep nanoseconds)."""

    names: list[str] = field(default_factory=list)
    name_ids: dict[str, int] = field(default_factory=dict)
    tids: dict[Any, int] = field(default_factory=dict)  # thread id (int or str) -> small int
    # GPU work
    g_dev: array = field(default_factory=lambda: array("i"))
    g_stream: array = field(default_factory=lambda: array("q"))
    g_kind: array = field(default_factory=lambda: array("b"))
    g_ts: array = field(default_factory=lambda: array("d"))
    g_dur: array = field(default_factory=lambda: array("d"))
    g_name: array = field(default_factory=lambda: array("i"))
    g_corr: array = field(default_factory=lambda: array("q"))
    g_bytes: array = field(default_factory=lambda: array("q"))
    g_graph: array = field(default_factory=lambda: array("q"))  # "graph id" arg, -1 when absent
    # runtime/driver calls that launch, copy, replay a graph or wait (others are only host activity)
    r_kind: array = field(default_factory=lambda: array("b"))
    r_ts: array = field(default_factory=lambda: array("d"))
    r_dur: array = field(default_factory=lambda: array("d"))
    r_tid: array = field(default_factory=lambda: array("q"))
    r_name: array = field(default_factory=lambda: array("i"))
    r_corr: array = field(default_factory=lambda: array("q"))
    # cuda_sync activity records on the GPU rows
    s_dev: array = field(default_factory=lambda: array("i"))
    s_host: array = field(default_factory=lambda: array("b"))  # 1: mirrors a host wait; 0: stream-wait-event
    s_ts: array = field(default_factory=lambda: array("d"))
    s_dur: array = field(default_factory=lambda: array("d"))
    # host activity: any CPU-side event (op, runtime call, annotation, Python frame), in file order
    h_tid: array = field(default_factory=lambda: array("q"))
    h_ts: array = field(default_factory=lambda: array("d"))
    h_end: array = field(default_factory=lambda: array("d"))
    costed: list[CostedOp] = field(default_factory=list)
    steps: list[tuple[str, float, float, int]] = field(default_factory=list)  # (name, ts, dur, tid)
    # a serving engine's step annotations: (ts, dur, prefill requests, prompt tokens, decode requests, tokens)
    engine_steps: list[tuple[float, float, int, int, int, int]] = field(default_factory=list)
    classed_ops: list[tuple[str, int, float, float]] = field(default_factory=list)  # (class, tid, ts, dur): CPU ops
    trace_spans: list[tuple[float, float]] = field(default_factory=list)  # the profiler's own window(s)
    # CPU ops and runtime calls of LONG_OP_US or more, (name, start, end): what the host was inside while the GPU
    # waited for it
    # (few: a decode step's ops are microseconds; a DDP forward's bucket copy or an optimizer step, milliseconds).
    long_ops: list[tuple[str, float, float]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # events seen: cpu_op, runtime, gpu, events (all)
    skips: Counter[str] = field(default_factory=Counter)  # events dropped here, by reason (decode.SKIP_*)
    op_names: Counter[str] = field(default_factory=Counter)  # CPU ops and annotations by name
    runtime_names: Counter[str] = field(default_factory=Counter)  # runtime and driver calls by name
    ext_ids: array = field(default_factory=lambda: array("q"))  # the first CPU ops' External ids, in file order
    comm_ops: list[tuple[int, float, float, str]] = field(default_factory=list)  # (tid, ts, end, collective)
    # "nccl:<collective>" annotations the profiler projects onto GPU streams: (device, stream, ts, end, collective)
    gpu_comm: list[tuple[int, int, float, float, str]] = field(default_factory=list)
    g_coll: dict[int, str] = field(default_factory=dict)  # GPU op index -> its "Collective name" arg
    shapes_seen: bool = False  # ops carry "Input Dims" (the profiler ran with record_shapes=True)
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: DecodeStats = field(default_factory=DecodeStats)
    path: Path = Path()

    def tid(self, tid: object) -> int:
        """Thread ids are ints in Kineto traces; anything else (or an int beyond 64 bits) gets a stable negative
        stand-in."""
        if isinstance(tid, int) and 0 <= tid < (1 << 63):
            return tid
        key = self.tids.get(tid)
        if key is None:
            key = self.tids[tid] = -1 - len(self.tids)
        return key

    def name_id(self, name: str) -> int:
        nid = self.name_ids.get(name)  # (a bound method call per event; still cheaper than storing the str)
        if nid is None:
            nid = self.name_ids[name] = len(self.names)
            self.names.append(name)
        return nid

    def extend(self, part: Tables) -> None:
        """Append the columns of `part`, the events that follow in the file (the parallel reader's chunks): the
        result is what one pass over both would have built. Name ids and thread stand-ins are renumbered."""
        names = [self.name_id(n) for n in part.names]
        tids = {stand_in: self.tid(key) for key, stand_in in part.tids.items()}

        def tid_of(values: array) -> array | list[int]:
            return values if not tids else [tids.get(v, v) for v in values]

        n0 = len(self.g_ts)
        for col in ("g_dev", "g_stream", "g_kind", "g_ts", "g_dur", "g_corr", "g_bytes", "g_graph", "r_kind", "r_ts",
                    "r_dur", "r_corr", "s_dev", "s_host", "s_ts", "s_dur", "h_ts", "h_end", "ext_ids"):
            getattr(self, col).extend(getattr(part, col))
        self.g_name.extend(array("i", map(names.__getitem__, part.g_name)))
        self.r_name.extend(array("i", map(names.__getitem__, part.r_name)))
        self.r_tid.extend(tid_of(part.r_tid))
        self.h_tid.extend(tid_of(part.h_tid))
        self.g_coll.update((n0 + i, c) for i, c in part.g_coll.items())
        for op in part.costed:
            op.tid = tids.get(op.tid, op.tid)
        self.costed.extend(part.costed)
        self.steps.extend((n, ts, d, tids.get(tid, tid)) for n, ts, d, tid in part.steps)
        self.engine_steps.extend(part.engine_steps)
        self.classed_ops.extend((c, tids.get(tid, tid), ts, d) for c, tid, ts, d in part.classed_ops)
        self.comm_ops.extend((tids.get(tid, tid), ts, e, c) for tid, ts, e, c in part.comm_ops)
        self.trace_spans.extend(part.trace_spans)
        self.long_ops.extend(part.long_ops)
        self.gpu_comm.extend(part.gpu_comm)
        for counter in ("counts", "skips", "op_names", "runtime_names"):
            getattr(self, counter).update(getattr(part, counter))
        self.shapes_seen = self.shapes_seen or part.shapes_seen

    def host_span(self) -> tuple[float, float]:
        """The first host event's start and the last one's end; (inf, -inf) without any. Computed when asked: the
        analysis needs it only for a trace without the profiler's own span (a pass over millions of times)."""
        if not self.h_ts:
            return float("inf"), float("-inf")
        return min(self.h_ts), max(self.h_end)


def _int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) else default


def collect(path: str | Path, *, chunk_bytes: int = CHUNK_BYTES, max_bytes: int | None = None,
            fast: bool = True) -> Tables:
    """Stream a trace file into Tables (one pass, bounded memory). `fast=False` reads every chunk with the typed
    decode (the scan's reference in the tests)."""
    path = Path(path)
    tf, chunks = open_events(path, chunk_bytes=chunk_bytes, max_bytes=max_bytes)
    t = Tables(path=path)
    # Nothing built here forms reference cycles; collecting during the pass only costs time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for data, mode in chunks:
            tf.stats.events += read_chunk(t, data, mode, tf.stats, fast=fast)
    finally:
        if was_enabled:
            gc.enable()
    _finish(t, tf)
    return t


def scan_built() -> bool:
    """Whether the compiled scan (_scan.c) is installed: without it every chunk is typed-decoded."""
    return _scan is not None


def _finish(t: Tables, tf: TraceFile) -> None:
    t.metadata = tf.metadata
    t.stats = tf.stats


def read_chunk(t: Tables, data: bytes, mode: int, stats: DecodeStats, *, fast: bool = True) -> int:
    """Read one raw chunk (decode.raw_chunks) into `t`; the number of events it held. A chunk of plain events is
    read by the scan (_scan.c) straight into columns; any other, or every chunk without the compiled scan, by the
    typed decode and `_ingest`. Both give the same columns (tests/test_trace_scan.py)."""
    if fast and mode == WHOLE:
        n = scan_chunk(t, data)
        if n is not None:
            return n
    events = decode_chunk(data, mode, stats)
    if events:
        _ingest(t, events)
    return len(events)


def _ingest(t: Tables, events: list[Event]) -> None:
    """Sort a chunk's events by category (one identity test each), then extract columns in batches.

    Each batch is first checked for valid times (complete 'X' events with finite, non-negative ts and dur: a few
    C-level passes); a batch that fails is filtered event by event and what is dropped is counted by reason. Each
    batch then has a fast path that assumes well-formed Kineto events (int thread ids, args present) and a per-event
    slow path taken only for a chunk where that assumption fails. List comprehensions and array.fromlist are the
    fastest way CPython offers to move a field of many objects into a column."""
    cpu_ops, runtime, gpu, rest = _by_category(events)
    counts = t.counts
    counts["events"] += len(events)
    if cpu_ops:
        _ingest_cpu_ops(t, cpu_ops)
    if runtime:
        _ingest_runtime(t, runtime)
    if gpu:
        gpu, ts, durs = _checked(t, gpu)
        counts["gpu"] += len(gpu)
        _gpu_work(t, gpu, ts, durs)
    if rest:
        rest, _, _ = _checked(t, rest, complete_only=False)
        for e in rest:
            _other(t, e)


def _by_category(events: list[Event]) -> tuple[list[Event], list[Event], list[Event], list[Event]]:
    """CPU ops, runtime calls, GPU work and the rest read (flows from CPU to GPU and unknown categories dropped)."""
    cpu_ops: list[Event] = []
    runtime: list[Event] = []
    gpu: list[Event] = []
    rest: list[Event] = []
    cpu_op, ac2g = Cat.CPU_OP, Cat.AC2G
    gpu_cats, runtime_cats, rest_cats = _GPU_CATS, _RUNTIME_CATS, _REST_CATS
    for e in events:
        c = e.cat
        if c is cpu_op:
            cpu_ops.append(e)
        elif c is ac2g:
            continue
        elif c in runtime_cats:
            runtime.append(e)
        elif c in gpu_cats:
            gpu.append(e)
        elif c in rest_cats:
            rest.append(e)
    return cpu_ops, runtime, gpu, rest


def _ingest_cpu_ops(t: Tables, cpu_ops: list[Event]) -> None:
    """A batch of CPU ops: host activity, long ops, names, external ids, collectives, classed and costed ops."""
    cpu_ops, ts, durs = _checked(t, cpu_ops)
    t.counts["cpu_op"] += len(cpu_ops)
    if not t.shapes_seen:
        t.shapes_seen = any(e.args is not None and bool(e.args.input_dims) for e in cpu_ops[:64])
    cpu_ops = _host_activity(t, cpu_ops, ts, durs)
    for i in compress(range(len(durs)), map(LONG_OP_US.__le__, durs)):
        t.long_ops.append((cpu_ops[i].name, ts[i], ts[i] + durs[i]))
    names = Counter(map(_NAME, cpu_ops))
    t.op_names.update(names)
    # (each part of the parallel reader keeps its own first ids: the merged columns start with the same ones)
    if len(t.ext_ids) < SAMPLE_IDS:
        _external_ids(t, cpu_ops)
    comm = {n for n in names if n in _COMM_OP_NAMES or n.startswith(COMM_OP_PREFIX)}
    if comm:
        _comm_ops(t, [e for e in cpu_ops if e.name in comm])
    classed = [n for n in names if n in CPU_OP_CLASS]
    if classed:
        cls_of = CPU_OP_CLASS
        t.classed_ops.extend((cls_of[e.name], t.tid(e.tid), e.ts, e.dur)  # type: ignore[misc]
                             for e in cpu_ops if e.name in cls_of)
    costed = COSTED_OPS
    _costed_ops(t, [e for e in cpu_ops if e.name in costed])


def _costed_ops(t: Tables, ops: list[Event]) -> None:
    """The ops (of COSTED_OPS) that carry shapes, kept with their shapes as raw JSON."""
    for e in ops:
        args = e.args
        if args is not None and args.input_dims:
            t.costed.append(CostedOp(e.name, t.tid(e.tid), e.ts, e.dur, args.external_id,  # type: ignore[arg-type]
                                     bytes(args.input_dims), bytes(args.input_type), bytes(args.concrete)))


def _ingest_runtime(t: Tables, runtime: list[Event]) -> None:
    """A batch of CUDA/HIP runtime and driver calls: host activity, long calls, launches, syncs and copies."""
    runtime, ts, durs = _checked(t, runtime)
    t.counts["runtime"] += len(runtime)
    runtime = _host_activity(t, runtime, ts, durs)
    # A long runtime call holds the host too (a 2 ms cudaGraphLaunch, a blocking copy).
    for i in compress(range(len(durs)), map(LONG_OP_US.__le__, durs)):
        t.long_ops.append((runtime[i].name, ts[i], ts[i] + durs[i]))
    get_kind = _RUNTIME_KIND_GET
    kinds = [get_kind(e.name) for e in runtime]
    _runtime_calls(t, list(compress(runtime, kinds)), list(filter(None, kinds)))
    t.runtime_names.update(map(_NAME, runtime))


# --- the scan's columns (_scan.c): the same Tables as _ingest, from packed arrays -------------------------------------

_DECODE_LIST = msgspec.json.Decoder(list[Event], strict=False)


def _events_at(data: bytes | memoryview, offsets: bytes) -> list[Event]:
    """The events at the given (start, end) byte offsets of `data`, typed-decoded."""
    spans = array("q", offsets)
    starts, ends = spans[0::2], spans[1::2]
    with memoryview(data) as view:
        listed = b",".join(view[s:e] for s, e in zip(starts, ends, strict=True))
    return _DECODE_LIST.decode(b"".join((b"[", listed, b"]")))


def scan_chunk(t: Tables, data: bytes | memoryview, *, bare: bool = False) -> int | None:
    """A chunk read by the scan into `t`, in _ingest's order (CPU ops, runtime calls, GPU work, the rest): the number
    of events it held, or None when the scan finds it not plain or is not built (then nothing is added). `bare`: the
    comma-separated events without the list's brackets (a range of a mapped file). The few events read for more
    than columns (the rest's categories, collectives, ops with shapes) are typed-decoded from their bytes first."""
    if _scan is None:
        return None
    cols = _scan(data, _RUNTIME_KINDS, _interest, _SYNC_KINDS, LONG_OP_US, bare)
    if cols is None:
        return None
    picked = list(zip(array("i", cols[_S_PICK_IDX]), cols[_S_PICK_FLAG], strict=True))
    try:
        rest = _events_at(data, cols[_S_REST_OFF]) if cols[_S_REST_OFF] else []
    except (msgspec.DecodeError, msgspec.ValidationError):  # read otherwise by the typed decode: leave it to it
        return None
    n_events: int = cols[_S_EVENTS]
    t.counts["events"] += n_events
    if cols[_S_CPU_TS]:
        _scanned_cpu_ops(t, cols, picked)
    if cols[_S_RT_TS]:
        _scanned_runtime(t, cols)
    if cols[_S_G_TS]:
        _scanned_gpu_work(t, cols)
    if cols[_S_S_TS]:  # the cuda_sync records kept (as _other keeps them)
        t.s_dev.frombytes(cols[_S_S_DEV])
        t.s_host.frombytes(cols[_S_S_HOST])
        t.s_ts.frombytes(cols[_S_S_TS])
        t.s_dur.frombytes(cols[_S_S_DUR])
    if rest:
        rest, _, _ = _checked(t, rest, complete_only=False)
        for e in rest:
            _other(t, e)
    return n_events


# The cuda_sync kinds kept on the GPU rows: 2 a host wait, 1 a stream waiting on an event (_other's test).
_SYNC_KINDS = {**dict.fromkeys(HOST_SYNC_KINDS, 2), STREAM_WAIT_KIND: 1}

# Why a CPU op is read for more than its columns (the scan asks once per name in a chunk).
_COMM, _CLASSED, _COSTED = 1, 2, 4


def _interest(name: str) -> int:
    return ((_COMM if name in _COMM_OP_NAMES or name.startswith(COMM_OP_PREFIX) else 0)
            | (_CLASSED if name in CPU_OP_CLASS else 0) | (_COSTED if name in COSTED_OPS else 0))


def _scanned_cpu_ops(t: Tables, cols: tuple[Any, ...], picked: list[tuple[int, int]]) -> None:
    names: list[str] = cols[_S_NAMES]
    t.counts["cpu_op"] += len(cols[_S_CPU_TS]) // 8
    if not t.shapes_seen:
        t.shapes_seen = cols[_S_SHAPES]
    t.h_tid.frombytes(cols[_S_CPU_TID])
    t.h_ts.frombytes(cols[_S_CPU_TS])
    t.h_end.frombytes(cols[_S_CPU_END])
    t.long_ops.extend(cols[_S_CPU_LONG])
    counts = array("q", cols[_S_CPU_COUNT])
    t.op_names.update({names[i]: counts[i] for i in array("i", cols[_S_C_ORDER])})
    if len(t.ext_ids) < SAMPLE_IDS:
        t.ext_ids.frombytes(cols[_S_CPU_EXT])
    if picked:
        tid = t.tid
        tids, ts, durs = array("q", cols[_S_CPU_TID]), array("d", cols[_S_CPU_TS]), array("d", cols[_S_CPU_DUR])
        name_of = array("i", cols[_S_CPU_NAME])
        comm = [k for k, f in picked if f & _COMM]
        if comm:  # as _comm_ops: the op's "Collective name", else its name
            t.comm_ops.extend((tid(tids[k]), ts[k], ts[k] + durs[k], coll or names[name_of[k]])
                              for k, coll in zip(comm, cols[_S_CPU_COLLS], strict=True))
        cls_of = CPU_OP_CLASS
        t.classed_ops.extend((cls_of[names[name_of[k]]], tid(tids[k]), ts[k], durs[k])
                             for k, f in picked if f & _CLASSED)
        # as _costed_ops: the ops with shapes, their shapes raw
        t.costed.extend(CostedOp(names[name_of[k]], tid(tids[k]), ts[k], durs[k], ext, dims, types, concrete)
                        for k, ext, dims, types, concrete in cols[_S_COSTED])


def _global_ids(t: Tables, names: list[str], order: bytes, local: bytes) -> array:
    """Chunk-local name indices as the table's name ids, new names numbered in order of first sight (as _name_ids)."""
    glob: dict[int, int] = {}
    for i in array("i", order):
        glob[i] = t.name_id(names[i])
    return array("i", map(glob.__getitem__, array("i", local)))


def _scanned_runtime(t: Tables, cols: tuple[Any, ...]) -> None:
    names: list[str] = cols[_S_NAMES]
    t.counts["runtime"] += len(cols[_S_RT_TS]) // 8
    t.h_tid.frombytes(cols[_S_RT_TID])
    t.h_ts.frombytes(cols[_S_RT_TS])
    t.h_end.frombytes(cols[_S_RT_END])
    t.long_ops.extend(cols[_S_RT_LONG])
    t.r_ts.frombytes(cols[_S_L_TS])
    t.r_dur.frombytes(cols[_S_L_DUR])
    t.r_tid.frombytes(cols[_S_L_TID])
    t.r_corr.frombytes(cols[_S_L_CORR])
    t.r_kind.frombytes(cols[_S_L_KIND])
    t.r_name.extend(_global_ids(t, names, cols[_S_L_ORDER], cols[_S_L_NAME]))
    counts = array("q", cols[_S_RT_COUNT])
    t.runtime_names.update({names[i]: counts[i] for i in array("i", cols[_S_R_ORDER])})


def _scanned_gpu_work(t: Tables, cols: tuple[Any, ...]) -> None:
    names: list[str] = cols[_S_NAMES]
    n0 = len(t.g_ts)
    t.counts["gpu"] += len(cols[_S_G_TS]) // 8
    t.g_ts.frombytes(cols[_S_G_TS])
    t.g_dur.frombytes(cols[_S_G_DUR])
    t.g_dev.frombytes(cols[_S_G_DEV])
    t.g_stream.frombytes(cols[_S_G_STREAM])
    t.g_corr.frombytes(cols[_S_G_CORR])
    t.g_kind.frombytes(cols[_S_G_KIND])
    t.g_name.extend(_global_ids(t, names, cols[_S_G_ORDER], cols[_S_G_NAME]))
    t.g_bytes.frombytes(cols[_S_G_BYTES])
    t.g_graph.frombytes(cols[_S_G_GRAPH])
    t.g_coll.update((n0 + i, c) for i, c in cols[_S_COLLS])


# The scan's tuple, in _scan.c's order (its enum, then the extras).
(_S_CPU_TID, _S_CPU_TS, _S_CPU_DUR, _S_CPU_END, _S_CPU_NAME, _S_CPU_EXT,
 _S_RT_TID, _S_RT_TS, _S_RT_DUR, _S_RT_END, _S_RT_NAME,
 _S_L_KIND, _S_L_TS, _S_L_DUR, _S_L_TID, _S_L_CORR, _S_L_NAME,
 _S_G_KIND, _S_G_DEV, _S_G_STREAM, _S_G_TS, _S_G_DUR, _S_G_NAME, _S_G_CORR, _S_G_BYTES, _S_G_GRAPH,
 _S_REST_OFF, _S_L_ORDER, _S_G_ORDER, _S_C_ORDER, _S_R_ORDER, _S_PICK_IDX, _S_PICK_FLAG,
 _S_S_DEV, _S_S_HOST, _S_S_TS, _S_S_DUR,
 _S_EVENTS, _S_NAMES, _S_CPU_COUNT, _S_RT_COUNT, _S_CPU_LONG, _S_RT_LONG, _S_COLLS, _S_CPU_COLLS, _S_COSTED,
 _S_SHAPES) = range(47)


def _checked(t: Tables, events: list[Event],
             complete_only: bool = True) -> tuple[list[Event], list[float], list[float]]:
    """The events of a batch with both times, and their ts and dur; complete events without one are counted in
    t.skips. (The decoder already refused negative and non-finite times.)

    Only complete ('X') events carry a duration; with `complete_only` other phases are dropped silently (they are
    not what the batch's category is read for), otherwise they are kept unchecked."""
    ts = list(map(_TS, events))
    durs = list(map(_DUR, events))
    if not _has_none(durs) and not _has_none(ts):  # only complete events carry a duration
        return events, ts, durs
    keep: list[Event] = []
    for e, ph, s, d in zip(events, map(_PH, events), ts, durs, strict=True):
        if ph is not _PH_X:
            if not complete_only:
                keep.append(e)
        elif s is None or d is None:
            t.skips[SKIP_MISSING_TIME] += 1
        else:
            keep.append(e)
    return keep, [e.ts for e in keep], [e.dur for e in keep]  # type: ignore[misc]


def _has_none(numbers: list[float | None] | list[int | None]) -> bool:
    """Whether a list of numbers holds a None: sum() stops at the first None with a TypeError, and is several times
    faster than `None in numbers`, which compares each number with None through both types' comparisons."""
    try:
        sum(numbers)  # type: ignore[arg-type]
    except TypeError:
        return True
    return False


def _external_ids(t: Tables, ops: list[Event]) -> None:
    """The ops' External ids (the profiler numbers every op it records; a trace that kept a sample of the ops has
    large holes between consecutive ids)."""
    try:
        ids = [e.args.external_id for e in ops]  # type: ignore[union-attr]
    except AttributeError:
        ids = [e.args.external_id if e.args is not None else None for e in ops]
    if _has_none(ids):
        ids = [i for i in ids if i is not None]
    try:
        t.ext_ids.fromlist(ids)
    except OverflowError:
        t.ext_ids.fromlist([i for i in ids if -(1 << 63) <= i < (1 << 63)])  # type: ignore[operator]


def _comm_ops(t: Tables, ops: list[Event]) -> None:
    """Host-side records of collectives (c10d ops, record_param_comms with its "Collective name"), to name the
    collective a communication kernel ran for when the kernel itself does not say."""
    for e in ops:
        coll = e.args.collective if e.args is not None and e.args.collective else e.name
        if e.ts is not None and e.dur is not None:
            t.comm_ops.append((t.tid(e.tid), e.ts, e.ts + e.dur, coll))


def _truncate(n: int, *columns: array) -> None:
    for col in columns:
        del col[n:]


def _host_activity(t: Tables, events: list[Event], ts: list[float], durs: list[float]) -> list[Event]:
    """Record the (time-checked) events as host activity of their threads; return them."""
    n0 = len(t.h_ts)
    try:
        t.h_tid.fromlist([e.tid for e in events])  # TypeError on a thread id that is not an int
        t.h_ts.fromlist(ts)
        t.h_end.fromlist(list(map(add, ts, durs)))
        return events
    except (TypeError, OverflowError):
        _truncate(n0, t.h_tid, t.h_ts, t.h_end)
    for e, s, d in zip(events, ts, durs, strict=True):
        t.h_tid.append(t.tid(e.tid))
        t.h_ts.append(s)
        t.h_end.append(s + d)
    return events


def _name_ids(t: Tables, events: list[Event]) -> list[int]:
    """Interned ids of the events' names (a dict lookup each; new names are rare)."""
    get = t.name_ids.get
    ids = [get(e.name) for e in events]
    if _has_none(ids):
        ids = [t.name_id(e.name) if i is None else i for e, i in zip(events, ids, strict=True)]
    return ids  # type: ignore[return-value]


def _runtime_calls(t: Tables, calls: list[Event], kinds: list[int]) -> None:
    n0 = len(t.r_ts)
    try:
        t.r_ts.fromlist([e.ts for e in calls])
        t.r_dur.fromlist([e.dur for e in calls])
        t.r_tid.fromlist([e.tid for e in calls])
        # Fast path: args without correlation (None) raise AttributeError, handled by the slow path below.
        t.r_corr.fromlist([e.args.correlation for e in calls])  # type: ignore[union-attr]
    except (TypeError, AttributeError, OverflowError):
        _truncate(n0, t.r_ts, t.r_dur, t.r_tid, t.r_corr)
        for e in calls:
            args = e.args
            t.r_ts.append(e.ts)
            t.r_dur.append(e.dur)
            t.r_tid.append(t.tid(e.tid))
            t.r_corr.append(_int64(args.correlation if args is not None else None, -1))
    t.r_kind.fromlist(kinds)
    t.r_name.fromlist(_name_ids(t, calls))


def _gpu_work(t: Tables, events: list[Event], ts: list[float], durs: list[float]) -> None:
    n0 = len(t.g_ts)
    try:
        t.g_ts.fromlist(ts)
        t.g_dur.fromlist(durs)
        args = [e.args for e in events]
        t.g_dev.fromlist([a.device for a in args])  # type: ignore[union-attr]
        t.g_stream.fromlist([a.stream for a in args])  # type: ignore[union-attr]
        t.g_corr.fromlist([a.correlation for a in args])  # type: ignore[union-attr]
    except (TypeError, AttributeError, OverflowError):  # args without device/stream/correlation, or out of range
        _truncate(n0, t.g_ts, t.g_dur, t.g_dev, t.g_stream, t.g_corr)
        _gpu_work_slowly(t, events)
        return
    kinds = _GPU_CATS
    t.g_kind.fromlist([kinds[e.cat] for e in events])
    t.g_name.fromlist(_name_ids(t, events))
    nbytes = [a.nbytes for a in args]  # type: ignore[union-attr]
    t.g_bytes.fromlist([_int64(b, -1) for b in nbytes] if nbytes.count(None) != len(nbytes)
                       else [-1] * len(nbytes))
    graphs = [a.graph_id for a in args]  # type: ignore[union-attr]
    t.g_graph.fromlist([_int64(g, -1) for g in graphs] if graphs.count(None) != len(graphs)
                       else [-1] * len(graphs))
    colls = [a.collective for a in args]  # type: ignore[union-attr]
    if colls.count(None) != len(colls):
        t.g_coll.update((n0 + i, c) for i, c in enumerate(colls) if c)


def _gpu_work_slowly(t: Tables, events: list[Event]) -> None:
    for e in events:
        args = e.args
        if args is None:
            args = _NO_ARGS
        dev = args.device
        if dev is None:
            dev = _int_or(e.pid, 0)
        stream = args.stream
        if not isinstance(stream, int):
            stream = _stream_of(stream, e.tid)
        if not (-(1 << 31) <= dev < (1 << 31) and -(1 << 63) <= stream < (1 << 63)):
            t.skips[SKIP_BAD_TYPE] += 1
            continue
        if args.collective:
            t.g_coll[len(t.g_ts)] = args.collective
        t.g_dev.append(dev)
        t.g_stream.append(stream)
        t.g_kind.append(_GPU_CATS[e.cat])
        t.g_ts.append(e.ts)
        t.g_dur.append(e.dur)
        t.g_name.append(t.name_id(e.name))
        t.g_corr.append(_int64(args.correlation, -1))
        t.g_bytes.append(_int64(args.nbytes, -1))
        t.g_graph.append(_int64(args.graph_id, -1))


def _stream_of(stream: str | None, tid: object) -> int:
    """A stream given as a string ("0x0", "7") as a number; the row (tid) when there is none."""
    if isinstance(stream, str):
        try:
            return int(stream, 0)
        except ValueError:
            pass
    return _int_or(tid, 0)


def _int64(value: int | None, default: int) -> int:
    return value if value is not None and -(1 << 63) <= value < (1 << 63) else default


def _other(t: Tables, e: Event) -> None:
    if e.ph is not Ph.X:
        return
    ts, dur = e.ts, e.dur
    assert ts is not None and dur is not None
    c = e.cat
    if c is Cat.USER_ANNOTATION:
        t.op_names[e.name] += 1
        if e.name.startswith(STEP_PREFIX):
            t.steps.append((e.name, ts, dur, t.tid(e.tid)))
            return
        if e.name.startswith(VLLM_STEP_PREFIX):
            parsed = parse_step(e.name)
            if parsed is not None:
                t.engine_steps.append((ts, dur, *parsed))
        if e.name.startswith(COMM_ANNOTATION_PREFIX):
            t.comm_ops.append((t.tid(e.tid), ts, ts + dur, e.name[len(COMM_ANNOTATION_PREFIX):]))
    elif c is Cat.GPU_USER_ANNOTATION:
        if e.name.startswith(COMM_ANNOTATION_PREFIX) and isinstance(e.pid, int) and isinstance(e.tid, int):
            t.gpu_comm.append((e.pid, e.tid, ts, ts + dur, e.name[len(COMM_ANNOTATION_PREFIX):]))
        return
    if c is Cat.USER_ANNOTATION or c in _OTHER_HOST_CATS:
        t.h_tid.append(t.tid(e.tid))
        t.h_ts.append(ts)
        t.h_end.append(ts + dur)
    elif c is Cat.CUDA_SYNC:
        args = e.args or _NO_ARGS
        kind = args.sync_kind or e.name
        if kind in HOST_SYNC_KINDS or kind == STREAM_WAIT_KIND:
            t.s_dev.append(args.device if args.device is not None else _int_or(e.pid, 0))
            t.s_host.append(1 if kind in HOST_SYNC_KINDS else 0)
            t.s_ts.append(ts)
            t.s_dur.append(dur)
    elif c is Cat.TRACE:
        t.trace_spans.append((ts, ts + dur))


_COMM_OP_NAMES = COMM_OP_NAMES
_RUNTIME_KINDS = {n: runtime_kind(n) for n in (KERNEL_LAUNCHES | GRAPH_LAUNCHES | COPY_CALLS | SYNC_CALLS)}
_RUNTIME_KIND_GET = _RUNTIME_KINDS.get


class _NoArgs(msgspec.Struct):
    stream: int | None = None
    correlation: int | None = None
    device: int | None = None
    nbytes: int | None = None
    graph_id: int | None = None
    sync_kind: str | None = None
    collective: str | None = None


_NO_ARGS: Any = _NoArgs()
