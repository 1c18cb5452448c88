"""The engine's scheduler as a model (diagnoser/engines/): vLLM's knob table, its defaults by version and platform,
the knob that binds named in its direction, and compare mapping every changed knob through the same table.

Each rule case is one a real vLLM 0.32 (CPU build) got wrong one step beside the real-engine tier's situations, with
the answer written from the set-up: a tight per-step token budget advised as --max-num-seqs; a budget larger than
every prompt advised raised; a 0 % prefix-cache hit rate on unique prompts with caching on read as a miss; HTTP 400
refusals read as clients giving up; SRV003 and SRV004's opposite directions merged into one fix; a batch pinned at a
default limit not on the command line passed unseen."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from diagnoser.capture import GpuInfo, ServerInfo, ServingConfig
from diagnoser.collectors.server_maps import parse_spec
from diagnoser.collectors.target import serving_from_cmdline
from diagnoser.compare import compare
from diagnoser.diagnosis import FixKind
from diagnoser.engines import vllm
from diagnoser.engines.knobs import Direction, Platform, direction_of, parse_version, setting
from diagnoser.pipeline import diagnose_capture
from diagnoser.rules import diagnose
from tests.factories import make_capture

CPU_032 = "0.32.0+cpu"


def capture(signals: dict[str, Any], *, serving: dict | None = None, version: str = CPU_032,
            gpu: GpuInfo | None = None) -> Any:
    cap = make_capture(signals, gpu=None)
    if gpu is not None:
        cap.gpus.append(gpu)
    cap.server = ServerInfo(kind="vllm", version=version)
    typed = {k: v for k, v in (serving or {}).items() if k in ServingConfig.__struct_fields__}
    extra = {k: str(v) for k, v in (serving or {}).items() if k not in typed}
    cap.serving = msgspec.structs.replace(cap.serving, engine="vllm", **typed, extra=extra)
    cap.cpu_only = gpu is None
    return cap


def codes(d: Any) -> list[str]:
    return [f.code for f in d.findings]


# --- the table ------------------------------------------------------------------------------------------------

def test_every_knob_says_what_it_constrains_binds_trades_and_bounds() -> None:
    for k in vllm.KNOBS:
        assert k.flags and all(f.startswith("-") for f in k.flags), k.name
        for text in (k.title, k.constrains, k.binds, k.trades, k.bounds):
            assert len(text) > 5, (k.name, text)
        if k.relieves is not None and k.fixes:
            assert k.relieves in k.fixes, f"{k.name}: the relieving direction applies no fix"
    names = {k.name for k in vllm.KNOBS}
    for needed in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "long_prefill_token_threshold",
                   "max_model_len", "gpu_memory_utilization", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                   "block_size", "prefix_caching", "speculative_config", "tensor_parallel_size",
                   "data_parallel_size", "scheduling_policy"):
        assert needed in names


@pytest.mark.parametrize("platform, seqs, budget", [
    (Platform(cpu=True), 128, 2048),  # the CPU build's API-server defaults (vLLM 0.32 arg_utils)
    (Platform(cpu=True, world_size=2), 256, 4096),  # per rank
    (Platform(gpu_memory_gib=79.6, gpu_name="NVIDIA A100-SXM4-80GB"), 256, 2048),  # an A100 keeps the small ones
    (Platform(gpu_memory_gib=79.6, gpu_name="NVIDIA H100 80GB HBM3"), 1024, 8192),
    (Platform(gpu_memory_gib=139.8, gpu_name="NVIDIA H200"), 1024, 8192),
    (Platform(gpu_memory_gib=179.0, gpu_name="NVIDIA B200"), 1024, 16384),
    (Platform(gpu_memory_gib=23.6, gpu_name="NVIDIA L4"), 256, 2048),
])
def test_defaults_by_platform_as_vllm_032_sets_them(platform: Platform, seqs: int, budget: int) -> None:
    empty = ServingConfig(engine="vllm")
    assert setting(vllm.MAX_NUM_SEQS, empty, (0, 32, 0), platform).value == seqs
    assert setting(vllm.MAX_NUM_BATCHED_TOKENS, empty, (0, 32, 0), platform).value == budget


def test_an_unknown_version_leaves_a_default_unknown_and_says_why() -> None:
    s = setting(vllm.MAX_NUM_SEQS, ServingConfig(engine="vllm"), None, Platform(cpu=True))
    assert not s.known and "version is unknown" in s.why_unknown
    s = setting(vllm.MAX_NUM_SEQS, ServingConfig(engine="vllm"), (0, 5, 0), Platform(cpu=True))
    assert not s.known and "before version 0.10" in s.why_unknown
    configured = setting(vllm.MAX_NUM_SEQS, ServingConfig(engine="vllm", max_num_seqs=7), None, None)
    assert configured.value == 7 and not configured.is_default
    assert parse_version("0.32.0+cpu") == (0, 32, 0) and parse_version("v0.9") == (0, 9) and parse_version("x") is None


def test_llama_cpp_build_numbers_parse_and_vllm_versions_read_as_before() -> None:
    assert parse_version("b11434-1a2b3c4") == (11434,) and parse_version("version: 11434 (1a2b3c4)") == (11434,)
    assert parse_version("b6xyz") is None and parse_version("build") is None
    assert parse_version("b0-unknown") is None  # built outside git (tests/fixtures/llamacpp): no build number
    assert parse_version("0.32.0+cpu") == (0, 32, 0) and parse_version("0.10.1") == (0, 10, 1)


def test_command_line_spellings_come_from_the_table() -> None:
    s = serving_from_cmdline(["python", "-m", "vllm.entrypoints.openai.api_server", "--max-num-batched-tokens=128",
                              "--no-enable-prefix-caching", "--long-prefill-token-threshold", "256",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                              "--scheduling-policy", "priority", "--block-size", "32"])
    assert s.max_num_batched_tokens == 128 and s.prefix_caching is False and s.block_size == 32
    assert s.extra["long_prefill_token_threshold"] == "256" and s.extra["scheduling_policy"] == "priority"
    assert "ngram" in s.extra["speculative_config"]


def test_directions_of_a_change() -> None:
    assert direction_of(vllm.MAX_NUM_BATCHED_TOKENS, 128, 2048) is Direction.RAISE
    assert direction_of(vllm.LONG_PREFILL_THRESHOLD, 0, 256) is Direction.LOWER  # 0 is no cap
    assert direction_of(vllm.SPECULATIVE_CONFIG, '{"method": "ngram"}', None) is Direction.OFF
    assert direction_of(vllm.PREFIX_CACHING, False, True) is Direction.ON
    assert direction_of(vllm.MAX_NUM_SEQS, None, 16) is None


def test_a_spec_with_two_label_matchers() -> None:
    name, where = parse_spec('http_requests_total{handler=~"/v1/.*",status=~"4.*"}')
    assert name == "http_requests_total" and where is not None
    assert where.matches({"handler": "/v1/completions", "status": "4xx"})
    assert not where.matches({"handler": "/v1/completions", "status": "2xx"})
    assert not where.matches({"handler": "/metrics", "status": "4xx"})


# --- the knob that binds, in its direction ----------------------------------------------------------------------

LONG_UNIQUE = {"server.prompt_len_mean": [512.0], "server.kv_usage": 0.1}


def test_a_tight_token_budget_is_named_not_the_sequence_limit() -> None:
    """--max-num-batched-tokens 128, 512-token unique prompts, 4 clients: 1 running of 16 allowed, 3 waiting."""
    d = diagnose(capture({"server.running": 1.0, "server.waiting": 3.0, "server.ttft_mean_s": [3.0],
                          "server.queue_time_mean_s": [2.5], **LONG_UNIQUE},
                         serving={"max_num_batched_tokens": 128, "max_num_seqs": 16}))
    assert d.verdict == "batching" and "BAT006" in codes(d) and "BAT005" not in codes(d)
    first = d.fixes[0]
    assert first.kind is FixKind.TOKEN_BUDGET and "--max-num-batched-tokens from 128" in first.action
    assert not any(f.kind is FixKind.BATCH_MORE for f in d.fixes), [f.action for f in d.fixes]


def test_a_budget_that_chunks_every_prompt_binds_without_a_queue() -> None:
    """As a real vLLM 0.32 (CPU build) read it with --max-num-batched-tokens 128 and 512-token unique prompts from 4
    clients: vLLM V1 admits every request and prefills them a chunk a step, so 3-4 run and nothing waits; the time
    to first token (10.8 s) is half prefill (5.2 s) over 5 steps a prompt. Nothing fired before: no queue."""
    d = diagnose(capture({"server.running": [2.0, 3.0, 3.0, 3.0, 4.0, 4.0, 3.0, 4.0, 4.0, 4.0],
                          "server.waiting": [2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          "server.ttft_mean_s": [10.76], "server.prefill_time_mean_s": [5.18],
                          "server.queue_time_mean_s": [2.06], "server.prompt_len_mean": [512.0],
                          "server.kv_usage": 0.02}, serving={"max_num_batched_tokens": 128, "max_num_seqs": 16}))
    assert d.verdict == "batching" and codes(d)[0] == "BAT006"
    assert d.fixes[0].kind is FixKind.TOKEN_BUDGET and "prefills over 5 steps" in d.findings[0].message


def test_the_budget_at_a_default_larger_than_every_prompt_is_never_advised() -> None:
    """The same load on vLLM 0.32's CPU default (2048 tokens per step): a 512-token prompt fits in one step."""
    d = diagnose(capture({"server.running": 4.0, "server.waiting": 0.0, "server.ttft_mean_s": [1.2],
                          "server.prefill_time_mean_s": [1.0], "server.queue_time_mean_s": [0.1], **LONG_UNIQUE},
                         serving={"max_num_seqs": 16}))
    assert "SRV003" in codes(d) and "BAT006" not in codes(d)
    assert not any(f.kind is FixKind.TOKEN_BUDGET for f in d.fixes)
    assert not any("--max-num-batched-tokens" in f.action and "Raise" in f.action for f in d.fixes)
    (srv3,) = [f for f in d.fixes if "SRV003" in f.rules]
    assert "already fits in one step (--max-num-batched-tokens 2048)" in srv3.action


