"""A real llama.cpp `llama-server` (CPU build) serving a tiny random GGUF Llama on 127.0.0.1, diagnosed by
`diagnoser attach --port` in five situations. Each situation's verdict and first fix were written from its set-up
(docstring) before the tool ran on it; the batching-limited one's fix and the draft model's are applied on the real
server, re-measured, and `diagnoser compare` grades them.

The server is built by scripts/install-llamacpp.sh (run by scripts/test.sh). Without it the tier is skipped here and
fails under CI. The model is written at test time (tests/engines/gguf_model.py, under a second). Servers start in a
second or two and are shared by the situations with the same flags; the whole tier takes about two minutes on two
cores. LLAMACPP_TIER_KEEP=DIR keeps the captures and the server logs; LLAMACPP_TIER_ONLY=name,name records only those
situations (the others then fail for want of a recording).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diagnoser import capture as capture_mod
from diagnoser.engines import llamacpp
from diagnoser.engines.knobs import parse_version
from diagnoser.evidence_build import build_evidence
from tests.engines import gguf_model, llamacpp_server
from tests.engines import situations as sit
from tests.engines.load import Load

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

WINDOW_S = float(os.environ.get("LLAMACPP_WINDOW_S", "10"))
WARM_S = 4.0  # load runs this long before the window: every slot busy, the queue at its steady state


@dataclass(frozen=True)
class Situation:
    name: str
    server: str  # key into SERVERS
    load: dict[str, Any]
    verdicts: tuple[str, ...]
    first_fix: tuple[str, ...] = ()  # fix kinds, any of them first; () = not checked
    fix_text: str = ""  # in the first fix's action
    forbidden_first: tuple[str, ...] = ()  # fix kinds that must not come first
    applied: str = ""  # server key the first fix is applied as


DRAFT = "{draft}"  # in a server's flags: the draft model's path, written beside the target at test time
SERVERS: dict[str, tuple[str, ...]] = {
    # the target with a draft model that does not agree with it: a small model of another seed, the same vocabulary. In
    # build 11434 -md alone loads the draft without drafting (the speculative type is read from the draft's GGUF,
    # and a plain model names none): --spec-type draft-simple turns it on. Draft length: the default, 3 tokens.
    # First in the table: its fix is applied on "np2", the same flags without the draft.
    "draft": ("-np", "2", "-c", "2048", "-md", DRAFT, "--spec-type", "draft-simple"),
    "np2": ("-np", "2", "-c", "2048"),  # 1024 tokens per slot
    "np8": ("-np", "8", "-c", "8192"),  # the fix for "deferred": 4x the slots, the same 1024 tokens per slot
    # 256 tokens per slot (this build rounds a smaller -c up: -c 512 -np 4 also gives 256 a slot)
    "short_ctx": ("-np", "4", "-c", "1024"),
    "small_batch": ("-np", "2", "-c", "4096", "-b", "32", "-ub", "32"),
    # small_batch's fix as the tool words it (steps full at -b 32 with no prompt length on the page: four times it)
    "small_batch_fixed": ("-np", "2", "-c", "4096", "-b", "128", "-ub", "128"),
}

SITUATIONS = (
    Situation(
        # One client, 32-word prompts, 64 tokens each, against 2 slots of 1024 tokens: one slot busy, nothing ever
        # deferred, every prompt fits. No scheduler knob binds, so the first fix is no knob (not --parallel, not
        # --ctx-size, not --batch-size): the server is underused (idle or inconclusive on a CPU).
        "one_client", "np2", {"clients": 1, "prompt_words": 32, "max_tokens": 64},
        verdicts=("idle", "inconclusive", "compute"), forbidden_first=("batch_more", "context_length",
                                                                         "token_budget")),
    Situation(
        # Eight clients against 2 slots: 2 requests processing, about 6 deferred all window, each request 33 + 64
        # tokens (well inside a slot's 1024). The slots cap the batch: batching-limited, first fix raises --parallel
        # (with --ctx-size raised with it, so each slot still holds a request). Applied as -np 8 -c 8192.
        "deferred", "np2", {"clients": 8, "prompt_words": 32, "max_tokens": 64},
        verdicts=("batching",), first_fix=("batch_more",), fix_text="--parallel", applied="np8"),
    Situation(
        # 4 slots of 256 tokens (-c 1024 -np 4) and 300-word prompts (301 tokens): every request exceeds its slot's
        # context and is refused (HTTP 400). The context per slot binds: the first fix raises --ctx-size (or lowers
        # --parallel), and says what it trades (KV memory, or fewer requests at once).
        "short_context", "short_ctx", {"clients": 4, "prompt_words": 300, "max_tokens": 16, "pause_s": 0.2},
        verdicts=("batching", "inconclusive", "idle", "vram"), first_fix=("context_length",),
        fix_text="--ctx-size"),
    Situation(
        # -b 32 -ub 32 with 600-word prompts (601 tokens) and 16 tokens out, 4 clients on 2 slots: each prompt takes
        # 19 steps of 32 tokens, prompt processing dominates and requests are deferred behind it. The logical batch
        # caps prefill: batching-limited, first fix raises --batch-size (and --ubatch-size).
        "small_batch", "small_batch", {"clients": 4, "prompt_words": 600, "max_tokens": 16},
        verdicts=("batching",), first_fix=("token_budget",), fix_text="--batch-size", applied="small_batch_fixed"),
    Situation(
        # Two clients on 2 slots (nothing deferred), 32-word prompts, 32 tokens out, greedy, with a draft model of
        # unrelated random weights: the target almost never takes its drafts (acceptance near 0, about 1 token per
        # verification step), while every step pays 3 draft tokens on the draft model and a 4-token verification.
        # Speculative decoding does not pay: the verdict is compute-bound decoding (SRV005), and the first fix turns
        # it off by dropping the draft model (the speculative_config knob, direction off), naming llama.cpp's own
        # --model-draft. Applied as the same server without -md (np2).
        "draft_not_paying", "draft", {"clients": 2, "prompt_words": 32, "max_tokens": 32},
        verdicts=("compute",), first_fix=("spec_decode",), fix_text="--model-draft",
        forbidden_first=("batch_more", "context_length", "token_budget"), applied="np2"),
)
BY_NAME = {s.name: s for s in SITUATIONS}


@dataclass
class Recording:
    situation: Situation
    capture: Path
    diagnosis: dict[str, Any]
    client: dict[str, Any]
    applied: Recording | None = None
    compare: dict[str, Any] = field(default_factory=dict)


def _window(server: llamacpp_server.LlamaCppServer, s: Situation, out: Path) -> Recording:
    load = Load(port=server.port, model=llamacpp_server.MODEL_NAME, seconds=WARM_S + WINDOW_S + 120, timeout_s=60,
                **s.load)
    with load:
        time.sleep(WARM_S)
        before = (load.done, load.failed, load.tokens, time.monotonic())
        diagnosis, _ = sit.attach(server.port, out, WINDOW_S)
        after = (load.done, load.failed, load.tokens, time.monotonic())
    client = {"done": after[0] - before[0], "failed": after[1] - before[1],
              "tokens_per_s": (after[2] - before[2]) / (after[3] - before[3]), "errors": load.errors[:2],
              "load_avg": os.getloadavg()[0]}
    return Recording(s, out, diagnosis, client)


DRAFT_SHAPE = {"hidden": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 4}  # 2.5 M parameters, ~5 % of it


def draft_model(model: Path) -> Path:
    """A draft for the target: a small model of another seed with the same vocabulary (llama.cpp checks it
    matches), about a twentieth of the target's weights, as a real draft is (0.5 B for 7 B)."""
    return gguf_model.build(model.parent, seed=7, name="draft.gguf", **DRAFT_SHAPE)


