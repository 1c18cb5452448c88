"""Load rules: batching-limited (the GPU waits for work it could have had) and idle / over-provisioned."""

from __future__ import annotations

from diagnoser.diagnosis import Finding, Limiter
from diagnoser.evidence import Signal
from diagnoser.rules.base import Check, Page, Threshold, rule
from diagnoser.rules.gains import batch_gain, observed_batch

_BUSY = "gpu.busy|gpu.sm_active"
_BATCH_SOURCES = "Seed physics: 'if the GPU is busy < 50 % of the time, fix batching before hardware'; Nsight " \
    "Systems gpu_time_util flags < 50 % busy; torch-tb-profiler's GPU utilisation < 50 % rule."


def busy_signal(c: Check) -> Signal | None:
    """The best 'was the GPU working' signal: time-busy first, since SM activity also drops on small kernels."""
    return c.sig("gpu.busy") or c.sig("gpu.sm_active")


def _batching_fixes(c: Check, busy: float | None) -> None:
    gain, basis = batch_gain(c.ev, factor=4.0)
    if gain is None and busy:
        gain, basis = min(1.0 / max(busy, 0.05), 10.0), "if the GPU were kept busy: 1 / busy fraction"
    c.fix("Let the scheduler batch more", "Raise the concurrent-sequence limit (vLLM --max-num-seqs, "
          "--max-num-batched-tokens; TGI --max-batch-total-tokens; Triton dynamic batching max_queue_delay) and "
          "check the client sends requests concurrently.", gain, basis)
    c.fix("Use continuous batching", "Serve through an engine that schedules per iteration (vLLM, SGLang, TGI) "
          "rather than one request per forward pass.")


