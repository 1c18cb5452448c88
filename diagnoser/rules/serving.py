"""Serving rules: what an LLM-serving engineer reads off the engine's own metrics (prefix cache, where time to first
token goes, prefill interfering with decode, speculative decoding, KV pressure, max_tokens reservations, LoRA slots).

Every gain is bounded by a measured time or count and says so in its basis; a fix that buys capacity or latency
rather than tokens per second has no throughput gain and says which it buys.

Written in the current `@rule` style (requires/uses by name); each predicate reads only its own signals and the
capture's serving configuration, so it converts mechanically to typed signals and a RuleSet.
"""

from __future__ import annotations

from diagnoser.diagnosis import Finding, Limiter
from diagnoser.evidence import Signal
from diagnoser.rules.base import Check, Page, Threshold, rule
from diagnoser.rules.gains import batch_gain

# Engines whose scheduler admits a request only with room for its prompt plus max_tokens (TGI's token budget,
# SGLang's admission estimate, TensorRT-LLM's GUARANTEED_NO_EVICT policy); vLLM allocates KV blocks as tokens come.
RESERVING_ENGINES = {"tgi": "TGI", "sglang": "SGLang", "triton": "TensorRT-LLM"}
_LATENCY_SOURCES = ("MLPerf Inference LLM server scenarios bound TTFT (0.5-2 s) and TPOT (40-200 ms) per model; "
                    "vLLM's request phase histograms (queue, prefill, decode) split TTFT into waiting and prefill.")


def _prefill_share(c: Check) -> tuple[float, str] | None:
    """Prefill's share of the serving work: from the physics (least GPU time of the served tokens) when the model
    and GPU are known, else from the engine's per-request prefill and decode times (a proxy)."""
    decode = c.sig("theory.decode_share")
    if decode is not None:
        return 1.0 - decode.values[0], "prefill's share of the least GPU time the served tokens need"
    pre, dec = c.sig("server.prefill_time_mean_s"), c.sig("server.decode_time_mean_s")
    if pre is not None and dec is not None and pre.mean + dec.mean > 0:
        c.cite(pre, "value")
        c.cite(dec, "value")
        return pre.mean / (pre.mean + dec.mean), "prefill's share of requests' running time (prefill / (prefill + decode))"
    return None


def _value(s: Signal) -> float:
    return s.values[-1] if s.n == 1 else s.mean