def record_all(model: Path, out: Path) -> dict[str, Recording]:
    only = [n for n in os.environ.get("LLAMACPP_TIER_ONLY", "").split(",") if n]  # a subset by hand
    chosen = [s for s in SITUATIONS if not only or s.name in only]
    recordings: dict[str, Recording] = {}
    for key, flags in SERVERS.items():
        on_it = [s for s in chosen if s.server == key]
        fixed = [s for s in chosen if s.applied == key and s.name in recordings]
        if not on_it and not fixed:
            continue
        if DRAFT in flags:
            flags = tuple(str(draft_model(model)) if f == DRAFT else f for f in flags)
        with llamacpp_server.LlamaCppServer(model, flags, log=out / f"server-{key}.log") as server:
            for s in on_it:
                recordings[s.name] = _window(server, s, out / f"{s.name}.dgc")
            for s in fixed:
                before = recordings[s.name]
                after = _window(server, s, out / f"{s.name}-fixed.dgc")
                before.applied = after
                before.compare = sit.compare(before.capture, after.capture)
    return recordings


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Recording]:
    why = llamacpp_server.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the llama.cpp tier cannot run: {why}")
        pytest.skip(why)
    keep = os.environ.get("LLAMACPP_TIER_KEEP")
    out = Path(keep) if keep else tmp_path_factory.mktemp("llamacpp-tier")
    out.mkdir(parents=True, exist_ok=True)
    model = gguf_model.build(out / "model")
    return record_all(model, out)


