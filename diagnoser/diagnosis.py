"""The diagnosis: what the rule engine returns and every renderer reads.

Plain data with a stable dict form (`to_dict`), whose JSON schema is docs/diagnosis.schema.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

import msgspec

from diagnoser.capture import Unavailable

SCHEMA_VERSION = 1


class Limiter(str, Enum):
    VRAM = "vram"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    COMPUTE = "compute"
    # A busy GPU whose kernels saturate neither HBM nor the SMs: the gap is in the kernels (small or unfused kernels,
    # poor occupancy, launch-to-launch gaps), whichever roof the work would hit.
    LATENCY = "latency"
    BATCHING = "batching"
    HOST_LAUNCH = "host_launch"
    THROTTLING = "throttling"
    INTERCONNECT = "interconnect"
    IDLE = "idle"
    ERRORS = "errors"

    @property
    def label(self) -> str:
        return LIMITER_LABELS[self]


LIMITER_LABELS = {
    Limiter.VRAM: "VRAM-limited",
    Limiter.MEMORY_BANDWIDTH: "memory-bandwidth-limited",
    Limiter.COMPUTE: "compute-limited",
    Limiter.LATENCY: "latency/kernel-bound",
    Limiter.BATCHING: "batching-limited",
    Limiter.HOST_LAUNCH: "host/launch-bound",
    Limiter.THROTTLING: "throttled (power/thermal)",
    Limiter.INTERCONNECT: "interconnect-bound (PCIe/NVLink/NCCL)",
    Limiter.IDLE: "idle / over-provisioned",
    Limiter.ERRORS: "GPU errors",
}



class Verdict(str, Enum):
    """What a diagnosis concludes: a Limiter's value, or inconclusive. A str that prints as its value, so the JSON's
    `verdict`, the agent's history and every message read as before."""

    VRAM = "vram"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    COMPUTE = "compute"
    LATENCY = "latency"
    BATCHING = "batching"
    HOST_LAUNCH = "host_launch"
    THROTTLING = "throttling"
    INTERCONNECT = "interconnect"
    IDLE = "idle"
    ERRORS = "errors"
    INCONCLUSIVE = "inconclusive"

    def __str__(self) -> str:  # as StrEnum (3.11+) does; format() follows str()
        return str(self.value)

    @classmethod
    def of(cls, limiter: Limiter) -> Verdict:
        return cls(limiter.value)

    @property
    def limiter(self) -> Limiter | None:
        return None if self is Verdict.INCONCLUSIVE else Limiter(self.value)


class Regime(str, Enum):
    """Which roof the work would hit if nothing else held it back: its arithmetic intensity against the ridge."""

    MEMORY = "memory"
    COMPUTE = "compute"
    UNKNOWN = ""


