"""VRAM rules: the model or its KV cache does not fit. Checked first: if it does not fit, nothing else helps."""

from __future__ import annotations

from diagnoser import signals as S
from diagnoser.diagnosis import Finding, FixKind, GainKind, Limiter
from diagnoser.rules import formula as fm
from diagnoser.rules import gains
from diagnoser.rules.base import MAX, MEAN, P90, VALUE, Check, Gain, Page, Threshold, rule


def _kv_knob(c: Check, mem_used: float | None) -> str:
    """The action that gives the KV cache more room, naming the knob that sizes it on this server: a block count
    forced on the command line or the page, a byte budget, the CPU build's KV space, else the memory share."""
    serving = c.ev.serving
    override = serving.extra.get("num_gpu_blocks_override")
    if override not in (None, "", "None", "0"):
        size = f" ({override} blocks of {serving.block_size} tokens)" if serving.block_size else f" ({override} blocks)"
        return (f"The KV pool is forced to a fixed size{size} by vLLM --num-gpu-blocks-override: raise it, or drop "
                "it so the engine sizes the pool from the free memory, so the waiting requests can run.")
    if serving.extra.get("kv_cache_memory_bytes"):
        return (f"The KV pool is sized by vLLM --kv-cache-memory-bytes ({serving.extra['kv_cache_memory_bytes']}): "
                "raise it so the waiting requests can run.")
    if serving.extra.get("VLLM_CPU_KVCACHE_SPACE"):
        return (f"The KV pool is sized by VLLM_CPU_KVCACHE_SPACE={serving.extra['VLLM_CPU_KVCACHE_SPACE']} (GiB) in "
                "the server's environment: raise it while the host has memory free, so the waiting requests can run.")
    if c.ev.meta.cpu_only and (serving.engine or c.ev.meta.server_kind) == "vllm":
        return ("vLLM's CPU build sizes the KV pool from VLLM_CPU_KVCACHE_SPACE (GiB) or --kv-cache-memory-bytes: "
                "raise it while the host has memory free, so the waiting requests can run.")
    where = (f"Only {mem_used:.0%} of the device memory is in use: raise" if mem_used is not None else
             "If the device has memory free (its use was not read), raise")
    return (f"{where} the KV cache's share (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static, a larger KV "
            "pool) so the waiting requests can run.")


def _kv_fixes(c: Check) -> None:
    """More room for the KV cache: the free memory, fewer bytes per token, fewer weight bytes, more GPUs."""
    mem = c.opt(S.GPU_MEM_USED_FRAC)
    if mem is None or mem.p90 < c.t["mem_free_for_kv"]:
        want, batch = gains.demand(c.ev), c.ev.observed_batch()
        g = gains.batch_gain(c.ev, target=want) if want is not None else Gain.unknown(
            "needs the queue length to bound the gain by the demand")
        limit = gains.sequence_limit(c.ev)
        if g.value is None and want is not None and batch:
            runs, held = want, ""
            if limit is not None and limit.sequences < want:
                runs, held = float(limit.sequences), f", no more than {limit.describe()}"
            if runs > batch:
                g = Gain(runs / batch, f"the waiting requests running too: {runs:.0f} sequences for {batch:.0f}{held} "
                                       "(the model's shape or the GPU is unknown, so the step is assumed not to slow)",
                         GainKind.UPPER_BOUND)
        if mem is not None:
            c.cite(mem, "p90", "<", c.t["mem_free_for_kv"])
        # More KV room lets the batch grow only up to the scheduler's cap: when that is below the demand, say so.
        c.fix(FixKind.KV_MEMORY, "Give the KV cache more memory", _kv_knob(c, mem.p90 if mem is not None else None)
              + gains.next_limit_text(c.ev, want), g)
    c.fix(FixKind.FP8_KV, "Store the KV cache in FP8", "Start the server with an FP8 KV cache (vLLM: "
          "--kv-cache-dtype fp8); each token's KV then takes half the bytes, so twice the sequences fit and each "
          "decode step reads half the KV bytes.", gains.kv_dtype_gain(c.ev, "fp8"))
    if mem is None or mem.p90 >= c.t["mem_free_for_kv"]:
        c.fix(FixKind.QUANTIZE_FOR_MEMORY, "Quantise the weights to free memory for the KV cache",
              "Serve FP8 or INT4 weights (an FP8 checkpoint, AWQ/GPTQ INT4); the memory freed goes to the KV cache.")
        c.fix(FixKind.SHARD_MODEL, "Shard the model or use a larger GPU", "Tensor parallelism over more GPUs (vLLM "
              "--tensor-parallel-size) or a GPU with more memory (H200: 141 GB).")


