"""The JSON form of a diagnosis, for scripts and CI: `Diagnosis.to_dict()` made safe to publish.

Two things happen on the way out: every string is redacted (targets and notes can carry command lines and URLs),
and numbers that JSON cannot hold (an infinite ridge batch, say) become null, so the output is strict JSON that any
parser reads. The shape is docs/diagnosis.schema.json (JSON Schema 2020-12), versioned by `schema_version`; the
tests validate every diagnosis the suite produces against it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from diagnoser.diagnosis import SCHEMA_VERSION, Diagnosis
from diagnoser.reports.redact import redact

if TYPE_CHECKING:  # (names for hints only: `analyze --json` prints a diagnosis without loading the report model)
    from diagnoser.fleet.model import FleetReport
    from diagnoser.reports.model import Report


def _published(obj: Any, seen: dict[str, str]) -> Any:
    """Every string redacted (each distinct one once: a trace's kernel names repeat thousands of times), numbers JSON
    cannot hold as null, tuples as lists."""
    cls = type(obj)  # the common types by exact type first (a trace's context holds hundreds of thousands of leaves)
    if cls is float:
        return obj if math.isfinite(obj) else None
    if cls is int or obj is None or cls is bool:
        return obj
    if cls is list:
        return [_published(v, seen) for v in obj]
    if isinstance(obj, str):
        out = seen.get(obj)
        if out is None:
            out = seen[obj] = redact(obj)
        return out
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _published(v, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_published(v, seen) for v in obj]
    return obj


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """The published form: to_dict() with strings redacted and non-finite numbers as null."""
    out = _published(d.to_dict(), {})
    assert isinstance(out, dict)
    return out


def indented(obj: Any) -> str:
    """`json.dumps(obj, indent=2, allow_nan=False)`, byte for byte: json's C encoder writes it without indentation and
    msgspec lays the whitespace out again (json's indenting encoder runs in Python: 3x slower on the 4 MB diagnosis
    of eight ranks' traces)."""
    return msgspec.json.format(json.dumps(obj, allow_nan=False), indent=2)


def dumps(d: Diagnosis) -> str:
    return indented(diagnosis_json(d))


class JsonRenderer:
    """Renders a Report as the diagnosis JSON (docs/diagnosis.schema.json)."""

    def render(self, report: Report) -> str:
        # The document is the diagnosis itself, redacted whole by diagnosis_json: the one field of a Report kept
        # in the diagnosis's own shape, since that shape is the published schema.
        return dumps(report.document)


def fleet_json(report: FleetReport) -> dict[str, Any]:
    """A fleet report published the same way: every row's diagnosis redacted, non-finite numbers as null."""
    doc = report.to_dict()
    for row, out in zip(report.rows, doc["rows"], strict=True):
        out["diagnosis"] = diagnosis_json(row.diagnosis)
    cleaned = _published(doc, {})
    assert isinstance(cleaned, dict)
    return cleaned


def schema_path() -> Path | None:
    """docs/diagnosis.schema.json in a source checkout (the docs are not part of the installed package)."""
    path = Path(__file__).resolve().parents[2] / "docs" / "diagnosis.schema.json"
    return path if path.is_file() else None


__all__ = ["SCHEMA_VERSION", "JsonRenderer", "diagnosis_json", "dumps", "fleet_json", "indented", "schema_path"]