@rule(
    code="SRV001",
    name="prefix-cache-missing",
    limiter=Limiter.COMPUTE,
    summary="Long prompts are prefilled again and again: the prefix cache is off or rarely hits.",
    requires=("server.prompt_len_mean",),
    uses=("server.prefix_cache_hit_rate", "server.prompt_tokens_per_s", "theory.decode_share",
          "server.prefill_time_mean_s", "server.decode_time_mean_s"),
    thresholds={
        "hit_rate_max": Threshold(0.20, "prefix-cache hit rate below which the cache saves little prefill"),
        "target_hit_rate": Threshold(0.50, "hit rate a workload with shared prompts reaches (system prompt, "
                                     "few-shot, multi-turn history); the gain assumes it unless the capture says "
                                     "the shared share (serving key shared_prefix_frac)"),
        "prompt_len_min": Threshold(256, "mean prompt tokens below which prefill is too short to matter"),
        "prefill_share_min": Threshold(0.15, "prefill's share of the work below which caching cannot pay"),
    },
    page=Page(
        detects="Prompts averaging 256 tokens or more, prefill taking at least 15 % of the work, and the prefix "
        "cache either switched off (vLLM cache_config_info enable_prefix_caching=False) or hitting under 20 % of "
        "the prompt tokens it is asked for over the window. It does not fire when the capture says the prompts "
        "share nothing (serving key shared_prefix_frac = 0).",
        why="A prompt whose prefix (system prompt, few-shot examples, earlier turns) was prefilled before can reuse "
        "its KV blocks; every miss recomputes those tokens, which is compute-bound prefill work that also delays "
        "first tokens and decode steps.",
        fixes="Enable prefix caching (vLLM --enable-prefix-caching, on by default in V1; SGLang's radix cache is "
        "on unless --disable-radix-cache). Put the shared part first and keep it byte-identical (no timestamps or "
        "request ids in the system prompt). Route requests with the same prefix to the same replica "
        "(prefix-aware routing). Give the cache room: evictions under a full KV cache lose prefixes. Predicted "
        "gain: the prefill time the extra hits would save, an upper bound.",
        sources="vLLM automatic prefix caching docs; SGLang RadixAttention (Zheng et al., 2024); hit rate = "
        "prefix_cache_hits / prefix_cache_queries (vLLM), cached / prompt tokens (SGLang).",
    ),
)
def prefix_cache_missing(c: Check) -> Finding | None:
    prompt = c.sig("server.prompt_len_mean")
    assert prompt is not None
    serving = c.ev.capture.serving
    shared = serving.get("shared_prefix_frac")
    if isinstance(shared, (int, float)) and shared <= 0:
        return None  # the operator says no prompt shares a prefix: nothing to cache
    hit = c.sig("server.prefix_cache_hit_rate")
    off = serving.get("enable_prefix_caching") is False
    if _value(prompt) < c.t["prompt_len_min"] or not (off or (hit is not None and _value(hit) < c.t["hit_rate_max"])):
        return None
    share = _prefill_share(c)
    if share is not None and share[0] < c.t["prefill_share_min"]:
        return None
    c.cite(prompt, "value", ">=", c.t["prompt_len_min"])
    h = 0.0 if off or hit is None else _value(hit)
    if hit is not None and not off:
        c.cite(hit, "value", "<", c.t["hit_rate_max"])
    target = float(shared) if isinstance(shared, (int, float)) and 0 < shared < 1 else c.t["target_hit_rate"]
    gain, basis = None, "no prefill share measured (needs the model and GPU, or vLLM's prefill/decode histograms)"
    if share is not None and target > h:
        saved = share[0] * (target - h) / (1.0 - h)  # prefill work that the extra hits would not recompute
        gain = 1.0 / max(0.05, 1.0 - saved)
        assumed = "the capture's shared_prefix_frac" if target != c.t["target_hit_rate"] else "an assumed"
        basis = (f"upper bound: {share[1]} {share[0]:.0%}, hits from {h:.0%} to {target:.0%} ({assumed} shared "
                 f"share) save {saved:.0%} of the work: 1 / (1 - {saved:.2f})")
    action = ("Start vLLM with --enable-prefix-caching (SGLang: drop --disable-radix-cache)" if off else
              "Put the shared prompt first and byte-identical, route equal prefixes to one replica, and leave the "
              "KV cache room so prefixes are not evicted")
    c.fix("Reuse shared prompt prefixes", action + ".", gain, basis)
    state = "is off" if off else f"hits {h:.0%} of the prompt tokens it is asked for"
    return c.finding(0.5, f"Prompts average {_value(prompt):.0f} tokens and the prefix cache {state}: shared prefixes "
                     "are prefilled again for every request.")