def test_a_queue_nothing_on_the_server_holds_asks_for_capacity_not_a_knob_in_place() -> None:
    d = diagnose(capture({"server.running": 4.0, "server.waiting": 3.0, "server.ttft_mean_s": [3.0],
                          "server.queue_time_mean_s": [2.5], "server.prompt_len_mean": [64.0],
                          "server.kv_usage": 0.1}, serving={"max_num_seqs": 16}))
    assert "SRV002" in codes(d)
    (fix,) = [f for f in d.fixes if "SRV002" in f.rules]
    assert fix.kind is FixKind.ADD_GPUS and "4.0 running of 16" in fix.action


def test_unique_prompts_with_caching_on_are_the_workload_not_a_miss() -> None:
    signals = {"server.prefix_cache_hit_rate": [0.0], "server.prompt_len_mean": [1536.0],
               "server.prompt_tokens_per_s": 3000.0, "server.gen_tokens_per_s": 10.0}
    d = diagnose(capture({**signals, "server.kv_usage": 0.2}))
    assert "SRV001" not in codes(d)
    # The neighbouring situation: caching on but the pool full, so prefixes are evicted before they are reused.
    d = diagnose(capture({**signals, "server.kv_usage": 0.97}))
    assert "SRV001" in codes(d)
    # And caching off: the cache is the fix whatever the hit rate says.
    d = diagnose(capture({"server.prompt_len_mean": [1536.0], "server.prompt_tokens_per_s": 3000.0,
                          "server.gen_tokens_per_s": 10.0, "server.kv_usage": 0.2},
                         serving={"prefix_caching": False}))
    assert "SRV001" in codes(d)