class FixKind(str, Enum):
    """What a fix changes. One kind appears once per diagnosis, and a kind the capture shows in place is not offered."""

    # memory and batching
    BATCH_MORE = "batch_more"
    CONTINUOUS_BATCHING = "continuous_batching"
    KV_MEMORY = "kv_memory"
    # admit fewer sequences than the KV cache holds at peak: no eviction, no recompute (its gain is the recompute
    # saved, not the batch growth more KV memory brings: a fix of its own, so neither bounds the other)
    STOP_PREEMPTION = "stop_preemption"
    FP8_KV = "fp8_kv"
    QUANTIZE_FOR_MEMORY = "quantize_for_memory"
    SHARD_MODEL = "shard_model"
    CONFIRM_METRICS = "confirm_metrics"
    # bytes and math
    FP8_WEIGHTS = "fp8_weights"
    INT4_WEIGHTS = "int4_weights"
    FP8_MATMUL = "fp8_matmul"
    SPLIT_PREFILL = "split_prefill"
    # the engine's per-step token budget (vLLM --max-num-batched-tokens): raised where it holds prompts back,
    # lowered where prefill chunks stall decodes; opposite directions of one knob, so two kinds that never merge
    TOKEN_BUDGET = "token_budget"
    CAP_PREFILL = "cap_prefill"
    CONTEXT_LENGTH = "context_length"  # requests refused for a prompt over the served context length
    ADMISSION = "admission"  # offered load above what the server serves: capacity or admission control
    ADD_GPUS = "add_gpus"
    # kernels and launches
    FUSE_KERNELS = "fuse_kernels"
    TUNED_ENGINE = "tuned_engine"
    CUDA_GRAPHS = "cuda_graphs"
    OFFLOAD_HOST_WORK = "offload_host_work"
    REMOVE_SYNCS = "remove_syncs"
    PIN_MEMORY = "pin_memory"
    HOST_CPU = "host_cpu"  # give the server the host's cores other processes take
    # links, hardware, provisioning
    REDUCE_TP = "reduce_tp"
    KEEP_DATA_ON_GPU = "keep_data_on_gpu"
    POWER_COOLING = "power_cooling"
    DRAIN_GPU = "drain_gpu"
    RIGHT_SIZE = "right_size"
    # serving-engine features
    PREFIX_CACHING = "prefix_caching"
    SPEC_DECODE = "spec_decode"
    MAX_TOKENS = "max_tokens"
    LORA = "lora"
    # training
    OVERLAP_COMM = "overlap_comm"
    MIXED_PRECISION = "mixed_precision"
    LARGER_BATCH = "larger_batch"
    FUSED_OPTIMIZER = "fused_optimizer"
    BALANCE_RANKS = "balance_ranks"
    # fewer, larger collectives (DDP's gradient buckets, coalesced collectives): the latency of each and its launch
    BUCKET_COMM = "bucket_comm"


# Fixes that only make sense for an inference server (a training job gets none of them).
SERVING_ONLY = frozenset({
    FixKind.BATCH_MORE, FixKind.CONTINUOUS_BATCHING, FixKind.KV_MEMORY, FixKind.STOP_PREEMPTION, FixKind.FP8_KV,
    FixKind.TUNED_ENGINE,
    FixKind.SPLIT_PREFILL, FixKind.REDUCE_TP, FixKind.PREFIX_CACHING, FixKind.SPEC_DECODE, FixKind.MAX_TOKENS,
    FixKind.LORA, FixKind.RIGHT_SIZE, FixKind.CONFIRM_METRICS, FixKind.TOKEN_BUDGET, FixKind.CAP_PREFILL,
    FixKind.CONTEXT_LENGTH, FixKind.ADMISSION,
})
TRAINING_ONLY = frozenset({FixKind.OVERLAP_COMM, FixKind.BUCKET_COMM, FixKind.LARGER_BATCH, FixKind.FUSED_OPTIMIZER,
                           FixKind.BALANCE_RANKS})


class Benefit(str, Enum):
    """What a fix buys: this traffic served faster, more traffic on the same GPUs, or something else."""

    SPEED = "speed"  # the same requests finish sooner
    CAPACITY = "capacity"  # more requests fit; only a gain if more load is offered
    COST = "cost"  # fewer or cheaper GPUs for the same load
    HEALTH = "health"  # a broken or degraded GPU


class GainKind(str, Enum):
    ESTIMATE = "estimate"  # what the physics predicts this capture would get
    UPPER_BOUND = "upper_bound"  # the most it could give (e.g. all of a measured idle share removed)


@dataclass(frozen=True)
class Citation:
    """One number a finding stands on, with the threshold it was compared to and where it came from."""

    signal: str
    stat: str  # mean, p50, p90, max, value, frac_above:0.9
    value: float
    unit: str
    source: str
    op: str = ""  # ">=", "<", ...; empty for context numbers
    threshold: float | None = None
    # A histogram quantile: the bucket (low, high) it was interpolated in; `value` is then only where its rank falls.
    bucket: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        # A signal constant is a str subclass; the diagnosis keeps the plain name (msgspec and pickle see a str).
        if type(self.signal) is not str:
            object.__setattr__(self, "signal", str.__str__(self.signal))

    def text(self) -> str:
        from diagnoser.units import fmt, fmt_bucket

        left = f"{self.signal} {self.stat} = {fmt_bucket(self.value, self.unit, self.bucket)}"
        if self.op and self.threshold is not None:
            left += f" ({self.op} {fmt(self.threshold, self.unit)})"
        return f"{left} [{self.source}]"