@rule(
    code="SRV002",
    name="ttft-dominated-by-queueing",
    limiter=Limiter.BATCHING,
    summary="Time to first token is mostly time spent waiting to be scheduled: the server lacks capacity.",
    requires=("server.ttft_mean_s", "server.queue_time_mean_s"),
    uses=("server.kv_usage", "server.waiting", "server.prefill_time_mean_s"),
    thresholds={
        "ttft_min_s": Threshold(0.5, "mean time to first token below which no split is worth making"),
        "queue_share": Threshold(0.5, "queue time's share of TTFT at which waiting dominates"),
        "kv_full": Threshold(0.90, "KV use (p90) at which memory, not the scheduler's limits, holds requests"),
    },
    page=Page(
        detects="Mean time to first token of 0.5 s or more, half or more of it spent queued (vLLM "
        "request_queue_time vs time_to_first_token; SGLang queue_time; Triton queue duration).",
        why="A request that waits is not being served at all: the batch is at the scheduler's limit "
        "(max-num-seqs) or the KV cache is full, so new requests queue until others finish.",
        fixes="A capacity fix, not a speed fix: more replicas or GPUs for the load; if the KV cache has room, a "
        "larger running batch (vLLM --max-num-seqs, SGLang --max-running-requests); if it is full, more KV memory "
        "(FP8 KV cache, --gpu-memory-utilization). Predicted: TTFT falls by at most the queue time.",
        sources=_LATENCY_SOURCES,
    ),
)
def ttft_dominated_by_queueing(c: Check) -> Finding | None:
    ttft, queue = c.sig("server.ttft_mean_s"), c.sig("server.queue_time_mean_s")
    assert ttft is not None and queue is not None
    t, q = _value(ttft), min(_value(queue), _value(ttft))
    if t < c.t["ttft_min_s"] or q / t < c.t["queue_share"]:
        return None
    c.cite(ttft, "value", ">=", c.t["ttft_min_s"])
    c.cite(queue, "value", ">=", round(c.t["queue_share"] * t, 4))
    kv = c.sig("server.kv_usage")
    full = kv is not None and kv.p90 >= c.t["kv_full"]
    if kv is not None:
        c.cite(kv, "p90", ">=" if full else "<", c.t["kv_full"])
    basis = f"latency, not throughput: TTFT falls at most by the queue time, {t:.2f} s to {t - q:.2f} s"
    if full:
        c.fix("Give the KV cache more memory (capacity)", "FP8 KV cache (vLLM --kv-cache-dtype fp8), a higher "
              "--gpu-memory-utilization, or more GPUs: the cache is what keeps requests waiting.", None, basis)
    else:
        c.fix("Admit more requests per step (capacity)", "Raise vLLM --max-num-seqs / SGLang --max-running-requests "
              "while the KV cache has room, or add replicas.", None, basis)
    return c.finding(0.55, f"Requests wait {q:.2f} s of their {t:.2f} s to first token ({q / t:.0%}): time to first "
                     f"token is queueing, the server is at capacity{' (KV cache full)' if full else ''}.")


@rule(
    code="SRV003",
    name="ttft-dominated-by-prefill",
    limiter=Limiter.COMPUTE,
    summary="Time to first token is mostly the prompt's own prefill, not waiting.",
    requires=("server.ttft_mean_s", "server.prefill_time_mean_s"),
    uses=("server.queue_time_mean_s", "server.prompt_len_mean", "server.prefill_time_per_token_mean_s"),
    thresholds={
        "ttft_min_s": Threshold(0.5, "mean time to first token below which no split is worth making"),
        "prefill_share": Threshold(0.5, "prefill time's share of TTFT at which prefill dominates"),
    },
    page=Page(
        detects="Mean time to first token of 0.5 s or more, half or more of it in the request's prefill phase "
        "(vLLM request_prefill_time vs time_to_first_token).",
        why="Long prompts, or prefill split into small chunks that share each step with decodes, make the first "
        "token wait for the prompt's compute.",
        fixes="Larger prefill chunks per step (vLLM --max-num-batched-tokens; SGLang --chunked-prefill-size) "
        "shorten prefill at the cost of decode latency during it; prefix caching removes repeated prompt tokens; "
        "disaggregated prefill (separate prefill and decode instances) stops the two from sharing steps. "
        "Predicted: TTFT falls at most by the prefill time (latency, not throughput).",
        sources=_LATENCY_SOURCES + " Sarathi-Serve (Agrawal et al., OSDI 2024) and DistServe (Zhong et al., OSDI "
        "2024) on chunked and disaggregated prefill.",
    ),
)
def ttft_dominated_by_prefill(c: Check) -> Finding | None:
    ttft, prefill = c.sig("server.ttft_mean_s"), c.sig("server.prefill_time_mean_s")
    assert ttft is not None and prefill is not None
    t, p = _value(ttft), min(_value(prefill), _value(ttft))
    if t < c.t["ttft_min_s"] or p / t < c.t["prefill_share"]:
        return None
    c.cite(ttft, "value", ">=", c.t["ttft_min_s"])
    c.cite(prefill, "value", ">=", round(c.t["prefill_share"] * t, 4))
    prompt = c.sig("server.prompt_len_mean")
    if prompt is not None:
        c.cite(prompt, "value")
    basis = f"latency, not throughput: TTFT falls at most by the prefill time, {t:.2f} s to {t - p:.2f} s"
    c.fix("Prefill in larger chunks, or on its own instances", "Raise vLLM --max-num-batched-tokens (SGLang "
          "--chunked-prefill-size) so a prompt prefills in fewer steps, or disaggregate prefill and decode; reuse "
          "shared prefixes (prefix caching).", None, basis)
    return c.finding(0.5, f"Prefill takes {p:.2f} s of the {t:.2f} s to first token ({p / t:.0%}): time to first "
                     "token is the prompt's compute, not queueing.")