@rule(
    code="VRAM001",
    name="kv-cache-full",
    limiter=Limiter.VRAM,
    summary="The KV cache is full while requests wait or get preempted.",
    requires=(S.SERVER_KV_USAGE,),
    uses=(S.SERVER_WAITING, S.SERVER_PREEMPTIONS_PER_S, S.SERVER_RUNNING, S.GPU_MEM_USED_FRAC),
    reads={S.SERVER_KV_USAGE: (P90, MAX,), S.SERVER_WAITING: (MEAN,), S.SERVER_PREEMPTIONS_PER_S: (MAX,),
           S.GPU_MEM_USED_FRAC: (P90,)},
    thresholds={
        "kv_usage_p90": Threshold(0.90, "KV-cache use (p90) at or above which the cache counts as full", "ratio"),
        "waiting_mean": Threshold(1.0, "mean queued requests that count as pressure", "requests"),
        "preemptions_per_s": Threshold(0.0, "any preemption above this rate counts as pressure", "1/s"),
        "kv_usage_max_preempting": Threshold(0.80, "KV-cache use (max) that, with preemptions and a queue, counts "
                                             "as full whatever the p90", "ratio"),
        "mem_free_for_kv": Threshold(0.50, "device memory in use (p90) below which the KV pool, not the GPU, is "
                                     "what is small", "ratio"),
    },
    page=Page(
        detects="KV-cache use near full (p90 at or above {kv_usage_p90}) together with requests queued or preempted: "
        "the server would batch more sequences but has no memory for their KV cache. Also: requests preempted while "
        "others wait and the cache reached {kv_usage_max_preempting}: engines preempt only when the cache has run "
        "out, and a gauge scraped once a second misses the peaks. When the device memory itself is under "
        "{mem_free_for_kv} used, the KV pool was sized small, and the fix is to give it the free memory.",
        why="Decode throughput grows with the batch until the ridge point; when the KV cache caps the batch, the "
        "GPU streams all the weights every step for only a few sequences. Preemptions also recompute or swap "
        "work already done.",
        fixes="Give the KV cache the free memory when there is some; the batch then grows only up to the server's "
        "sequence limit (vLLM --max-num-seqs), so its gain is capped there and, when the queue wants more, raising "
        "the limit is named as the next fix. Store the KV cache in FP8 (vLLM "
        "`--kv-cache-dtype fp8`): half the bytes per token, twice the sequences, half the KV bytes each step reads. "
        "Quantise the weights (FP8/INT4) to free memory for the cache. Shard with tensor parallelism or move to a "
        "GPU with more memory. Lower `--max-model-len` if long contexts are rare.",
        sources="KV bytes per token = 2 x layers x kv_heads x head_dim x bytes; vLLM docs on preemption; "
        "torch-tb-profiler's 90 % peak-memory rule.",
    ),
)
def kv_cache_full(c: Check) -> Finding | None:
    kv = c.req(S.SERVER_KV_USAGE)
    waiting, preempt = c.opt(S.SERVER_WAITING), c.opt(S.SERVER_PREEMPTIONS_PER_S)
    queued = waiting is not None and waiting.mean >= c.t["waiting_mean"]
    preempted = preempt is not None and preempt.max > c.t["preemptions_per_s"]
    if not (queued or preempted):
        return None
    full = kv.p90 >= c.t["kv_usage_p90"]
    # The preemption counter never misses an event; the usage gauge, scraped at 1 Hz, misses the moments it was full.
    ran_out = queued and preempted and kv.max >= c.t["kv_usage_max_preempting"]
    if not (full or ran_out):
        return None
    if full:
        c.cite(kv, "p90", ">=", c.t["kv_usage_p90"])
    else:
        c.cite(kv, "max", ">=", c.t["kv_usage_max_preempting"])
    if queued and waiting is not None:
        c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    if preempted and preempt is not None:
        c.cite(preempt, "max", ">", c.t["preemptions_per_s"])
    _kv_fixes(c)
    strength = 0.6 + (0.2 if queued else 0.0) + (0.15 if preempted else 0.0)
    fullness = f"is {kv.p90:.0%} full (p90)" if full else f"runs out (read at up to {kv.max:.0%}; reads miss the peaks)"
    mem = c.opt(S.GPU_MEM_USED_FRAC)
    tail = (f"; the device memory is only {mem.p90:.0%} used, so the KV pool, not the GPU, is what is small"
            if mem is not None and mem.p90 < c.t["mem_free_for_kv"] else "")
    return c.finding(strength, f"The KV cache {fullness} while requests "
                     f"{'wait' if queued else ''}{' and ' if queued and preempted else ''}"
                     f"{'are preempted' if preempted else ''}: memory caps the batch{tail}.")


