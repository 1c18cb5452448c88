"""Serving rules: what an LLM-serving engineer reads off the engine's own metrics (prefix cache, where time to first
token goes, prefill interfering with decode, speculative decoding, KV pressure, max_tokens reservations, LoRA slots).

Every gain is bounded by a measured time or count and says so in its basis; a fix that buys capacity or latency
rather than tokens per second has no throughput gain and says which it buys.

Each predicate reads only the signals it declares (diagnoser.rules.base) and the capture's serving configuration.
"""

from __future__ import annotations

import math

from diagnoser import signals as S
from diagnoser.diagnosis import Benefit, Finding, FixKind, GainKind, Limiter
from diagnoser.engines.tables import engine_label
from diagnoser.evidence import Signal
from diagnoser.rules import gains
from diagnoser.rules.base import (
    HIGHEST,
    LOWEST,
    MAX,
    MEAN,
    P50,
    P90,
    VALUE,
    AnyOf,
    CannotDecide,
    Check,
    Gain,
    Page,
    Threshold,
    rule,
)
from diagnoser.units import fmt

# Engines whose scheduler admits a request only with room for its prompt plus max_tokens (TGI's token budget,
# SGLang's admission estimate, TensorRT-LLM's GUARANTEED_NO_EVICT policy); vLLM allocates KV blocks as tokens come.
RESERVING_ENGINES = {"tgi": "TGI", "sglang": "SGLang", "triton": "TensorRT-LLM"}
_LATENCY_SOURCES = ("MLPerf Inference LLM server scenarios bound TTFT (0.5-2 s) and TPOT (40-200 ms) per model; "
                    "vLLM's request phase histograms (queue, prefill, decode) split TTFT into waiting and prefill.")


def _prefill_share(c: Check) -> tuple[float, str] | None:
    """Prefill's share of the serving work: from the physics (least GPU time of the served tokens) when the model
    and GPU are known, else from the engine's per-request prefill and decode times (a proxy)."""
    decode = c.opt(S.THEORY_DECODE_SHARE)
    if decode is not None:
        return 1.0 - decode.value, "prefill's share of the least GPU time the served tokens need"
    pre, dec = c.opt(S.SERVER_PREFILL_TIME_MEAN_S), c.opt(S.SERVER_DECODE_TIME_MEAN_S)
    if pre is not None and dec is not None and pre.mean + dec.mean > 0:
        c.cite(pre, "value")
        c.cite(dec, "value")
        return pre.mean / (pre.mean + dec.mean), \
            "prefill's share of requests' running time (prefill / (prefill + decode))"
    return None


def _token_bound(c: Check, hit: float, shared: float | None) -> tuple[float, Gain] | None:
    """The most prefix caching can give, from the tokens the engine processed: a prompt token costs at most a
    generated token's time, so prompt tokens' share of all tokens bounds prefill's share of the work; caching the
    shared prompt tokens (all of them where the operator gave no share) removes at most that much."""
    prompt, gen = c.opt(S.SERVER_PROMPT_TOKENS_PER_S), c.opt(S.SERVER_GEN_TOKENS_PER_S)
    if prompt is None or gen is None or prompt.mean <= 0 or gen.mean <= 0:
        return None
    share = prompt.mean / (prompt.mean + gen.mean)
    cacheable = 1.0 if shared is None or not 0 < shared < 1 else shared
    saved = share * max(0.0, cacheable - hit) / (1.0 - hit) if hit < 1 else 0.0
    if saved <= 0:
        return None
    c.cite(prompt, "mean")
    c.cite(gen, "mean")
    which = ("every prompt token but the first block" if cacheable == 1.0 else
             f"the capture's shared share ({cacheable:.0%}) of prompt tokens")
    return share, Gain(1.0 / max(0.05, 1.0 - saved), f"prompt tokens are {share:.0%} of the tokens processed "
                f"({prompt.mean:.0f}/s against {gen.mean:.0f}/s generated) and cost at most a generated token's time "
                f"each; served from the cache ({which}, from a {hit:.0%} hit rate), the work falls by at most "
                f"{saved:.0%}: 1 / (1 - {saved:.2f})", GainKind.UPPER_BOUND)


def _value(s: Signal) -> float:
    return s.value


def _number(text: str | None) -> float | None:
    """A number kept as text in ServingConfig.extra (max_loras, shared_prefix_frac); None when absent or not one."""
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