@rule(
    code="SRV004",
    name="itl-inflated-by-prefill",
    limiter=Limiter.COMPUTE,
    summary="Some decode steps are much slower than the median: prefill work shares them.",
    requires=("server.itl_p50_s", "server.itl_p99_s", "server.iteration_tokens_p99|server.prefill_step_mean_s"),
    uses=("server.iteration_tokens_p50", "server.decode_step_mean_s", "server.prompt_tokens_per_s"),
    thresholds={
        "itl_ratio": Threshold(3.0, "p99 / p50 inter-token latency at which the tail counts as inflated"),
        "step_ratio": Threshold(4.0, "tokens of the p99 step over the median step (vLLM), or prefill over decode "
                                "step time (TGI), that shows prefill riding along"),
    },
    page=Page(
        detects="p99 inter-token latency at least 3x the median while the engine's steps show prefill work: vLLM's "
        "tokens per step at p99 at least 4x the median step, or TGI's prefill forward pass at least 4x its decode "
        "pass.",
        why="A decode token comes out once per step; a step that also prefills a prompt chunk takes as long as that "
        "chunk's compute, so every running sequence's next token waits for someone else's prompt.",
        fixes="Cap the prefill per step: a smaller chunk (vLLM --max-num-batched-tokens, SGLang "
        "--chunked-prefill-size) trades some TTFT for a tighter inter-token tail; disaggregated prefill removes "
        "the interference. Predicted: p99 inter-token latency falls at most to the median (latency, not "
        "throughput).",
        sources="Sarathi-Serve (Agrawal et al., OSDI 2024): generation stalls from prefills in the same batch; "
        "vLLM chunked-prefill docs; DistServe (OSDI 2024).",
    ),
)
def itl_inflated_by_prefill(c: Check) -> Finding | None:
    p50, p99 = c.sig("server.itl_p50_s"), c.sig("server.itl_p99_s")
    assert p50 is not None and p99 is not None
    if _value(p50) <= 0 or _value(p99) / _value(p50) < c.t["itl_ratio"]:
        return None
    steps_hi, steps_lo = c.sig("server.iteration_tokens_p99"), c.sig("server.iteration_tokens_p50")
    pre, dec = c.sig("server.prefill_step_mean_s"), c.sig("server.decode_step_mean_s")
    if steps_hi is not None and steps_lo is not None and _value(steps_lo) > 0:
        ratio, cite = _value(steps_hi) / _value(steps_lo), (steps_hi, steps_lo)
    elif pre is not None and dec is not None and _value(dec) > 0:
        ratio, cite = _value(pre) / _value(dec), (pre, dec)
    else:
        return None
    if ratio < c.t["step_ratio"]:
        return None
    c.cite(p99, "value", ">=", round(c.t["itl_ratio"] * _value(p50), 6))
    c.cite(p50, "value")
    c.cite(cite[0], "value", ">=", round(c.t["step_ratio"] * _value(cite[1]), 6))
    c.cite(cite[1], "value")
    basis = (f"latency, not throughput: p99 inter-token latency falls at most to the median, "
             f"{_value(p99) * 1e3:.0f} ms to {_value(p50) * 1e3:.0f} ms")
    c.fix("Cap the prefill that rides in decode steps", "Lower vLLM --max-num-batched-tokens (SGLang "
          "--chunked-prefill-size) so a step carries a smaller prompt chunk, or disaggregate prefill and decode.",
          None, basis)
    return c.finding(0.45, f"p99 inter-token latency is {_value(p99) / _value(p50):.1f}x the median while the "
                     f"heaviest steps carry {ratio:.1f}x the work of a typical one: prefills stall decoding.")


