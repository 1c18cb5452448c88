"""VRAM rules: the model or its KV cache does not fit. Checked first: if it does not fit, nothing else helps."""

from __future__ import annotations

from diagnoser.diagnosis import Finding, Limiter
from diagnoser.rules.base import Check, Page, Threshold, rule
from diagnoser.rules.gains import batch_gain


@rule(
    code="VRAM001",
    name="kv-cache-full",
    limiter=Limiter.VRAM,
    summary="The KV cache is full while requests wait or get preempted.",
    requires=("server.kv_usage",),
    uses=("server.waiting", "server.preemptions_per_s", "server.running", "gpu.mem_used_frac"),
    thresholds={
        "kv_usage_p90": Threshold(0.90, "KV-cache use (p90) at or above which the cache counts as full"),
        "waiting_mean": Threshold(1.0, "mean queued requests that count as pressure"),
        "preemptions_per_s": Threshold(0.0, "any preemption above this rate counts as pressure"),
        "kv_usage_max_preempting": Threshold(0.80, "KV-cache use (max) that, with preemptions and a queue, counts "
                                             "as full whatever the p90"),
    },
    page=Page(
        detects="KV-cache use near 100 % (p90 >= 90 %) together with requests queued or preempted: the server would "
        "batch more sequences but has no memory for their KV cache. Also: requests preempted while others wait "
        "and the cache reached 80 %: engines preempt only when the cache has run out, and a gauge scraped once a "
        "second misses the peaks (use swings from 67 % to 97 % as sequences are preempted and re-admitted).",
        why="Decode throughput grows with the batch until the ridge point; when the KV cache caps the batch, the "
        "GPU streams all the weights every step for only a few sequences. Preemptions also recompute or swap "
        "work already done.",
        fixes="Store the KV cache in FP8 (vLLM `--kv-cache-dtype fp8`): half the bytes per token, twice the "
        "sequences. Quantise the weights (FP8/INT4) to free memory for the cache. Shard with tensor parallelism "
        "or move to a GPU with more memory. Lower `--max-model-len` if long contexts are rare.",
        sources="KV bytes per token = 2 x layers x kv_heads x head_dim x bytes; vLLM docs on preemption; "
        "torch-tb-profiler's 90 % peak-memory rule.",
    ),
)
def kv_cache_full(c: Check) -> Finding | None:
    kv = c.sig("server.kv_usage")
    assert kv is not None
    waiting, preempt = c.sig("server.waiting"), c.sig("server.preemptions_per_s")
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
    if queued:
        c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    if preempted:
        c.cite(preempt, "max", ">", c.t["preemptions_per_s"])
    gain, basis = batch_gain(c.ev, factor=2.0)
    c.fix("Store the KV cache in FP8", "Start the server with an FP8 KV cache (vLLM: --kv-cache-dtype fp8); "
          "each sequence then takes half the memory, so about twice as many run at once.", gain, basis)
    c.fix("Quantise the weights to free memory for the KV cache",
          "Serve FP8 or INT4 weights (e.g. an FP8 checkpoint, AWQ/GPTQ INT4); the memory freed goes to the KV cache.")
    c.fix("Shard the model or use a larger GPU",
          "Tensor parallelism over more GPUs (vLLM --tensor-parallel-size) or a GPU with more memory (H200: 141 GB).")
    strength = 0.6 + (0.2 if queued else 0.0) + (0.15 if preempted else 0.0)
    fullness = f"is {kv.p90:.0%} full (p90)" if full else f"runs out (read at up to {kv.max:.0%}; reads miss the peaks)"
    return c.finding(strength, f"The KV cache {fullness} while requests "
                     f"{'wait' if queued else ''}{' and ' if queued and preempted else ''}"
                     f"{'are preempted' if preempted else ''}: memory caps the batch.")


@rule(
    code="VRAM002",
    name="weights-do-not-fit",
    limiter=Limiter.VRAM,
    summary="The model's weights alone do not fit in the GPU memory.",
    requires=("theory.weight_bytes", "gpu.mem_total_bytes"),
    thresholds={"weights_frac": Threshold(0.95, "weights over device memory at which nothing is left for the KV cache")},
    page=Page(
        detects="Weight bytes (parameters x bytes per parameter, per tensor-parallel rank) at or above the GPU's memory.",
        why="A model that does not fit cannot run, or runs offloaded over PCIe at a small fraction of HBM speed; "
        "and with no room left for the KV cache no batch can form. Nothing else helps until it fits.",
        fixes="Quantise (FP8 halves BF16 weights, INT4 quarters them), shard with tensor parallelism, or use a "
        "GPU with more memory.",
        sources="Seed physics: weight bytes = params x bytes per element; 'if the model does not fit VRAM nothing else helps'.",
    ),
)
def weights_do_not_fit(c: Check) -> Finding | None:
    weights, total = c.sig("theory.weight_bytes"), c.sig("gpu.mem_total_bytes")
    assert weights is not None and total is not None
    frac = weights.values[0] / total.max
    if frac < c.t["weights_frac"]:
        return None
    c.cite(weights, "value", ">=", c.t["weights_frac"] * total.max)
    c.cite(total, "max")
    need = max(2, int(-(-frac // 0.8)))  # ranks so each holds <= 80 % of a GPU
    c.fix("Quantise the weights", "Serve FP8 (half of BF16) or INT4 (a quarter) weights.")
    c.fix("Shard the model", f"Tensor parallelism over at least {need} GPUs of this kind.")
    return c.finding(1.0, f"The weights need {frac:.0%} of the GPU's memory: the model does not fit.")


@rule(
    code="VRAM003",
    name="device-memory-full",
    limiter=Limiter.VRAM,
    summary="Device memory is nearly full and no KV-cache metric tells whether that is pressure or preallocation.",
    requires=("gpu.mem_used_frac",),
    uses=("server.kv_usage",),
    thresholds={"mem_used_p90": Threshold(0.97, "device memory in use (p90) that counts as full")},
    page=Page(
        detects="Device memory at or above 97 % with no server KV-cache metric to say whether the memory is "
        "really under pressure.",
        why="Out-of-memory retries, allocator fragmentation and a KV cache with no room cap the batch. But serving "
        "engines preallocate (vLLM takes 90 % by default), so a full GPU alone is weak evidence: the rule stays "
        "weak unless server metrics confirm it (VRAM001).",
        fixes="Expose the server's /metrics so KV-cache use and preemptions can be read; if the cache is the "
        "limit, see VRAM001.",
        sources="torch-tb-profiler's 90 % peak-memory rule; vLLM gpu_memory_utilization default 0.9.",
    ),
)
def device_memory_full(c: Check) -> Finding | None:
    if "server.kv_usage" in c.ev:
        return None  # VRAM001 decides with the better signal
    mem = c.sig("gpu.mem_used_frac")
    assert mem is not None
    if mem.p90 < c.t["mem_used_p90"]:
        return None
    c.cite(mem, "p90", ">=", c.t["mem_used_p90"])
    c.fix("Confirm with server metrics", "Attach with --port so KV-cache use and preemptions are read "
          "(serving engines preallocate most of the memory on purpose).")
    return c.finding(0.4, f"Device memory is {mem.p90:.0%} used (p90); without KV-cache metrics this may be "
                     "preallocation rather than pressure.")