def test_refusals_are_told_apart_from_clients_giving_up() -> None:
    """96 % of the requests answered 400 (prompts over --max-model-len) beside a light valid load."""
    d = diagnose(capture({"server.http_requests_per_s": 10.0, "server.http_rejected_per_s": 9.6,
                          "server.requests_per_s": 0.4, "server.running": 1.0, "server.waiting": 0.0},
                         serving={"max_model_len": 256}))
    assert "SRV010" in codes(d) and "SRV009" not in codes(d)
    (fix,) = [f for f in d.fixes if "SRV010" in f.rules]
    assert fix.kind is FixKind.CONTEXT_LENGTH and "--max-model-len (now 256)" in fix.action
    # The neighbour: the same HTTP count with no refusals and few served is clients leaving.
    d = diagnose(capture({"server.http_requests_per_s": 10.0, "server.requests_per_s": 0.4, "server.running": 1.0,
                          "server.waiting": 0.0}))
    assert "SRV009" in codes(d) and "SRV010" not in codes(d)


def _v0(cap: Any) -> Any:
    """vLLM's V0 engine (before 0.8), which observed iteration_tokens_total once per step: SRV004 reads it there."""
    cap.server.version = "0.7.3"
    return cap


def test_opposite_directions_of_one_knob_are_two_fixes_never_one() -> None:
    """Long prompts arriving while short requests decode: SRV003 (TTFT is prefill) and SRV004 (prefills stall
    decodes) both hold; one wants larger chunks, the other smaller."""
    d = diagnose(_v0(capture({"server.running": 4.0, "server.waiting": 0.0, "server.ttft_mean_s": [4.0],
                              "server.prefill_time_mean_s": [3.5], "server.queue_time_mean_s": [0.1],
                              "server.prompt_len_mean": [3000.0], "server.kv_usage": 0.2,
                              "server.itl_p50_s": [0.02], "server.itl_p99_s": [1.0],
                              "server.iteration_tokens_p50": [4.0], "server.iteration_tokens_p99": [2048.0]},
                             serving={"chunked_prefill": True, "max_num_batched_tokens": 2048})))  # set on V0
    assert {"SRV003", "SRV004"} <= set(codes(d))
    by_rule = {f.rules: f for f in d.fixes}
    assert ("SRV003", "SRV004") not in by_rule and ("SRV004", "SRV003") not in by_rule
    up = next(f for f in d.fixes if "SRV003" in f.rules)
    down = next(f for f in d.fixes if "SRV004" in f.rules)
    assert up.kind is FixKind.TOKEN_BUDGET and "Raise --max-num-batched-tokens" in up.action
    assert down.kind is FixKind.CAP_PREFILL and "--long-prefill-token-threshold 512" in down.action