def _spec_speedup(alpha: float, k: int, cost: float) -> float:
    """Tokens per unit of target-model time with k draft tokens at acceptance alpha, each draft token costing
    `cost` of a target step (Leviathan et al., 2023): E[tokens] = (1 - alpha^(k+1)) / (1 - alpha)."""
    tokens = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * cost)


@rule(
    code="SRV005",
    name="speculative-decoding-not-paying",
    limiter=Limiter.COMPUTE,
    summary="Speculative decoding's accepted tokens do not pay for the drafting, or a shorter draft would pay more.",
    requires=("server.spec_mean_accept_len|server.spec_acceptance_rate",),
    uses=("server.spec_draft_len", "server.spec_acceptance_rate"),
    thresholds={
        "draft_cost": Threshold(0.10, "cost of one draft token as a share of a target-model step (EAGLE-style "
                                "heads ~0.05-0.1; a separate draft model ~ its size over the target's)"),
        "tune_gain": Threshold(1.10, "speed-up of the best draft length over the current one that is worth a "
                               "change"),
    },
    page=Page(
        detects="Speculative decoding whose measured tokens per verification step, against the draft's cost, "
        "give no speed-up over plain decoding (drop it), or a draft length whose acceptance falls so fast that a "
        "shorter draft is at least 10 % faster (tune it). Acceptance and draft length come from the engine's "
        "counters (vLLM spec_decode_*; SGLang spec_accept_rate / spec_accept_length).",
        why="Each step drafts k tokens and verifies them in one target pass; it pays only if the accepted tokens "
        "per step exceed the extra draft and verification work. Low acceptance means the target computes tokens "
        "it throws away.",
        fixes="Drop speculative decoding when it does not pay, shorten the draft (vLLM num_speculative_tokens, "
        "SGLang --speculative-num-steps) when late positions are rarely accepted, or use a draft better matched "
        "to the target (EAGLE heads trained on it). Gains are from the expected-tokens formula with the assumed "
        "draft cost: upper bounds.",
        sources="Leviathan et al., 'Fast Inference from Transformers via Speculative Decoding' (2023); vLLM "
        "SpecDecodingProm (acceptance = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts); "
        "EAGLE (Li et al., 2024).",
    ),
)
def speculative_decoding_not_paying(c: Check) -> Finding | None:
    length, rate, k_sig = (c.sig("server.spec_mean_accept_len"), c.sig("server.spec_acceptance_rate"),
                           c.sig("server.spec_draft_len"))
    cost = c.t["draft_cost"]
    k = round(_value(k_sig)) if k_sig is not None and _value(k_sig) >= 1 else None
    if length is not None and k is not None:
        tokens, now = _value(length), _value(length) / (1.0 + k * cost)
    elif rate is not None and k is not None:
        now = _spec_speedup(_value(rate), k, cost)
        tokens = now * (1.0 + k * cost)
    elif length is not None:
        tokens, now = _value(length), _value(length) / (1.0 + cost)  # k unknown: at least one draft token's cost
    else:
        return None
    best_k, best = k, 0.0
    if rate is not None and k is not None:
        for trial in range(1, max(k, 8) + 1):
            speed = _spec_speedup(min(_value(rate), 0.999), trial, cost)
            if speed > best:
                best_k, best = trial, speed
    for s in (length, rate, k_sig):
        if s is not None:
            c.cite(s, "value")
    if now < 1.0:
        c.fix("Turn speculative decoding off", "Serve without a draft (vLLM: no --speculative-config; SGLang: no "
              "--speculative-algorithm): plain decoding is faster at this acceptance.", 1.0 / now,
              f"upper bound: {tokens:.2f} tokens per step for 1 + {k or 1} x {cost:g} of a step's work "
              f"= {now:.2f}x plain decoding; off: 1 / {now:.2f}")
        return c.finding(0.5, f"Speculative decoding yields {tokens:.2f} tokens per verification step: with the "
                         f"draft's cost that is {now:.2f}x plain decoding, slower than none.")
    formula_now = _spec_speedup(min(_value(rate), 0.999), k, cost) if rate is not None and k is not None else now
    if best_k is not None and best_k != k and best / formula_now >= c.t["tune_gain"]:
        c.fix("Shorten the speculative draft", f"Draft {best_k} tokens instead of {k} (vLLM num_speculative_tokens, "
              "SGLang --speculative-num-steps).", best / formula_now,
              f"upper bound from acceptance {_value(rate):.0%} (rate, positions assumed independent) and draft "  # type: ignore[arg-type]
              f"cost {cost:g}: {best:.2f}x vs {formula_now:.2f}x plain decoding")
        return c.finding(0.4, f"Speculative decoding accepts {_value(rate):.0%} of drafted tokens: a {best_k}-token "  # type: ignore[arg-type]
                         f"draft would beat the current {k} ({best:.2f}x vs {formula_now:.2f}x plain decoding).")
    return None


