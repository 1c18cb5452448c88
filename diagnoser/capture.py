"""The capture: one observation window of one target, as plain data.

A capture is what collectors produce and everything downstream reads. It holds no behaviour beyond
building and (de)serialising itself, so that a capture saved today can be diagnosed by a later version.

On disk a capture is gzip-compressed JSON with a format tag and version (see docs/capture-format.md).
"""

from __future__ import annotations

import gzip
import math
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from diagnoser.errors import InputError
from diagnoser.fileio import TooLarge, read_bounded, write_atomic

FORMAT_NAME = "diagnoser-capture"
# Bump when a change is not backward compatible; add a migration in _MIGRATIONS from the old version.
# 2: `serving` became a typed ServingConfig (version 1 wrote a free dict); `origin` added.
FORMAT_VERSION = 3

# Sources a number can come from. Kept as plain strings so collectors added later need no change here.
SOURCES = ("nvml", "gpm", "dcgm", "psutil", "server", "trace", "physics", "user")


class CaptureError(InputError):
    """A capture file could not be read or written; the message is one sentence for the user."""


# A quantile read from a server's histogram carries the bucket it was interpolated in, as two labels (in the series'
# unit): inside one bucket the value only says where the rank falls, so two captures in one bucket show no change.
BUCKET_LOW, BUCKET_HIGH = "bucket_low", "bucket_high"


def bucket_labels(low: float, high: float) -> dict[str, str]:
    return {BUCKET_LOW: repr(low), BUCKET_HIGH: repr(high)}


class Series(msgspec.Struct, kw_only=True):
    """A time series of one signal from one source, e.g. gpu.dram_active from GPM for GPU 0.

    `times` are seconds since the window start; `values` are in `unit` (ratios are 0..1).
    """

    name: str
    unit: str
    source: str
    times: list[float] = msgspec.field(default_factory=list)
    values: list[float] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # A signal constant (diagnoser.signals.Sig) is a str subclass: keep the plain name, which msgspec encodes.
        if type(self.name) is not str:
            self.name = str.__str__(self.name)

    def add(self, t: float, value: float) -> None:
        # A counter that returns NaN or inf (GPM's first interval on an H100 does) read nothing: no point.
        if not math.isfinite(value):
            return
        self.times.append(t)
        self.values.append(value)

    def bucket(self) -> tuple[float, float] | None:
        """The histogram bucket a quantile series was interpolated in (see bucket_labels), when it says."""
        try:
            low, high = float(self.labels[BUCKET_LOW]), float(self.labels[BUCKET_HIGH])
        except (KeyError, ValueError):
            return None
        return (low, high) if low == low and high == high and low <= high else None

    def drop_non_finite(self) -> None:
        """Remove points that are not numbers; JSON has no NaN, so they would make the file unreadable."""
        if all(math.isfinite(v) for v in self.values):
            return
        kept = [(t, v) for t, v in zip(self.times, self.values, strict=True) if math.isfinite(v)]
        self.times, self.values = [t for t, _ in kept], [v for _, v in kept]


class Unavailable(msgspec.Struct, frozen=True):
    """A source or signal that could not be read, and why (no GPU, no permission, not supported...).

    The one type for it: stored in captures, carried by the evidence (`Meta.unavailable`) and listed in the
    diagnosis. Frozen, since one instance is shared by all three (and by a fleet's GPUs)."""

    source: str
    what: str
    reason: str
    hint: str = ""


class GpuInfo(msgspec.Struct, kw_only=True):
    """The hardware as the collector saw it. `spec_name` is the physics table entry it matched, if any."""

    index: int
    name: str
    uuid: str = ""
    memory_total_bytes: int | None = None
    driver: str = ""
    cuda_capability: str = ""
    max_sm_clock_mhz: float | None = None
    max_mem_clock_mhz: float | None = None
    power_limit_w: float | None = None
    mig_mode: bool = False
    mig_instance: str = ""
    spec_name: str | None = None
    # Measured roofs from `diagnoser calibrate`, when available: {"hbm_bytes_per_s": ..., "bf16_flops": ...}
    measured: dict[str, float] = msgspec.field(default_factory=dict)


class ProcessInfo(msgspec.Struct, kw_only=True):
    pid: int
    name: str = ""
    cmdline: list[str] = msgspec.field(default_factory=list)
    user: str = ""
    children: list[int] = msgspec.field(default_factory=list)
    gpu_indices: list[int] = msgspec.field(default_factory=list)
    exited_at_s: float | None = None  # seconds into the window when the process went away


class ServerInfo(msgspec.Struct, kw_only=True):
    kind: str  # vllm, sglang, tgi, triton, demo, unknown
    url: str = ""
    version: str = ""


class ModelInfo(msgspec.Struct, kw_only=True):
    """The served model's shape, when known (from config.json, flags or the server)."""

    name: str = ""
    params: float | None = None  # total parameters
    active_params: float | None = None  # per token, for MoE
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    dtype: str = ""  # weights: fp32, bf16, fp16, fp8, int8, int4, fp4
    kv_dtype: str = ""
    max_context: int | None = None
    tensor_parallel: int = 1
    # How quantised weights are stored, from the config's quantization_config (docs/physics.md): the method
    # ("gptq", "awq", "fp8", "nvfp4", "mxfp4", ...), weights per scale group (-1: one scale per output channel;
    # None: the precision's default), bytes of one group's scale and zero point (None: the method's default), and
    # whether lm_head is quantised too (it stays 16-bit in most checkpoints).
    quant_method: str = ""
    quant_group_size: int | None = None
    quant_scale_bytes: float | None = None
    quant_lm_head: bool = False
    tied_embeddings: bool = False  # lm_head shares the input embedding's matrix


class KernelStat(msgspec.Struct, kw_only=True):
    """One kernel name's time in a trace (TraceSummary.top_kernels; docs/traces.md)."""

    name: str  # short readable name (no namespaces, template arguments or parameters)
    full_name: str = ""  # as the trace spells it (capped at 512 characters)
    kind: str = ""  # its class, a key of TraceSummary.kernel_share
    count: int = 0
    total_us: float = 0.0
    share: float = 0.0  # of summed GPU-op time (the kernel_share basis)
    mean_us: float = 0.0
    p50_us: float = 0.0
    p90_us: float = 0.0
    # FLOPs and bytes per call from the launching op's recorded shapes, over the calls that have them (`costed_calls`),
    # and what those calls achieved: FLOP/s and bytes/s over their own GPU time. None without shapes.
    costed_calls: int = 0
    flops_per_call: float | None = None
    bytes_per_call: float | None = None
    achieved_flop_per_s: float | None = None
    achieved_bytes_per_s: float | None = None


class DurationStats(msgspec.Struct, kw_only=True):
    """The distribution of kernel durations (µs): percentiles and a histogram on 1-2-5 bins."""

    count: int = 0
    mean_us: float = 0.0
    p10_us: float = 0.0
    p50_us: float = 0.0
    p90_us: float = 0.0
    p99_us: float = 0.0
    max_us: float = 0.0
    bin_edges_us: list[float] = msgspec.field(default_factory=list)  # upper edges; the last bin is open
    bin_counts: list[int] = msgspec.field(default_factory=list)  # len(bin_edges_us) + 1
    bin_time_us: list[float] = msgspec.field(default_factory=list)  # summed duration per bin


