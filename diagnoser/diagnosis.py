"""The diagnosis: what the rule engine returns and every renderer reads.

Plain data with a stable dict form (`to_dict`), whose JSON schema is docs/diagnosis.schema.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

SCHEMA_VERSION = 1


class Limiter(str, Enum):
    VRAM = "vram"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    COMPUTE = "compute"
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
    Limiter.BATCHING: "batching-limited",
    Limiter.HOST_LAUNCH: "host/launch-bound",
    Limiter.THROTTLING: "throttled (power/thermal)",
    Limiter.INTERCONNECT: "interconnect-bound (PCIe/NVLink/NCCL)",
    Limiter.IDLE: "idle / over-provisioned",
    Limiter.ERRORS: "GPU errors",
}

INCONCLUSIVE = "inconclusive"


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

    def text(self) -> str:
        from diagnoser.units import fmt

        left = f"{self.signal} {self.stat} = {fmt(self.value, self.unit)}"
        if self.op and self.threshold is not None:
            left += f" ({self.op} {fmt(self.threshold, self.unit)})"
        return f"{left} [{self.source}]"


@dataclass(frozen=True)
class Fix:
    title: str
    action: str  # what to change, concretely
    gain: float | None = None  # predicted throughput multiplier (1.8 = +80 %); None when not predictable
    basis: str = ""  # how the gain was predicted
    rule: str = ""  # the rule code that proposed it


@dataclass(frozen=True)
class Finding:
    code: str
    name: str
    limiter: Limiter
    strength: float  # 0..1: how strongly the evidence supports this finding
    message: str  # one sentence
    citations: tuple[Citation, ...] = ()
    fixes: tuple[Fix, ...] = ()


@dataclass(frozen=True)
class Skipped:
    code: str
    reason: str


@dataclass
class Diagnosis:
    verdict: str  # a Limiter value or "inconclusive"
    confidence: float
    headline: str
    target: str
    findings: list[Finding] = field(default_factory=list)
    secondary: list[str] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # rules evaluated that found nothing
    unavailable: list[dict[str, str]] = field(default_factory=list)
    to_collect: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    confidence_reasons: list[str] = field(default_factory=list)

    @property
    def limiter(self) -> Limiter | None:
        return None if self.verdict == INCONCLUSIVE else Limiter(self.verdict)

    @property
    def confidence_label(self) -> str:
        return "high" if self.confidence >= 0.7 else "medium" if self.confidence >= 0.45 else "low"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for f in d["findings"]:
            f["limiter"] = Limiter(f["limiter"]).value
        d["schema_version"] = SCHEMA_VERSION
        d["confidence_label"] = self.confidence_label
        d["verdict_label"] = self.limiter.label if self.limiter else INCONCLUSIVE
        return d
