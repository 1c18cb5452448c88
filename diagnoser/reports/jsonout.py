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
from typing import Any

from diagnoser.diagnosis import SCHEMA_VERSION, Diagnosis
from diagnoser.fleet.model import FleetReport
from diagnoser.reports.model import Report
from diagnoser.reports.redact import redact_obj


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """The published form: to_dict() with strings redacted and non-finite numbers as null."""
    out = redact_obj(_finite(d.to_dict()))
    assert isinstance(out, dict)
    return out


def dumps(d: Diagnosis) -> str:
    return json.dumps(diagnosis_json(d), indent=2, allow_nan=False)


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
    cleaned = redact_obj(_finite(doc))
    assert isinstance(cleaned, dict)
    return cleaned


def schema_path() -> Path | None:
    """docs/diagnosis.schema.json in a source checkout (the docs are not part of the installed package)."""
    path = Path(__file__).resolve().parents[2] / "docs" / "diagnosis.schema.json"
    return path if path.is_file() else None


__all__ = ["SCHEMA_VERSION", "JsonRenderer", "diagnosis_json", "dumps", "fleet_json", "schema_path"]