class TimelineItem(msgspec.Struct, kw_only=True, array_like=True):
    """One GPU op in TimelineWindow: times are µs from the window's start; `name` indexes TimelineWindow.names.
    Encoded as an array in field order (a window holds up to 2,000 of them)."""

    device: int
    stream: int
    start_us: float
    dur_us: float
    kind: str  # kernel class (gemm, attention, comm, memcpy, ...)
    name: int


class TimelineGap(msgspec.Struct, kw_only=True, array_like=True):
    """A device-level idle gap inside the window, with its idle cause (a key of idle_frac_by_cause); an array in
    field order."""

    device: int
    start_us: float
    dur_us: float
    cause: str


class HostCall(msgspec.Struct, kw_only=True, array_like=True):
    """A host launch, copy or sync call inside the window (for a host lane); an array in field order."""

    tid: int
    start_us: float
    dur_us: float
    kind: str  # launch, graph, copy, sync


class TimelineWindow(msgspec.Struct, kw_only=True):
    """A compact window of the GPU timeline around a representative step, to draw (at most `MAX_ITEMS` ops)."""

    label: str = ""  # what the window shows: "ProfilerStep#12", "middle of the GPU activity"
    start_us: float = 0.0  # trace µs of the window's start
    offset_us: float = 0.0  # from the analysed window's start
    length_us: float = 0.0
    names: list[str] = msgspec.field(default_factory=list)  # short kernel names
    items: list[TimelineItem] = msgspec.field(default_factory=list)
    gaps: list[TimelineGap] = msgspec.field(default_factory=list)
    host_calls: list[HostCall] = msgspec.field(default_factory=list)
    capped: bool = False  # the window was shortened to keep the item count


class RankStat(msgspec.Struct, kw_only=True):
    """One rank of a multi-rank job (TraceSummary.ranks): fractions are of that rank's own analysed window."""

    rank: int | None = None  # distributedInfo.rank
    path: str = ""  # file name
    window_s: float = 0.0
    gpu_busy_frac: float | None = None
    compute_frac: float | None = None  # GPU busy with anything but exposed communication
    comm_frac: float | None = None  # communication kernels running (overlapped or not)
    comm_exposed_frac: float | None = None  # communication with no compute beside it
    idle_frac_by_cause: dict[str, float] = msgspec.field(default_factory=dict)
    kernel_count: int = 0
    step_ms_p50: float | None = None  # median ProfilerStep duration
    straggler: bool = False


class EngineSteps(msgspec.Struct, kw_only=True):
    """A serving engine's own step annotations in a trace (vLLM's execute_context_N(T)_generation_M(G)): the step
    split as the engine wrote it (traces/engine_steps.py)."""

    steps: int = 0
    step_ms_p50: float = 0.0
    steps_frac: float = 0.0  # share of the window inside steps (the rest: scheduling, waiting for requests)
    prefill_steps: int = 0  # steps that carried a prefill (prompt tokens)
    prefill_time_frac: float = 0.0  # share of the steps' time in steps that carried a prefill
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_batch: float | None = None  # mean requests of the decode-only steps
    decode_step_ms_p50: float | None = None
    # Share of the steps' time by CPU op class (matmul, attention, kv_write, sampling, other): a CPU build's trace
    op_share: dict[str, float] = msgspec.field(default_factory=dict)
    # The window outside the steps by the same classes, as shares of the window (they add up to 1 - steps_frac):
    # vLLM samples after the annotated forward, so its sampling is here; "other" is scheduling, Python and waiting.
    outside_op_share: dict[str, float] = msgspec.field(default_factory=dict)


class TraceSummary(msgspec.Struct, kw_only=True):
    """What a torch.profiler trace analysis found, reduced to numbers the evidence layer reads.

    Fractions are of the analysed window (0..1). Absent values mean not measurable from this trace.
    """

    path: str = ""
    window_s: float = 0.0
    devices: list[int] = msgspec.field(default_factory=list)
    gpu_busy_frac: float | None = None
    # Idle time by cause, as fractions of the window: host, sync, pageable_memcpy, queue_dry, kernel_overhead
    idle_frac_by_cause: dict[str, float] = msgspec.field(default_factory=dict)
    # The CPU ops and runtime calls (of 0.5 ms or more) the host was inside while the GPU waited for it (host and
    # sync idle), as fractions of the window, the largest first (at most 8); nested ops each count their own overlap.
    host_idle_ops: dict[str, float] = msgspec.field(default_factory=dict)
    # The blocking copies (to pageable host memory) the host sat in while the GPU idled with work queued (stream
    # waits), as fractions of the window: the read-back that keeps the host from queueing the next step.
    blocked_in_waits: dict[str, float] = msgspec.field(default_factory=dict)
    # Share of GPU busy time by kernel class: gemm, attention, norm_elementwise, reduction, comm, memcpy, memset, other
    kernel_share: dict[str, float] = msgspec.field(default_factory=dict)
    kernel_count: int = 0
    short_kernel_frac: float | None = None  # kernels shorter than their launch call
    launch_call_us_p50: float | None = None
    launch_delay_us_p50: float | None = None
    cuda_graph_launches: int = 0
    intensity_flop_per_byte: float | None = None  # time-weighted over ops with known FLOPs/bytes
    achieved_flops: float | None = None  # FLOP/s over the window
    achieved_bytes_per_s: float | None = None
    decode_batch: float | None = None  # inferred batch of decode-like steps
    prefill_frac: float | None = None  # share of GPU time in prefill-like steps
    attention_frac: float | None = None
    skipped: list[str] = msgspec.field(default_factory=list)  # what the analysis could not read
    # Communication not hidden behind compute, as a share of the window (per device; a job's: mean over its ranks).
    comm_exposed_frac: float | None = None
    # Share of the kernels, by count, launched from graph replays (graph_kernel_frac below is the share by time).
    graph_kernel_count_frac: float | None = None
    # Share of the GEMM and attention kernel time launched by ops whose FLOPs and bytes are known (costed_time_frac
    # below is of all kernel time).
    costed_gemm_attention_frac: float | None = None
    costed_op_count: int | None = None  # ops whose FLOPs and bytes are known
    ridge_flop_per_byte: float | None = None  # the GPU's ridge point the costed ops were held against
    time_frac_below_ridge: float | None = None  # share of the costed ops' time in ops below the ridge point
    # The first and last decode steps: their context (KV) length in tokens and attention's share of their time.
    context_tokens_first: int | None = None
    context_tokens_last: int | None = None
    attention_frac_first: float | None = None
    attention_frac_last: float | None = None
    rank_count: int | None = None  # ranks combined (several traces of one job)
    comm_share_max_rank: float | None = None  # the highest communication share of GPU time of any rank
    # Precision most of the costed op time ran at (fp32, tf32, bf16, fp16, fp8); "" when unknown. The ridge point
    # is read at this precision when the capture has no model dtype.
    dtype: str = ""
    # Data quality (docs/traces.md): the file was cut short; events found (read and left out); events left out, in
    # all and by reason (malformed_json, bad_field_type, truncated_tail, non_finite_time, negative_time,
    # negative_duration, missing_time).
    truncated: bool = False
    events_total: int = 0
    events_skipped: int = 0
    skip_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    # What ran (docs/traces.md): "cuda" | "rocm" | ""; "training" | "inference" | "" with the reasons; ProfilerStep
    # annotations (None: none); whether the trace holds only part of what ran (a sample of the events, records the
    # profiler dropped) and why.
    platform: str = ""
    workload: str = ""
    workload_evidence: list[str] = msgspec.field(default_factory=list)
    steps: int | None = None
    sampled: bool = False
    sampled_reason: str = ""
    # Shares of GPU kernel time: launched from CUDA/HIP graph replays; launched by ops whose FLOPs and bytes are known
    # (how far intensity_flop_per_byte speaks for the whole trace).
    graph_kernel_frac: float | None = None
    # The longest single idle gap over the window: near 1, the window holds one long pause (a warm-up, a stray
    # kernel long before the steps) and its idle shares describe that pause, not the workload.
    longest_gap_frac: float | None = None
    longest_gap_cause: str = ""  # its idle cause (traces.timeline.IDLE_CAUSES), "" in captures that predate it
    costed_time_frac: float | None = None
    top_kernels: list[KernelStat] = msgspec.field(default_factory=list)
    kernel_duration_us: DurationStats | None = None
    timeline: TimelineWindow | None = None
    # Share of summed GPU-op time by collective (all_reduce, all_gather, reduce_scatter, all_to_all, send_recv,
    # other): adds up to kernel_share["comm"].
    comm_share_by_kind: dict[str, float] = msgspec.field(default_factory=dict)
    # The collective pattern: communication kernels a profiler step (per device; None without ProfilerStep
    # annotations), their median time, and the share of the window the host spent issuing collectives (c10d ops,
    # record_param_comms, their union per thread): hundreds of µs-long collectives a step are latency and launches,
    # which bucketing removes together. A job's: mean over its ranks.
    collectives_per_step: float | None = None
    collective_us_p50: float | None = None
    collective_host_frac: float | None = None
    # Multi-rank input (a folder or several files of one job): one entry per rank, and a sentence naming a straggler.
    ranks: list[RankStat] = msgspec.field(default_factory=list)
    straggler: str = ""
    # Temporal breakdown (HolisticTraceAnalysis'): shares of the window with a compute kernel running (anything but
    # communication, memcpy and memset), with only communication or memory ops running, and with nothing running
    # (the union over all streams of a device; mean over devices, then ranks). They add up to 1. None: no GPU events.
    compute_time_frac: float | None = None
    non_compute_time_frac: float | None = None
    idle_time_frac: float | None = None
    # Files beside the ranks that are not ranks (a serving frontend: vLLM's AsyncLLM process, CPU only, no model ops),
    # left out of every rank statistic: "file: why".
    frontends: list[str] = msgspec.field(default_factory=list)
    engine_steps: EngineSteps | None = None  # the serving engine's own step annotations, where it wrote them


class StackFrame(msgspec.Struct, kw_only=True):
    """One Python frame: function, file (as the sampler shortens it: package-relative) and line."""

    function: str
    file: str = ""
    line: int = 0


class HotFrame(msgspec.Struct, kw_only=True):
    """A function of one thread and the share of that thread's active samples it was running in."""

    frame: StackFrame
    self_frac: float  # with this function innermost
    total_frac: float  # with it anywhere on the stack


class HotStack(msgspec.Struct, kw_only=True):
    frames: list[StackFrame]  # innermost first, cut to a few frames
    frac: float  # share of the thread's active samples


class ThreadStacks(msgspec.Struct, kw_only=True):
    """The sampled Python stacks of one thread of the target, reduced to what a finding cites."""

    pid: int
    tid: int | None = None
    name: str = ""
    samples: int = 0  # samples with the thread active (idle threads are not sampled)
    active_frac: float = 0.0  # share of the window the thread was active in Python
    role: str = ""  # scheduler, tokenizer, detokenizer, sampling, data movement, serialization, http, "" (unknown)
    roles: dict[str, float] = msgspec.field(default_factory=dict)  # role -> share of the thread's samples
    top: list[HotFrame] = msgspec.field(default_factory=list)
    stacks: list[HotStack] = msgspec.field(default_factory=list)


class CounterTrack(msgspec.Struct, kw_only=True):
    """One of the server's counters as it read at each scrape: the window's rate is its change from the first scrape
    to the last over their times, whatever the engine's bursts did between (a mean of the per-interval rates is not
    it when scrapes are irregular). `name` is the rate signal the counter gives (server.gen_tokens_per_s), `values`
    the counter's totals (summed over its label sets), `times` the scrapes' seconds since the window start (when the
    request went out) and `fetch_s` how long each answer took, which bounds when in it the page was written."""

    name: str
    times: list[float] = msgspec.field(default_factory=list)
    values: list[float] = msgspec.field(default_factory=list)
    fetch_s: list[float] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if type(self.name) is not str:
            self.name = str.__str__(self.name)


class StackSamples(msgspec.Struct, kw_only=True):
    """Python stacks sampled from the target during the window (py-spy), busiest threads first."""

    tool: str = "py-spy"
    rate_hz: float = 0.0
    duration_s: float = 0.0
    samples: int = 0
    errors: int = 0
    threads: list[ThreadStacks] = msgspec.field(default_factory=list)


class TraceCost(msgspec.Struct, kw_only=True):
    """What taking a trace cost the server: its rates in the counter window and while tracing (tracing/cost.py)."""

    seconds: float = 0.0
    before: dict[str, float] = msgspec.field(default_factory=dict)
    during: dict[str, float] = msgspec.field(default_factory=dict)
    loss: dict[str, float] = msgspec.field(default_factory=dict)
    pauses_ms: dict[str, float] = msgspec.field(default_factory=dict)
    why_not: str = ""


class ServingConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How the server is configured, as far as its command line, its /metrics page or the user said.

    None (or "") is "not known", never a default: a rule that needs a value must say it assumed one.
    """

    engine: str = ""  # vllm, sglang, tgi, triton, demo, selftest
    max_num_seqs: int | None = None  # vLLM --max-num-seqs; SGLang --max-running-requests
    max_num_batched_tokens: int | None = None
    max_batch_total_tokens: int | None = None  # TGI
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None  # size of the KV pool in tokens, where the server says (demo, SGLang)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    dtype: str = ""  # --dtype as given
    quantization: str = ""  # --quantization / --quantize as given
    kv_cache_dtype: str = ""  # --kv-cache-dtype as given ("auto" = the activations' precision)
    gpu_memory_utilization: float | None = None  # vLLM
    mem_fraction_static: float | None = None  # SGLang
    block_size: int | None = None  # KV block size in tokens
    enforce_eager: bool | None = None  # vLLM --enforce-eager: no CUDA graphs
    disable_cuda_graph: bool | None = None  # SGLang --disable-cuda-graph
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    mean_context_tokens: float | None = None  # mean tokens per sequence (prompt + generated) while served
    load_concurrency: int | None = None  # closed-loop clients of the demo's load generator
    selftest_scenario: str = ""
    usd_per_gpu_hour: float | None = None  # what one GPU hour costs the user (for cost per token)
    trace_cost: TraceCost | None = None
    # Other flags read from the command line, as text, for the report.
    extra: dict[str, str] = msgspec.field(default_factory=dict)

    def items(self) -> list[tuple[str, Any]]:
        """The known values, in field order, for a report."""
        out: list[tuple[str, Any]] = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is None or value == "" or value == {} or name == "trace_cost":
                continue
            if name == "extra":
                out.extend(value.items())
            else:
                out.append((name, value))
        return out

    def graphs_disabled(self) -> bool | None:
        """True when the command line turned CUDA graphs off, False when it shows a graph-capable default."""
        if self.enforce_eager or self.disable_cuda_graph:
            return True
        if self.engine in ("vllm", "sglang") and (self.enforce_eager is False or self.disable_cuda_graph is False):
            return False
        return None


class Capture(msgspec.Struct, kw_only=True):
    """One observation window of one target."""

    target: str  # human description: "pid 1234 (python -m vllm...)", "gpu 0 on node-a", "trace foo.json"
    started_at: float  # unix seconds
    duration_s: float
    host: str = ""
    tool_version: str = ""
    gpus: list[GpuInfo] = msgspec.field(default_factory=list)
    process: ProcessInfo | None = None
    server: ServerInfo | None = None
    model: ModelInfo | None = None
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)
    # What made the capture: attach, dcgm, fleet, trace (analyze), selftest, demo, agent; "" when not said.
    origin: str = ""
    series: list[Series] = msgspec.field(default_factory=list)
    trace: TraceSummary | None = None
    unavailable: list[Unavailable] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    # Set by tests and the demo: a capture that did not come from a GPU says so, and the verdict repeats it.
    cpu_only: bool = False
    # The target's Python stacks sampled during the window (collectors/stacks.py), when sampling worked.
    stacks: StackSamples | None = None
    # The server's counters at each scrape (collectors/server_metrics.py), for rates over the whole window; older
    # captures have none and their rates are read from the rate series.
    counters: list[CounterTrack] = msgspec.field(default_factory=list)

    def series_named(self, name: str) -> list[Series]:
        return [s for s in self.series if s.name == name]

    def mark_unavailable(self, source: str, what: str, reason: str, hint: str = "") -> None:
        if not any(u.source == source and u.what == what for u in self.unavailable):
            self.unavailable.append(Unavailable(source=source, what=what, reason=reason, hint=hint))


def new_capture(target: str, *, started_at: float | None = None, duration_s: float = 0.0) -> Capture:
    from diagnoser import __version__

    return Capture(
        target=target,
        started_at=time.time() if started_at is None else started_at,
        duration_s=duration_s,
        host=os.uname().nodename,
        tool_version=__version__,
    )


# --- on disk -------------------------------------------------------------------------------------------

class _Envelope(msgspec.Struct):
    format: str
    version: int
    capture: msgspec.Raw


def _serving_v1_to_v2(raw: Any) -> Any:
    """Version 1 kept the serving config as a free dict: known keys become typed fields, the rest text in `extra`."""
    if not isinstance(raw, dict):
        return raw
    old = raw.get("serving")
    if not isinstance(old, dict):
        raw["serving"] = {}
        return raw
    fields = ServingConfig.__struct_fields__
    renames = {"tensor_parallel": "tensor_parallel_size", "max_running_requests": "max_num_seqs"}
    new: dict[str, Any] = {"extra": {}}
    for key, value in old.items():
        name = renames.get(key, key)
        if name in fields and name != "extra":
            new[name] = value
        elif value is not None:
            new["extra"][str(key)] = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    raw["serving"] = new
    return raw


# Version 2 kept some trace results as free keys of `trace.extra`: old key -> (typed field, its type).
_TRACE_EXTRA: dict[str, tuple[str, type]] = {
    "comm_exposed_frac": ("comm_exposed_frac", float), "graph_kernel_frac": ("graph_kernel_count_frac", float),
    "costed_gpu_frac": ("costed_gemm_attention_frac", float), "costed_ops": ("costed_op_count", int),
    "ridge_flop_per_byte": ("ridge_flop_per_byte", float), "time_frac_below_ridge": ("time_frac_below_ridge", float),
    "context_first": ("context_tokens_first", int), "context_last": ("context_tokens_last", int),
    "attention_frac_first": ("attention_frac_first", float), "attention_frac_last": ("attention_frac_last", float),
    "ranks": ("rank_count", int), "comm_share_max_rank": ("comm_share_max_rank", float),
}

# Those fields, in that order: the trace results a report lists by name.
TRACE_RESULTS: tuple[str, ...] = tuple(name for name, _ in _TRACE_EXTRA.values())


def _trace_fields(extra: dict[str, Any]) -> dict[str, Any]:
    """An old `trace.extra` as typed fields; counts were written as floats (2.0). Other keys had no reader: dropped.
    A value that is not a number is kept as it is, for the typed decode to refuse in its sentence."""
    out: dict[str, Any] = {}
    for key, value in extra.items():
        name, kind = _TRACE_EXTRA.get(key, ("", float))
        if name:
            whole = kind is int and isinstance(value, float) and value.is_integer()
            out[name] = int(value) if whole else value
    return out


def _trace_extra_v2_to_v3(raw: Any) -> Any:
    """Version 2 kept some trace results in `trace.extra`, a free dict: each becomes its typed field."""
    trace = raw.get("trace") if isinstance(raw, dict) else None
    if isinstance(trace, dict) and isinstance(extra := trace.pop("extra", None), dict):
        trace.update(_trace_fields(extra))
    return raw


_MIGRATIONS: dict[int, Any] = {1: _serving_v1_to_v2, 2: _trace_extra_v2_to_v3}  # version v -> function(dict) -> v + 1


class _V2Trace(msgspec.Struct):
    extra: dict[str, float] = msgspec.field(default_factory=dict)


class _V2Capture(msgspec.Struct):
    trace: _V2Trace | None = None


# The typed fields the old keys became, all optional: checks their types as the typed decode would.
_TraceExtraFields = msgspec.defstruct("_TraceExtraFields", [(name, kind | None, None) for name, kind in
                                                            _TRACE_EXTRA.values()], kw_only=True)


def _trace_extra_typed(body: msgspec.Raw, capture: Capture) -> None:
    """Version 2 -> 3 after a typed decode (which ignored `trace.extra` as an unknown field): read only that dict."""
    old = msgspec.json.decode(body, type=_V2Capture).trace
    if old is not None and old.extra and capture.trace is not None:
        fields = msgspec.convert(_trace_fields(dict(old.extra)), type=_TraceExtraFields)
        for name in fields.__struct_fields__:
            if (value := getattr(fields, name)) is not None:
                setattr(capture.trace, name, value)


# Versions whose difference from this one is small enough to decode with this version's types (fast and bounded,
# series by series) and then upgrade in place: version -> function(body, capture).
_TYPED_UPGRADES: dict[int, Callable[[msgspec.Raw, Capture], None]] = {2: _trace_extra_typed}


def dumps(capture: Capture) -> bytes:
    for series in capture.series:  # series built directly (DCGM answers, tests) bypass Series.add's check
        series.drop_non_finite()
    body = msgspec.json.encode({"format": FORMAT_NAME, "version": FORMAT_VERSION, "capture": capture}, enc_hook=str)
    return gzip.compress(body, compresslevel=6, mtime=0)


# Bounds of what a capture may be, on disk and decompressed. A 10 s window of one GPU is about 40 kB of JSON (20 bytes
# a point); 256 MiB holds about 18 hours of one GPU sampled at 10 Hz, or two of eight GPUs. Beyond it a file is not a
# capture diagnoser wrote (a gzip bomb, /dev/zero, a mistaken path) and is refused before it fills memory.
MAX_CAPTURE_BYTES = 256 << 20


def _looks_like_trace(data: bytes | bytearray) -> bool:
    """A torch.profiler/Chrome trace handed to a command that reads captures: an object with a traceEvents key near
    its start (Kineto writes a few metadata keys first), or the Chrome array of events."""
    head = bytes(data[: 1 << 20]).lstrip()
    return head[:1] == b"[" or (head[:1] == b"{" and b'"traceEvents"' in head)


def loads(data: bytes | bytearray, *, origin: str = "capture") -> Capture:
    """Decode a capture (gzip-compressed or plain JSON), checked against its typed schema.

    Wrong types anywhere (`series` as a string, a number as text, a number too large to be finite) reject the file
    in one sentence: that is not what diagnoser writes, and guessing would change a verdict silently. Inside a
    series, points that are no reading (null, as diagnoser 0.1.0 wrote NaN) are dropped, and a series whose times and
    values do not pair up (different lengths) is dropped whole; each with a note in the capture, which the verdict
    repeats: the rest of the window is still evidence, and the reader is told what was left out.
    """
    env = _envelope(data, origin)
    notes: list[str] = []
    unpaired: list[str] = []
    capture = _decode_capture(env, origin, notes, unpaired)
    _check_window(capture, origin)
    _check_numbers(capture, origin)
    _drop_unpaired(capture, notes, unpaired)
    _bound_series(capture, notes)
    _cut_lists(capture)
    _cut_text(capture, notes)
    capture.notes.extend(notes)
    return capture


_TOO_DEEP = "is not a capture diagnoser wrote: its JSON nests arrays or objects more than about 1,000 levels deep."


def _envelope(data: bytes | bytearray, origin: str) -> _Envelope:
    """The file's envelope (format, version, the capture's raw JSON): gunzipped within bounds, a format and a version
    this diagnoser reads, or one sentence saying what the file is instead."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = _gunzip_bounded(data, MAX_CAPTURE_BYTES)
        except TooLarge:
            raise CaptureError(f"{origin} decompresses to more than {MAX_CAPTURE_BYTES >> 20} MiB; that is not a "
                               "capture diagnoser wrote (the limit is about 18 hours of one GPU).") from None
        except (OSError, EOFError, zlib.error) as exc:
            raise CaptureError(f"{origin} is not a readable capture: its gzip stream is damaged ({exc}).") from None
    try:
        env = msgspec.json.decode(data, type=_Envelope)
    except RecursionError:  # arrays or objects nested past the decoder's depth, anywhere (an unknown field too)
        raise CaptureError(f"{origin} {_TOO_DEEP}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        if _looks_like_trace(data):
            raise CaptureError(f"{origin} is a torch.profiler/Chrome trace, not a diagnoser capture: "
                               "`diagnoser analyze` reads traces.") from None
        raise CaptureError(f"{origin} is not a diagnoser capture: {_sentence(exc)}.") from None
    if env.format != FORMAT_NAME:
        raise CaptureError(f"{origin} is a '{_quote(env.format)}' file, not a diagnoser capture.")
    if env.version > FORMAT_VERSION:
        raise CaptureError(
            f"{origin} uses capture format version {env.version}, newer than this diagnoser reads "
            f"(up to {FORMAT_VERSION}); upgrade diagnoser to read it."
        )
    if any(v not in _MIGRATIONS for v in range(env.version, FORMAT_VERSION)):
        raise CaptureError(f"{origin} uses capture format version {env.version}, which this diagnoser cannot "
                           f"read (it reads {FORMAT_VERSION}).")
    return env


def _decode_capture(env: _Envelope, origin: str, notes: list[str], unpaired: list[str]) -> Capture:
    """The capture itself: straight into its types when it is of this version, within bounds and well-formed;
    otherwise on the generic path that migrates older versions and repairs what earlier writers got wrong."""
    shape = _shape(env.capture, origin)
    typed = env.version == FORMAT_VERSION or env.version in _TYPED_UPGRADES
    try:
        capture: Capture | None = None
        if shape is not None and shape.over and typed:
            capture = _decode_bounded(env.capture, shape, origin, notes)
        elif typed:
            try:
                capture = msgspec.json.decode(env.capture, type=Capture)
            except msgspec.ValidationError:
                pass  # retried below, on the generic path that can repair what earlier writers got wrong
        if capture is not None and env.version != FORMAT_VERSION:
            _TYPED_UPGRADES[env.version](env.capture, capture)
        if capture is None:
            if shape is None or shape.over:
                # The generic path decodes every point into Python objects: only for what is within the bounds.
                _refuse_unbounded(env.capture, origin, env.version)
            raw = msgspec.json.decode(env.capture)
            for v in range(env.version, FORMAT_VERSION):
                raw = _MIGRATIONS[v](raw)
            capture = msgspec.convert(_drop_null_points(raw, notes, unpaired), type=Capture)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CaptureError(f"{origin} is a damaged capture (version {env.version}): {_sentence(exc)}.") from None
    except RecursionError:
        raise CaptureError(f"{origin} {_TOO_DEEP}") from None
    return capture


def _sentence(exc: Exception) -> str:
    """msgspec's message ("Expected `float`, got `str` - at `$.series[0].values[3]`") as part of one sentence."""
    return _quote(str(exc)).rstrip(".")


def _quote(text: str, limit: int = 200) -> str:
    """Text from the file, shortened; control characters are escaped where the sentence is printed."""
    return text if len(text) <= limit else text[:limit] + "..."


# Bounds on what a capture's numbers can be. A window starts between 1970 and the year 3000 and lasts at most ten
# years; a series' times are seconds into its window. No reading comes near MAX_ABS_VALUE (a GPU's memory is about
# 1e11 bytes, a token rate 1e5/s, a counter that wrapped 2e19). Beyond these a file is damaged or forged, and what
# reads it fails deep inside: math.fsum of two 1.7e308 overflows, a square of 1e200 raises, a date past the year
# 9999 cannot be shown. Refused here in one sentence instead.
MAX_STARTED_AT = 32_503_680_000.0  # 3000-01-01 UTC
MAX_WINDOW_S = 10 * 366 * 86_400.0
MAX_ABS_VALUE = 1e30


def _check_window(capture: Capture, origin: str) -> None:
    start, duration = capture.started_at, capture.duration_s
    if not (math.isfinite(start) and math.isfinite(duration) and duration >= 0):
        raise CaptureError(f"{origin} is a damaged capture: its window (start {start}, "
                           f"{duration} s) is not a finite, non-negative time.")
    if not 0 <= start <= MAX_STARTED_AT:
        raise CaptureError(f"{origin} is a damaged capture: its window starts at {start:g} s after 1970, not "
                           "between 1970 and the year 3000.")
    if duration > MAX_WINDOW_S:
        raise CaptureError(f"{origin} is a damaged capture: its window lasts {duration:g} s, over ten years.")


def _check_numbers(capture: Capture, origin: str) -> None:
    """Every number within its bound (see MAX_ABS_VALUE): series by their extremes (millions of points, read at C
    speed), the rest of the capture field by field."""
    for i, series in enumerate(capture.series):
        name = _quote(series.name, 60)
        values, times = series.values, series.times
        if values and (max(values) > MAX_ABS_VALUE or min(values) < -MAX_ABS_VALUE):
            raise CaptureError(f"{origin} is a damaged capture: series {name} ($.series[{i}].values) holds "
                               f"{max(values, key=abs):g}, larger than any measurement (1e30).")
        if times and (max(times) > MAX_WINDOW_S or min(times) < -MAX_WINDOW_S):
            raise CaptureError(f"{origin} is a damaged capture: series {name} ($.series[{i}].times) holds a time "
                               f"of {max(times, key=abs):g} s, more than ten years from its window's start.")
    found = _huge_number(capture, "$")
    if found is not None:
        where, value = found
        raise CaptureError(f"{origin} is a damaged capture: {where} is {value:g}, larger than any measurement "
                           "(1e30).")


def _huge_number(obj: Any, where: str) -> tuple[str, float] | None:
    """The first number beyond MAX_ABS_VALUE in a decoded capture (outside its series), with where it is."""
    if isinstance(obj, (int, float)):
        return (where, obj) if abs(obj) > MAX_ABS_VALUE else None
    if isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            if isinstance(obj, Capture) and name in ("series", "started_at", "duration_s"):
                continue  # checked above
            found = _huge_number(getattr(obj, name), f"{where}.{name}")
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            if isinstance(item, (str, bool)) or item is None:
                continue
            found = _huge_number(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(obj, dict):
        for key, item in obj.items():
            found = _huge_number(item, f"{where}.{_quote(str(key), 40)}")
            if found is not None:
                return found
    return None


def _drop_null_points(raw: Any, notes: list[str], unpaired: list[str]) -> Any:
    """diagnoser 0.1.0 wrote a counter's NaN (GPM's first interval on Hopper) as JSON null; such a point is no
    reading, so it is dropped (with a note) and the rest of the capture is kept. A series with nulls whose times and
    values differ in length cannot be repaired without guessing the pairing: it is taken out (`unpaired`). Anything
    that is not shaped like a series is left for the typed conversion to reject."""
    series_list = raw.get("series") if isinstance(raw, dict) else None
    if not isinstance(series_list, list):
        return raw
    dropped = 0
    for series in list(series_list):
        if not isinstance(series, dict):
            continue
        values, times = series.get("values"), series.get("times")
        if not (isinstance(values, list) and isinstance(times, list)) or (None not in values and None not in times):
            continue
        if len(values) != len(times):
            unpaired.append(_unpaired(str(series.get("name", "?")), len(times), len(values)))
            series_list.remove(series)
            continue
        kept = [(t, v) for t, v in zip(times, values, strict=True) if t is not None and v is not None]
        dropped += len(values) - len(kept)
        series["times"], series["values"] = [t for t, _ in kept], [v for _, v in kept]
    if dropped:
        notes.append(f"{dropped} point{'s' if dropped != 1 else ''} recorded as null (no reading) were left out of "
                     "the capture's series.")
    return raw


def _unpaired(name: str, times: int, values: int) -> str:
    return f"{_quote(name, 60)} ({times} times, {values} values)"


def _drop_unpaired(capture: Capture, notes: list[str], unpaired: list[str]) -> None:
    """Series whose times and values differ in length cannot be paired: dropped whole, said in a note (with those
    the null repair already took out)."""
    kept = [s for s in capture.series if len(s.times) == len(s.values)]
    unpaired += [_unpaired(s.name, len(s.times), len(s.values)) for s in capture.series
                 if len(s.times) != len(s.values)]
    capture.series = kept
    if unpaired:
        shown = ", ".join(unpaired[:3]) + (f" and {len(unpaired) - 3} more" if len(unpaired) > 3 else "")
        notes.append(f"The capture file is damaged: {len(unpaired)} series whose times and values do not pair up "
                     f"were left out: {shown}.")


# Bounds on what a capture holds, beside its bytes: 256 MiB of JSON can be a hundred million points, millions of series
# or notes, or one name of 200 million characters, and each costs tens of bytes in memory and time in every step after
# (a 226 KB file of compressible points took `report` 61 s and 854 MB; a million notes were all printed). What a
# capture diagnoser writes stays far inside them: a 10 s window of one GPU is about 45 series of 100 points and a few
# notes. Past a bound the rest is cut, and a note says what was cut; never silently.
MAX_SERIES = 4096  # series read; about 90 GPUs' worth
MAX_POINTS = 1_000_000  # points over all series: past it each long series is thinned (every k-th point, the last kept)
MAX_SERIES_READ = 250_000  # points of one series decoded (7 hours at 10 Hz); a longer series is cut to its first
MAX_NOTES = 200
# JSON values outside the series' points (labels, notes, command-line arguments, trace tables) and objects anywhere:
# past these the file is refused before it is decoded, as no writer comes near them and decoding is what costs.
MAX_VALUES = 2_000_000
MAX_OBJECTS = 250_000
# Text: names and labels (a model, a GPU, a metric label, a series' name) and any other text (a note, a command-line
# argument, the target). A longer string is cut and marked; the marker says how long it was.
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 4096
_NAME_FIELDS = frozenset({"name", "unit", "source", "uuid", "driver", "user", "spec_name", "kind", "dtype",
                          "kv_dtype", "version", "host", "tool_version", "mig_instance", "engine"})


def cut_text(text: str, limit: int) -> str:
    """`text` within `limit` characters, with a visible marker of what it held when it was longer."""
    return text if len(text) <= limit else f"{text[:limit]}... (cut, {len(text)} chars)"


class _SeriesShape(msgspec.Struct, gc=False):
    times: msgspec.Raw = msgspec.Raw(b"[]")
    values: msgspec.Raw = msgspec.Raw(b"[]")


class _Shape(msgspec.Struct, gc=False):
    series: list[_SeriesShape] = msgspec.field(default_factory=list)


@dataclass
class _Counts:
    """A capture's size in series and points, read from its JSON without decoding a point."""

    shape: _Shape
    points: list[int]  # per series, from its values' separators (an upper bound where the JSON holds odd text)
    over: bool  # some bound is passed: the capture is decoded series by series (_decode_bounded)


_CHUNK_SCAN = 1 << 20


def _count(buf: Any, byte: bytes) -> int:
    """Occurrences of `byte` in a buffer (a Raw, a bytearray), a megabyte at a time: no copy of the whole."""
    view = memoryview(buf)
    return sum(bytes(view[i:i + _CHUNK_SCAN]).count(byte) for i in range(0, len(view), _CHUNK_SCAN))


def _points_in(raw: msgspec.Raw) -> int:
    n = len(memoryview(raw))
    if n <= 2:  # [] (no whitespace: what msgspec writes)
        return 0
    return _count(raw, b",") + 1


def _shape(body: msgspec.Raw, origin: str) -> _Counts | None:
    """Count series and points before decoding them; refuse in one sentence what no writer makes (too many objects,
    too many values outside the series). None when the series are not shaped like series: the typed decode then says
    where, in its own sentence."""
    objects = _count(body, b"{")
    if objects > MAX_OBJECTS:
        raise CaptureError(f"{origin} is not a capture diagnoser wrote: it holds {objects:,} JSON objects, more than "
                           f"{MAX_OBJECTS:,} (a capture holds one per series, GPU and note-taking part, thousands at "
                           "most).")
    try:
        shape = msgspec.json.decode(body, type=_Shape)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    points = [_points_in(s.values) for s in shape.series]
    separators = sum(_count(s.times, b",") + _count(s.values, b",") for s in shape.series)
    others = _count(body, b",") - separators
    if others > MAX_VALUES:
        raise CaptureError(f"{origin} is not a capture diagnoser wrote: it holds {others:,} values besides its "
                           f"series' points, more than {MAX_VALUES:,}.")
    kept = points[:MAX_SERIES]
    over = len(points) > MAX_SERIES or sum(kept) > MAX_POINTS or any(
        _points_in(s.times) > MAX_SERIES_READ for s in shape.series[:MAX_SERIES])
    return _Counts(shape, points, over)


def _refuse_unbounded(body: msgspec.Raw, origin: str, version: int) -> None:
    """The generic path (a repair of nulls, an older version) decodes everything at once: refused past the bounds."""
    values = _count(body, b",")
    if values > MAX_VALUES + 2 * MAX_POINTS:
        raise CaptureError(f"{origin} is a capture (version {version}) of {values:,} values, more than this "
                           f"diagnoser repairs or migrates ({MAX_VALUES + 2 * MAX_POINTS:,}); it reads that many only "
                           f"in a well-formed capture of version {FORMAT_VERSION}.")


def _lite_type(struct: type[msgspec.Struct], name: str, swap: dict[str, Any]) -> type[msgspec.Struct]:
    """A copy of `struct` with some fields' types swapped (points left as raw JSON), decoded the same way."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(struct):
        kind = swap.get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, kind, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind))
    return msgspec.defstruct(name, fields, kw_only=True)


_LiteSeries = _lite_type(Series, "_LiteSeries", {"times": msgspec.Raw, "values": msgspec.Raw})
_LiteCapture = _lite_type(Capture, "_LiteCapture", {"series": list[_LiteSeries]})  # type: ignore[valid-type]


def _first_points(raw: msgspec.Raw, n: int) -> bytes | msgspec.Raw:
    """The JSON array `raw` cut to its first `n` elements (at the n-th separator), or `raw` when it holds fewer."""
    view = memoryview(raw)
    if len(view) <= 2 or view[0] != ord("["):
        return raw
    found = re.match(rb"\[(?:[^,]*,){%d}" % n, view)
    return raw if found is None else bytes(view[:found.end() - 1]) + b"]"


def _decode_bounded(body: msgspec.Raw, counts: _Counts, origin: str, notes: list[str]) -> Capture:
    """A capture past a bound, decoded series by series: the first MAX_SERIES series, each cut to its first
    MAX_SERIES_READ points (then thinned by _bound_series). Each cut is one note."""
    lite: Any = msgspec.json.decode(body, type=_LiteCapture)
    n_series = len(lite.series)
    chosen = lite.series[:MAX_SERIES]
    lite.series = []
    if n_series > MAX_SERIES:
        notes.append(_series_left_out(n_series))
    read = [min(n, MAX_SERIES_READ) for n in counts.points[:MAX_SERIES]]
    total, budget = sum(read), _budget(read, MAX_POINTS)
    series: list[Series] = []
    cut = thinned = 0
    for i, s in enumerate(chosen):
        lists = []
        for part in ("times", "values"):
            raw = getattr(s, part)
            bounded = _first_points(raw, MAX_SERIES_READ)
            cut += part == "values" and bounded is not raw
            try:
                lists.append(msgspec.json.decode(bounded, type=list[float]))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                where = str(exc).replace("`$", f"`$.series[{i}].{part}")
                raise CaptureError(f"{origin} is a damaged capture (version {FORMAT_VERSION}): "
                                   f"{_quote(where).rstrip('.')}.") from None
        chosen[i] = None  # its raw points are not needed any more
        one = Series(name=s.name, unit=s.unit, source=s.source, times=lists[0], values=lists[1], labels=s.labels)
        del lists
        thinned += _thin(one, budget)  # now, so that no more than one long series is held whole
        series.append(one)
    if cut:
        notes.append(f"{cut} series held more than {MAX_SERIES_READ:,} points, more than any window diagnoser "
                     f"records: each was read to its first {MAX_SERIES_READ:,} and the rest of it left out.")
    if thinned:
        notes.append(_thinned(total, thinned, budget))
    fields = {f: getattr(lite, f) for f in Capture.__struct_fields__ if f != "series"}
    return Capture(**fields, series=series)


def _series_left_out(n_series: int) -> str:
    return (f"The capture holds {n_series:,} series, more than any capture diagnoser writes: the first "
            f"{MAX_SERIES:,} were read and {n_series - MAX_SERIES:,} left out.")


def _bound_series(capture: Capture, notes: list[str]) -> None:
    """At most MAX_SERIES series and MAX_POINTS points (a capture the generic path decoded whole is cut here too):
    long series are thinned to evenly spaced points, the last kept, so the statistics still span the window."""
    if len(capture.series) > MAX_SERIES:
        notes.append(_series_left_out(len(capture.series)))
        del capture.series[MAX_SERIES:]
    points = [len(s.values) for s in capture.series]
    total = sum(points)
    if total <= MAX_POINTS + len(points):  # thinning keeps each series' last point
        return
    budget = _budget(points, MAX_POINTS)
    thinned = sum(_thin(s, budget) for s in capture.series)
    notes.append(_thinned(total, thinned, budget))


def _thin(s: Series, budget: int) -> bool:
    """Keep at most about `budget` evenly spaced points of `s`, the last among them; whether any was dropped."""
    n = len(s.values)
    if n <= budget or len(s.times) != n:
        return False
    keep = list(range(0, n, math.ceil(n / budget)))
    if keep[-1] != n - 1:
        keep.append(n - 1)  # the window's end: counters and rates read their last point
    s.times, s.values = [s.times[k] for k in keep], [s.values[k] for k in keep]
    return True


def _thinned(total: int, thinned: int, budget: int) -> str:
    return (f"The capture's series hold {total:,} points, over the {MAX_POINTS:,} read at once: {thinned} long "
            f"series {'were' if thinned != 1 else 'was'} thinned to about {budget:,} points each (evenly spaced, "
            "the last kept); the statistics are of the points kept.")


def _budget(points: list[int], total: int) -> int:
    """The largest per-series cap b with sum(min(n, b)) <= total: short series whole, long ones share the rest."""
    if sum(points) <= total:
        return max(points, default=0) or 1
    left, remaining = total, len(points)
    for n in sorted(points):
        share = left // remaining
        if n > share:
            return max(share, 2)
        left -= n
        remaining -= 1
    return max(left, 2)


MAX_ARGS = 1000  # command-line arguments kept


def _cut_lists(capture: Capture) -> None:
    """Notes and command-line arguments within their counts, the cut said in the list itself."""
    if len(capture.notes) > MAX_NOTES:
        extra = len(capture.notes) - MAX_NOTES
        del capture.notes[MAX_NOTES:]
        capture.notes.append(f"The capture holds {MAX_NOTES + extra:,} notes: the first {MAX_NOTES} were read and "
                             f"{extra:,} left out.")
    if capture.process is not None and len(capture.process.cmdline) > MAX_ARGS:
        extra = len(capture.process.cmdline) - MAX_ARGS
        del capture.process.cmdline[MAX_ARGS:]
        capture.process.cmdline.append(f"... (cut, {extra} more arguments)")
        capture.notes.append(f"The target's command line holds {MAX_ARGS + extra:,} arguments: the first {MAX_ARGS} "
                             "were read.")


def _cut_text(capture: Capture, notes: list[str]) -> None:
    """Every string of the capture within its bound (MAX_NAME_CHARS for names and labels, MAX_TEXT_CHARS else),
    cut with a marker; one note says how many were cut and the longest."""
    cutter = _TextCutter()
    cutter.walk(capture, "$")
    if cutter.found:
        length, where = max(cutter.found)
        n = len(cutter.found)
        notes.append(f"{n} text field{'s' if n != 1 else ''} of the capture longer than "
                     f"{MAX_NAME_CHARS} characters (names, labels) or {MAX_TEXT_CHARS} (other text) "
                     f"{'were' if n != 1 else 'was'} cut, each marked '... (cut, N chars)'; the longest, "
                     f"{where}, held {length:,}.")


class _TextCutter:
    """Walks a capture's structs, lists and dicts, cutting each string over its bound in place and remembering
    (length, where) of each one cut."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def cut(self, text: str, limit: int, where: str) -> str:
        if len(text) <= limit:
            return text
        self.found.append((len(text), where))
        return cut_text(text, limit)

    def walk(self, obj: Any, where: str) -> None:
        for name in obj.__struct_fields__:
            value = getattr(obj, name)
            here = f"{where}.{name}"
            limit = MAX_NAME_CHARS if name in _NAME_FIELDS else MAX_TEXT_CHARS
            if isinstance(value, str):
                if len(value) > limit:
                    setattr(obj, name, self.cut(value, limit, here))
            elif isinstance(value, msgspec.Struct):
                self.walk(value, here)
            elif isinstance(value, list) and value and not isinstance(value[0], (int, float)):
                self._walk_list(value, limit, here)
            elif isinstance(value, dict) and value:
                cut = self._cut_dict(value, MAX_NAME_CHARS if name == "labels" else MAX_TEXT_CHARS, here)
                if cut is not value:
                    setattr(obj, name, cut)

    def _walk_list(self, value: list[Any], limit: int, here: str) -> None:
        for i, item in enumerate(value):
            if isinstance(item, str):
                if len(item) > limit:
                    value[i] = self.cut(item, limit, f"{here}[{i}]")
            elif isinstance(item, msgspec.Struct):
                self.walk(item, f"{here}[{i}]")

    def _cut_dict(self, value: dict[str, Any], limit: int, here: str) -> dict[str, Any]:
        """The dict with its keys and string values within `limit`; the same dict when none is over."""
        if not any(len(k) > limit or isinstance(v, str) and len(v) > limit for k, v in value.items()):
            return value
        return {self.cut(k, limit, f"{here} (a key)"): self.cut(v, limit, f"{here}.{_quote(k, 40)}")
                if isinstance(v, str) else v for k, v in value.items()}


def _gunzip_bounded(data: bytes | bytearray, limit: int) -> bytearray:
    """Decompress every gzip member of `data`, refusing (TooLarge) as soon as the output passes `limit`: bounded
    while decompressing, never after."""
    out = bytearray()
    view = memoryview(data)
    while view:
        inflater = zlib.decompressobj(wbits=31)
        pending: bytes | memoryview = view
        while not inflater.eof:
            chunk = inflater.decompress(pending, _CHUNK_OUT)
            out += chunk
            if len(out) > limit:
                raise TooLarge(limit)
            pending = inflater.unconsumed_tail
            if not chunk and not pending:
                break  # the input is used up and the member has no end
        if not inflater.eof:
            raise EOFError("the gzip stream ends early (a truncated file)")
        rest = inflater.unused_data
        view = memoryview(rest) if rest.strip(b"\0") else memoryview(b"")  # trailing zero padding is no member
    return out


_CHUNK_OUT = 1 << 20


def save(capture: Capture, path: str | Path) -> Path:
    """Write atomically: a crash mid-write leaves the old file (or none), never half a capture."""
    path = Path(path)
    try:
        write_atomic(path, dumps(capture), mode=0o600)
    except OSError as exc:
        raise CaptureError(f"cannot write capture to {path}: {exc.strerror or exc}.") from None
    return path


def load(path: str | Path) -> Capture:
    path = Path(path)
    try:
        data = read_bounded(path, MAX_CAPTURE_BYTES, _capture_head)
    except FileNotFoundError:
        raise CaptureError(f"no capture file at {path}.") from None
    except IsADirectoryError:
        raise CaptureError(f"{path} is a directory, not a capture file.") from None
    except TooLarge as exc:
        raise CaptureError(f"{path} is {exc}; that is not a capture diagnoser wrote.") from None
    except _NotACapture:
        raise CaptureError(f"{path} is not a diagnoser capture: it is neither gzip nor JSON.") from None
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}.") from None
    return loads(data, origin=str(path))


def _capture_head(head: bytes) -> None:
    """A capture starts with gzip's magic bytes or a JSON object: zeros (/dev/zero) or binary are refused at once."""
    if head[:2] != b"\x1f\x8b" and not head.lstrip(b" \t\r\n").startswith(b"{"):
        raise _NotACapture


class _NotACapture(OSError):
    pass
