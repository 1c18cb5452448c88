"""The JSON form of a diagnosis: `Diagnosis.to_dict()`, validated in the tests against docs/diagnosis.schema.json."""

from __future__ import annotations

import json
from typing import Any

from diagnoser.diagnosis import Diagnosis


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    return d.to_dict()


def dumps(d: Diagnosis) -> str:
    return json.dumps(diagnosis_json(d), indent=2)
