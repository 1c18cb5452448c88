"""The serving rules (SRV001-SRV008) on captures built from explicit values: each fires with its numbers and a
bounded gain, and each has cases that must not fire."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from diagnoser.capture import ServerInfo, ServingConfig
from diagnoser.diagnosis import Benefit, Finding, FixKind, GainKind
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import default_rules, diagnose
from diagnoser.rules.base import Check
from diagnoser.rules.serving import _spec_speedup
from tests.factories import llama_7b, make_capture


def run(code: str, signals: dict[str, Any], *, kind: str = "vllm", serving: dict | None = None, version: str = "",
        **kw: Any) -> Finding | None:
    """One rule on a capture of explicit values. `serving`: ServingConfig fields; other keys go to its extra."""
    capture = make_capture(signals, **kw)
    capture.server = ServerInfo(kind=kind, version=version)
    typed = {k: v for k, v in (serving or {}).items() if k in ServingConfig.__struct_fields__}
    extra = {k: str(v) for k, v in (serving or {}).items() if k not in typed}
    capture.serving = msgspec.structs.replace(capture.serving, **typed, extra=extra)
    rule = default_rules().get(code)
    assert rule is not None
    ev = build_evidence(capture)
    assert not rule.missing(ev), rule.missing(ev)
    return rule.predicate(Check(rule, ev, rule.defaults()))


# vLLM's window: prefill 0.1 s and decode 0.9 s per request -> prefill is 10 % of request time; with 0.5 s / 0.5 s, 50 %
PREFILL_HEAVY = {"server.prefill_time_mean_s": [0.5], "server.decode_time_mean_s": [0.5]}


def test_srv001_low_hit_rate_on_long_prompts_gain_bounded_by_the_prefill_saved():
    # caching on and the pool full: prefixes are evicted before they are asked for again
    f = run("SRV001", {"server.prompt_len_mean": [2000.0], "server.prefix_cache_hit_rate": [0.05],
                       "server.kv_usage": [0.95], **PREFILL_HEAVY})
    assert f is not None and f.code == "SRV001" and "hits 5%" in f.message
    (fix,) = f.fixes
    # prefill 50 % of the work; hits 5 % -> 50 %: (0.5 - 0.05) / 0.95 of prefill saved = 23.7 % of the work
    saved = 0.5 * (0.5 - 0.05) / 0.95
    assert fix.gain == pytest.approx(1 / (1 - saved))
    assert fix.gain_kind is GainKind.UPPER_BOUND and "assumed shared share" in fix.basis
    assert fix.kind is FixKind.PREFIX_CACHING


def test_srv001_cache_off_and_the_operators_shared_fraction():
    f = run("SRV001", {"server.prompt_len_mean": [1500.0], **PREFILL_HEAVY},
            serving={"prefix_caching": False, "shared_prefix_frac": 0.8})
    assert f is not None and "is off" in f.message
    assert f.fixes[0].gain == pytest.approx(1 / (1 - 0.5 * 0.8))  # all of 80 % shared prefill saved
    assert "--enable-prefix-caching" in f.fixes[0].action


@pytest.mark.parametrize("signals, serving", [
    ({"server.prompt_len_mean": [2000.0], "server.prefix_cache_hit_rate": [0.6], **PREFILL_HEAVY}, None),  # hits
    ({"server.prompt_len_mean": [120.0], "server.prefix_cache_hit_rate": [0.0], **PREFILL_HEAVY}, None),  # short
    ({"server.prompt_len_mean": [2000.0], "server.prefix_cache_hit_rate": [0.0],
      "server.prefill_time_mean_s": [0.05], "server.decode_time_mean_s": [0.95]}, None),  # prefill 5 % of the work
    ({"server.prompt_len_mean": [2000.0], "server.prefix_cache_hit_rate": [0.0], **PREFILL_HEAVY},
     {"shared_prefix_frac": 0.0}),  # the operator says nothing is shared
    ({"server.prompt_len_mean": [2000.0], **PREFILL_HEAVY}, None),  # no hit rate and the cache not known to be off
])
def test_srv001_must_not_fire(signals, serving):
    assert run("SRV001", signals, serving=serving) is None


def test_srv002_ttft_is_queueing_a_capacity_fix_with_no_throughput_gain():
    f = run("SRV002", {"server.ttft_mean_s": [2.0], "server.queue_time_mean_s": [1.6], "server.kv_usage": 0.5})
    assert f is not None and "1.60 s of their 2.00 s" in f.message and "(80%)" in f.message
    (fix,) = f.fixes
    assert fix.gain is None and fix.benefit is Benefit.CAPACITY and fix.kind is FixKind.BATCH_MORE
    assert "TTFT falls at most by the queue time, 2.00 s to 0.40 s" in fix.basis
    full = run("SRV002", {"server.ttft_mean_s": [2.0], "server.queue_time_mean_s": [1.6], "server.kv_usage": 0.97})
    assert full is not None and "KV cache full" in full.message and "KV cache more memory" in full.fixes[0].title


@pytest.mark.parametrize("ttft, queue", [(0.3, 0.25), (2.0, 0.6)])  # fast anyway; queue a minority
def test_srv002_must_not_fire(ttft, queue):
    assert run("SRV002", {"server.ttft_mean_s": [ttft], "server.queue_time_mean_s": [queue]}) is None


def test_srv003_ttft_is_prefill():
    f = run("SRV003", {"server.ttft_mean_s": [1.2], "server.prefill_time_mean_s": [0.9],
                       "server.prompt_len_mean": [6000.0]})
    assert f is not None and "0.90 s of the 1.20 s" in f.message
    assert f.fixes[0].gain is None and "1.20 s to 0.30 s" in f.fixes[0].basis
    assert "--max-num-batched-tokens" in f.fixes[0].action


@pytest.mark.parametrize("ttft, prefill", [(0.4, 0.35), (1.2, 0.3)])
def test_srv003_must_not_fire(ttft, prefill):
    assert run("SRV003", {"server.ttft_mean_s": [ttft], "server.prefill_time_mean_s": [prefill]}) is None


CONCURRENT = {"server.running": [3.0, 4.0, 4.0]}
# vLLM's V0 engine (before 0.8) observed iteration_tokens_total once per step: SRV004 reads it there only.
V0 = "0.7.3"


def test_srv004_itl_tail_from_heavy_steps_vllm_and_tgi():
    f = run("SRV004", {"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.12],
                       "server.iteration_tokens_p50": [40.0], "server.iteration_tokens_p99": [2048.0], **CONCURRENT},
            version=V0)
    assert f is not None and "at least 6.0x the median" in f.message
    assert f.fixes[0].gain is None and "from at least 120.0 ms to at most 20.0 ms" in f.fixes[0].basis
    tgi = run("SRV004", {"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.1], "server.prefill_step_mean_s": [0.4],
                         "server.decode_step_mean_s": [0.02], **CONCURRENT}, kind="tgi")
    assert tgi is not None and "20.0x the work" in tgi.message


def _quantile(capture: Any, name: str, value: float, low: float, high: float) -> None:
    """A quantile series as a server's histogram gives it: the value interpolated in the bucket (low, high]."""
    from diagnoser.capture import Series, bucket_labels
    capture.series.append(Series(name=name, unit="s" if name.endswith("_s") else "tokens", source="server",
                                 times=[10.0], values=[value], labels=bucket_labels(low, high)))