def _explain(r: Recording) -> str:
    d = r.diagnosis
    fixes = [(f["kind"], f["action"][:160]) for f in d["fixes"][:3]]
    return (f"{r.situation.name}: verdict {d['verdict']} ({d['confidence']:.2f}) {d['headline']!r}; findings "
            f"{[f['code'] for f in d['findings']]}; fixes {fixes}; client {r.client}")


# Situations where the tool's answer, run after these were written, differs from them, and why (strict: a tool that
# comes to answer them as written turns these into failures, and the mark is removed).
KNOWN_MISSES: dict[str, str] = {}
# short_context (refused by every slot: IDLE002's right_size ranked first) and small_batch (BAT005 named --parallel
# first) were strict misses until IDLE002 stood aside where most answers were refusals and BAT006 read llama.cpp's
# tokens per step; both answered as written on the build that says its number (b11434).


@pytest.mark.parametrize("name", [pytest.param(s.name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[s.name]))
                                  if s.name in KNOWN_MISSES else s.name for s in SITUATIONS])
def test_verdict_and_first_fix_as_written_before(recorded: dict[str, Recording], name: str) -> None:
    r, s = recorded[name], BY_NAME[name]
    d = r.diagnosis
    assert d["verdict"] in s.verdicts, _explain(r)
    first = d["fixes"][0] if d["fixes"] else None
    if s.first_fix:
        assert first is not None and first["kind"] in s.first_fix, _explain(r)
    if s.fix_text:
        assert first is not None and s.fix_text in first["action"], _explain(r)
    if first is not None:
        assert first["kind"] not in s.forbidden_first, _explain(r)


def test_more_slots_realise_a_gain_that_compare_grades(recorded: dict[str, Recording]) -> None:
    """-np 2 -> -np 8 (with -c 2048 -> 8192, the same context per slot) under the same eight clients: compare sees
    the knob change, lays the tokens/s ratio on the first fix and grades it."""
    r = recorded["deferred"]
    assert r.applied is not None and r.compare, _explain(r)
    kind = r.diagnosis["fixes"][0]["kind"]
    (p,) = [p for p in r.compare["predictions"] if p["kind"] == kind]
    assert p["applied"], (r.compare["changes"], _explain(r))
    assert p["realised"] is not None and p["realised"] > 1.0, (p, r.compare["rates"])
    assert p["verdict"], p


def test_a_larger_logical_batch_realises_a_gain_in_the_direction_named(recorded: dict[str, Recording]) -> None:
    """-b 32 -ub 32 -> -b 128 -ub 128 under the same four clients: compare sees the budget raised and credits it to
    the token-budget fix, and the prompt tokens/s (what a step full of prompt chunks carries) rise. No gain was
    promised (no device roofs, and a window whose steps never ran past the budget cannot price a longer step), so
    this holds the direction, not a size."""
    r = recorded["small_batch"]
    assert r.applied is not None and r.compare, _explain(r)
    (p,) = [p for p in r.compare["predictions"] if p["kind"] == "token_budget"]
    assert p["applied"], (r.compare["changes"], _explain(r))
    assert p["realised"] is not None and p["realised"] > 1.0, (p, r.compare["rates"], r.client, r.applied.client)