@rule(
    code="VRAM002",
    name="weights-do-not-fit",
    limiter=Limiter.VRAM,
    summary="The model's weights alone do not fit in the GPU memory.",
    requires=(S.THEORY_WEIGHT_BYTES, S.GPU_MEM_TOTAL_BYTES),
    reads={S.THEORY_WEIGHT_BYTES: (VALUE,), S.GPU_MEM_TOTAL_BYTES: (MAX,)},
    thresholds={"weights_frac": Threshold(0.95, "weights over device memory at which nothing is left for the KV "
                                          "cache", "ratio")},
    page=Page(
        detects="Weight bytes (parameters x bytes per parameter, per tensor-parallel rank) at or above "
        "{weights_frac} of the GPU's memory.",
        why="A model that does not fit cannot run, or runs offloaded over PCIe at a small fraction of HBM speed; "
        "and with no room left for the KV cache no batch can form. Nothing else helps until it fits.",
        fixes="Quantise (FP8 halves BF16 weights, INT4 quarters them), shard with tensor parallelism, or use a "
        "GPU with more memory.",
        sources="Seed physics: weight bytes = params x bytes per element; 'if the model does not fit VRAM nothing "
        "else helps'.",
    ),
)
def weights_do_not_fit(c: Check) -> Finding | None:
    weights, total = c.req(S.THEORY_WEIGHT_BYTES), c.req(S.GPU_MEM_TOTAL_BYTES)
    frac = weights.value / total.max
    if frac < c.t["weights_frac"]:
        return None
    c.cite(weights, "value", ">=", c.t["weights_frac"] * total.max)
    c.cite(total, "max")
    need = max(2, int(-(-frac // 0.8)))  # ranks so each holds <= 80 % of a GPU
    c.fix(FixKind.QUANTIZE_FOR_MEMORY, "Quantise the weights", "Serve FP8 (half of BF16) or INT4 (a quarter) weights.",
          Gain.unknown("the model does not run as it is, so there is no speed to compare with"))
    c.fix(FixKind.SHARD_MODEL, "Shard the model", f"Tensor parallelism over at least {need} GPUs of this kind.",
          Gain.unknown("the model does not run as it is, so there is no speed to compare with"))
    return c.finding(1.0, f"The weights need {frac:.0%} of the GPU's memory: the model does not fit.")


@rule(
    code="VRAM003",
    name="device-memory-full",
    limiter=Limiter.VRAM,
    summary="Device memory is nearly full and no KV-cache metric tells whether that is pressure or preallocation.",
    requires=(S.GPU_MEM_USED_FRAC,),
    uses=(S.SERVER_KV_USAGE,),
    reads={S.GPU_MEM_USED_FRAC: (P90,)},
    fleet=(fm.Read(S.GPU_MEM_USED_FRAC, P90) >= fm.Bar("mem_used_p90")).unless(fm.Present(S.SERVER_KV_USAGE))
    .valued(0.4),
    thresholds={"mem_used_p90": Threshold(0.97, "device memory in use (p90) that counts as full", "ratio")},
    page=Page(
        detects="Device memory at or above {mem_used_p90} with no server KV-cache metric to say whether the memory "
        "is really under pressure.",
        why="Out-of-memory retries, allocator fragmentation and a KV cache with no room cap the batch. But serving "
        "engines preallocate (vLLM takes 90 % by default), so a full GPU alone is weak evidence: the rule stays "
        "weak unless server metrics confirm it (VRAM001).",
        fixes="Expose the server's /metrics so KV-cache use and preemptions can be read; if the cache is the "
        "limit, see VRAM001.",
        sources="torch-tb-profiler's 90 % peak-memory rule; vLLM gpu_memory_utilization default 0.9.",
    ),
)
def device_memory_full(c: Check) -> Finding | None:
    if c.opt(S.SERVER_KV_USAGE) is not None:
        return None  # VRAM001 decides with the better signal
    mem = c.req(S.GPU_MEM_USED_FRAC)
    if mem.p90 < c.t["mem_used_p90"]:
        return None
    c.cite(mem, "p90", ">=", c.t["mem_used_p90"])
    c.fix(FixKind.CONFIRM_METRICS, "Confirm with server metrics", "Attach with --port so KV-cache use and "
          "preemptions are read (serving engines preallocate most of the memory on purpose).")
    return c.finding(0.4, f"Device memory is {mem.p90:.0%} used (p90); without KV-cache metrics this may be "
                     "preallocation rather than pressure.")


RULES = (kv_cache_full, weights_do_not_fit, device_memory_full)