def _srv004_on(capture: Any) -> Finding | None:
    capture.server = ServerInfo(kind="vllm", version=V0)
    rule = default_rules().get("SRV004")
    assert rule is not None
    ev = build_evidence(capture)
    return None if rule.missing(ev) else rule.predicate(Check(rule, ev, rule.defaults()))


def test_srv004_compares_bucketed_quantiles_by_their_buckets_not_their_interpolated_values():
    """vLLM's first iteration_tokens bucket is (0, 1]: a median step interpolated at 0.51 tokens is one token, and a
    p99 step of 91.5 interpolated in (64, 128] is at least 64. Both ratios are read from the buckets."""
    cap = make_capture({"server.running": [2.0, 3.0]})
    _quantile(cap, "server.itl_p50_s", 0.0488, 0.025, 0.05)
    _quantile(cap, "server.itl_p99_s", 0.12, 0.1, 0.15)  # 2.5x interpolated, 2.0x at the least: no inflated tail
    _quantile(cap, "server.iteration_tokens_p50", 0.509, 0.0, 1.0)
    _quantile(cap, "server.iteration_tokens_p99", 91.5, 64.0, 128.0)
    assert _srv004_on(cap) is None
    cap = make_capture({"server.running": [2.0, 3.0]})
    _quantile(cap, "server.itl_p50_s", 0.0488, 0.025, 0.05)
    _quantile(cap, "server.itl_p99_s", 1.66, 1.0, 2.5)
    _quantile(cap, "server.iteration_tokens_p50", 0.509, 0.0, 1.0)
    _quantile(cap, "server.iteration_tokens_p99", 91.5, 64.0, 128.0)
    f = _srv004_on(cap)
    assert f is not None and "at least 20.0x the median" in f.message and "at least 64.0x the work" in f.message
    shown = {c.signal: c.text() for c in f.citations}
    assert "<= 1 tokens (the histogram's first bucket)" in shown["server.iteration_tokens_p50"]
    assert "0.509" not in shown["server.iteration_tokens_p50"] and "91.5" not in shown["server.iteration_tokens_p99"]