@rule(
    code="BAT001",
    name="gpu-idle-while-requests-wait",
    limiter=Limiter.BATCHING,
    summary="The GPU is busy less than half the time while requests sit in the queue.",
    requires=(_BUSY, "server.waiting"),
    uses=("server.running",),
    thresholds={
        "busy_mean": Threshold(0.50, "GPU busy fraction below which the GPU is underused"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand is there"),
    },
    page=Page(
        detects="GPU busy under 50 % of the window while on average at least one request waits in the queue.",
        why="The work is there but does not reach the GPU: the scheduler admits too few sequences per step, or "
        "requests are served one at a time. Every idle moment is throughput lost for nothing.",
        fixes="Raise the batch limits (max-num-seqs, max-num-batched-tokens), use continuous batching, check the "
        "client's concurrency.",
        sources=_BATCH_SOURCES,
    ),
)
def gpu_idle_while_requests_wait(c: Check) -> Finding | None:
    busy, waiting = busy_signal(c), c.sig("server.waiting")
    assert busy is not None and waiting is not None
    if busy.mean >= c.t["busy_mean"] or waiting.mean < c.t["waiting_mean"]:
        return None
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    _batching_fixes(c, busy.mean)
    return c.finding(0.85, f"The GPU is busy {busy.mean:.0%} of the time while {waiting.mean:.1f} requests wait "
                     "on average: work is queued but not batched.")


@rule(
    code="BAT002",
    name="batch-far-below-ridge-under-load",
    limiter=Limiter.BATCHING,
    summary="Requests wait while the running batch is far below the batch the GPU could serve efficiently.",
    requires=("server.running", "server.waiting", "theory.ridge_batch"),
    uses=("server.kv_usage",),
    thresholds={
        "batch_over_ridge": Threshold(0.25, "running batch below this fraction of the ridge batch counts as small"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand is there"),
        "kv_usage_max": Threshold(0.90, "KV use above which memory, not the scheduler, caps the batch (VRAM001)"),
    },
    page=Page(
        detects="A running batch under a quarter of the ridge batch while requests wait and the KV cache has room.",
        why="Decode intensity rises with the batch until the ridge; below it each step reads all weights for few "
        "tokens. With requests waiting and memory free, the scheduler's limit is what holds the batch down.",
        fixes="Raise max-num-seqs / max-num-batched-tokens until the running batch nears the ridge batch or the KV "
        "cache fills.",
        sources="Seed physics: ideal batch ~ ridge x (total/active params); " + _BATCH_SOURCES,
    ),
)
def batch_below_ridge(c: Check) -> Finding | None:
    running, waiting, rb = c.sig("server.running"), c.sig("server.waiting"), c.sig("theory.ridge_batch")
    assert running is not None and waiting is not None and rb is not None
    kv = c.sig("server.kv_usage")
    limit = c.t["batch_over_ridge"] * rb.values[0]
    if running.mean >= limit or waiting.mean < c.t["waiting_mean"]:
        return None
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None
    c.cite(running, "mean", "<", limit)
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
    gain, basis = batch_gain(c.ev, target=min(rb.values[0] / 2, running.mean + waiting.mean))
    c.fix("Raise the batch limit", f"Let the running batch grow toward {rb.values[0] / 2:.0f} sequences (vLLM "
          "--max-num-seqs); the queue shows the demand is there.", gain, basis)
    return c.finding(0.75, f"Only {running.mean:.1f} sequences run per step while {waiting.mean:.1f} wait; the "
                     f"ridge batch is {rb.values[0]:.0f}.")


@rule(
    code="BAT003",
    name="gpu-busy-under-half",
    limiter=Limiter.BATCHING,
    summary="The GPU is busy less than half the time (no queue metric to tell batching from a light load).",
    requires=(_BUSY,),
    uses=("server.waiting",),
    thresholds={
        "busy_mean": Threshold(0.50, "GPU busy fraction below which the GPU is underused"),
        "idle_below": Threshold(0.10, "below this the GPU is idle rather than underfed (IDLE001)"),
    },
    page=Page(
        detects="GPU busy between 10 % and 50 % of the window when no server queue metric is available.",
        why="A GPU that works less than half the time is limited by what feeds it, not by its roofs: batches too "
        "small, requests served one by one, or host work between launches. Faster hardware would idle more.",
        fixes="Batch more (see BAT001); if the load is simply light, see IDLE001. Attach with --port to read the "
        "queue and tell the two apart.",
        sources=_BATCH_SOURCES,
    ),
)
def gpu_busy_under_half(c: Check) -> Finding | None:
    if "server.waiting" in c.ev:
        return None  # BAT001/IDLE001 decide with the queue in view
    busy = busy_signal(c)
    assert busy is not None
    if not (c.t["idle_below"] <= busy.mean < c.t["busy_mean"]):
        return None
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    _batching_fixes(c, busy.mean)
    return c.finding(0.5, f"The GPU is busy only {busy.mean:.0%} of the time: it waits for work more than it does it.")


@rule(
    code="BAT004",
    name="busy-gpu-underfilled",
    limiter=Limiter.BATCHING,
    summary="The GPU always has a kernel running, but its SMs, DRAM and tensor pipes are mostly unused: each step's "
    "kernels are too small to fill it.",
    requires=("gpu.busy", "gpu.sm_active", "gpu.dram_active"),
    uses=("gpu.tensor_active", "server.running", "theory.ridge_batch"),
    thresholds={
        "busy_min": Threshold(0.80, "GPU busy fraction (a kernel running) at or above which the GPU looks busy"),
        "sm_max": Threshold(0.50, "SM activity below which most SMs idle while kernels run"),
        "dram_max": Threshold(0.50, "DRAM activity below which the memory interface is not what limits"),
        "tensor_max": Threshold(0.30, "tensor activity below which the math units are not what limits"),
    },
    page=Page(
        detects="NVML says a kernel runs at least 80 % of the time while GPM/DCGM say SMs are active under 50 %, DRAM "
        "under 50 % and the tensor pipes under 30 %. It stands back when the model's shape is known and the batch is "
        "far below the ridge batch: BW004 then names the same case from the physics.",
        why="'GPU utilisation' only says that some kernel was running. Small kernels (a batch-1 GEMV, a norm over one "
        "token) occupy a few SMs and move little data, so a GPU can be '100 % busy' at a quarter of its capacity. "
        "Measured on an H100: a batch-1 decode of a 2.4B model read 99.8 % busy, 27 % SM active, 29 % DRAM active, "
        "1 % tensor active; batch 16 on the same GPU gave 12.3x the tokens/s.",
        fixes="Put more sequences in each step (more concurrent requests, vLLM --max-num-seqs); give --model so that "
        "diagnoser can compute the bandwidth floor and the gain of each batch size.",
        sources="Seed 004 (the utilisation trap: nvidia-smi's utilisation is time-busy, not capacity); DCGM docs "
        "(SM_ACTIVE and DRAM_ACTIVE as capacity measures); Nsight Compute SOL 60 %.",
    ),
)
def busy_gpu_underfilled(c: Check) -> Finding | None:
    busy, sm, dram = c.sig("gpu.busy"), c.sig("gpu.sm_active"), c.sig("gpu.dram_active")
    assert busy is not None and sm is not None and dram is not None
    rb, batch = c.sig("theory.ridge_batch"), observed_batch(c.ev)
    if rb is not None and batch is not None and batch < 0.5 * rb.values[0]:
        return None  # the physics knows this case better (BW004)
    if busy.mean < c.t["busy_min"] or sm.mean >= c.t["sm_max"] or dram.mean >= c.t["dram_max"]:
        return None
    tensor = c.sig("gpu.tensor_active")
    if tensor is not None and tensor.mean >= c.t["tensor_max"]:
        return None
    c.cite(busy, "mean", ">=", c.t["busy_min"])
    c.cite(sm, "mean", "<", c.t["sm_max"])
    c.cite(dram, "mean", "<", c.t["dram_max"])
    if tensor is not None:
        c.cite(tensor, "mean", "<", c.t["tensor_max"])
    _batching_fixes(c, None)
    at = f" at {batch:.1f} sequences per step" if batch is not None else ""
    return c.finding(0.55, f"A kernel runs {busy.mean:.0%} of the time, but SMs are active {sm.mean:.0%} and DRAM "
                     f"{dram.mean:.0%}{at}: the kernels are too small to fill this GPU, so more work per step "
                     "costs little extra time.")


@rule(
    code="IDLE001",
    name="gpu-mostly-idle",
    limiter=Limiter.IDLE,
    summary="The GPU is nearly idle and nothing waits: the load is small for this GPU.",
    requires=(_BUSY,),
    uses=("server.waiting", "server.running", "gpu.power_w"),
    thresholds={
        "busy_mean": Threshold(0.10, "GPU busy fraction below which the GPU is idle"),
        "waiting_mean": Threshold(0.5, "mean queued requests below which nothing is waiting"),
    },
    page=Page(
        detects="GPU busy under 10 % of the window with no requests waiting (or no queue metric).",
        why="Nothing limits this server: it has little to do. The GPU is paid for and mostly idle; the question "
        "is right-sizing, not speed.",
        fixes="Consolidate models onto fewer GPUs, split the GPU with MIG or time-slicing, or move the model to a "
        "smaller GPU; scale replicas on queue depth rather than keeping them warm.",
        sources="Seed 004 (the utilisation trap); nvitop/DCGM practice of flagging idle allocations.",
    ),
)
def gpu_mostly_idle(c: Check) -> Finding | None:
    busy, waiting = busy_signal(c), c.sig("server.waiting")
    assert busy is not None
    if busy.mean >= c.t["busy_mean"]:
        return None
    if waiting is not None and waiting.mean >= c.t["waiting_mean"]:
        return None  # work is waiting: that is batching, not idleness
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    if waiting is not None:
        c.cite(waiting, "mean", "<", c.t["waiting_mean"])
    c.fix("Right-size the GPU", "Pack more models or replicas per GPU (MIG, time-slicing) or move this model to a "
          "smaller, cheaper GPU; scale replicas on queue depth.")
    batch = observed_batch(c.ev)
    return c.finding(0.8 if waiting is not None else 0.65, f"The GPU is busy {busy.mean:.0%} of the time"
                     + (f" with {batch:.1f} sequences running" if batch else "") + " and nothing waits: "
                     "the load is small for this GPU.")
