"""Fleet rows handed from a triage worker process to the parent, and the diagnoses in them kept packed.

A worker diagnoses its share of the GPUs and sends its rows back as one msgpack message. Decoding every diagnosis
into objects in the parent cost about as much as making it (benchmarks/FLEET.md), so the parent does not: each row's
diagnosis stays msgpack bytes (`PackedDiagnosis`) with its verdict and confidence at hand, which is all the counts,
the sorting and the terminal table read. It is unpacked the first time anything else is asked of it (a report that
shows its findings), and `--json` turns the bytes into builtins without building objects.

What most GPUs share is sent once per message: the rules skipped and why, and the fields a GPU lacks, depend only on
which signals it has (about 6 KB of a 8.5 KB diagnosis).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import msgspec

from diagnoser.capture import Unavailable
from diagnoser.diagnosis import Diagnosis, Limiter, Skipped, Verdict
from diagnoser.fleet.model import FleetRow

# FleetRow's fields but the diagnosis, in order: a packed row is these values, then the diagnosis's parts.
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(FleetRow) if f.name != "diagnosis")
_DIAGNOSIS_AT = [f.name for f in dataclasses.fields(FleetRow)].index("diagnosis")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Diagnosis)


@dataclasses.dataclass
class SharedParts:
    """The skipped rules and unavailable fields of every row that refers to it, as builtins (as --json prints)."""

    skipped: list[dict[str, str]]
    unavailable: list[dict[str, str]]


class PackedDiagnosis:
    """A Diagnosis as msgpack bytes: verdict and confidence read without decoding, anything else unpacks it once.

    It stands where a Diagnosis is expected (FleetRow.diagnosis): an attribute it does not hold is the unpacked
    Diagnosis's."""

    __slots__ = ("verdict", "confidence", "_packed", "_shared", "_full")

    def __init__(self, verdict: Verdict, confidence: float, packed: bytes, shared: SharedParts) -> None:
        self.verdict = verdict
        self.confidence = confidence
        self._packed = packed
        self._shared = shared
        self._full: Diagnosis | None = None

    @property
    def limiter(self) -> Limiter | None:
        return self.verdict.limiter

    @property
    def confidence_label(self) -> str:
        return Diagnosis.confidence_label.fget(self)  # type: ignore[attr-defined]

    def unpack(self) -> Diagnosis:
        if self._full is None:
            d = _DECODER.decode(self._packed)
            d.skipped = [Skipped(**s) for s in self._shared.skipped]
            d.unavailable = [Unavailable(**u) for u in self._shared.unavailable]
            self._full = d
        return self._full

    def builtins(self) -> dict[str, Any]:
        """The diagnosis as msgspec.to_builtins would give it, straight from the bytes."""
        if self._full is not None:
            return cast(dict[str, Any], msgspec.to_builtins(self._full))
        out = msgspec.msgpack.decode(self._packed)
        out["skipped"], out["unavailable"] = self._shared.skipped, self._shared.unavailable
        return cast(dict[str, Any], out)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probing for hooks: not the diagnosis's to answer
            raise AttributeError(name)
        return getattr(self.unpack(), name)


class RowPacker:
    """Collects a worker's rows into one message (`finish`)."""

    def __init__(self) -> None:
        self._rows: list[list[Any]] = []
        self._shared: list[tuple[list[Skipped], list[Unavailable]]] = []
        self._index: dict[tuple[Any, ...], int] = {}

    def add(self, row: FleetRow) -> None:
        d = row.diagnosis
        skipped, unavailable = d.skipped, d.unavailable
        # The same Skipped objects come from the rule set's cached plan; _shared holds them, so their ids stay theirs.
        key = (tuple(map(id, skipped)), tuple(unavailable))
        at = self._index.get(key)
        if at is None:
            at = self._index[key] = len(self._shared)
            self._shared.append((skipped, unavailable))
        d.skipped, d.unavailable = [], []  # sent once in _shared; the worker drops the row after this
        values = [getattr(row, name) for name in _ROW_FIELDS]
        values += (d.verdict, d.confidence, _ENCODER.encode(d), at)
        self._rows.append(values)

    def finish(self, extra: Any = None) -> bytes:
        return _ENCODER.encode({"rows": self._rows, "shared": self._shared, "extra": extra})


def unpack_rows(message: bytes) -> tuple[list[FleetRow], Any]:
    """A worker's rows, their diagnoses left packed, and the extra it sent."""
    doc = msgspec.msgpack.decode(message)
    shared = [SharedParts(skipped, unavailable) for skipped, unavailable in doc["shared"]]
    rows = []
    for values in doc["rows"]:
        *fields, verdict, confidence, packed, at = values
        fields.insert(_DIAGNOSIS_AT, PackedDiagnosis(Verdict(verdict), confidence, packed, shared[at]))
        rows.append(FleetRow(*fields))
    return rows, doc["extra"]


__all__ = ["PackedDiagnosis", "RowPacker", "SharedParts", "unpack_rows"]
