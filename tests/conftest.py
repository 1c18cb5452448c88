"""Suite-wide check: every Diagnosis a test builds must match docs/diagnosis.schema.json.

And one more, suite-wide: a test that leaves a SIGINT or SIGTERM handler behind fails (the handler is put back first),
so a later test that sends itself Ctrl-C is not swallowed by a handler some earlier test installed. A suite started
with SIGINT ignored (a script's background job, as CI may run it) takes Python's own Ctrl-C handling first: the
commands leave an inherited ignored SIGINT ignored, as the convention is, and the tests that send Ctrl-C to a command
start it as from a terminal (a handler, unlike SIG_IGN, is not inherited across exec).

Diagnosis.__init__ is wrapped for the whole session to record each diagnosis made in-process; after each test's
call phase, the recorded ones are rendered as scripts see them (reports.jsonout.diagnosis_json) and validated, and
the test fails if one is invalid or is not strict JSON. Mark a test `no_schema_check` to build invalid ones on
purpose. Diagnoses made in child processes are not seen here: tests that run the CLI with --json validate the
output they parse themselves.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "diagnosis.schema.json"
_made: list[Any] = []


def _install_recorder() -> None:
    from diagnoser.diagnosis import Diagnosis

    if getattr(Diagnosis.__init__, "_records_for_schema", False):
        return
    original = Diagnosis.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _made.append(self)

    recording_init._records_for_schema = True  # type: ignore[attr-defined]
    Diagnosis.__init__ = recording_init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_schema_check: build diagnoses that need not match the JSON schema")
    _install_recorder()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # see the module's docstring
        signal.signal(signal.SIGINT, signal.default_int_handler)


def schema_errors(diagnosis: Any) -> list[str]:
    """Why a diagnosis's published JSON does not match the schema (empty when it does)."""
    import jsonschema

    from diagnoser.reports.jsonout import diagnosis_json

    validator = _validator(jsonschema)
    try:
        data = diagnosis_json(diagnosis)
    except Exception as exc:  # a verdict that is not a limiter makes to_dict itself fail
        return [f"cannot be serialised: {type(exc).__name__}: {exc}"]
    try:
        json.dumps(data, allow_nan=False)
    except ValueError as exc:
        return [f"not strict JSON: {exc}"]
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(data)]


_validators: dict[str, Any] = {}


def _validator(jsonschema: Any) -> Any:
    if "v" not in _validators:
        schema = json.loads(SCHEMA_PATH.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        _validators["v"] = jsonschema.Draft202012Validator(schema)
    return _validators["v"]


_GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    handlers = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}
    try:
        result = yield
    finally:
        made = list(_made)
        _made.clear()
    left = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}
    changed = [f"{signal.Signals(sig).name}: {left[sig]!r} (was {handlers[sig]!r})" for sig in _GUARDED_SIGNALS
               if left[sig] is not handlers[sig]]
    if changed:
        for sig in _GUARDED_SIGNALS:
            signal.signal(sig, handlers[sig])
        pytest.fail("the test left a signal handler behind: " + "; ".join(changed), pytrace=False)
    if item.get_closest_marker("no_schema_check") or not made:
        return result
    problems = []
    for d in made:
        problems += [f"{d.verdict!r} diagnosis of {d.target!r}: {err}" for err in schema_errors(d)]
    if problems:
        pytest.fail("a diagnosis does not match docs/diagnosis.schema.json:\n  " + "\n  ".join(problems[:10]),
                    pytrace=False)
    return result