def test_dropping_a_draft_that_does_not_pay_realises_the_estimated_gain(recorded: dict[str, Recording]) -> None:
    """-md draft.gguf --spec-type draft-simple -> no draft, under the same two clients: compare sees the draft model
    dropped (speculative_config, off), lays the tokens/s ratio on the first fix, and the realised gain lies in the
    estimate's range widened by 25 % either way (the issue's grade: within 25 %). Realised here: x1.27 to x2.04 against
    x1.3 to x4.3, a point estimate of x2.36 that over-predicts."""
    r = recorded["draft_not_paying"]
    assert r.applied is not None and r.compare, _explain(r)
    (p,) = [p for p in r.compare["predictions"] if p["kind"] == "spec_decode"]
    assert p["applied"], (r.compare["changes"], _explain(r))
    assert p["realised"] is not None and p["realised"] > 1.0, (p, r.compare["rates"], r.applied.client)
    in_range = p["low"] is not None and p["high"] is not None and \
        p["low"] / 1.25 <= p["realised"] <= p["high"] * 1.25
    assert in_range or p["verdict"] in ("held", "within the bound"), (p, r.compare["rates"], r.client,
                                                                      r.applied.client)


def three_ways(r: Recording) -> dict[str, Any]:
    """An applied fix's realised gain in generated tokens/s three ways: compare's (the server's counters over each
    window, with its standard error), and the clients' own count of the tokens they received over the same windows.
    The clients count a request's tokens as its answer arrives and the server as it finishes it, and the harness's
    window is not the capture's to the millisecond, so each window's two counts differ by the requests cut at its
    ends: up to one a client, half of one on average, as a share of the window's requests, the two windows' errors
    added in quadrature."""
    assert r.applied is not None
    (m,) = [m for m in r.compare["rates"] if m["signal"] == "server.gen_tokens_per_s"]
    before, after = r.client, r.applied.client
    clients = after["tokens_per_s"] / before["tokens_per_s"] if before["tokens_per_s"] > 0 else math.inf
    clients_n = r.situation.load.get("clients", 1)
    cut = math.hypot(clients_n / (2 * max(before["done"], 1)), clients_n / (2 * max(after["done"], 1)))
    return {"situation": r.situation.name, "compare": m["ratio"], "compare_error": m["ratio_error"],
            "method": m["method"], "clients": clients, "clients_error": clients * cut,
            "requests": [before["done"], after["done"]], "load_avg": [before["load_avg"], after["load_avg"]]}


@pytest.mark.parametrize("name", [s.name for s in SITUATIONS if s.applied])
def test_compare_and_the_clients_agree_on_each_applied_fix(recorded: dict[str, Recording], name: str) -> None:
    """What compare calls realised is what the clients received: the counters' ratio and the clients' ratio agree
    within their errors (two of compare's standard errors, and the requests cut at the windows' ends)."""
    r = recorded[name]
    assert r.applied is not None and r.compare, _explain(r)
    w = three_ways(r)
    keep = os.environ.get("LLAMACPP_TIER_KEEP")
    if keep:
        (Path(keep) / f"three-ways-{name}.json").write_text(json.dumps(w, indent=1))
    assert w["method"] == "counter delta", w
    assert abs(w["compare"] - w["clients"]) <= 2 * w["compare_error"] + w["clients_error"], w


def test_the_build_number_is_read_and_the_defaults_of_that_build_apply(recorded: dict[str, Recording]) -> None:
    """scripts/install-llamacpp.sh gives CMake the build number (the sdist has no git): /props says b11434, and a
    knob left unset (-b on the slot-limited server) is in force at build 11434's default, not unknown."""
    r = recorded.get("deferred") or next(iter(recorded.values()))
    cap = capture_mod.loads(r.capture.read_bytes())
    version = cap.server.version if cap.server is not None else ""
    assert parse_version(version) == llamacpp.B11434, (version, llamacpp_server.version())
    batch = build_evidence(cap).knob("max_num_batched_tokens")
    assert batch is not None and batch.known and batch.is_default and batch.value == 2048, batch


def test_the_server_answers_the_pages_the_map_reads(tmp_path: Path) -> None:
    """The pages kept in tests/fixtures/llamacpp still name the families this build serves."""
    why = llamacpp_server.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the llama.cpp tier cannot run: {why}")
        pytest.skip(why)
    kept = Path(__file__).with_name("fixtures") / "llamacpp" / "metrics-idle.txt"
    families = {line.split()[2] for line in kept.read_text().splitlines() if line.startswith("# TYPE")}
    model = gguf_model.build(tmp_path / "model")
    with llamacpp_server.LlamaCppServer(model, SERVERS["np2"], log=tmp_path / "server.log") as server:
        live = {line.split()[2] for line in server.page("/metrics").splitlines() if line.startswith("# TYPE")}
        assert '"n_ctx":1024' in server.page("/slots").replace(" ", "")
    assert families == live, (families ^ live, server.tail())