@pytest.mark.parametrize("signals", [
    {"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.04], "server.iteration_tokens_p50": [40.0],
     "server.iteration_tokens_p99": [2048.0], **CONCURRENT},  # tail only 2x
    {"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.12], "server.iteration_tokens_p50": [40.0],
     "server.iteration_tokens_p99": [64.0], **CONCURRENT},  # tail, but every step carries the same work: not prefill
    {"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.12], "server.iteration_tokens_p50": [1.0],
     "server.iteration_tokens_p99": [2048.0], "server.running": [1.0, 1.0, 0.0]},  # one request at a time
])
def test_srv004_must_not_fire(signals):
    assert run("SRV004", signals, version=V0) is None


def test_srv004_is_advisory_a_latency_tail_never_names_the_verdict():
    """A real vLLM with one client read 'INCONCLUSIVE, leans batching-limited: prefills stall decoding'; with four
    and no queue, the same. The tail is reported with its fix; the verdict is not taken from it."""
    cap = make_capture({"server.itl_p50_s": [0.02], "server.itl_p99_s": [0.5], "server.iteration_tokens_p50": [4.0],
                        "server.iteration_tokens_p99": [512.0], "server.running": [4.0] * 10,
                        "server.waiting": [0.0] * 10}, gpu=None)
    cap.server = ServerInfo(kind="vllm", version=V0)
    cap.serving = msgspec.structs.replace(cap.serving, max_num_seqs=16)
    d = diagnose(cap)
    assert d.verdict == "inconclusive" and "batching" not in d.headline
    assert "SRV004" in [f.code for f in d.findings] and d.fixes and d.fixes[0].kind is FixKind.CAP_PREFILL


def test_srv005_speculation_slower_than_none_is_dropped():
    # 1.1 tokens per step with a 4-token draft at 0.1 of a step each: 1.1 / 1.4 = 0.79x plain decoding
    f = run("SRV005", {"server.spec_mean_accept_len": [1.1], "server.spec_acceptance_rate": [0.03],
                       "server.spec_draft_len": [4.0]})
    assert f is not None and "0.79x plain decoding" in f.message
    assert f.fixes[0].gain == pytest.approx(1.4 / 1.1) and f.fixes[0].gain_kind is GainKind.UPPER_BOUND
    assert f.fixes[0].kind is FixKind.SPEC_DECODE


def test_srv005_a_shorter_draft_is_predicted_from_the_acceptance():
    # acceptance 0.3 with 8 drafted tokens: E = (1 - 0.3^9) / 0.7 = 1.43 tokens for 1.8 steps of work = 0.79x ...
    # measured mean length 2.0 (per-position dependence) keeps it above 1x; the formula's best k is 1 (1.3 / 1.1)
    f = run("SRV005", {"server.spec_mean_accept_len": [2.0], "server.spec_acceptance_rate": [0.3],
                       "server.spec_draft_len": [8.0]})
    assert f is not None and "a 1-token draft would beat the current 8" in f.message
    assert f.fixes[0].gain == pytest.approx(_spec_speedup(0.3, 1, 0.1) / _spec_speedup(0.3, 8, 0.1))


@pytest.mark.parametrize("signals", [
    {"server.spec_mean_accept_len": [2.8], "server.spec_acceptance_rate": [0.6], "server.spec_draft_len": [3.0]},
    {"server.spec_mean_accept_len": [3.2], "server.spec_acceptance_rate": [0.75]},  # SGLang: no draft length
])
def test_srv005_must_not_fire_when_speculation_pays(signals):
    assert run("SRV005", signals) is None