def test_a_cap_already_in_place_is_not_advised_again() -> None:
    d = diagnose(_v0(capture({"server.running": 4.0, "server.waiting": 0.0, "server.prompt_len_mean": [3000.0],
                              "server.itl_p50_s": [0.02], "server.itl_p99_s": [1.0],
                              "server.iteration_tokens_p50": [4.0], "server.iteration_tokens_p99": [600.0]},
                             serving={"long_prefill_token_threshold": 256, "max_num_batched_tokens": 256})))
    (fix,) = [f for f in d.fixes if "SRV004" in f.rules]
    assert fix.kind is FixKind.SPLIT_PREFILL and "already capped" in fix.action


def test_a_batch_pinned_at_a_default_limit_is_seen() -> None:
    """Open-loop arrivals above what the server serves: 128 running (the CPU build's default, not on the command
    line), the queue growing."""
    signals = {"server.running": 128.0, "server.waiting": [float(i) for i in range(30)], "server.kv_usage": 0.3}
    d = diagnose(capture(signals))
    assert "BAT005" in codes(d)
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "from 128" in fix.action and "--max-num-seqs" in fix.action
    assert "not set: vLLM >= 0.10 default" in next(f for f in d.findings if f.code == "BAT005").message
    # Version unknown: the limit is unknown, and the rule says it cannot decide rather than passing.
    d = diagnose(capture(signals, version=""))
    assert "BAT005" not in codes(d)
    assert any(s.code == "BAT005" and "version is unknown" in s.reason for s in d.skipped), d.skipped


def test_the_gpu_defaults_follow_the_device() -> None:
    h200 = GpuInfo(index=0, name="NVIDIA H200", memory_total_bytes=int(139.8 * (1 << 30)))
    d = diagnose(capture({"server.running": 1024.0, "server.waiting": 50.0, "server.kv_usage": 0.3},
                         version="0.32.0", gpu=h200))
    (fix,) = [f for f in d.fixes if "BAT005" in f.rules]
    assert "from 1024" in fix.action


# --- compare: every changed knob, mapped through the table -----------------------------------------------------

def _pair(before: dict[str, Any], after: dict[str, Any]) -> Any:
    signals = {"server.running": 2.0, "server.waiting": 1.0, "server.gen_tokens_per_s": 100.0}
    a, b = capture(signals, serving=before), capture(signals, serving=after)
    b.target = "after"
    return compare(diagnose_capture(a), diagnose_capture(b))