@rule(
    code="SRV006",
    name="kv-preemption-churn",
    limiter=Limiter.VRAM,
    summary="Requests are preempted, retracted, swapped or paused for lack of KV memory and redo their work.",
    requires=("server.preemptions_per_s|server.retractions_per_s|server.swapped|server.retracted|server.paused",),
    uses=("server.requests_per_s", "server.prompt_len_mean", "server.gen_len_mean", "server.prompt_tokens_per_s",
          "theory.decode_share", "server.prefill_time_mean_s", "server.decode_time_mean_s"),
    thresholds={
        "per_request": Threshold(0.05, "preemptions (or retractions) per finished request that count as churn"),
        "held_mean": Threshold(1.0, "requests swapped out, retracted or paused at a time (mean) that count"),
    },
    page=Page(
        detects="At least one preemption or retraction per 20 finished requests (vLLM num_preemptions, SGLang "
        "num_retracted_requests), or on average a request swapped out (vLLM V0), retracted (SGLang) or paused "
        "(TensorRT-LLM) at any time.",
        why="An engine that runs out of KV blocks evicts a running request: it recomputes its prompt and generated "
        "tokens later (recompute), copies its cache over PCIe (swap) or parks it (pause). That work is paid twice, "
        "and the evicted request's latency jumps.",
        fixes="Admit fewer sequences than the cache can hold at peak (vLLM --max-num-seqs, SGLang "
        "--max-running-requests or a higher --schedule-conservativeness, TensorRT-LLM GUARANTEED_NO_EVICT), or "
        "give the cache more memory (FP8 KV cache, --gpu-memory-utilization / --mem-fraction-static). Predicted "
        "gain: the recomputed prefill work, an upper bound; fewer admissions are a capacity trade, not speed.",
        sources="vLLM docs on preemption (recompute vs swap); SGLang scheduler retraction and "
        "schedule_conservativeness; TensorRT-LLM batch manager scheduler policies.",
    ),
)
def kv_preemption_churn(c: Check) -> Finding | None:
    events = c.sig("server.preemptions_per_s") or c.sig("server.retractions_per_s")
    held = c.sig("server.swapped") or c.sig("server.retracted") or c.sig("server.paused")
    requests = c.sig("server.requests_per_s")
    churn = None
    if events is not None and requests is not None and requests.mean > 0:
        churn = events.mean / requests.mean
    many = churn is not None and churn >= c.t["per_request"]
    holding = held is not None and held.mean >= c.t["held_mean"]
    if not (many or holding):
        return None
    if many:
        c.cite(events, "mean")  # type: ignore[arg-type]
        c.cite(requests, "mean")  # type: ignore[arg-type]
    if holding:
        c.cite(held, "mean", ">=", c.t["held_mean"])  # type: ignore[arg-type]
    gain, basis = None, "capacity trade: fewer admissions stop the churn but run fewer sequences at once"
    prompt, gen, share = c.sig("server.prompt_len_mean"), c.sig("server.gen_len_mean"), _prefill_share(c)
    if many and prompt is not None and gen is not None and share is not None and _value(prompt) > 0:
        # each recompute prefills the prompt and, on average, half the generated tokens again
        redo = churn * (_value(prompt) + _value(gen) / 2.0) / _value(prompt)  # type: ignore[operator]
        wasted = min(0.9, share[0] * redo / (1.0 + redo))
        gain = 1.0 / (1.0 - wasted)
        basis = (f"upper bound: {churn:.2f} recomputes per request redo {redo:.0%} of the prefill work; "
                 f"{share[1]} {share[0]:.0%}: 1 / (1 - {wasted:.2f})")
    c.fix("Stop evicting running requests", "Admit fewer sequences than the KV cache holds at peak (vLLM "
          "--max-num-seqs, SGLang --schedule-conservativeness 1.3 or --max-running-requests, TensorRT-LLM "
          "GUARANTEED_NO_EVICT) or give the cache more memory (FP8 KV cache).", gain, basis)
    what = (f"{churn:.2f} evictions per finished request" if many else
            f"{held.mean:.1f} requests held out of the batch on average")  # type: ignore[union-attr]
    return c.finding(0.5, f"The KV cache runs out mid-request: {what}; evicted work is done twice.")