def test_srv006_preemption_churn_gain_bounded_by_recomputed_prefill():
    f = run("SRV006", {"server.preemptions_per_s": 1.0, "server.requests_per_s": 10.0,
                       "server.prompt_len_mean": [1000.0], "server.gen_len_mean": [200.0], **PREFILL_HEAVY})
    assert f is not None and "0.10 evictions per finished request" in f.message
    # 0.1 recomputes per request redo 0.1 x (1000 + 100) / 1000 = 11 % of prefill; prefill is 50 % of the work
    redo = 0.1 * 1100 / 1000
    assert f.fixes[0].gain == pytest.approx(1 / (1 - 0.5 * redo / (1 + redo)))
    sglang = run("SRV006", {"server.retracted": 3.0}, kind="sglang")
    assert sglang is not None and "3.0 requests held out" in sglang.message and sglang.fixes[0].gain is None
    assert sglang.fixes[0].benefit is Benefit.CAPACITY


@pytest.mark.parametrize("signals", [
    {"server.preemptions_per_s": 0.02, "server.requests_per_s": 10.0},  # 1 in 500 requests
    {"server.swapped": 0.0, "server.preemptions_per_s": 0.0, "server.requests_per_s": 5.0},
    {"server.paused": [0.0] * 29 + [2.0]},  # a moment, not a habit
])
def test_srv006_must_not_fire(signals):
    assert run("SRV006", signals) is None


def test_srv007_tgi_reserves_max_new_tokens():
    f = run("SRV007", {"server.max_tokens_mean": [2000.0], "server.gen_len_mean": [80.0],
                       "server.prompt_len_mean": [300.0], "server.waiting": 12.0, "server.running": 8.0},
            kind="tgi", model=llama_7b())
    assert f is not None and "2000 tokens and generate 80" in f.message and "TGI reserves" in f.message
    (fix,) = f.fixes
    assert fix.basis.startswith("reservations 6.1x")  # (300 + 2000) / (300 + 80) = 6.05
    assert fix.kind is FixKind.MAX_TOKENS and fix.gain_kind is GainKind.UPPER_BOUND
    assert fix.gain is not None and fix.gain > 1


@pytest.mark.parametrize("kind, signals", [
    ("vllm", {"server.max_tokens_mean": [2000.0], "server.gen_len_mean": [80.0], "server.waiting": 12.0}),  # on demand
    ("tgi", {"server.max_tokens_mean": [2000.0], "server.gen_len_mean": [80.0], "server.waiting": 0.0}),  # no queue
    ("tgi", {"server.max_tokens_mean": [256.0], "server.gen_len_mean": [200.0], "server.waiting": 12.0}),  # asks right
])
def test_srv007_must_not_fire(kind, signals):
    assert run("SRV007", signals, kind=kind) is None


def test_srv008_adapter_slots_full_while_other_adapters_wait():
    f = run("SRV008", {"server.lora_running_adapters": 4.0, "server.lora_waiting_adapters": 1.0,
                       "server.waiting_deferred": 6.0, "server.running": 12.0}, serving={"max_loras": 4},
            model=llama_7b())
    assert f is not None and "All 4 LoRA slots" in f.message
    assert f.fixes[0].basis.startswith("the 6.0 deferred requests join the batch")
    assert f.fixes[0].kind is FixKind.LORA
    assert "--max-loras above 4" in f.fixes[0].action


@pytest.mark.parametrize("signals, serving", [
    ({"server.lora_running_adapters": 2.0, "server.lora_waiting_adapters": 1.0}, {"max_loras": 4}),  # slots free
    ({"server.lora_running_adapters": 4.0, "server.lora_waiting_adapters": 0.0, "server.waiting_deferred": 0.0},
     {"max_loras": 4}),  # full, but nobody waits for another adapter
    ({"server.lora_running_adapters": 4.0, "server.lora_waiting_adapters": 2.0}, {}),  # slots unknown
])
def test_srv008_must_not_fire(signals, serving):
    assert run("SRV008", signals, serving=serving) is None


def test_serving_findings_do_not_take_the_verdict_from_a_full_kv_cache():
    # the KV cache is full and requests churn: VRAM001 stays the verdict, SRV006 adds the cost of the churn
    capture = make_capture({"gpu.busy": 0.9, "gpu.mem_used_frac": 0.95, "server.kv_usage": 0.99, "server.waiting": 12, "server.running": 40,
                            "server.preemptions_per_s": 2.0, "server.requests_per_s": 10.0,
                            "server.ttft_mean_s": [3.0], "server.queue_time_mean_s": [2.5]})
    capture.server = ServerInfo(kind="vllm")
    d = diagnose(capture)
    codes = [f.code for f in d.findings]
    assert d.findings[0].code == "VRAM001" and {"SRV002", "SRV006"} <= set(codes)