def test_compare_names_each_changed_knob_with_the_fix_it_applies() -> None:
    c = _pair({"max_num_batched_tokens": 128}, {})
    (ch,) = [ch for ch in c.changes if ch.what == "serving.max_num_batched_tokens"]
    assert ch.before == "128" and ch.after == "2048 (default)" and ch.fix is FixKind.TOKEN_BUDGET
    c = _pair({"speculative_config": '{"method": "ngram"}'}, {})
    (ch,) = [ch for ch in c.changes if ch.what == "serving.speculative_config"]
    assert ch.fix is FixKind.SPEC_DECODE
    c = _pair({}, {"long_prefill_token_threshold": 256})
    (ch,) = [ch for ch in c.changes if ch.what == "serving.long_prefill_token_threshold"]
    assert ch.before == "0 (default)" and ch.fix is FixKind.CAP_PREFILL
    c = _pair({}, {"max_num_seqs": 64})
    (ch,) = [ch for ch in c.changes if ch.what == "serving.max_num_seqs"]
    assert ch.before == "128 (default)" and ch.fix is FixKind.STOP_PREEMPTION  # lowered: fewer admitted


def test_offered_load_above_capacity_is_its_own_finding() -> None:
    """Open-loop arrivals at twice what the server serves: the queue grows all window (2 requests a second here)."""
    grows = {"server.running": 128.0, "server.waiting": [float(i) for i in range(30)], "server.kv_usage": 0.3,
             "server.requests_per_s": 4.0}
    d = diagnose(capture(grows))
    assert "SRV011" in codes(d) and "BAT005" in codes(d)
    (fix,) = [f for f in d.fixes if "SRV011" in f.rules]
    assert fix.kind is FixKind.ADMISSION and "--max-num-queued-reqs" in fix.action
    srv11 = next(f for f in d.findings if f.code == "SRV011")
    assert "2.00 requests a second" in srv11.message
    # The neighbour: a steady queue of the same mean is a limit that binds, not arrivals outrunning service.
    d = diagnose(capture({**grows, "server.waiting": 14.5}))
    assert "SRV011" not in codes(d) and "BAT005" in codes(d)
    # Closed-loop clients arriving as the window opens: the queue fills once, then holds (a real vLLM, 8 clients of
    # 1536-token prompts): no overload.
    filled = [0.0] * 20 + [5.0] * 10
    d = diagnose(capture({**grows, "server.running": 3.0, "server.waiting": filled}))
    assert "SRV011" not in codes(d)