@rule(
    code="SRV007",
    name="max-tokens-over-reserved",
    limiter=Limiter.VRAM,
    summary="Requests ask for far more tokens than they generate, and the engine reserves KV space for all of them.",
    requires=("server.max_tokens_mean", "server.gen_len_mean"),
    uses=("server.waiting", "server.batch_reserved_tokens", "server.prompt_len_mean"),
    thresholds={
        "over_ratio": Threshold(4.0, "max_tokens asked over tokens generated (means) that counts as over-reserved"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show the reservation turns work away"),
    },
    page=Page(
        detects="On an engine that admits requests by prompt + max_tokens (TGI's token budget, SGLang's admission "
        "estimate, TensorRT-LLM's GUARANTEED_NO_EVICT), requests asking on average 4x or more the tokens they "
        "generate while others wait. Not on vLLM, which allocates KV blocks as tokens are generated.",
        why="KV space reserved for tokens that are never generated is space no other sequence can use: the batch "
        "stays small and requests queue while memory sits idle.",
        fixes="Set max_tokens (max_new_tokens) near what requests need, per route or client; on TGI lower "
        "--max-total-tokens / raise --max-batch-total-tokens consistently; on TensorRT-LLM use the "
        "MAX_UTILIZATION policy. Predicted gain: the larger decode batch the freed reservation admits, bounded by "
        "the decode physics and by the reservation ratio: an upper bound, and a capacity gain.",
        sources="TGI router admission (max_batch_total_tokens budget of input + max_new_tokens); SGLang "
        "PrefillAdder new_token_ratio estimate; TensorRT-LLM capacity scheduler policies; vLLM PagedAttention "
        "(Kwon et al., SOSP 2023) allocates blocks on demand.",
    ),
)
def max_tokens_over_reserved(c: Check) -> Finding | None:
    server = c.ev.capture.server
    engine = RESERVING_ENGINES.get(server.kind if server is not None else "")
    if engine is None:
        return None  # vLLM, NIM's vLLM backend and the demo allocate KV blocks as tokens are generated
    asked, made = c.sig("server.max_tokens_mean"), c.sig("server.gen_len_mean")
    assert asked is not None and made is not None
    waiting = c.sig("server.waiting")
    if _value(made) <= 0 or waiting is None:
        return None
    ratio = _value(asked) / _value(made)
    if ratio < c.t["over_ratio"] or waiting.mean < c.t["waiting_mean"]:
        return None
    c.cite(asked, "value", ">=", round(c.t["over_ratio"] * _value(made), 2))
    c.cite(made, "value")
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    prompt = c.sig("server.prompt_len_mean")
    reserve = ratio if prompt is None else (_value(prompt) + _value(asked)) / (_value(prompt) + _value(made))
    gain, basis = batch_gain(c.ev, factor=min(reserve, 4.0))
    basis = (f"upper bound, capacity: reservations {reserve:.1f}x the tokens used let up to that many more "
             f"sequences run; {basis}" if gain is not None else
             f"capacity: up to {reserve:.1f}x the sequences could be admitted (no decode physics to price it)")
    c.fix("Ask for the tokens requests need", f"Lower max_tokens (max_new_tokens) toward what requests generate "
          f"(mean {_value(made):.0f}, asked {_value(asked):.0f}); {engine} reserves KV space for all of it.",
          gain, basis)
    return c.finding(0.5, f"Requests ask for {_value(asked):.0f} tokens and generate {_value(made):.0f} on average "
                     f"({ratio:.0f}x) while {waiting.mean:.1f} wait: {engine} reserves KV space that is never used.")


@rule(
    code="SRV008",
    name="lora-slots-limit-batch",
    limiter=Limiter.BATCHING,
    summary="Requests wait for a LoRA adapter slot: the adapters per batch cap the batch.",
    requires=("server.lora_running_adapters",),
    uses=("server.lora_waiting_adapters", "server.waiting_deferred", "server.waiting", "server.running"),
    thresholds={
        "slots_full": Threshold(1.0, "running adapters over the batch's adapter slots (max_loras) that count as "
                                "full"),
        "waiting_adapters": Threshold(0.5, "mean adapters among waiting requests that show requests held back"),
    },
    page=Page(
        detects="The running batch using every LoRA slot (vLLM lora_requests_info running adapters = max_lora; "
        "SGLang LoRA pool slots used = total) while waiting requests need other adapters (vLLM waiting adapters, "
        "or requests waiting for a 'deferred' reason).",
        why="A batch holds at most max_loras distinct adapters; a request for another adapter waits, even with KV "
        "space and batch room free, until an adapter leaves the batch (and its weights are swapped in).",
        fixes="Raise the adapter slots (vLLM --max-loras, SGLang --max-loras-per-batch; each slot costs GPU memory "
        "for max rank weights), route requests by adapter so each replica serves few adapters, or merge hot "
        "adapters into the base weights. Predicted gain: the deferred requests admitted, bounded by the decode "
        "physics: an upper bound.",
        sources="vLLM LoRA docs (max_loras, max_cpu_loras); vLLM num_requests_waiting_by_reason ('deferred' = "
        "LoRA budget); S-LoRA (Sheng et al., 2023); SGLang LoRA pool metrics.",
    ),
)
def lora_slots_limit_batch(c: Check) -> Finding | None:
    running = c.sig("server.lora_running_adapters")
    assert running is not None
    slots = c.ev.capture.serving.get("max_loras")
    if not isinstance(slots, int) or slots <= 0 or running.max < c.t["slots_full"] * slots:
        return None
    waiting_adapters, deferred = c.sig("server.lora_waiting_adapters"), c.sig("server.waiting_deferred")
    held = (waiting_adapters is not None and waiting_adapters.mean >= c.t["waiting_adapters"]) or \
        (deferred is not None and deferred.mean > 0)
    if not held:
        return None
    c.cite(running, "max", ">=", slots)
    for s in (waiting_adapters, deferred):
        if s is not None and s.mean > 0:
            c.cite(s, "mean")
    batch = c.sig("server.running")
    factor = None
    if deferred is not None and batch is not None and batch.mean > 0:
        factor = (batch.mean + deferred.mean) / batch.mean
    gain, basis = batch_gain(c.ev, factor=factor) if factor and factor > 1 else (None, "")
    basis = (f"upper bound: the {deferred.mean:.1f} deferred requests join the batch; {basis}"  # type: ignore[union-attr]
             if gain is not None else "capacity: requests for other adapters wait for a slot")
    c.fix("Give the batch more adapter slots", f"Raise vLLM --max-loras above {slots} (SGLang "
          "--max-loras-per-batch) if memory allows, route requests by adapter, or merge hot adapters.", gain, basis)
    return c.finding(0.5, f"All {slots} LoRA slots are in use while requests for other adapters wait: adapter "
                     "slots, not memory, cap the batch.")