@rule(
    code="SRV001",
    name="prefix-cache-missing",
    limiter=Limiter.COMPUTE,
    summary="Long prompts are prefilled again and again: the prefix cache is off or rarely hits.",
    requires=(S.SERVER_PROMPT_LEN_MEAN,),
    uses=(S.SERVER_PREFIX_CACHE_HIT_RATE, S.SERVER_PROMPT_TOKENS_PER_S, S.SERVER_GEN_TOKENS_PER_S,
          S.THEORY_DECODE_SHARE, S.SERVER_PREFILL_TIME_MEAN_S, S.SERVER_DECODE_TIME_MEAN_S, S.SERVER_KV_USAGE),
    reads={S.SERVER_KV_USAGE: (P90,), S.SERVER_PREFIX_CACHE_HIT_RATE: (VALUE,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,),
           S.SERVER_PROMPT_TOKENS_PER_S:
           (MEAN,), S.SERVER_GEN_TOKENS_PER_S: (MEAN,), S.THEORY_DECODE_SHARE: (VALUE,), S.SERVER_PREFILL_TIME_MEAN_S:
           (MEAN, VALUE,), S.SERVER_DECODE_TIME_MEAN_S: (MEAN, VALUE,)},
    thresholds={
        "hit_rate_max": Threshold(0.20, "prefix-cache hit rate below which the cache saves little prefill", "ratio"),
        "target_hit_rate": Threshold(0.50, "hit rate a workload with shared prompts reaches (system prompt, "
                                     "few-shot, multi-turn history); the gain assumes it unless the capture says "
                                     "the shared share (serving key shared_prefix_frac)", "ratio"),
        "prompt_len_min": Threshold(256, "mean prompt tokens below which prefill is too short to matter", "tokens"),
        "prefill_share_min": Threshold(0.15, "prefill's share of the work below which caching cannot pay", "ratio"),
        "kv_full": Threshold(0.90, "KV use (p90) at which a cache that is on evicts the prefixes it holds", "ratio"),
    },
    page=Page(
        detects="Prompts averaging {prompt_len_min} or more, prefill taking at least {prefill_share_min} of the work, "
        "and the prefix cache either switched off (vLLM cache_config_info enable_prefix_caching=False) or hitting "
        "under {hit_rate_max} of "
        "the prompt tokens it is asked for over the window while the KV cache is at least {kv_full} used (a cache "
        "that is on and has room answers hits for every prefix that repeats: a low rate there is unique prompts, "
        "the workload, not a miss). It does not fire when the capture says the prompts "
        "share nothing (serving key shared_prefix_frac = 0). The gain is bounded from the tokens the engine "
        "processed: a prompt token costs at most a generated token's time (prefill runs many tokens per weight "
        "read), so prompt tokens' share of all tokens bounds prefill's share of the work; with every shared "
        "prompt token served from the cache (all of them unless shared_prefix_frac says), the work falls by "
        "that share.",
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
    prompt = c.opt(S.SERVER_PROMPT_LEN_MEAN)
    assert prompt is not None
    serving = c.ev.serving
    shared = _number(serving.extra.get("shared_prefix_frac"))
    if shared is not None and shared <= 0:
        return None  # the operator says no prompt shares a prefix: nothing to cache
    hit = c.opt(S.SERVER_PREFIX_CACHE_HIT_RATE)
    off = serving.prefix_caching is False
    if _value(prompt) < c.t["prompt_len_min"] or not (off or (hit is not None and _value(hit) < c.t["hit_rate_max"])):
        return None
    kv = c.opt(S.SERVER_KV_USAGE)
    if not off and (kv is None or kv.p90 < c.t["kv_full"]):
        # With caching on, the hits against the queries say whether prompts repeat at all: a low rate with room in
        # the pool (nothing evicted) is the workload, unique prompts, not a cache that misses.
        return None
    h = 0.0 if off or hit is None else _value(hit)
    # The tokens the engine processed bound prefill's share of its work; a request's own prefill / (prefill +
    # decode) time reads low under concurrency (its decode steps carry other requests' prefills), so it only gates
    # when the token counters are absent.
    tokens = _token_bound(c, h, shared)
    share = _prefill_share(c) if tokens is None else None
    if share is not None and share[0] < c.t["prefill_share_min"]:
        return None
    if tokens is not None and tokens[0] < c.t["prefill_share_min"]:
        return None
    c.cite(prompt, "value", ">=", c.t["prompt_len_min"])
    if hit is not None and not off:
        c.cite(hit, "value", "<", c.t["hit_rate_max"])
    target = shared if shared is not None and 0 < shared < 1 else c.t["target_hit_rate"]
    gain = Gain.unknown("no prefill share measured (needs the model and GPU, or vLLM's prefill/decode histograms)")
    if tokens is not None:
        gain = tokens[1]
    elif share is not None and target > h:
        saved = share[0] * (target - h) / (1.0 - h)  # prefill work that the extra hits would not recompute
        assumed = "the capture's shared_prefix_frac" if target != c.t["target_hit_rate"] else "an assumed"
        gain = Gain(1.0 / max(0.05, 1.0 - saved), f"{share[1]} {share[0]:.0%}, hits from {h:.0%} to {target:.0%} "
                    f"({assumed} shared share) save {saved:.0%} of the work: 1 / (1 - {saved:.2f})",
                    GainKind.UPPER_BOUND)
    action = (_prefix_caching_on(c) if off else
              "Leave the KV cache room so prefixes are not evicted (it is full), put the shared prompt first and "
              "byte-identical, and route equal prefixes to one replica")
    c.fix(FixKind.PREFIX_CACHING, "Reuse shared prompt prefixes", action + ".", gain)
    if kv is not None and not off:
        c.cite(kv, "p90", ">=", c.t["kv_full"])
    state = "is off" if off else f"hits {h:.0%} of the prompt tokens it is asked for while the KV cache is full"
    return c.finding(0.5, f"Prompts average {_value(prompt):.0f} tokens and the prefix cache {state}: shared prefixes "
                     "are prefilled again for every request.")


@rule(
    code="SRV002",
    name="ttft-dominated-by-queueing",
    limiter=Limiter.BATCHING,
    summary="Time to first token is mostly time spent waiting to be scheduled: the server lacks capacity.",
    requires=(S.SERVER_TTFT_MEAN_S, S.SERVER_QUEUE_TIME_MEAN_S),
    uses=(S.SERVER_KV_USAGE, S.SERVER_WAITING, S.SERVER_PREFILL_TIME_MEAN_S, S.SERVER_RUNNING,
          S.SERVER_PROMPT_LEN_MEAN),
    reads={S.SERVER_TTFT_MEAN_S: (VALUE,), S.SERVER_QUEUE_TIME_MEAN_S: (VALUE,), S.SERVER_KV_USAGE: (P90,),
           S.SERVER_RUNNING: (MEAN, P50), S.SERVER_WAITING: (MEAN,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,)},
    thresholds={
        "ttft_min_s": Threshold(0.5, "mean time to first token below which no split is worth making", "s"),
        "queue_share": Threshold(0.5, "queue time's share of TTFT at which waiting dominates", "ratio"),
        "kv_full": Threshold(0.90, "KV use (p90) at which memory, not the scheduler's limits, holds requests",
                             "ratio"),
        "at_cap": Threshold(0.9, "running batch (median) over the sequence limit at which that limit holds requests",
                            "ratio"),
    },
    page=Page(
        detects="Mean time to first token of {ttft_min_s} or more, {queue_share} or more of it spent queued (vLLM "
        "request_queue_time vs time_to_first_token; SGLang queue_time; Triton queue duration).",
        why="A request that waits is not being served at all: the batch is at the scheduler's limit "
        "(max-num-seqs) or the KV cache is full, so new requests queue until others finish.",
        fixes="The knob that holds the queue, in its direction: if the KV cache is full, more KV memory (FP8 KV "
        "cache, the KV pool's size knob in force); if the running batch is at the sequence limit (median at least "
        "{at_cap} of it), a larger limit (vLLM --max-num-seqs, SGLang --max-running-requests); if a mean prompt "
        "beside the running decodes exceeds the per-step token budget, a larger budget (vLLM "
        "--max-num-batched-tokens); if none of them binds, the server serves as fast as it can: more replicas or "
        "GPUs for the load. A knob already past what the load needs is never advised. Predicted: TTFT falls by at "
        "most the queue time.",
        sources=_LATENCY_SOURCES,
    ),
)
def ttft_dominated_by_queueing(c: Check) -> Finding | None:
    ttft, queue = c.opt(S.SERVER_TTFT_MEAN_S), c.opt(S.SERVER_QUEUE_TIME_MEAN_S)
    assert ttft is not None and queue is not None
    t, q = _value(ttft), min(_value(queue), _value(ttft))
    if t < c.t["ttft_min_s"] or q / t < c.t["queue_share"]:
        return None
    c.cite(ttft, "value", ">=", c.t["ttft_min_s"])
    c.cite(queue, "value", ">=", round(c.t["queue_share"] * t, 4))
    kv = c.opt(S.SERVER_KV_USAGE)
    full = kv is not None and kv.p90 >= c.t["kv_full"]
    if kv is not None:
        c.cite(kv, "p90", ">=" if full else "<", c.t["kv_full"])
    gain = Gain.unknown(f"capacity, not speed: TTFT falls at most by the queue time, {t:.2f} s to {t - q:.2f} s",
                        Benefit.CAPACITY)
    if full:
        c.fix(FixKind.KV_MEMORY, "Give the KV cache more memory (capacity)", "FP8 KV cache (vLLM --kv-cache-dtype "
              "fp8), a higher --gpu-memory-utilization, or more GPUs: the cache is what keeps requests waiting.", gain)
    else:
        _queue_fix(c, gain)
    return c.finding(0.55, f"Requests wait {q:.2f} s of their {t:.2f} s to first token ({q / t:.0%}): time to first "
                     f"token is queueing, the server is at capacity{' (KV cache full)' if full else ''}.")


def _prefix_caching_on(c: Check) -> str:
    """How to turn prefix caching on, in the engine's own flags."""
    s = c.knob("prefix_caching")
    if s is not None and c.ev.serving.engine == "llamacpp":
        reuse = c.knob("cache_reuse")
        return f"Start llama.cpp with {s.knob.flag}" + (f" (and {reuse.knob.flag} 256 to reuse chunks after a "
                                                           "differing start)" if reuse is not None else "")
    return "Start vLLM with --enable-prefix-caching (SGLang: drop --disable-radix-cache)"


def _queue_fix(c: Check, gain: Gain) -> None:
    """The fix for a queue the KV cache does not hold: the scheduler's knob that binds, in its direction."""
    running, waiting, prompt = c.opt(S.SERVER_RUNNING), c.opt(S.SERVER_WAITING), c.opt(S.SERVER_PROMPT_LEN_MEAN)
    seqs, budget = c.knob("max_num_seqs"), c.knob("max_num_batched_tokens")
    if seqs is None or not seqs.known or running is None:
        # No table or no known limit: the sequence limit is the usual cap, named for each engine.
        where = (f"{engine_label(c.ev.serving.engine)} {seqs.knob.flag}" if seqs is not None else
                 "vLLM --max-num-seqs / SGLang --max-running-requests")
        c.fix(FixKind.BATCH_MORE, "Admit more requests per step (capacity)", f"Raise {where} while the KV cache has "
              "room, or add replicas.", gain)
        return
    cap, flight = int(seqs.value), running.p50
    if flight >= c.t["at_cap"] * cap:
        want = max(cap + 1, round(running.mean + (waiting.mean if waiting is not None else 0.0)))
        c.fix(FixKind.BATCH_MORE, "Admit more requests per step (capacity)", f"Raise {seqs.knob.flag} from {cap} to "
              f"about {want}: the running batch sits at it ({flight:.1f}) while requests wait.", gain)
        return
    if budget is not None and budget.known and prompt is not None and prompt.value + running.mean > budget.value:
        want = gains.token_budget_target(prompt.value, running.mean, waiting.mean if waiting is not None else 0.0)
        c.fix(FixKind.TOKEN_BUDGET, "Raise the per-step token budget (capacity)", f"Raise {budget.knob.flag} from "
              f"{budget.value} to about {want}: a {prompt.value:.0f}-token prompt does not fit in a step beside the "
              f"running decodes, so waiting requests are admitted a chunk at a time ({flight:.1f} running of {cap}).",
              gain)
        return
    c.fix(FixKind.ADD_GPUS, "Add serving capacity", f"Neither the sequence limit ({flight:.1f} running of {cap}), "
          "the token budget nor the KV cache holds the queue: the engine serves as fast as it can. Add replicas "
          "(or GPUs), or shed load at admission.", gain)


@rule(
    code="SRV003",
    name="ttft-dominated-by-prefill",
    limiter=Limiter.COMPUTE,
    summary="Time to first token is mostly the prompt's own prefill, not waiting.",
    requires=(S.SERVER_TTFT_MEAN_S, S.SERVER_PREFILL_TIME_MEAN_S),
    uses=(S.SERVER_QUEUE_TIME_MEAN_S, S.SERVER_PROMPT_LEN_MEAN, S.SERVER_PREFILL_TIME_PER_TOKEN_MEAN_S,
          S.SERVER_RUNNING),
    reads={S.SERVER_TTFT_MEAN_S: (VALUE,), S.SERVER_PREFILL_TIME_MEAN_S: (VALUE,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,),
           S.SERVER_RUNNING: (MEAN,)},
    thresholds={
        "ttft_min_s": Threshold(0.5, "mean time to first token below which no split is worth making", "s"),
        "prefill_share": Threshold(0.5, "prefill time's share of TTFT at which prefill dominates", "ratio"),
    },
    page=Page(
        detects="Mean time to first token of {ttft_min_s} or more, {prefill_share} or more of it in the request's "
        "prefill phase "
        "(vLLM request_prefill_time vs time_to_first_token).",
        why="Long prompts, or prefill split into small chunks that share each step with decodes, make the first "
        "token wait for the prompt's compute.",
        fixes="Where prompts are longer than the per-step token budget (each prefilled over several steps), a "
        "larger budget (vLLM --max-num-batched-tokens; SGLang --chunked-prefill-size) shortens prefill at the cost "
        "of decode latency during it; where a prompt already fits in one step, the budget is not the knob (it is "
        "never advised): prefix caching removes repeated prompt tokens, and disaggregated prefill (separate "
        "prefill and decode instances) stops the two from sharing steps. "
        "Predicted: TTFT falls at most by the prefill time (latency, not throughput).",
        sources=_LATENCY_SOURCES + " Sarathi-Serve (Agrawal et al., OSDI 2024) and DistServe (Zhong et al., OSDI "
        "2024) on chunked and disaggregated prefill.",
    ),
)
def ttft_dominated_by_prefill(c: Check) -> Finding | None:
    ttft, prefill = c.opt(S.SERVER_TTFT_MEAN_S), c.opt(S.SERVER_PREFILL_TIME_MEAN_S)
    assert ttft is not None and prefill is not None
    t, p = _value(ttft), min(_value(prefill), _value(ttft))
    if t < c.t["ttft_min_s"] or p / t < c.t["prefill_share"]:
        return None
    c.cite(ttft, "value", ">=", c.t["ttft_min_s"])
    c.cite(prefill, "value", ">=", round(c.t["prefill_share"] * t, 4))
    prompt = c.opt(S.SERVER_PROMPT_LEN_MEAN)
    if prompt is not None:
        c.cite(prompt, "value")
    latency = f"latency, not throughput: TTFT falls at most by the prefill time, {t:.2f} s to {t - p:.2f} s"
    budget = c.knob("max_num_batched_tokens")
    running = c.opt(S.SERVER_RUNNING)
    decodes = running.mean if running is not None else 0.0
    if budget is not None and budget.known and prompt is not None and prompt.value + decodes > budget.value:
        want = int(math.ceil((prompt.value + decodes) / 256) * 256)
        c.fix(FixKind.TOKEN_BUDGET, "Prefill each prompt in one step", f"Raise {budget.knob.flag} from "
              f"{budget.value} to about {want}: a {prompt.value:.0f}-token prompt now takes "
              f"{math.ceil(prompt.value / max(1.0, budget.value - decodes))} steps to prefill.", Gain.unknown(latency))
    elif budget is not None and budget.known:
        c.fix(FixKind.SPLIT_PREFILL, "Prefill on instances of its own", f"A {_prompt_text(prompt)}prompt already "
              f"fits in one step ({budget.knob.flag} {budget.value}): disaggregate prefill and decode, or reuse "
              "shared prefixes (prefix caching) where prompts repeat.", Gain.unknown(latency))
    else:
        where = (f"{engine_label(c.ev.serving.engine)} {budget.knob.flag}" if budget is not None else
                 "vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size")
        c.fix(FixKind.SPLIT_PREFILL, "Prefill on instances of its own, or in larger chunks", "Disaggregate prefill "
              "and decode; reuse shared prefixes (prefix caching); where prompts are longer than the per-step token "
              f"budget ({where}), raise it.", Gain.unknown(latency))
    return c.finding(0.5, f"Prefill takes {p:.2f} s of the {t:.2f} s to first token ({p / t:.0%}): time to first "
                     "token is the prompt's compute, not queueing.")


@rule(
    code="SRV004",
    name="itl-inflated-by-prefill",
    limiter=Limiter.BATCHING,
    summary="Some decode steps are much slower than the median: prefill work shares them.",
    requires=(S.SERVER_ITL_P50_S, S.SERVER_ITL_P99_S,
              AnyOf(S.SERVER_ITERATION_TOKENS_P99, S.SERVER_PREFILL_STEP_MEAN_S),
              AnyOf(S.SERVER_RUNNING, S.SERVER_BATCH_SIZE)),
    uses=(S.SERVER_ITERATION_TOKENS_P50, S.SERVER_DECODE_STEP_MEAN_S, S.SERVER_PROMPT_TOKENS_PER_S,
          S.SERVER_PROMPT_LEN_MEAN),
    advisory=True,
    reads={S.SERVER_RUNNING: (MAX,), S.SERVER_BATCH_SIZE: (MAX,), S.SERVER_ITL_P50_S: (VALUE, HIGHEST,),
           S.SERVER_ITL_P99_S: (VALUE, LOWEST,), S.SERVER_ITERATION_TOKENS_P50: (VALUE, HIGHEST,),
           S.SERVER_ITERATION_TOKENS_P99: (VALUE, LOWEST,), S.SERVER_DECODE_STEP_MEAN_S: (VALUE, HIGHEST,),
           S.SERVER_PREFILL_STEP_MEAN_S: (VALUE, LOWEST,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,)},
    thresholds={
        "itl_ratio": Threshold(3.0, "p99 / p50 inter-token latency at which the tail counts as inflated"),
        "step_ratio": Threshold(4.0, "tokens of the p99 step over the median step (vLLM), or prefill over decode "
                                "step time (TGI), that shows prefill riding along"),
        "running_min": Threshold(2.0, "requests in flight at once (most seen) without which no prefill can share a "
                                 "step with another request's decode", "requests"),
    },
    page=Page(
        detects="p99 inter-token latency at least {itl_ratio}x the median while the engine's steps show prefill work: "
        "vLLM's tokens per step at p99 at least {step_ratio}x the median step (vLLM before 0.8 only: V1, the "
        "default from 0.8, records iteration_tokens_total when a prompt's first token comes out and per batch of "
        "outputs, not per step, so there the rule cannot decide), or TGI's prefill forward pass at "
        "least {step_ratio}x its decode pass; and at least {running_min} requests in flight at once. Quantiles "
        "interpolated inside a histogram bucket are compared by their buckets (the least p99 over the most p50), "
        "never as exact values. Advisory: it names a latency tail and its cause, never the verdict.",
        why="A decode token comes out once per step; a step that also prefills a prompt chunk takes as long as that "
        "chunk's compute, so every running sequence's next token waits for someone else's prompt.",
        fixes="Cap the prefill per step, the opposite direction to SRV003's larger chunks (the two are never one "
        "fix): on vLLM a long-prefill cap (--long-prefill-token-threshold, about a quarter of a mean prompt) where "
        "none is set, else a smaller token budget (--max-num-batched-tokens); SGLang --chunked-prefill-size. It "
        "trades some TTFT for a tighter inter-token tail; disaggregated prefill removes the interference. "
        "Predicted: p99 inter-token latency falls at most to the median (latency, not "
        "throughput).",
        sources="Sarathi-Serve (Agrawal et al., OSDI 2024): generation stalls from prefills in the same batch; "
        "vLLM chunked-prefill docs; DistServe (OSDI 2024).",
    ),
)
def itl_inflated_by_prefill(c: Check) -> Finding | None:
    p50, p99 = c.opt(S.SERVER_ITL_P50_S), c.opt(S.SERVER_ITL_P99_S)
    assert p50 is not None and p99 is not None
    # One request at a time: a long step is that request's own prefill, which stalls nobody's decode.
    flight = c.first(S.SERVER_RUNNING, S.SERVER_BATCH_SIZE)
    if flight.max < c.t["running_min"]:
        return None
    # Quantiles interpolated inside a bucket are only known to lie in it: the tail must be inflated even at the
    # least p99 and the most p50 their buckets allow.
    if p50.highest <= 0 or p99.lowest / p50.highest < c.t["itl_ratio"]:
        return None
    steps_hi, steps_lo = c.opt(S.SERVER_ITERATION_TOKENS_P99), c.opt(S.SERVER_ITERATION_TOKENS_P50)
    pre, dec = c.opt(S.SERVER_PREFILL_STEP_MEAN_S), c.opt(S.SERVER_DECODE_STEP_MEAN_S)
    not_per_step = iteration_tokens_not_per_step(c.ev.meta.server_kind, c.ev.meta.server_version)
    if not_per_step and steps_hi is not None and (pre is None or dec is None):
        raise CannotDecide(not_per_step)
    if not not_per_step and steps_hi is not None and steps_lo is not None and steps_lo.highest > 0:
        ratio, cite = steps_hi.lowest / steps_lo.highest, (steps_hi, steps_lo)
    elif pre is not None and dec is not None and dec.highest > 0:
        ratio, cite = pre.lowest / dec.highest, (pre, dec)
    else:
        return None
    if ratio < c.t["step_ratio"]:
        return None
    c.cite(flight, "max", ">=", c.t["running_min"])
    c.cite(p99, "value", ">=", round(c.t["itl_ratio"] * p50.highest, 6))
    c.cite(p50, "value")
    c.cite(cite[0], "value", ">=", round(c.t["step_ratio"] * cite[1].highest, 6))
    c.cite(cite[1], "value")
    _cap_prefill_fix(c, Gain.unknown(f"latency, not throughput: p99 inter-token latency falls at most to the median, "
                                     f"from at least {fmt(p99.lowest, 's')} to at most {fmt(p50.highest, 's')}"))
    return c.finding(0.45, f"p99 inter-token latency is at least {p99.lowest / p50.highest:.1f}x the median while "
                     f"the heaviest steps carry at least {ratio:.1f}x the work of a typical one: prefills stall "
                     "decoding.")


# vLLM's V1 engine, the default from 0.8: its iteration_tokens_total is observed once per batch of outputs the front
# end receives, a prompt's tokens counted when its first token comes out (a mean of 385 tokens per "iteration" on a
# server whose steps hold at most 64), so it is no measure of the work in one step. V0 observed it per step.
VLLM_V1_FROM = (0, 8)


def iteration_tokens_not_per_step(server_kind: str, version: str) -> str:
    """Why the engine's iteration-tokens histogram is not tokens per step, or "" where it is (vLLM before 0.8, whose
    V0 engine observed it each step; diagnoser's demo server, which does too)."""
    if server_kind != "vllm":
        return ""
    from diagnoser.engines.knobs import parse_version

    parsed = parse_version(version) if version else None
    if parsed is not None and parsed < VLLM_V1_FROM:
        return ""
    which = f"vLLM {version}" if parsed is not None else "vLLM of an unknown version (V1 is the default from 0.8)"
    return (f"{which} records iteration_tokens_total when a request's first token comes out (a whole prompt at once) "
            "and per batch of outputs, not per engine step: it does not say how much prefill a step carries")


def _cap_prefill_fix(c: Check, gain: Gain) -> None:
    """Less prompt per step, through the knob that is not yet at the value: vLLM's long-prefill cap where none is
    set (it leaves the decodes' room alone), else a smaller token budget, else no knob is left: disaggregate."""
    prompt = c.opt(S.SERVER_PROMPT_LEN_MEAN)
    cap, budget = c.knob("long_prefill_token_threshold"), c.knob("max_num_batched_tokens")
    if cap is None or budget is None or not budget.known:
        c.fix(FixKind.CAP_PREFILL, "Cap the prefill that rides in decode steps", "Lower the prefill per step (vLLM "
              "--long-prefill-token-threshold or --max-num-batched-tokens, SGLang --chunked-prefill-size) so a step "
              "carries a smaller prompt chunk, or disaggregate prefill and decode.", gain)
        return
    chunk = max(64, 2 ** int(math.log2(max(64.0, prompt.value / 4)))) if prompt is not None else 256
    now = int(cap.value) if cap.known and cap.value else None
    if (now is None or now > chunk) and chunk < budget.value:
        c.fix(FixKind.CAP_PREFILL, "Cap the prefill that rides in decode steps", f"Set {cap.knob.flag} {chunk} "
              f"({'none set' if now is None else f'now {now}'}): a long prompt then takes at most {chunk} tokens of "
              f"a step ({budget.knob.flag} {budget.value}), leaving the decodes' steps short.", gain)
        return
    fits = prompt is None or prompt.value <= budget.value  # a budget that already chunks prompts is not lowered:
    # SRV003 / BAT006 may raise it on the same page, and one knob is advised in one direction only
    if fits and chunk < budget.value and budget.value > 256:
        c.fix(FixKind.CAP_PREFILL, "Cap the prefill that rides in decode steps", f"Lower {budget.knob.flag} from "
              f"{budget.value} to about {max(256, chunk)} so a step carries a smaller prompt chunk.", gain)
        return
    c.fix(FixKind.SPLIT_PREFILL, "Prefill on instances of its own", f"The per-step prefill is already capped "
          f"({budget.knob.flag} {budget.value}): disaggregate prefill and decode so prompts stop sharing decode "
          "steps.", gain)


def _prompt_text(prompt: Signal | None) -> str:
    return f"{prompt.value:.0f}-token " if prompt is not None else ""


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
    requires=(AnyOf(S.SERVER_SPEC_MEAN_ACCEPT_LEN, S.SERVER_SPEC_ACCEPTANCE_RATE),),
    uses=(S.SERVER_SPEC_DRAFT_LEN, S.SERVER_SPEC_DRAFTS_PER_TOKEN),
    reads={S.SERVER_SPEC_MEAN_ACCEPT_LEN: (VALUE,), S.SERVER_SPEC_ACCEPTANCE_RATE: (VALUE,), S.SERVER_SPEC_DRAFT_LEN:
           (VALUE,), S.SERVER_SPEC_DRAFTS_PER_TOKEN: (VALUE,)},
    thresholds={
        "draft_cost": Threshold(0.10, "cost of one draft token as a share of a target-model step (EAGLE-style "
                                "heads ~0.05-0.1; a separate draft model ~ its size over the target's)"),
        "tune_gain": Threshold(1.10, "speed-up of the best draft length over the current one that is worth a "
                               "change"),
        "draft_share_min": Threshold(0.20, "drafts per generated token below which most steps carry no draft: the "
                                     "acceptance formula does not describe the window"),
    },
    page=Page(
        detects="Speculative decoding that drafts on under {draft_share_min} of the generated tokens' steps (vLLM "
        "drafts over generation tokens: ngram speculation with no match in the prompt proposes nothing), whose "
        "cost is then the speculative path on every step and whose gain is at most the few accepted tokens; or "
        "speculative decoding whose measured tokens per verification step, against the draft's cost, "
        "give no speed-up over plain decoding (drop it), or a draft length whose acceptance falls so fast that a "
        "shorter draft is at least {tune_gain}x as fast (tune it), with a draft token costing {draft_cost} of a "
        "target step. Acceptance and draft length come from the engine's "
        "counters (vLLM spec_decode_*; SGLang spec_accept_rate / spec_accept_length).",
        why="Each step drafts k tokens and verifies them in one target pass; it pays only if the accepted tokens "
        "per step exceed the extra draft and verification work. Low acceptance means the target computes tokens "
        "it throws away.",
        fixes="Drop speculative decoding when it does not pay, shorten the draft (vLLM num_speculative_tokens, "
        "SGLang --speculative-num-steps) when late positions are rarely accepted, or use a draft better matched "
        "to the target (EAGLE heads trained on it). Gains are from the expected-tokens formula with the assumed "
        "draft cost: upper bounds; turning it off on a CPU build, whose verification of k + 1 tokens costs up to "
        "k + 1 steps, is an estimate between one step and k + 1.",
        sources="Leviathan et al., 'Fast Inference from Transformers via Speculative Decoding' (2023); vLLM "
        "SpecDecodingProm (acceptance = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts); "
        "EAGLE (Li et al., 2024).",
    ),
)
def speculative_decoding_not_paying(c: Check) -> Finding | None:
    length, rate, k_sig = (c.opt(S.SERVER_SPEC_MEAN_ACCEPT_LEN), c.opt(S.SERVER_SPEC_ACCEPTANCE_RATE),
                           c.opt(S.SERVER_SPEC_DRAFT_LEN))
    drafts = c.opt(S.SERVER_SPEC_DRAFTS_PER_TOKEN)
    if drafts is not None and _value(drafts) < c.t["draft_share_min"]:
        return _rarely_drafting(c, drafts, length)
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
        c.fix(FixKind.SPEC_DECODE, "Turn speculative decoding off", f"Serve without a draft ({_spec_off(c)}): plain "
              "decoding is faster at this acceptance.", _off_gain(c, tokens, now, k or 1, cost))
        return c.finding(0.5, f"Speculative decoding yields {tokens:.2f} tokens per verification step: with the "
                         f"draft's cost that is {now:.2f}x plain decoding, slower than none.")
    formula_now = _spec_speedup(min(_value(rate), 0.999), k, cost) if rate is not None and k is not None else now
    if best_k is not None and best_k != k and best / formula_now >= c.t["tune_gain"]:
        length_knob = c.knob("draft_max")
        where = (f"{engine_label(c.ev.serving.engine or c.ev.meta.server_kind)} {length_knob.knob.flag}"
                 if length_knob is not None else "vLLM num_speculative_tokens, SGLang --speculative-num-steps")
        title = "Shorten the speculative draft" if k is None or best_k < k else "Lengthen the speculative draft"
        c.fix(FixKind.SPEC_DECODE, title, f"Draft {best_k} tokens instead of {k} ({where}).",
              Gain(best / formula_now, f"from acceptance {_value(rate):.0%} (positions assumed independent) and "  # type: ignore[arg-type]
                   f"draft cost {cost:g}: {best:.2f}x vs {formula_now:.2f}x plain decoding", GainKind.UPPER_BOUND))
        return c.finding(0.4, f"Speculative decoding accepts {_value(rate):.0%} of drafted tokens: a {best_k}-token "  # type: ignore[arg-type]
                         f"draft would beat the current {k} ({best:.2f}x vs {formula_now:.2f}x plain decoding).")
    return None


def _off_gain(c: Check, tokens: float, now: float, k: int, cost: float) -> Gain:
    """Turning speculation off: 1 / now where the verification pass of k + 1 tokens costs one step (a GPU decoding
    memory-bound), the formula's figure. A CPU build's step time grows with its tokens (its matmuls are
    compute-bound even at a few tokens), so verifying k + 1 tokens costs up to k + 1 steps: the gain lies between
    the two, its estimate their geometric mean."""
    basis = f"{tokens:.2f} tokens per step for 1 + {k} x {cost:g} of a step's work = {now:.2f}x plain decoding"
    if not c.ev.meta.cpu_only:
        return Gain(1.0 / now, f"{basis}; off: 1 / {now:.2f}", GainKind.UPPER_BOUND)
    low, high = 1.0 / now, (k + 1 + k * cost) / tokens
    return Gain((low * high) ** 0.5, f"{basis} if verifying {k + 1} tokens costs one step (x{low:.2f} off); a CPU "
                f"build's step grows with its tokens, up to {k + 1} steps for the verification (x{high:.2f} off): "
                "the geometric mean of the two", GainKind.ESTIMATE, low=low, high=high)


def _spec_off(c: Check) -> str:
    """How to serve without speculation: the engine's own flag where its knob table has one (llama.cpp
    --model-draft), else vLLM's and SGLang's."""
    knob = c.knob("speculative_config")
    if knob is None:
        return "vLLM: no --speculative-config; SGLang: no --speculative-algorithm"
    engine = c.ev.serving.engine or c.ev.meta.server_kind
    return f"{engine_label(engine)}: no {knob.knob.flag}" + (" and --spec-type" if engine == "llamacpp" else "")


def _rarely_drafting(c: Check, drafts: Signal, length: Signal | None) -> Finding:
    """Speculation that proposes a draft on few steps: every step pays the speculative path, few gain from it. What
    it could save is bounded by the accepted tokens; what it costs per step is not in the engine's counters."""
    share = _value(drafts)
    accepted = share * max(0.0, _value(length) - 1.0) if length is not None else None
    c.cite(drafts, "value", "<", c.t["draft_share_min"])
    if length is not None:
        c.cite(length, "value")
    saved = f"; the accepted drafts saved at most {accepted:.1%} of the steps" if accepted is not None else ""
    c.fix(FixKind.SPEC_DECODE, "Turn speculative decoding off", f"Serve without a draft ({_spec_off(c)}): it "
          f"proposed a draft for {share:.1%} of the generated tokens, so nearly every step pays the speculative path "
          "for nothing.",
          Gain.unknown(f"drafts on {share:.1%} of the steps{saved}: the cost is the speculative path's per-step "
                       "overhead, which the engine's counters do not measure (compare the step time without it)"))
    return c.finding(0.5, f"Speculative decoding proposed a draft for only {share:.1%} of the generated tokens: "
                     "nearly every step pays for a speculative path that rarely drafts.")


@rule(
    code="SRV006",
    name="kv-preemption-churn",
    limiter=Limiter.VRAM,
    summary="Requests are preempted, retracted, swapped or paused for lack of KV memory and redo their work.",
    requires=(AnyOf(S.SERVER_PREEMPTIONS_PER_S, S.SERVER_RETRACTIONS_PER_S, S.SERVER_SWAPPED, S.SERVER_RETRACTED,
                    S.SERVER_PAUSED),),
    uses=(S.SERVER_REQUESTS_PER_S, S.SERVER_PROMPT_LEN_MEAN, S.SERVER_GEN_LEN_MEAN, S.SERVER_PROMPT_TOKENS_PER_S,
          S.THEORY_DECODE_SHARE, S.SERVER_PREFILL_TIME_MEAN_S, S.SERVER_DECODE_TIME_MEAN_S),
    reads={S.SERVER_PREEMPTIONS_PER_S: (MEAN,), S.SERVER_RETRACTIONS_PER_S: (MEAN,), S.SERVER_SWAPPED: (MEAN,),
           S.SERVER_RETRACTED: (MEAN,), S.SERVER_PAUSED: (MEAN,), S.SERVER_REQUESTS_PER_S: (MEAN,),
           S.SERVER_PROMPT_LEN_MEAN: (VALUE,), S.SERVER_GEN_LEN_MEAN: (VALUE,), S.THEORY_DECODE_SHARE: (VALUE,),
           S.SERVER_PREFILL_TIME_MEAN_S: (MEAN, VALUE,), S.SERVER_DECODE_TIME_MEAN_S: (MEAN, VALUE,)},
    thresholds={
        "per_request": Threshold(0.05, "preemptions (or retractions) per finished request that count as churn"),
        "held_mean": Threshold(1.0, "requests swapped out, retracted or paused at a time (mean) that count"),
    },
    page=Page(
        detects="At least {per_request} preemptions or retractions per finished request (vLLM num_preemptions, "
        "SGLang num_retracted_requests), or on average {held_mean} request swapped out (vLLM V0), retracted "
        "(SGLang) or paused (TensorRT-LLM) at any time.",
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
    events = c.opt(S.SERVER_PREEMPTIONS_PER_S) or c.opt(S.SERVER_RETRACTIONS_PER_S)
    held = c.opt(S.SERVER_SWAPPED) or c.opt(S.SERVER_RETRACTED) or c.opt(S.SERVER_PAUSED)
    requests = c.opt(S.SERVER_REQUESTS_PER_S)
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
    gain = Gain.unknown("capacity trade: fewer admissions stop the churn but run fewer sequences at once",
                        Benefit.CAPACITY)
    prompt, gen, share = c.opt(S.SERVER_PROMPT_LEN_MEAN), c.opt(S.SERVER_GEN_LEN_MEAN), _prefill_share(c)
    if many and prompt is not None and gen is not None and share is not None and _value(prompt) > 0:
        # each recompute prefills the prompt and, on average, half the generated tokens again
        redo = churn * (_value(prompt) + _value(gen) / 2.0) / _value(prompt)  # type: ignore[operator]
        wasted = min(0.9, share[0] * redo / (1.0 + redo))
        gain = Gain(1.0 / (1.0 - wasted), f"{churn:.2f} recomputes per request redo {redo:.0%} of the prefill work; "
                    f"{share[1]} {share[0]:.0%}: 1 / (1 - {wasted:.2f})", GainKind.UPPER_BOUND)
    c.fix(FixKind.STOP_PREEMPTION, "Stop evicting running requests", "Admit fewer sequences than the KV cache holds at "
          "peak (vLLM --max-num-seqs, SGLang --schedule-conservativeness 1.3 or --max-running-requests, TensorRT-LLM "
          "GUARANTEED_NO_EVICT) or give the cache more memory (FP8 KV cache).", gain)
    what = (f"{churn:.2f} evictions per finished request" if many else
            f"{held.mean:.1f} requests held out of the batch on average")  # type: ignore[union-attr]
    return c.finding(0.5, f"The KV cache runs out mid-request: {what}; evicted work is done twice.")


@rule(
    code="SRV007",
    name="max-tokens-over-reserved",
    limiter=Limiter.VRAM,
    summary="Requests ask for far more tokens than they generate, and the engine reserves KV space for all of them.",
    requires=(S.SERVER_MAX_TOKENS_MEAN, S.SERVER_GEN_LEN_MEAN),
    uses=(S.SERVER_WAITING, S.SERVER_BATCH_RESERVED_TOKENS, S.SERVER_PROMPT_LEN_MEAN),
    reads={S.SERVER_MAX_TOKENS_MEAN: (VALUE,), S.SERVER_GEN_LEN_MEAN: (VALUE,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,),
           S.SERVER_WAITING: (MEAN,)},
    thresholds={
        "over_ratio": Threshold(4.0, "max_tokens asked over tokens generated (means) that counts as over-reserved"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show the reservation turns work away"),
    },
    page=Page(
        detects="On an engine that admits requests by prompt + max_tokens (TGI's token budget, SGLang's admission "
        "estimate, TensorRT-LLM's GUARANTEED_NO_EVICT), requests asking on average {over_ratio}x or more the tokens "
        "they generate while others wait. Not on vLLM, which allocates KV blocks as tokens are generated.",
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
    engine = RESERVING_ENGINES.get(c.ev.serving.engine or c.ev.meta.server_kind)
    if engine is None:
        return None  # vLLM, NIM's vLLM backend and the demo allocate KV blocks as tokens are generated
    asked, made = c.opt(S.SERVER_MAX_TOKENS_MEAN), c.opt(S.SERVER_GEN_LEN_MEAN)
    assert asked is not None and made is not None
    waiting = c.opt(S.SERVER_WAITING)
    if _value(made) <= 0 or waiting is None:
        return None
    ratio = _value(asked) / _value(made)
    if ratio < c.t["over_ratio"] or waiting.mean < c.t["waiting_mean"]:
        return None
    c.cite(asked, "value", ">=", round(c.t["over_ratio"] * _value(made), 2))
    c.cite(made, "value")
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    prompt = c.opt(S.SERVER_PROMPT_LEN_MEAN)
    reserve = ratio if prompt is None else (_value(prompt) + _value(asked)) / (_value(prompt) + _value(made))
    physics = gains.batch_gain(c.ev, factor=min(reserve, 4.0))
    why = f"reservations {reserve:.1f}x the tokens used let up to that many more sequences run"
    gain = (Gain(physics.value, f"{why}; {physics.basis}", GainKind.UPPER_BOUND, physics.benefit)
            if physics.value is not None else
            Gain.unknown(f"{why} (no decode physics to price it)", Benefit.CAPACITY))
    c.fix(FixKind.MAX_TOKENS, "Ask for the tokens requests need", f"Lower max_tokens (max_new_tokens) toward what "
          f"requests generate (mean {_value(made):.0f}, asked {_value(asked):.0f}); {engine} reserves KV space for all "
          "of it.", gain)
    return c.finding(0.5, f"Requests ask for {_value(asked):.0f} tokens and generate {_value(made):.0f} on average "
                     f"({ratio:.0f}x) while {waiting.mean:.1f} wait: {engine} reserves KV space that is never used.")


@rule(
    code="SRV008",
    name="lora-slots-limit-batch",
    limiter=Limiter.BATCHING,
    summary="Requests wait for a LoRA adapter slot: the adapters per batch cap the batch.",
    requires=(S.SERVER_LORA_RUNNING_ADAPTERS,),
    uses=(S.SERVER_LORA_WAITING_ADAPTERS, S.SERVER_WAITING_DEFERRED, S.SERVER_WAITING, S.SERVER_RUNNING),
    reads={S.SERVER_LORA_RUNNING_ADAPTERS: (MAX,), S.SERVER_LORA_WAITING_ADAPTERS: (MEAN,), S.SERVER_WAITING_DEFERRED:
           (MEAN,), S.SERVER_RUNNING: (MEAN,)},
    thresholds={
        "slots_full": Threshold(1.0, "running adapters over the batch's adapter slots (max_loras) that count as "
                                "full"),
        "waiting_adapters": Threshold(0.5, "mean adapters among waiting requests that show requests held back"),
    },
    page=Page(
        detects="The running batch using every LoRA slot (running adapters at least {slots_full}x max_loras: vLLM "
        "lora_requests_info running adapters = max_lora; SGLang LoRA pool slots used = total) while on average "
        "{waiting_adapters} or more waiting requests need other adapters (vLLM waiting adapters, or requests "
        "waiting for a 'deferred' reason).",
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
    running = c.opt(S.SERVER_LORA_RUNNING_ADAPTERS)
    assert running is not None
    found = _number(c.ev.serving.extra.get("max_loras"))
    slots = int(found) if found is not None else 0
    if slots <= 0 or running.max < c.t["slots_full"] * slots:
        return None
    waiting_adapters, deferred = c.opt(S.SERVER_LORA_WAITING_ADAPTERS), c.opt(S.SERVER_WAITING_DEFERRED)
    held = (waiting_adapters is not None and waiting_adapters.mean >= c.t["waiting_adapters"]) or \
        (deferred is not None and deferred.mean > 0)
    if not held:
        return None
    c.cite(running, "max", ">=", slots)
    for s in (waiting_adapters, deferred):
        if s is not None and s.mean > 0:
            c.cite(s, "mean")
    batch = c.opt(S.SERVER_RUNNING)
    factor = None
    if deferred is not None and batch is not None and batch.mean > 0:
        factor = (batch.mean + deferred.mean) / batch.mean
    physics = gains.batch_gain(c.ev, factor=factor) if factor and factor > 1 else None
    gain = (Gain(physics.value, f"the {deferred.mean:.1f} deferred requests join the batch; {physics.basis}",  # type: ignore[union-attr]
                 GainKind.UPPER_BOUND, physics.benefit)
            if physics is not None and physics.value is not None else
            Gain.unknown("requests for other adapters wait for a slot", Benefit.CAPACITY))
    c.fix(FixKind.LORA, "Give the batch more adapter slots", f"Raise vLLM --max-loras above {slots} (SGLang "
          "--max-loras-per-batch) if memory allows, route requests by adapter, or merge hot adapters.", gain)
    return c.finding(0.5, f"All {slots} LoRA slots are in use while requests for other adapters wait: adapter "
                     "slots, not memory, cap the batch.")


RULES = (prefix_cache_missing, ttft_dominated_by_queueing, ttft_dominated_by_prefill, itl_inflated_by_prefill,
         speculative_decoding_not_paying, kv_preemption_churn, max_tokens_over_reserved, lora_slots_limit_batch)