def test_the_engines_environment_sets_a_knob(tmp_path: Any) -> None:
    """VLLM_CPU_KVCACHE_SPACE read from a real process's environment: the KV pool's bytes knob in force."""
    import subprocess
    import sys

    import psutil

    from diagnoser.collectors.target import _with_environment

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={"VLLM_CPU_KVCACHE_SPACE": "3", "PATH": "/usr/bin:/bin"})
    try:
        serving = _with_environment(ServingConfig(engine="vllm"), psutil.Process(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    assert serving.extra["VLLM_CPU_KVCACHE_SPACE"] == "3"
    s = setting(vllm.KV_CACHE_MEMORY_BYTES, serving, (0, 32, 0), Platform(cpu=True))
    assert s.value == 3 * (1 << 30) and not s.is_default


def test_speculation_that_rarely_drafts_is_not_sized_as_if_every_step_verified_a_draft() -> None:
    """ngram speculation that drafted 56 tokens (about 19 drafts of 3) in about 12,500 generated: the acceptance
    formula ('0.77x plain decoding, up to +30 %') described steps that never happened."""
    d = diagnose(capture({"server.spec_mean_accept_len": [1.6], "server.spec_draft_len": [3.0],
                          "server.spec_drafts_per_token": [19 / 12500]}))
    (f,) = [f for f in d.findings if f.code == "SRV005"]
    assert "0.2% of the generated tokens" in f.message
    (fix,) = [x for x in d.fixes if "SRV005" in x.rules]
    assert fix.gain is None and "per-step overhead" in fix.basis
    # The neighbour: drafts on most steps, as the formula assumes, accepted too rarely: the formula sizes it.
    d = diagnose(capture({"server.spec_mean_accept_len": [1.1], "server.spec_draft_len": [3.0],
                          "server.spec_drafts_per_token": [0.5]}))
    (fix,) = [x for x in d.fixes if "SRV005" in x.rules]
    assert fix.gain is not None


def test_docs_attach_md_lists_every_knob_as_the_table_says() -> None:
    from pathlib import Path

    from diagnoser.engines.tables import DOC_BEGIN, DOC_END, markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "attach.md").read_text()
    held = doc[doc.index(DOC_BEGIN):doc.index(DOC_END) + len(DOC_END)] + "\n"
    assert held == markdown(), "docs/attach.md's knob table is stale: regenerate it with `python -m diagnoser.engines`"
    for k in vllm.KNOBS:
        assert f"`{k.flag}`" in held


def test_a_pinned_pool_dropped_is_the_kv_fix_and_a_longer_context_no_second_change() -> None:
    """The real tier's kv-capped fix: the server restarted without --num-gpu-blocks-override and without its
    --max-model-len 256; no request was refused in either window, so the context length is not a second fix."""
    signals = {"server.running": 2.0, "server.waiting": 1.0, "server.gen_tokens_per_s": 100.0}
    a = capture(signals, serving={"num_gpu_blocks_override": 12, "max_model_len": 256})
    b = capture(signals, serving={"max_model_len": 2048})
    b.target = "after"
    c = compare(diagnose_capture(a), diagnose_capture(b))
    (ch,) = [ch for ch in c.changes if ch.what == "serving.num_gpu_blocks_override"]
    assert ch.fix is FixKind.KV_MEMORY
    assert not any("several changes" in x for x in c.confounders), c.confounders
    refused = {**signals, "server.http_requests_per_s": 5.0, "server.http_rejected_per_s": 4.0}
    a = capture(refused, serving={"num_gpu_blocks_override": 12, "max_model_len": 256})
    b = capture(refused, serving={"max_model_len": 2048})
    b.target = "after"
    c = compare(diagnose_capture(a), diagnose_capture(b))
    assert any("several changes" in x for x in c.confounders), c.confounders


# --- the real engine's kept windows -----------------------------------------------------------------------------

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "vllm"


def _kept(name: str) -> Any:
    from diagnoser.capture import load

    return diagnose_capture(load(FIXTURES / f"{name}.dgc"))


def test_kept_budget_fix_is_seen_applied_and_helped() -> None:
    """--max-num-batched-tokens 128 -> the CPU default (2048), the same load: compare names the knob, credits the
    token-budget fix (not batch_more) and measures a gain; nothing was promised on a CPU build."""
    before, after = _kept("budget-capped"), _kept("budget-capped-fixed")
    assert before.diagnosis.fixes[0].kind is FixKind.TOKEN_BUDGET
    c = compare(before, after)
    (ch,) = [ch for ch in c.changes if ch.what == "serving.max_num_batched_tokens"]
    assert (ch.before, ch.after, ch.fix) == ("128", "2048 (default)", FixKind.TOKEN_BUDGET)
    (p,) = [p for p in c.predictions if p.kind is FixKind.TOKEN_BUDGET]
    assert p.applied and p.realised is not None and p.realised > 1.0 and p.predicted is None
    assert not c.confounders, c.confounders


def test_kept_kv_fix_is_graded_without_the_context_length_as_a_second_change() -> None:
    c = compare(_kept("kv-capped"), _kept("kv-capped-fixed"))
    (p,) = [p for p in c.predictions if p.kind is FixKind.KV_MEMORY]
    # Graded for the change made: the BEFORE window's own step-time curve (no device roofs) at the batch the AFTER
    # window ran, an estimate, not the rule's bound of x4.25.
    assert p.applied and p.verdict == "held" and p.for_change_kind == "estimate", (p, c.confounders)


def test_the_real_engine_tier_tries_each_knob_binding_and_loose_or_says_why_not() -> None:
    """Every knob of vLLM's table has a situation of the real-engine tier where it binds (its fix, in its relieving
    direction, is the one expected first) and one where it is loose (that fix must not be offered), or a reason."""
    from tests.engines.situations import MATRIX, SITUATIONS

    by_name = {s.name: s for s in SITUATIONS}
    assert set(MATRIX) == {k.name for k in vllm.KNOBS}, "tests/engines/situations.py MATRIX: one entry per knob"
    for name, entry in MATRIX.items():
        if isinstance(entry, str):
            assert len(entry) > 20, name
            continue
        knob = vllm.BY_NAME[name]
        assert knob.relieves is not None
        relief = knob.fixes[knob.relieves].value
        binds, loose = by_name[entry[0]], by_name[entry[1]]
        assert relief in binds.first_fix, (name, binds.name, binds.first_fix)
        assert relief in loose.forbidden_fixes, (name, loose.name, loose.forbidden_fixes)