@dataclass(frozen=True)
class Fix:
    title: str
    action: str  # what to change, concretely
    gain: float | None = None  # throughput multiplier (1.8 = +80 %); None when not predictable
    basis: str = ""  # how the gain was predicted, and what bounds it
    rule: str = ""  # the rule code that proposed it (the first, when several did)
    kind: FixKind = FixKind.TUNED_ENGINE
    gain_kind: GainKind = GainKind.ESTIMATE
    benefit: Benefit = Benefit.SPEED
    capped: str = ""  # set when the gain was capped: by what, from what
    rules: tuple[str, ...] = ()  # every rule that proposed this kind of fix
    # An estimate's range (the engine's step-time curve fitted over the window, rules/curve.py): the least and most
    # the fit allows at two standard errors; None for a bound or an estimate without one.
    gain_low: float | None = None
    gain_high: float | None = None

    @property
    def is_upper_bound(self) -> bool:
        return self.gain_kind is GainKind.UPPER_BOUND


@dataclass(frozen=True)
class Finding:
    code: str
    name: str
    limiter: Limiter
    strength: float  # 0..1: how strongly the evidence supports this finding
    message: str  # one sentence
    citations: tuple[Citation, ...] = ()
    fixes: tuple[Fix, ...] = ()
    regime: Regime = Regime.UNKNOWN
    # Achieved over the roof of the regime (0..1), when measured.
    saturation: float | None = None


@dataclass(frozen=True)
class Skipped:
    code: str
    reason: str


@dataclass(frozen=True)
class Withheld:
    """A fix a rule proposed that the capture shows is already in place, or that does not fit the workload."""

    kind: FixKind
    title: str
    why: str
    rule: str


@dataclass
class Diagnosis:
    verdict: Verdict
    confidence: float
    headline: str
    target: str
    findings: list[Finding] = field(default_factory=list)
    secondary: list[str] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # rules evaluated that found nothing
    unavailable: list[Unavailable] = field(default_factory=list)
    to_collect: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    confidence_reasons: list[str] = field(default_factory=list)
    regime: Regime = Regime.UNKNOWN
    saturation: float | None = None
    withheld: list[Withheld] = field(default_factory=list)
    workload: str = ""  # inference, training, or "" when not told
    # Set when the verdict's finding beat a finding of another limiter by a hair (engine.NEAR_TIE): both named, with
    # their strengths, so a reader knows the window supports either about as well.
    near_tie: str = ""

    @property
    def limiter(self) -> Limiter | None:
        return Verdict(self.verdict).limiter

    @property
    def confidence_label(self) -> str:
        return "high" if self.confidence >= 0.7 else "medium" if self.confidence >= 0.45 else "low"

    def to_dict(self) -> dict[str, Any]:
        # Field by field rather than asdict(self): the context is plain data already (the engine's, a trace
        # analysis's to_dict: megabytes for a folder of ranks), which asdict would deep-copy leaf by leaf.
        d = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        d["schema_version"] = SCHEMA_VERSION
        d["confidence_label"] = self.confidence_label
        d["verdict_label"] = self.limiter.label if self.limiter else Verdict.INCONCLUSIVE.value
        return d


# Types _plain returns as they are, tested first by exact type: a trace analysis's context holds hundreds of
# thousands of numbers and strings, and the isinstance and dataclass checks below cost more than the copy itself.
_LEAVES = frozenset({str, int, float, bool, type(None)})


def _plain(obj: Any) -> Any:
    """Enums as their values, all the way down (asdict keeps them as members)."""
    cls = type(obj)
    if cls in _LEAVES:
        return obj
    if cls is list:
        return [_plain(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    if is_dataclass(obj) and not isinstance(obj, type):
        return _plain(asdict(obj))
    if isinstance(obj, msgspec.Struct):  # Unavailable: a dict in its fields' order
        return {name: _plain(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, dict):
        return {(k.value if isinstance(k, Enum) else k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj
