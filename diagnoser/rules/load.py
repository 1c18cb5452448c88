"""Load rules: batching-limited (the GPU waits for work it could have had) and idle / over-provisioned."""

from __future__ import annotations

from diagnoser import signals as S
from diagnoser.diagnosis import Benefit, Finding, FixKind, Limiter
from diagnoser.engines.tables import engine_label, flag_of
from diagnoser.evidence import Signal
from diagnoser.physics import MigSlice, mig_slice
from diagnoser.rules import formula as fm
from diagnoser.rules import gains
from diagnoser.rules.base import MEAN, P90, VALUE, AnyOf, Check, Gain, Page, Threshold, rule

_BUSY = AnyOf(S.GPU_BUSY, S.GPU_SM_ACTIVE)
# The same, as the fleet's formulas read it (busy_signal): recorded once by the rule group.
BUSY = fm.Named("busy", fm.Read(S.GPU_BUSY, MEAN) | fm.Read(S.GPU_SM_ACTIVE, MEAN))
_IDLE = (BUSY < fm.Bar("busy_mean")).unless(fm.Read(S.SERVER_WAITING, MEAN) >= fm.Bar("waiting_mean"))
_BATCH_SOURCES = "Seed physics: 'if the GPU is busy < 50 % of the time, fix batching before hardware'; Nsight " \
    "Systems gpu_time_util flags < 50 % busy; torch-tb-profiler's GPU utilisation < 50 % rule."


def busy_signal(c: Check) -> Signal:
    """The best 'was the GPU working' signal: time-busy first, since SM activity also drops on small kernels."""
    return c.first(S.GPU_BUSY, S.GPU_SM_ACTIVE)


def _batching_fixes(c: Check, busy: float | None) -> None:
    g = gains.batch_gain(c.ev, factor=4.0, raises_limit=True)
    if g.value is None and busy:
        g = gains.kept_busy(busy)
        want, batch = gains.demand(c.ev), c.ev.observed_batch()
        if want is not None and batch:
            g = g.bounded(want / batch, f"no more than the demand ({want:.0f} sequences for {batch:.0f} running)")
        if c.ev.waiting() is None:
            g = g.as_capacity("no queue metric: a gain only if requests are waiting")
    c.fix(FixKind.BATCH_MORE, "Let the scheduler batch more", "Raise the concurrent-sequence limit (vLLM "
          "--max-num-seqs, --max-num-batched-tokens; TGI --max-batch-total-tokens; Triton dynamic batching "
          "max_queue_delay) and check the client sends requests concurrently.", g)
    c.fix(FixKind.CONTINUOUS_BATCHING, "Use continuous batching", "Serve through an engine that schedules per "
          "iteration (vLLM, SGLang, TGI) rather than one request per forward pass.")


@rule(
    code="BAT001",
    name="gpu-idle-while-requests-wait",
    limiter=Limiter.BATCHING,
    summary="The GPU is busy less than half the time while requests sit in the queue.",
    requires=(_BUSY, S.SERVER_WAITING),
    uses=(S.SERVER_RUNNING, S.SERVER_KV_USAGE),
    reads={S.GPU_BUSY: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,), S.SERVER_WAITING: (MEAN,), S.SERVER_KV_USAGE: (P90,)},
    thresholds={
        "busy_mean": Threshold(0.50, "GPU busy fraction below which the GPU is underused", "ratio"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand is there", "requests"),
        "kv_usage_max": Threshold(0.90, "KV use (p90) above which the KV cache, not the scheduler, holds the queue "
                                  "(VRAM001)", "ratio"),
    },
    page=Page(
        detects="GPU busy under {busy_mean} of the window while on average at least {waiting_mean} waits in the queue, "
        "and the KV cache has room (under {kv_usage_max}).",
        why="The work is there but does not reach the GPU: the scheduler admits too few sequences per step, or "
        "requests are served one at a time. Every idle moment is throughput lost for nothing.",
        fixes="Raise the batch limits (max-num-seqs, max-num-batched-tokens), use continuous batching, check the "
        "client's concurrency. The gain is bounded by the demand (running + waiting) and by 1 / busy.",
        sources=_BATCH_SOURCES,
    ),
)
def gpu_idle_while_requests_wait(c: Check) -> Finding | None:
    busy, waiting = busy_signal(c), c.req(S.SERVER_WAITING)
    if busy.mean >= c.t["busy_mean"] or waiting.mean < c.t["waiting_mean"]:
        return None
    kv = c.opt(S.SERVER_KV_USAGE)
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None  # the queue waits for KV memory: VRAM001
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
    _batching_fixes(c, busy.mean)
    return c.finding(0.85, f"The GPU is busy {busy.mean:.0%} of the time while {waiting.mean:.1f} requests wait "
                     "on average: work is queued but not batched.")


@rule(
    code="BAT002",
    name="batch-far-below-ridge-under-load",
    limiter=Limiter.BATCHING,
    summary="Requests wait while the running batch is far below the batch the GPU could serve efficiently.",
    requires=(S.SERVER_RUNNING, S.SERVER_WAITING, S.THEORY_RIDGE_BATCH),
    uses=(S.SERVER_KV_USAGE,),
    reads={S.SERVER_RUNNING: (MEAN,), S.SERVER_WAITING: (MEAN,), S.THEORY_RIDGE_BATCH: (VALUE,), S.SERVER_KV_USAGE:
           (P90,)},
    thresholds={
        "batch_over_ridge": Threshold(0.25, "running batch below this fraction of the ridge batch counts as small"),
        "waiting_mean": Threshold(1.0, "mean queued requests that show demand is there", "requests"),
        "kv_usage_max": Threshold(0.90, "KV use above which memory, not the scheduler, caps the batch (VRAM001)",
                                  "ratio"),
    },
    page=Page(
        detects="A running batch under {batch_over_ridge} of the ridge batch while requests wait and the KV cache "
        "has room (under {kv_usage_max}).",
        why="Decode intensity rises with the batch until the ridge; below it each step reads all weights for few "
        "tokens. With requests waiting and memory free, the scheduler's limit is what holds the batch down.",
        fixes="Raise max-num-seqs / max-num-batched-tokens until the running batch nears the ridge batch or the KV "
        "cache fills.",
        sources="Seed physics: ideal batch ~ ridge x (total/active params); " + _BATCH_SOURCES,
    ),
)
def batch_below_ridge(c: Check) -> Finding | None:
    running, waiting, rb = c.req(S.SERVER_RUNNING), c.req(S.SERVER_WAITING), c.req(S.THEORY_RIDGE_BATCH)
    kv = c.opt(S.SERVER_KV_USAGE)
    limit = c.t["batch_over_ridge"] * rb.value
    if running.mean >= limit or waiting.mean < c.t["waiting_mean"]:
        return None
    if kv is not None and kv.p90 >= c.t["kv_usage_max"]:
        return None
    c.cite(running, "mean", "<", limit)
    c.cite(waiting, "mean", ">=", c.t["waiting_mean"])
    if kv is not None:
        c.cite(kv, "p90", "<", c.t["kv_usage_max"])
    engine = c.ev.serving.engine
    flag = f"{engine_label(engine)} {flag_of(engine, 'max_num_seqs', '--max-num-seqs')}"
    c.fix(FixKind.BATCH_MORE, "Raise the batch limit", f"Let the running batch grow toward {rb.value / 2:.0f} "
          f"sequences ({flag}); the queue shows the demand is there.",
          gains.batch_gain(c.ev, target=min(rb.value / 2, running.mean + waiting.mean), raises_limit=True))
    return c.finding(0.75, f"Only {running.mean:.1f} sequences run per step while {waiting.mean:.1f} wait; the "
                     f"ridge batch is {rb.value:.0f}.")


@rule(
    code="BAT003",
    name="gpu-busy-under-half",
    limiter=Limiter.BATCHING,
    summary="The GPU is busy less than half the time (no queue metric to tell batching from a light load).",
    requires=(_BUSY,),
    uses=(S.SERVER_WAITING,),
    reads={S.GPU_BUSY: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,)},
    fleet=((BUSY >= fm.Bar("idle_below")) < fm.Bar("busy_mean")).unless(fm.Present(S.SERVER_WAITING)).valued(0.5),
    thresholds={
        "busy_mean": Threshold(0.50, "GPU busy fraction below which the GPU is underused", "ratio"),
        "idle_below": Threshold(0.10, "below this the GPU is idle rather than underfed (IDLE001)", "ratio"),
    },
    page=Page(
        detects="GPU busy between {idle_below} and {busy_mean} of the window when no server queue metric is "
        "available.",
        why="A GPU that works less than half the time is limited by what feeds it, not by its roofs: batches too "
        "small, requests served one by one, or host work between launches. Faster hardware would idle more.",
        fixes="Batch more (see BAT001); if the load is simply light, see IDLE001. Attach with --port to read the "
        "queue and tell the two apart.",
        sources=_BATCH_SOURCES,
    ),
)
def gpu_busy_under_half(c: Check) -> Finding | None:
    if c.opt(S.SERVER_WAITING) is not None:
        return None  # BAT001/IDLE001 decide with the queue in view
    busy = busy_signal(c)
    if not (c.t["idle_below"] <= busy.mean < c.t["busy_mean"]):
        return None
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    if c.ev.workload == "training":
        c.fix(FixKind.LARGER_BATCH, "Give each GPU a larger batch", "A larger per-GPU batch (or gradient "
              "accumulation) gives every launch and every host step more work.",
              gains.kept_busy(busy.mean))
    else:
        _batching_fixes(c, busy.mean)
    return c.finding(0.5, f"The GPU is busy only {busy.mean:.0%} of the time: it waits for work more than it does it.")


def _mig(c: Check) -> tuple[bool, MigSlice | None]:
    """Whether the target runs in a MIG instance, and its profile when a name carries it (NVML names the instance,
    dcgm-exporter's profile label is appended to the GPU's name)."""
    for gpu in c.ev.meta.gpus:
        for name in (gpu.mig_instance, gpu.name):
            found = mig_slice(name) if name else None
            if found is not None:
                return True, found
        if gpu.mig_mode:
            return True, None
    return False, None


def _right_size_action(c: Check) -> str:
    """Where the idle capacity can go: a MIG split only where a smaller slice exists (a one-slice profile such as
    1g.10gb is already the least a GPU splits into)."""
    in_mig, found = _mig(c)
    if found is not None and found.smallest:
        return (f"This is already the smallest MIG slice ({found.profile}): no profile splits it further. Pack more "
                "models or replicas into it (several models in one server, time-slicing), or move this load onto a "
                "slice or GPU it shares with other work; scale replicas on queue depth.")
    if found is not None:
        return (f"Move this model to a smaller MIG profile than {found.profile} (down to one compute slice, 1g) or "
                "pack more models or replicas into this one (time-slicing); scale replicas on queue depth.")
    if in_mig:
        return ("Pack more models or replicas into this MIG instance (time-slicing), or give it a smaller profile if "
                "it has more than one compute slice (its profile was not read); scale replicas on queue depth.")
    return ("Pack more models or replicas per GPU (MIG, time-slicing) or move this model to a smaller, cheaper GPU; "
            "scale replicas on queue depth.")


@rule(
    code="IDLE001",
    name="gpu-mostly-idle",
    limiter=Limiter.IDLE,
    summary="The GPU is nearly idle and nothing waits: the load is small for this GPU.",
    requires=(_BUSY,),
    uses=(S.SERVER_WAITING, S.SERVER_RUNNING, S.GPU_POWER_W),
    reads={S.GPU_BUSY: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,), S.SERVER_WAITING: (MEAN,)},
    fleet=(_IDLE & fm.Present(S.SERVER_WAITING)).valued(0.8) | _IDLE.valued(0.65),
    thresholds={
        "busy_mean": Threshold(0.10, "GPU busy fraction below which the GPU is idle", "ratio"),
        "waiting_mean": Threshold(0.5, "mean queued requests below which nothing is waiting", "requests"),
    },
    page=Page(
        detects="GPU busy under {busy_mean} of the window with no requests waiting (or no queue metric).",
        why="Nothing limits this server: it has little to do. The GPU is paid for and mostly idle; the question "
        "is right-sizing, not speed.",
        fixes="Consolidate models onto fewer GPUs, split the GPU with MIG or time-slicing, or move the model to a "
        "smaller GPU; scale replicas on queue depth rather than keeping them warm. On a MIG instance a smaller "
        "profile is offered only where one exists: a one-compute-slice profile (1g.5gb, 1g.6gb, 1g.10gb, ...) is "
        "the least its GPU splits into, so there the fix is to share the slice.",
        sources="Seed 004 (the utilisation trap); nvitop/DCGM practice of flagging idle allocations.",
    ),
)
def gpu_mostly_idle(c: Check) -> Finding | None:
    busy, waiting = busy_signal(c), c.opt(S.SERVER_WAITING)
    if busy.mean >= c.t["busy_mean"]:
        return None
    if waiting is not None and waiting.mean >= c.t["waiting_mean"]:
        return None  # work is waiting: that is batching, not idleness
    c.cite(busy, "mean", "<", c.t["busy_mean"])
    if waiting is not None:
        c.cite(waiting, "mean", "<", c.t["waiting_mean"])
    c.fix(FixKind.RIGHT_SIZE, "Right-size the GPU", _right_size_action(c),
          Gain(None, "frees GPU time rather than speeding anything up", benefit=Benefit.COST))
    batch = c.ev.observed_batch()
    return c.finding(0.8 if waiting is not None else 0.65, f"The GPU is busy {busy.mean:.0%} of the time"
                     + (f" with {batch:.1f} sequences running" if batch else "")
                     + (" and nothing waits" if waiting is not None else " (no queue metric was read)")
                     + ": the load is small for this GPU.")


RULES = (gpu_idle_while_requests_wait, batch_below_ridge, gpu_busy_under_half, gpu_mostly_idle)
