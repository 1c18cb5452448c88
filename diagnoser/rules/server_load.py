"""Load rules decided from the server's own signals and the host, with no GPU counter needed: a batch pinned at the
scheduler's cap while requests queue, a server under-loaded by its clients, clients giving up, and other processes
taking the host's CPU. They hold on a CPU build and on a GPU node without NVML access alike; on a GPU node the GPU
rules (load.py, host.py) add to them.
"""

from __future__ import annotations

import math
from dataclasses import replace

from diagnoser import signals as S
from diagnoser.diagnosis import Benefit, Finding, FixKind, Limiter
from diagnoser.engines.tables import engine_label
from diagnoser.evidence import Signal
from diagnoser.rules import curve, gains
from diagnoser.rules.base import MAX, MEAN, P50, P90, VALUE, AnyOf, CannotDecide, Check, Gain, Page, Threshold, rule
from diagnoser.rules.serving import iteration_tokens_not_per_step


@rule(
    code="BAT005",
    name="batch-pinned-at-limit",
    limiter=Limiter.BATCHING,
    summary="The running batch sits at the server's configured limit while requests queue and the KV cache has room.",
    requires=(S.SERVER_RUNNING, S.SERVER_WAITING),
    uses=(S.SERVER_KV_USAGE, S.SERVER_GEN_TOKENS_PER_S, S.SERVER_ITERATION_TOKENS_MEAN),
    reads={S.SERVER_RUNNING: (MEAN, P50,), S.SERVER_WAITING: (MEAN,), S.SERVER_KV_USAGE: (P90,),
           S.SERVER_ITERATION_TOKENS_MEAN: (VALUE,)},
    thresholds={
        "at_cap": Threshold(0.9, "running batch (median) over the configured limit that counts as pinned", "ratio"),
        "steps_full": Threshold(0.6, "tokens per step (mean) over the per-step token budget at which the budget, "
                                "not the sequence limit, caps the step (BAT006)", "ratio"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand beyond the limit", "requests"),
        "kv_usage_max": Threshold(0.90, "KV use (p90) above which the KV cache, not the limit, holds the queue "
                                  "(VRAM001)", "ratio"),
    },
    page=Page(
        detects="A running batch whose median is at least {at_cap} of the server's concurrent-sequence limit (vLLM "
        "--max-num-seqs, SGLang --max-running-requests, as read from its command line) while on average "
        "{waiting_mean} or more requests wait and the KV cache is under {kv_usage_max} used. Not where the "
        "engine's steps already hold {steps_full} or more of its per-step token budget (tokens per step counted "
        "per step): more sequences add no token to a full step, the budget binds first (BAT006).",
        why="A decode step reads every weight once whatever the batch; below the ridge its time grows slowly with "
        "the batch, so each sequence added is nearly free throughput. A limit the queue keeps full is the only "
        "thing holding the batch down.",
        fixes="Raise the limit toward the batch the queue would fill (running + waiting), as far as the KV cache "
        "has room. Predicted gain: the physics at the new batch when the model and GPU are known (the engine's own "
        "curve beside it as a cross-check); otherwise an estimate with its range from that curve: the step time "
        "fitted over the window's busy intervals against the tokens each step held, at the batch the load can "
        "supply (running + waiting). A window whose tokens per step never varied cannot price it: none, and why.",
        sources="Seed physics (batching raises intensity until the ridge); vLLM scheduler docs (max_num_seqs caps "
        "the running batch); Orca (Yu et al., OSDI 2022) on iteration-level batching.",
    ),
)
def batch_pinned_at_limit(c: Check) -> Finding | None:
    running, waiting = c.req(S.SERVER_RUNNING), c.req(S.SERVER_WAITING)
    if waiting.mean < c.t["waiting_mean"]:
        return None
    limit, flags, where = _sequence_limit(c)
    cap = limit
    if running.p50 < c.t["at_cap"] * cap:
        return None
    kv = c.opt(S.SERVER_KV_USAGE)
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None
    if steps_full(c) is not None:
        return None  # the steps are full at the token budget: it binds first (BAT006), more sequences add no token
    c.cite(running, "p50", ">=", round(c.t["at_cap"] * cap, 3))
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    want = running.mean + waiting.mean
    note = ""
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
        # KV use grows with the sequences held: the cache has room for about running / usage of them.
        room = running.mean * c.t["kv_usage_max"] / kv.p90 if kv.p90 > 0 else want
        if room < want:
            want, note = room, f", as many as the KV cache has room for ({kv.p90:.0%} used at {running.mean:.1f})"
    target = max(cap + 1, round(want))
    g = gains.batch_gain(c.ev, target=float(target), raises_limit=True)
    # What the load can supply: no more sequences than are running and waiting now (a closed loop of N clients
    # never has more than N in flight).
    est = curve.batch_gain(c.ev, min(float(target), running.mean + waiting.mean))
    if g.value is None and not isinstance(est, curve.Refused):
        g = est  # no device roofs (a CPU build): the engine's own curve over the window prices it, with its range
    elif g.value is None and running.mean > 0:
        # Without the device's roofs nothing bounds it: on vLLM's CPU build, 2 -> 11 sequences gave x4.1 in one run
        # and x8.7 in another (its steps got shorter at the larger batch), against the batch ratio's x5.6-6.
        ratio = target / running.mean
        g = Gain.unknown(f"tokens per step from {running.mean:.1f} to {target} sequences{note}: x{ratio:.1f} "
                         "at an unchanged step time, but a step's time can grow or shrink with the batch and no "
                         "model and device roofs price it here"
                         + (f"; gain not predictable: {est.why}" if isinstance(est, curve.Refused) else ""))
    elif g.value is not None and not isinstance(est, curve.Refused):
        g = replace(g, basis=f"{g.basis}; cross-check, the engine's own curve over the window: x{est.value:.2f} "
                    f"(x{est.low:.2f} to x{est.high:.2f})")
    split = _split_context(c, cap, target)
    c.fix(FixKind.BATCH_MORE, "Raise the batch limit", f"Raise the concurrent-sequence limit from {cap} to about "
          f"{target} ({'; '.join(f'{f} {target}' for f in flags)}): the queue keeps it full{split}.", g)
    kv_said = "the KV cache has room" if kv is not None else "the server's page shows no KV use to hold it"
    return c.finding(0.85, f"The batch is pinned at the server's limit of {cap} sequences{where} while "
                     f"{waiting.mean:.1f} requests wait and {kv_said}: the limit, not the hardware, caps throughput.")


def steps_full(c: Check) -> tuple[Signal, int] | None:
    """The engine's tokens per step (mean) and its per-step token budget where the steps hold at least `steps_full`
    of the budget, counted per step (not vLLM V1's iteration histogram, which counts a prompt when its first token
    comes out); None where they do not, or where either is unknown."""
    tokens, budget = c.opt(S.SERVER_ITERATION_TOKENS_MEAN), c.knob("max_num_batched_tokens")
    if tokens is None or budget is None or not budget.known or int(budget.value) <= 0:
        return None
    if iteration_tokens_not_per_step(c.ev.meta.server_kind, c.ev.meta.server_version):
        return None
    b = int(budget.value)
    return (tokens, b) if tokens.value >= c.t["steps_full"] * b else None


def _split_context(c: Check, cap: int, target: int) -> str:
    """What raising the slots costs where each slot holds a share of one context (llama.cpp without a unified KV
    buffer): the context per slot falls by cap / target unless the total context rises with it."""
    unified, per_slot = c.knob("kv_unified"), c.knob("max_model_len")
    if unified is None or not unified.known or unified.value or per_slot is None or not per_slot.known:
        return ""
    total = int(per_slot.value) * target
    return (f"; each slot holds {per_slot.knob.flag} / slots, so raise {per_slot.knob.flag} with it to about "
            f"{total} to keep {int(per_slot.value)} tokens a slot (or share one buffer: {unified.knob.flag}); "
            f"left as it is, a slot's context falls to about {int(per_slot.value) * cap // target} tokens")


def _sequence_limit(c: Check) -> tuple[int, tuple[str, ...], str]:
    """The running-sequence limit in force, the flags that set it and, for a default, where the value comes from;
    CannotDecide where it is unknown (an engine's default with no version to read it from)."""
    s = c.knob("max_num_seqs")
    if s is None:  # an engine with no knob table: only a limit read off its command line or page counts
        cap = c.ev.serving.max_num_seqs
        if not cap:
            raise CannotDecide("cannot decide: the server's running-sequence limit is not on its command line or "
                               "page, and this engine has no table of its defaults")
        flags = {"sglang": ("SGLang --max-running-requests",), "demo": ("--max-num-seqs",)}.get(
            c.ev.serving.engine or c.ev.meta.server_kind, ("vLLM --max-num-seqs", "SGLang --max-running-requests"))
        return cap, flags, ""
    s = c.limit("max_num_seqs")
    return int(s.value), (f"{engine_label(c.ev.serving.engine)} {s.knob.flag}",), \
        "" if not s.is_default else f" (not set: {s.source})"

@rule(
    code="IDLE002",
    name="server-under-loaded",
    limiter=Limiter.IDLE,
    summary="Requests come one at a time or fewer and nothing waits: the offered load, not the server, sets the pace.",
    requires=(S.SERVER_RUNNING, S.SERVER_WAITING),
    uses=(S.SERVER_REQUESTS_PER_S, S.SERVER_HTTP_REJECTED_PER_S, S.SERVER_HTTP_REQUESTS_PER_S),
    reads={S.SERVER_RUNNING: (MEAN,), S.SERVER_WAITING: (MEAN,), S.SERVER_HTTP_REJECTED_PER_S: (MEAN,),
           S.SERVER_HTTP_REQUESTS_PER_S: (MEAN,)},
    thresholds={
        "running_mean": Threshold(1.5, "requests in flight (mean) at or below which the server serves them about one "
                                  "at a time", "requests"),
        "refused_most": Threshold(0.5, "share of the API's answers that were 4xx refusals at or above which the "
                                  "offered load is refused, not light (SRV010)", "ratio"),
        "cap_share": Threshold(0.1, "share of the configured batch limit at or below which the batch counts as "
                               "nearly empty, when the limit is known", "ratio"),
        "waiting_mean": Threshold(0.5, "mean queued requests below which nothing waits", "requests"),
    },
    page=Page(
        detects="On average {running_mean} or fewer requests in flight (or at most {cap_share} of the configured "
        "batch limit) and under {waiting_mean} waiting, from the server's own metrics; no GPU counter needed. Not "
        "where {refused_most} or more of the API's answers were refusals: that load is offered and refused "
        "(SRV010), not light.",
        why="A server that runs one request at a time decodes at batch 1, the least efficient point of the roofline, "
        "and nothing it changes makes the clients send more. Its throughput is the offered load.",
        fixes="Nothing to speed up on the server: send requests concurrently (clients, a load balancer that does not "
        "serialise), or consolidate: fewer replicas, a smaller GPU, several models on one GPU.",
        sources="Seed 004 (the utilisation trap); Little's law (in flight = arrival rate x latency).",
    ),
)
def server_under_loaded(c: Check) -> Finding | None:
    running, waiting = c.req(S.SERVER_RUNNING), c.req(S.SERVER_WAITING)
    cap = c.ev.serving.max_num_seqs
    limit = max(c.t["running_mean"], c.t["cap_share"] * cap) if cap else c.t["running_mean"]
    if running.mean > limit or waiting.mean >= c.t["waiting_mean"]:
        return None
    refused, http = c.opt(S.SERVER_HTTP_REJECTED_PER_S), c.opt(S.SERVER_HTTP_REQUESTS_PER_S)
    if refused is not None and http is not None and http.mean > 0 and \
            refused.mean >= c.t["refused_most"] * http.mean:
        return None  # most requests are turned away (SRV010): the clients offer load the server refuses
    c.cite(running, "mean", "<=", round(limit, 3))
    c.cite(waiting, "mean", "<", c.t["waiting_mean"])
    room = f" of a limit of {cap}" if cap else ""
    c.fix(FixKind.RIGHT_SIZE, "Send more load, or consolidate", "Nothing on the server limits it: send requests "
          "concurrently, or serve this load with fewer replicas or a smaller GPU.",
          Gain(None, f"the server could run many more sequences at once ({running.mean:.1f} running{room}); more "
               "throughput only if more load is offered", benefit=Benefit.CAPACITY))
    return c.finding(0.7, f"About {running.mean:.1f} requests are in flight{room} and nothing waits: the clients' "
                     "load, not the server, sets the throughput.")


@rule(
    code="SRV009",
    name="clients-give-up",
    limiter=Limiter.BATCHING,
    summary="Many requests end because the client went away: the server's latency exceeds what clients wait.",
    requires=(AnyOf(S.SERVER_ABORTS_PER_S, S.SERVER_HTTP_REQUESTS_PER_S),),
    uses=(S.SERVER_REQUESTS_PER_S, S.SERVER_REQUEST_ERRORS_PER_S, S.SERVER_WAITING, S.SERVER_HTTP_REJECTED_PER_S),
    advisory=True,
    reads={S.SERVER_ABORTS_PER_S: (MEAN,), S.SERVER_HTTP_REQUESTS_PER_S: (MEAN,), S.SERVER_REQUESTS_PER_S: (MEAN,),
           S.SERVER_REQUEST_ERRORS_PER_S: (MEAN,), S.SERVER_HTTP_REJECTED_PER_S: (MEAN,)},
    thresholds={
        "abort_share": Threshold(0.10, "aborted share of the requests that ended in the window that counts", "ratio"),
    },
    page=Page(
        detects="At least {abort_share} of the requests that ended in the window were aborted by their client (vLLM "
        "request_success_total with finished_reason abort: a timeout or a cancel), or answered by the HTTP layer "
        "(http_requests_total for /v1/ handlers) without the engine finishing them; requests the server refused "
        "(4xx answers, such as a prompt over --max-model-len) are not counted here but by SRV010. Advisory: it "
        "qualifies the verdict, never names it.",
        why="A request the client gave up on used queue space and often compute, and nobody got the answer; the "
        "served throughput counts only the rest. Clients that time out and retry add load while the server is "
        "already behind.",
        fixes="Fix what makes the server slow (the verdict's fixes); meanwhile give clients a timeout above the "
        "server's latency at this load, limit retries, and shed load at admission (a bounded queue) rather than "
        "after the work.",
        sources="vLLM finished_reason labels (stop, length, abort, error); the retry-storm pattern (Google SRE book, "
        "'Handling Overload').",
    ),
)
def clients_give_up(c: Check) -> Finding | None:
    served, errors = c.opt(S.SERVER_REQUESTS_PER_S), c.opt(S.SERVER_REQUEST_ERRORS_PER_S)
    done = served.mean if served is not None else 0.0
    aborts, http = c.opt(S.SERVER_ABORTS_PER_S), c.opt(S.SERVER_HTTP_REQUESTS_PER_S)
    # The engine's abort count where it keeps one; else the requests the HTTP layer answered that the engine never
    # finished (a front end that cancels a request whose client left counts it nowhere else).
    gone, cited = (aborts.mean, aborts) if aborts is not None and aborts.mean > 0 else (0.0, None)
    if cited is None and http is not None and served is not None:
        refused = c.opt(S.SERVER_HTTP_REJECTED_PER_S)
        others = (errors.mean if errors is not None else 0.0) + (refused.mean if refused is not None else 0.0)
        gone, cited = max(0.0, http.mean - done - others), http
    ended = gone + done
    if cited is None or ended <= 0 or gone / ended < c.t["abort_share"]:
        return None
    c.cite(cited, "mean")
    if served is not None:
        c.cite(served, "mean")
    return c.finding(0.6, f"{gone / ended:.0%} of the requests that ended were abandoned by their clients "
                     f"({gone:.2f}/s against {done:.2f}/s served): clients give up before the answer; the throughput "
                     "counts only the requests served.")


@rule(
    code="HOST004",
    name="host-cpu-taken",
    limiter=Limiter.HOST_LAUNCH,
    summary="The host's CPU is saturated and other processes take a large share of it: the server is starved of CPU.",
    requires=(S.HOST_CPU_FRAC, S.HOST_OTHERS_CPU, S.HOST_CORES),
    uses=(S.HOST_TARGET_CPU, S.HOST_TARGET_CPU_WAIT),
    reads={S.HOST_CORES: (MAX,), S.HOST_CPU_FRAC: (MEAN,), S.HOST_OTHERS_CPU: (MEAN,), S.HOST_TARGET_CPU: (MEAN,),
           S.HOST_TARGET_CPU_WAIT: (MEAN,)},
    thresholds={
        "host_busy": Threshold(0.90, "whole-host CPU use (mean) at which the host is saturated", "ratio"),
        "others_share": Threshold(0.25, "share of the host's cores used by other processes (mean) that counts as "
                                  "taken from the server, with a working thread of it seen waiting for a CPU", "ratio"),
        "cpu_wait": Threshold(0.30, "share of the time a working thread of the server waited, runnable, for a CPU "
                              "(Linux schedstat; the thread that waited most)", "ratio"),
        "others_share_unseen": Threshold(0.40, "share of the host's cores used by other processes that counts on its "
                                         "own where the run-queue wait cannot be read", "ratio"),
        "target_cpu": Threshold(0.15, "CPU the server's own process tree uses (mean) at or above which it wants the "
                                "CPU, where its run-queue wait cannot be read", "cores"),
    },
    page=Page(
        detects="The whole host's CPU at least {host_busy} busy on average while processes outside the server's tree "
        "(this tool's own sampling left out) use at least {others_share} of its cores and a working thread of the "
        "server (5 % of a core or more) waits, runnable, for a CPU at least {cpu_wait} of the time; where that wait "
        "cannot be read, others using {others_share_unseen} of the cores while the server itself uses at least "
        "{target_cpu}. A server that wants no CPU (no request in the window, its threads neither running nor "
        "waiting) is not starved by its neighbours, however busy they keep the host: an idle verdict stands.",
        why="A serving engine's scheduler, tokenizer and kernel launches run on the CPU, and a CPU build runs the "
        "model there too. When other tenants keep every core busy, the server waits for a core between steps: "
        "each step and each launch takes longer whatever the GPU could do.",
        fixes="Give the server its cores: move the other work off this host, or pin the server to cores nobody else "
        "uses (cpusets, Kubernetes CPU requests with the static CPU manager, taskset), and size its thread pools "
        "to them. No gain is predicted: a threaded engine loses far more than the share of CPU taken (on vLLM's "
        "CPU build, other processes taking 0.6 of 2 cores cut its tokens/s 4.3x: its threads wait for each other "
        "at every barrier).",
        sources="Linux CFS sharing; Kubernetes CPU manager static policy; vLLM CPU backend docs (dedicated cores via "
        "VLLM_CPU_OMP_THREADS_BIND).",
    ),
)
def host_cpu_taken(c: Check) -> Finding | None:
    host, others, cores = c.req(S.HOST_CPU_FRAC), c.req(S.HOST_OTHERS_CPU), c.req(S.HOST_CORES)
    n = cores.max
    if n <= 0 or host.mean < c.t["host_busy"]:
        return None
    wait = c.opt(S.HOST_TARGET_CPU_WAIT)
    share = c.t["others_share"] if wait is not None else c.t["others_share_unseen"]
    if others.mean < share * n or (wait is not None and wait.mean < c.t["cpu_wait"]):
        return None
    # The server must want the CPU: its threads seen waiting for it, else its own use (neighbours' load alone, with
    # the server at 0.02 cores and no request in the window, outranked an idle verdict).
    mine = c.opt(S.HOST_TARGET_CPU)
    if wait is None and (mine is None or mine.mean < c.t["target_cpu"]):
        return None
    c.cite(host, "mean", ">=", c.t["host_busy"])
    c.cite(others, "mean", ">=", round(share * n, 3))
    c.cite(cores, "max")
    if wait is not None:
        c.cite(wait, "mean", ">=", c.t["cpu_wait"])
    if mine is not None:
        c.cite(mine, "mean", *((">=", c.t["target_cpu"]) if wait is None else ()))
    # The CPU share taken does not bound the loss: threads that meet at barriers all wait for the slowest.
    gain = Gain.unknown(f"other processes take {others.mean:.2f} of {n:.0f} cores; a threaded engine loses more than "
                        "that share (its threads wait for each other), so no bound is given")
    c.fix(FixKind.HOST_CPU, "Give the server its CPU cores", "Move the other work off this host, or pin the server "
          "to cores nobody else uses (cpuset, Kubernetes static CPU manager, taskset) and size its threads to them "
          "(vLLM CPU: VLLM_CPU_OMP_THREADS_BIND).", gain)
    return c.finding(0.75, f"The host's CPU is {host.mean:.0%} busy and other processes use {others.mean:.1f} of its "
                     f"{n:.0f} cores: the server waits for CPU.")


@rule(
    code="SRV010",
    name="requests-refused",
    limiter=Limiter.BATCHING,
    summary="Many requests are refused by the server (HTTP 4xx) before the engine runs them.",
    requires=(S.SERVER_HTTP_REJECTED_PER_S, S.SERVER_HTTP_REQUESTS_PER_S),
    uses=(S.SERVER_REQUESTS_PER_S,),
    advisory=True,
    reads={S.SERVER_HTTP_REJECTED_PER_S: (MEAN,), S.SERVER_HTTP_REQUESTS_PER_S: (MEAN,), S.SERVER_REQUESTS_PER_S:
           (MEAN,)},
    thresholds={
        "refused_share": Threshold(0.10, "share of the API's answers that were 4xx refusals that counts", "ratio"),
    },
    page=Page(
        detects="At least {refused_share} of the inference API's answers in the window were 4xx refusals (vLLM's "
        "http_requests_total with status 4xx for /v1/ handlers): requests the server turned away before the "
        "engine ran them. Told apart from clients giving up (SRV009, aborts) and engine errors. Advisory: it "
        "qualifies the verdict, never names it.",
        why="A refused request costs the server almost nothing and serves nobody: the load the engine sees is only "
        "the rest, and the clients are not getting answers. vLLM answers 400 to a prompt longer than "
        "--max-model-len (prompt + max_tokens over the context), to a model name it does not serve and to a "
        "malformed body; the response's message says which.",
        fixes="Read one refused response's message. For prompts over the context length: raise --max-model-len "
        "where the model's position limit and the KV pool allow, or truncate prompts (and max_tokens) at the "
        "client. Otherwise fix the clients' requests. No gain is predicted: it changes what is served, not how "
        "fast.",
        sources="vLLM OpenAI server input validation (the context-length check in serving); "
        "prometheus-fastapi-instrumentator's status grouping (2xx/4xx/5xx).",
    ),
)
def requests_refused(c: Check) -> Finding | None:
    refused, http = c.req(S.SERVER_HTTP_REJECTED_PER_S), c.req(S.SERVER_HTTP_REQUESTS_PER_S)
    if http.mean <= 0 or refused.mean / http.mean < c.t["refused_share"]:
        return None
    share = min(1.0, refused.mean / http.mean)
    c.cite(refused, "mean", ">=", round(c.t["refused_share"] * http.mean, 4))
    c.cite(http, "mean")
    limit = c.knob("max_model_len")
    where = f" (now {limit.value})" if limit is not None and limit.known else ""
    flag = limit.knob.flag if limit is not None else "--max-model-len"
    if c.ev.serving.engine == "llamacpp":  # -c is the whole KV context, split over the slots unless unified
        where = f"{where[:-1]} per slot)" if where else where
    c.fix(FixKind.CONTEXT_LENGTH, "Stop sending requests the server refuses", "Read a refused response's message; "
          f"for prompts over the context length raise {flag}{where} where the model and KV pool allow, "
          "or truncate prompts and max_tokens at the client.",
          Gain(None, f"{share:.0%} of the answers were refusals: it changes what is served, not how fast",
               benefit=Benefit.CAPACITY))
    return c.finding(0.6, f"{share:.0%} of the API's answers were refusals (HTTP 4xx, {refused.mean:.2f}/s): the "
                     "server turns these requests away before running them; the clients are not giving up.")


@rule(
    code="BAT006",
    name="token-budget-binds",
    limiter=Limiter.BATCHING,
    summary="The per-step token budget splits every prompt over several steps: prefill holds requests back while "
    "the running batch is below its limit (or the steps are full at the budget) and the KV cache has room.",
    requires=(S.SERVER_RUNNING, S.SERVER_WAITING, AnyOf(S.SERVER_PROMPT_LEN_MEAN, S.SERVER_ITERATION_TOKENS_MEAN)),
    uses=(S.SERVER_KV_USAGE, S.SERVER_PREFILL_TIME_MEAN_S, S.SERVER_TTFT_MEAN_S),
    reads={S.SERVER_RUNNING: (MEAN, P50,), S.SERVER_WAITING: (MEAN,), S.SERVER_PROMPT_LEN_MEAN: (VALUE,),
           S.SERVER_ITERATION_TOKENS_MEAN: (VALUE,),
           S.SERVER_KV_USAGE: (P90,), S.SERVER_PREFILL_TIME_MEAN_S: (VALUE,), S.SERVER_TTFT_MEAN_S: (VALUE,)},
    thresholds={
        # A step holds a prompt chunk filled to the budget or only the decodes' one token each (a few), so its mean
        # over the window is close to the share of steps filled: at 0.6 most steps are full. On llama.cpp with -b 32
        # and 600-token prompts the steps held 25 of 32 (16 tokens out each); with the default 2048, under 1 %.
        "steps_full": Threshold(0.6, "tokens per step (mean) over the per-step token budget at which most steps "
                                "are full: the budget caps the step whatever the sequence limit", "ratio"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand the step cannot admit", "requests"),
        "prefill_share": Threshold(0.3, "prefill time's share of the time to first token at which the chunked "
                                   "prefill holds requests back (where nothing queues)", "ratio"),
        "below_cap": Threshold(0.9, "running batch (median) under this share of the sequence limit: the sequence "
                               "limit is not what holds the queue", "ratio"),
        "kv_usage_max": Threshold(0.90, "KV use (p90) above which the KV cache holds the queue (VRAM001)", "ratio"),
    },
    page=Page(
        detects="The engine's per-step token budget (vLLM --max-num-batched-tokens, llama.cpp --batch-size, its "
        "default for the engine's version where not set) smaller than a mean prompt plus the running decodes, so "
        "every prompt is prefilled over two or more steps, while it holds requests back: requests waiting (mean "
        "{waiting_mean} or more) or prefill taking at least {prefill_share} of the time to first token; and neither "
        "the sequence limit (running median under {below_cap} of it) nor the KV cache (under {kv_usage_max} used) "
        "binds. Or the steps full at the budget (tokens per step, mean, at least {steps_full} of it, where the "
        "engine counts them per step) while requests wait: then the budget binds whatever the sequence limit, as "
        "more sequences add no token to a full step.",
        why="Each step the scheduler spends its token budget: one token per decoding sequence, a prompt chunk's "
        "length per prefilling one. A prompt longer than what is left is prefilled over several steps, and while "
        "it is, no other waiting request is admitted: the budget, not the sequence limit or memory, sets the "
        "batch.",
        fixes="Raise the token budget (vLLM --max-num-batched-tokens) to at least two mean prompts beside the "
        "running decodes, so a waiting prompt is admitted whole. It trades a longer step while prompts prefill "
        "(decodes that share it wait longer: watch the inter-token tail, SRV004). Predicted: each prompt's "
        "prefill steps fall to about one (time to first token); tokens/s is not priced without the device's "
        "roofs or the engine's measured step curve.",
        sources="vLLM V1 scheduler (token budget per step, chunked prefill); vLLM 0.32 EngineArgs defaults "
        "(2048 per rank on a CPU build, 2048 on GPUs under 70 GiB, 8192 on 70-160 GiB, 16384 from 160 GiB); "
        "Sarathi-Serve (Agrawal et al., OSDI 2024).",
    ),
)
def token_budget_binds(c: Check) -> Finding | None:
    running, waiting = c.req(S.SERVER_RUNNING), c.req(S.SERVER_WAITING)
    prompt = c.opt(S.SERVER_PROMPT_LEN_MEAN)
    budget, seqs = c.knob("max_num_batched_tokens"), c.knob("max_num_seqs")
    if budget is None:
        return None  # an engine without a knob table
    b = c.limit("max_num_batched_tokens").value
    full = steps_full(c)
    if full is not None and waiting.mean >= c.t["waiting_mean"]:
        return _steps_full_at_budget(c, full, running, waiting, prompt)
    if prompt is None:
        return None  # no prompt length: whether a prompt fits one step is unknown
    p = prompt.value
    if b >= p + running.mean:
        return None  # a whole prompt fits beside the decodes: the budget does not bind
    if seqs is not None and seqs.known and running.p50 >= c.t["below_cap"] * int(seqs.value):
        return None  # the sequence limit holds the queue (BAT005)
    kv = c.opt(S.SERVER_KV_USAGE)
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None  # memory holds the queue (VRAM001)
    prefill, ttft = c.opt(S.SERVER_PREFILL_TIME_MEAN_S), c.opt(S.SERVER_TTFT_MEAN_S)
    share = min(1.0, prefill.value / ttft.value) if prefill is not None and ttft is not None and ttft.value > 0 \
        else None
    queued = waiting.mean >= c.t["waiting_mean"]
    if not queued and (share is None or share < c.t["prefill_share"]):
        return None
    c.cite(prompt, "value", ">", round(b - running.mean, 1))
    c.cite(running, "p50")
    if queued:
        c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    elif prefill is not None and ttft is not None:
        c.cite(prefill, "value", ">=", round(c.t["prefill_share"] * ttft.value, 4))
        c.cite(ttft, "value")
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
    target = gains.token_budget_target(p, running.mean, waiting.mean)
    steps = math.ceil(p / max(1.0, b - running.mean))
    where = "" if not budget.is_default else f" (not set: {budget.source})"
    c.fix(FixKind.TOKEN_BUDGET, "Raise the per-step token budget", f"Raise {budget.knob.flag} from {b} to about "
          f"{target}: a {p:.0f}-token prompt then prefills in one step beside the running decodes instead of "
          f"{steps}.",
          Gain.unknown(f"a prompt's prefill from {steps} steps to about one (time to first token); tokens/s not "
                       "priced: no device roofs or measured step curve price a longer step here"))
    held = f"{waiting.mean:.1f} requests wait" if queued else \
        f"prefill is {share:.0%} of the time to first token"
    return c.finding(0.8, f"The per-step token budget of {b}{where} is smaller than a mean prompt ({p:.0f} tokens) "
                     f"beside {running.mean:.1f} decodes, so each prompt prefills over {steps} steps: {held} while "
                     "the batch is below its limit and the KV cache has room.")


def _steps_full_at_budget(c: Check, full: tuple[Signal, int], running: Signal, waiting: Signal,
                          prompt: Signal | None) -> Finding | None:
    """BAT006 where the steps are full at the budget while requests wait: the budget binds whatever the sequence
    limit (BAT005 stands aside), raised to hold two mean prompts beside the decodes where the prompt length is
    known."""
    kv = c.opt(S.SERVER_KV_USAGE)
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None  # memory holds the queue (VRAM001)
    tokens, b = full
    budget = c.limit("max_num_batched_tokens")
    c.cite(tokens, "value", ">=", round(c.t["steps_full"] * b, 1))
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    c.cite(running, "p50")
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
    flags = f"{engine_label(c.ev.serving.engine)} {budget.knob.flag}"
    if prompt is not None and prompt.value > 0:
        c.cite(prompt, "value")
        target = max(gains.token_budget_target(prompt.value, running.mean, waiting.mean), 2 * b)
        need = f"two mean prompts ({prompt.value:.0f} tokens) beside the decodes"
        steps = f"a {prompt.value:.0f}-token prompt prefills in {math.ceil(prompt.value / b)} steps now"
    else:
        target = 4 * b
        need = "four times the budget (the server's page has no prompt length to size it by)"
        steps = "prompts prefill over several steps"
    ub = c.knob("ubatch_size")
    also = f" (and {ub.knob.flag} from {ub.value} with it: the physical batch the step is computed in)" \
        if ub is not None and ub.known and int(ub.value) < target else ""
    where = "" if not budget.is_default else f" (not set: {budget.source})"
    c.fix(FixKind.TOKEN_BUDGET, "Raise the per-step token budget", f"Raise {flags} from {b} to about {target}"
          f"{also}, for {need}: {steps}, and the steps are full.",
          Gain.unknown(f"steps that hold {tokens.value:.0f} of {b} tokens hold up to {target}: the step's fixed cost "
                       "is shared over more tokens; tokens/s not priced here (no device roofs, and the window's "
                       "steps never ran past the budget to measure a longer step)"))
    return c.finding(0.8, f"The engine's steps hold {tokens.value:.0f} tokens on average against a per-step budget "
                     f"of {b}{where} while {waiting.mean:.1f} requests wait: the steps are full, so the budget caps "
                     "throughput; more sequences would add no token to a full step.")


@rule(
    code="SRV011",
    name="offered-load-above-capacity",
    limiter=Limiter.BATCHING,
    summary="Requests arrive faster than the server serves them: the queue grows all window.",
    requires=(S.SERVER_WAITING_GROWTH_PER_S, S.SERVER_WAITING),
    uses=(S.SERVER_REQUESTS_PER_S,),
    advisory=True,
    reads={S.SERVER_WAITING_GROWTH_PER_S: (VALUE,), S.SERVER_WAITING: (MEAN, MAX), S.SERVER_REQUESTS_PER_S: (MEAN,)},
    thresholds={
        "growth_share": Threshold(0.10, "queue growth over the served rate at which arrivals outrun service "
                                  "(a share of the requests served per second)", "ratio"),
        "growth_min": Threshold(0.2, "queue growth in requests per second below which a trend is noise", "1/s"),
    },
    page=Page(
        detects="The waiting queue growing all window (the lesser of its two halves' least-squares slopes) by at "
        "least {growth_min} (requests a second) and by at least {growth_share} of the requests served per second, "
        "with requests finishing in the window: "
        "arrivals outrun service, an open loop above capacity. Advisory: it qualifies the verdict, never names it.",
        why="A server serves at most its capacity; offered load above it does not raise throughput, it queues. "
        "The queue, and every request's wait, grows for as long as the overload lasts, whatever knob binds inside "
        "the server: a knob that binds raises capacity only as far as the device allows.",
        fixes="Capacity or admission control, not a scheduler knob: add replicas or GPUs for the offered load, or "
        "bound the queue (vLLM --max-num-queued-reqs answers 503 beyond it, so a load balancer retries elsewhere) "
        "and shed load early. Fix the limiter the verdict names too, for the capacity it gives. No gain predicted.",
        sources="Little's law and queueing stability (arrival rate above service rate: the queue grows without "
        "bound); vLLM 0.32 SchedulerConfig.max_num_queued_reqs; Google SRE book, 'Handling Overload'.",
    ),
)
def offered_load_above_capacity(c: Check) -> Finding | None:
    growth, waiting = c.req(S.SERVER_WAITING_GROWTH_PER_S), c.req(S.SERVER_WAITING)
    served = c.opt(S.SERVER_REQUESTS_PER_S)
    if served is not None and served.mean <= 0:
        return None  # nothing finished in the window: slow requests, not a measured service rate to compare with
    rate = served.mean if served is not None else 0.0
    bar = max(c.t["growth_min"], c.t["growth_share"] * rate)
    if growth.value < bar:
        return None
    c.cite(growth, "value", ">=", round(bar, 4))
    c.cite(waiting, "max")
    if served is not None:
        c.cite(served, "mean")
    queued = c.knob("max_num_queued_reqs")
    bound = " (vLLM --max-num-queued-reqs answers 503 beyond it)" if queued is not None else ""
    c.fix(FixKind.ADMISSION, "Add capacity or bound the queue", "The offered load is above what this server serves: "
          f"add replicas or GPUs for it, or bound the queue{bound} and shed load early.",
          Gain(None, f"the queue grows {growth.value:.2f} requests a second: no knob serves more than the device "
               "allows", benefit=Benefit.CAPACITY))
    served_text = f" against {rate:.2f} served" if served is not None else ""
    return c.finding(0.6, f"The queue grows by {growth.value:.2f} requests a second all window (up to "
                     f"{waiting.max:.0f} waiting){served_text}: requests arrive faster than the server serves them.")


RULES = (batch_pinned_at_limit, token_budget_binds, server_under_loaded, clients_give_up, requests_refused,
         offered_load_above_capacity, host_cpu_taken)
