"""Host and launch rules: the GPU waits for the CPU (a saturated serving thread, launch gaps, syncs, copies).

Every gain here is an upper bound: removing a measured share s of idle time gives at most 1 / (1 - s), and no host
fix can make the GPU busier than all the time (1 / busy; the engine's judge enforces that bound on every host-side
fix).
"""

from __future__ import annotations

import re

from diagnoser import signals as S
from diagnoser.diagnosis import Finding, FixKind, GainKind, Limiter
from diagnoser.evidence import Evidence
from diagnoser.rules import gains
from diagnoser.rules.base import MEAN, P50, VALUE, AnyOf, Check, Gain, Page, Threshold, rule
from diagnoser.stacks import HotCode, hot_code
from diagnoser.traces.timeline import BLOCKS_HOST

_GRAPHS = "Capture the decode step in CUDA graphs (vLLM does by default unless --enforce-eager; torch.compile " \
    "mode='reduce-overhead'; SGLang --cuda-graph-max-bs) so one launch replaces hundreds."


_GRAPHS_TRAINING = ("Capture the training step (forward, backward, optimizer) in CUDA graphs: torch.compile "
                    "mode='reduce-overhead' or torch.cuda.make_graphed_callables, so one launch replaces hundreds.")
_GRAPHS_FORWARD = ("Capture the model's forward step in CUDA graphs (torch.compile mode='reduce-overhead', or "
                   "torch.cuda.CUDAGraph around a static-shape forward) so one launch replaces hundreds.")


def serves_llm(ev: Evidence) -> bool:
    """Whether the capture is of a language-model server (its engine's metrics, a model config, decode-like steps in
    the trace): advice about decode steps and vLLM/SGLang flags is for those only."""
    return (ev.meta.server_kind not in ("", "unknown") or ev.model is not None
            or (ev.trace is not None and ev.trace.decode_batch is not None)
            or any(name.startswith("server.") for name in ev.signals))


# A compiled graph's generated name ("## Call CompiledFxGraph fleput27pphh...q46 ##"): the hash names a cache entry,
# not code an operator can find.
_COMPILED_CALL = re.compile(r"#+\s*Call\s+(CompiledFxGraph|\w+)\s+[a-z0-9]{16,}\s*#+", re.IGNORECASE)
_HASH = re.compile(r"\s*\b(?=[a-z0-9]*\d)(?=[a-z0-9]*[a-z])[a-z0-9]{24,}\b")


def op_name(name: str) -> str:
    """A CPU op's name as a sentence cites it: a compiled graph's call without its cache hash."""
    named = _COMPILED_CALL.sub(lambda m: f"{m.group(1)} call", name)
    return _HASH.sub("", named).strip() or name


def held_by(ev: Evidence) -> str:
    """What the host was inside while the GPU waited for it (the trace's long CPU ops), when those ops hold a real
    part of that time, and how much of it no such op holds (shorter ops and launches, or Python between them)."""
    trace = ev.trace
    if trace is None:
        return ""
    waited = trace.idle_frac_by_cause.get("host", 0.0) + trace.idle_frac_by_cause.get("sync", 0.0)
    if waited <= 0:
        return ""
    # A call that blocks the host (a copy to pageable memory) is named first: it is the op that held it, and the CPU
    # ops around it (aten::to, copy_) only enclose it.
    held = sorted(trace.host_idle_ops.items(), key=lambda kv: BLOCKS_HOST not in kv[0])
    # Ops whose shares together exceed the time the host waited overlap: one runs inside the other (the aten op
    # and the kernel call it makes), so they are one share, cited once with the ops nested in it.
    top: list[tuple[list[str], float]] = []
    for name, frac in held:
        if frac < 0.1 * waited:
            continue
        if top and top[-1][1] + frac > waited + 1e-9:
            top[-1][0].append(name)
            continue
        if len(top) == 3:
            break
        top.append(([name], frac))
    short = (" shorter ops and launches, or Python between them (diagnoser attach samples the process's Python "
             "stacks, which name it)")
    if not top:
        return f" No CPU op or runtime call of 0.5 ms or more holds that time: it is in{short}."
    text = " The host was inside " + ", ".join(
        f"{op_name(names[0])} ({frac:.0%} of the window"
        + (f", with {', '.join(op_name(n) for n in names[1:])} nested in the same time)" if names[1:] else ")")
        for names, frac in top)
    rest = waited - sum(frac for _, frac in top)  # (ops nested without overlapping past it still undercount it)
    if rest >= 0.1:
        text += f"; about {rest:.0%} of the window more is in{short}"
    return text + "."


# CPU ops that hold a training step's host time, and what shortens them (PyTorch's DDP and optimizer options).
_HOST_OP_ADVICE = (
    (("flatten_dense_tensors", "unflatten_dense_tensors"),
     "DDP copies gradients into and out of its buckets on the host's path ({ops}): "
     "DistributedDataParallel(gradient_as_bucket_view=True) makes the buckets views instead of copies, and "
     "broadcast_buffers=False skips re-sending buffers each forward when they do not change."),
    (("_foreach_", "Optimizer.step", "SGD.step", "Adam.step", "AdamW.step"),
     "The optimizer step runs as many small launches ({ops}): a fused optimizer (fused=True: one kernel for all "
     "the parameters) or a compiled step (torch.compile) makes it a few kernels."),
)


def _known_host_ops(ev: Evidence) -> tuple[list[str], float]:
    """Advice for the named host ops that held the GPU's idle (2 % of the window or more), and the share of the
    window they held: per advice, the aten ops' shares summed (they do not nest in one another), or an enclosing
    annotation's (Optimizer.step around its foreach ops) where that is larger, so nothing is counted twice."""
    trace = ev.trace
    if trace is None:
        return [], 0.0
    held = {name: frac for name, frac in trace.host_idle_ops.items() if frac >= 0.02}
    out, share = [], 0.0
    for patterns, advice in _HOST_OP_ADVICE:
        ops = [name for name in held if any(p in name for p in patterns)]
        if ops:
            out.append(advice.format(ops=", ".join(ops[:2])))
            share += max(sum(held[n] for n in ops if n.startswith("aten::")),
                         max((held[n] for n in ops if not n.startswith("aten::")), default=0.0))
    return out, min(share, 1.0)


def _graphs_action(ev: Evidence) -> str:
    if ev.workload == "training":
        text = _GRAPHS_TRAINING
    elif serves_llm(ev):
        text = _GRAPHS
    else:
        text = _GRAPHS_FORWARD
    if ev.platform == "rocm":
        text = text.replace("CUDA graphs", "HIP graphs (torch.cuda.graphs works on ROCm)")
    return text


def _graphs_title(ev: Evidence) -> str:
    return "Launch with HIP graphs" if ev.platform == "rocm" else "Launch with CUDA graphs"


def _offload(c: Check, g: Gain, hot: HotCode | None = None) -> None:
    if hot is not None and hot.role == "model forward":
        # The stacks show the model's own forward on the serving thread: it cannot move to another thread (the next
        # step waits for it); what moves is how much host work each step of it costs.
        c.fix(FixKind.OFFLOAD_HOST_WORK, "Cut the host's cost of the model's forward", f"Start with {hot.function} "
              f"({hot.self_frac:.0%} of the samples of thread {hot.thread or '?'}, model forward by its frames): the "
              "model's own code runs on the serving thread and cannot move off it; make each step cost the host "
              "less: a fused attention backend (transformers' attn_implementation, or a serving engine's kernels), "
              "a static KV cache (cache_implementation=\"static\"), and compilation (torch.compile with "
              "mode=\"reduce-overhead\", which replays CUDA graphs) so one launch replaces hundreds of Python calls.",
              g)
        return
    if hot is not None:
        # The sampled stacks name the code: the fix starts from it.
        c.fix(FixKind.OFFLOAD_HOST_WORK, "Take the hot Python code off the serving loop", f"Start with "
              f"{hot.function} ({hot.self_frac:.0%} of the samples of thread {hot.thread or '?'}, "
              f"{hot.role or 'role unknown'} by its frames): move it to another process or thread, batch it, or "
              "make it cheaper (vectorise, cache, or drop per-step Python work); tokenise and detokenise outside "
              "the engine loop.", g)
        return
    if c.ev.workload == "training":
        known, share = _known_host_ops(c.ev)
        if known:
            # The trace names the ops that held the host: the advice for those, not a guess at data loading, and
            # the gain of removing the idle they hold, not all of it.
            c.fix(FixKind.OFFLOAD_HOST_WORK, "Shorten the host work the trace names", " ".join(known),
                  gains.removal(share, "the GPU's idle inside those ops"))
            return
        c.fix(FixKind.OFFLOAD_HOST_WORK, "Take host work off the training step's path", "Load and transform data in "
              "DataLoader workers (num_workers, pin_memory=True, prefetch), keep logging and metric reads "
              "(.item()) out of the step.", g)
        return
    if not serves_llm(c.ev):
        c.fix(FixKind.OFFLOAD_HOST_WORK, "Move CPU work off the loop that feeds the GPU", "Prepare inputs and format "
              "results in other processes or DataLoader workers (pin_memory=True, prefetch); keep Python work "
              "between forward steps out of the loop that launches the GPU work.", g)
        return
    c.fix(FixKind.OFFLOAD_HOST_WORK, "Move CPU work off the serving loop", "Tokenise, detokenise and post-process in "
          "other processes (vLLM's API server does); enable asynchronous scheduling and output processing; keep "
          "Python work out of the step.", g)


@rule(
    code="HOST001",
    name="serving-thread-saturated",
    limiter=Limiter.HOST_LAUNCH,
    summary="A thread of the server is pinned near 100 % of a core while the GPU is not fully busy.",
    requires=(S.HOST_TARGET_BUSIEST_THREAD, AnyOf(S.GPU_BUSY, S.GPU_SM_ACTIVE, S.TRACE_GPU_IDLE_FRAC)),
    uses=(S.HOST_TARGET_CPU,),
    reads={S.HOST_TARGET_BUSIEST_THREAD: (P50,), S.GPU_BUSY: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,), S.TRACE_GPU_IDLE_FRAC:
           (VALUE,)},
    thresholds={
        "thread_p50": Threshold(0.90, "busiest thread's share of one core (median) that counts as saturated",
                                "ratio"),
        "busy_max": Threshold(0.70, "GPU busy fraction below which the GPU is waiting on the host", "ratio"),
    },
    page=Page(
        detects="The target's busiest thread at or above {thread_p50} of one core for half the window while the GPU "
        "is busy less than {busy_max}.",
        why="Python serving loops (scheduling, sampling, detokenising, launching kernels) run on one thread; when "
        "that thread is saturated the GPU waits between steps however fast it is.",
        fixes=_GRAPHS + " Move tokenisation/detokenisation to other processes (vLLM's API server does), enable "
        "asynchronous scheduling/output processing, use a faster CPU. The gain is at most 1 / busy. When the "
        "target's Python stacks were sampled (py-spy, see docs/attach.md), the finding and the first fix name the "
        "busiest thread's hottest function and what it does (scheduler, tokenizer, detokenizer, sampling, model "
        "forward, data movement).",
        sources="Nsight Systems CPU-bound heuristics; nvitop-style per-thread CPU; MLPerf inference practice "
        "(CPUBottleneck: GPU < 10 % and CPU > 90 %).",
    ),
)
def serving_thread_saturated(c: Check) -> Finding | None:
    thread = c.req(S.HOST_TARGET_BUSIEST_THREAD)
    busy_sig = c.first(S.GPU_BUSY, S.GPU_SM_ACTIVE, S.TRACE_GPU_IDLE_FRAC)
    busy_frac = 1.0 - busy_sig.value if busy_sig.name == S.TRACE_GPU_IDLE_FRAC else busy_sig.mean
    if thread.p50 < c.t["thread_p50"] or busy_frac >= c.t["busy_max"]:
        return None
    c.cite(thread, "p50", ">=", c.t["thread_p50"])
    if busy_sig.name == S.TRACE_GPU_IDLE_FRAC:
        c.cite(busy_sig, "value")
    else:
        c.cite(busy_sig, "mean", "<", c.t["busy_max"])
    bound = gains.kept_busy(busy_frac)
    hot = hot_code(c.ev.stacks, limit=1)
    _offload(c, bound, hot[0] if hot else None)
    c.fix(FixKind.CUDA_GRAPHS, _graphs_title(c.ev), _graphs_action(c.ev), bound)
    where = f" Sampled stacks: {hot[0].cite()}." if hot else ""
    return c.finding(0.7, f"The server's busiest thread uses {thread.p50:.0%} of a core while the GPU is busy "
                     f"{busy_frac:.0%}: the host sets the pace.{where}")


@rule(
    code="HOST002",
    name="launch-gaps",
    limiter=Limiter.HOST_LAUNCH,
    summary="The trace shows the GPU idle because the host had not launched the next kernel yet.",
    requires=(S.TRACE_IDLE_HOST_FRAC,),
    uses=(S.TRACE_GPU_IDLE_FRAC, S.TRACE_KERNELS_PER_S, S.TRACE_IDLE_SYNC_FRAC),
    reads={S.TRACE_IDLE_HOST_FRAC: (VALUE,), S.TRACE_IDLE_SYNC_FRAC: (VALUE,)},
    thresholds={"host_idle_frac": Threshold(0.15, "share of the window idle waiting for launches", "ratio")},
    page=Page(
        detects="At least {host_idle_frac} of the traced window with the GPU idle while the host was still preparing "
        "the next launch (the gap ends at a kernel whose launch call started inside the gap).",
        why="Each idle gap is time the GPU could have worked; a host that launches slower than the GPU executes "
        "caps throughput at the host's pace.",
        fixes=_GRAPHS + " Fuse small ops (torch.compile), move Python work out of the step. Removing the gaps gives "
        "at most 1 / (1 - their share).",
        sources="HolisticTraceAnalysis idle-time breakdown (host wait); Nsight Systems gpu_gaps rule.",
    ),
)
def launch_gaps(c: Check) -> Finding | None:
    host = c.req(S.TRACE_IDLE_HOST_FRAC)
    if host.value < c.t["host_idle_frac"]:
        return None
    c.cite(host, "value", ">=", c.t["host_idle_frac"])
    g = gains.removal(host.value, "the host launch gaps")
    c.fix(FixKind.CUDA_GRAPHS, _graphs_title(c.ev), _graphs_action(c.ev), g)
    sync = c.opt(S.TRACE_IDLE_SYNC_FRAC)
    if FixKind.CUDA_GRAPHS in c.ev.in_place and sync is not None and sync.value > 0:
        # With the step replayed as a graph the host's time is not launch overhead but its own work, and the idle
        # after each sync is that work too (the sync returns as the GPU drains): removing the work removes both.
        c.cite(sync, "value")
        _offload(c, gains.removal(host.value + sync.value, f"the host's own work, the launch gaps ({host.value:.0%} "
                                  f"of the traced window) and the idle after each sync ({sync.value:.0%}) together "
                                  "(graphs are replayed, so it is not launch overhead)"))
    else:
        _offload(c, g)
    if c.ev.workload == "training":
        c.fix(FixKind.LARGER_BATCH, "Give each GPU a larger batch", "A larger per-GPU batch (or fewer, larger "
              "micro-batches) gives every launch more work, so the host's per-step cost is spread over more "
              "samples.", g)
    return c.finding(0.5 + min(0.4, host.value), f"The GPU sat idle {host.value:.0%} of the traced window "
                     "waiting for the host to launch work." + held_by(c.ev))


@rule(
    code="HOST003",
    name="small-kernel-storm",
    limiter=Limiter.HOST_LAUNCH,
    summary="Most kernels are shorter than their own launch call and no graphs are replayed.",
    requires=(S.TRACE_SHORT_KERNEL_FRAC, S.TRACE_CUDA_GRAPH_LAUNCHES),
    uses=(S.TRACE_KERNELS_PER_S, S.TRACE_IDLE_HOST_FRAC, S.TRACE_GPU_IDLE_FRAC),
    reads={S.TRACE_SHORT_KERNEL_FRAC: (VALUE,), S.TRACE_CUDA_GRAPH_LAUNCHES: (VALUE,), S.TRACE_IDLE_HOST_FRAC:
           (VALUE,)},
    thresholds={"short_kernel_frac": Threshold(0.50, "share of kernels shorter than their launch call", "ratio")},
    page=Page(
        detects="At least {short_kernel_frac} of the kernels run for less time than the CPU spends launching them, "
        "with no graph launch in the trace.",
        why="When a kernel is shorter than its launch, the GPU drains faster than the host fills it; the run is "
        "launch-bound no matter how fast the GPU is.",
        fixes=_GRAPHS + " Fuse elementwise chains with torch.compile.",
        sources="XProf kernel-launch share; HTA kernel launch statistics (short kernels).",
    ),
)
def small_kernel_storm(c: Check) -> Finding | None:
    short, graphs = c.req(S.TRACE_SHORT_KERNEL_FRAC), c.req(S.TRACE_CUDA_GRAPH_LAUNCHES)
    if short.value < c.t["short_kernel_frac"] or graphs.value > 0:
        return None
    c.cite(short, "value", ">=", c.t["short_kernel_frac"])
    c.cite(graphs, "value", "=", 0)
    idle = c.opt(S.TRACE_GPU_IDLE_FRAC)
    host = c.opt(S.TRACE_IDLE_HOST_FRAC)
    g = gains.removal(host.value, "the host launch gaps") if host is not None else Gain.unknown(
        "the idle time the launches cause is not attributed in this trace")
    c.fix(FixKind.CUDA_GRAPHS, _graphs_title(c.ev), _graphs_action(c.ev), g)
    if idle is not None:
        # Sized from the same launch gaps as the graphs: a host-side gain, so no more than keeping the GPU busy all
        # the time (the judge bounds kernel-side fixes only by the floor). An H200 eager decode read 19.6x here
        # against the 11.3x of 1 / busy.
        bound = gains.host_bound(c.ev)
        c.fix(FixKind.FUSE_KERNELS, "Fuse the short kernels", "Fuse elementwise chains (torch.compile) so fewer, "
              "longer kernels are launched.", g.bounded(*bound) if bound is not None else g)
    return c.finding(0.6, f"{short.value:.0%} of kernels are shorter than their launch and no graph is replayed: "
                     "launch overhead dominates.")


def blocking_call(ev: Evidence, waited: float) -> tuple[str, float] | None:
    """The call that blocked the host longest while the GPU waited (a copy to pageable memory), when it holds a real
    part of that wait (a tenth or more), with its share of the window."""
    trace = ev.trace
    if trace is None or waited <= 0:
        return None
    calls = [(name, frac) for name, frac in trace.host_idle_ops.items() if BLOCKS_HOST in name and frac >= 0.1 * waited]
    return max(calls, key=lambda kv: kv[1]) if calls else None


def _unsynced(c: Check, sync: float) -> Gain:
    """Without the sync the host runs ahead, so its work overlaps the GPU's; it does not vanish. Host work hides
    only behind GPU work: the step is at least the longer of the two. The host's share is at least the idle it
    caused (launch gaps and the time after each sync), the GPU's its busy share: 1 / max(host, busy). On the H100
    host-bound decode: 1 / max(0.63, 0.34) = 1.6x; on the launch-bound one, 1 / 0.96: nothing."""
    idle, host = c.opt(S.TRACE_GPU_IDLE_FRAC), c.opt(S.TRACE_IDLE_HOST_FRAC)
    if idle is None:
        return Gain.unknown("the trace's busy time is not known")
    c.cite(idle, "value")
    waited = sync + (host.value if host is not None else 0.0)
    if host is not None:
        c.cite(host, "value")
    busy = 1.0 - idle.value
    longer = max(waited, busy)
    if longer <= 0:
        return Gain.unknown("the trace holds no busy or host time")
    return gains.capped(Gain(1.0 / longer, f"the host's work overlapped with the GPU's: the host caused {waited:.0%} "
                             f"of the window as idle, the GPU was busy {busy:.0%}; the step lasts at least the "
                             f"longer, 1 / {longer:.2f}", GainKind.UPPER_BOUND))


@rule(
    code="SYNC001",
    name="host-sync-stalls",
    limiter=Limiter.HOST_LAUNCH,
    summary="The GPU idles in gaps that begin with the host in a synchronisation or a blocking copy.",
    requires=(S.TRACE_IDLE_SYNC_FRAC,),
    uses=(S.TRACE_IDLE_HOST_FRAC, S.TRACE_GPU_IDLE_FRAC),
    reads={S.TRACE_GPU_IDLE_FRAC: (VALUE,), S.TRACE_IDLE_HOST_FRAC: (VALUE,), S.TRACE_IDLE_SYNC_FRAC: (VALUE,)},
    thresholds={"sync_idle_frac": Threshold(0.10, "share of the window idle after host synchronisations", "ratio")},
    page=Page(
        detects="At least {sync_idle_frac} of the traced window idle around cudaStreamSynchronize / "
        "cudaDeviceSynchronize / blocking copies (`.item()`, `.cpu()`, `.tolist()`).",
        why="A sync empties the GPU's queue: the host waits for the GPU, then the GPU waits for the host to launch "
        "again. In a decode loop this happens every step.",
        fixes="Keep sampling and stopping checks on the GPU; read results back once per step with non_blocking "
        "copies into pinned buffers; overlap the next step's launch with the copy (async scheduling). The sync "
        "itself returns as soon as the GPU drains; the idle after it is the host's own work, which removing the "
        "sync lets run beside the GPU's, not vanish. Host work hides only behind GPU work, so the step still lasts "
        "as long as the longer of the two: the gain is at most 1 / max(host-caused idle, GPU busy). Removing the "
        "host work itself is the other fix (HOST001, HOST002).",
        sources="Nsight Systems sync-API rule; HTA idle breakdown.",
    ),
)
def host_sync_stalls(c: Check) -> Finding | None:
    sync = c.req(S.TRACE_IDLE_SYNC_FRAC)
    if sync.value < c.t["sync_idle_frac"]:
        return None
    c.cite(sync, "value", ">=", c.t["sync_idle_frac"])
    blocking = blocking_call(c.ev, sync.value)
    if blocking is not None:
        # The trace names the read-back that blocks: the fix starts from it.
        name, frac = blocking
        c.fix(FixKind.REMOVE_SYNCS, "Stop the blocking read-back", f"The host waits in {name} for {frac:.0%} of the "
              "window: copy into a pinned buffer with non_blocking=True and wait on its event only where the values "
              "are used, or move the read-back off the step's path (pipeline the input one batch ahead, e.g. "
              "TorchRec's TrainPipelineSparseDist for the all-to-all's sizes).", _unsynced(c, sync.value))
    else:
        c.fix(FixKind.REMOVE_SYNCS, "Remove per-step host syncs", "Avoid .item()/.cpu()/.tolist() inside the step; "
              "copy results with non_blocking=True into pinned memory and read them one step later.",
              _unsynced(c, sync.value))
    return c.finding(0.5 + min(0.4, sync.value), f"The GPU idled {sync.value:.0%} of the traced window in gaps "
                     "that began with the host in a synchronisation or a blocking copy: the GPU had nothing queued "
                     "until the host returned and launched again." + held_by(c.ev))


@rule(
    code="COPY001",
    name="pageable-memcpy",
    limiter=Limiter.HOST_LAUNCH,
    summary="Copies from pageable host memory stall the GPU.",
    requires=(S.TRACE_IDLE_PAGEABLE_MEMCPY_FRAC,),
    reads={S.TRACE_IDLE_PAGEABLE_MEMCPY_FRAC: (VALUE,)},
    thresholds={"pageable_idle_frac": Threshold(0.05, "share of the window idle around pageable copies", "ratio")},
    page=Page(
        detects="At least {pageable_idle_frac} of the traced window idle around host-to-device copies from pageable "
        "memory.",
        why="A copy from pageable memory is staged through a driver buffer and is synchronous with respect to the "
        "host; it cannot overlap compute.",
        fixes="Allocate host tensors with pin_memory=True and copy with non_blocking=True.",
        sources="Nsight Systems cuda-async-memcpy / pageable memcpy rule.",
    ),
)
def pageable_memcpy(c: Check) -> Finding | None:
    frac = c.req(S.TRACE_IDLE_PAGEABLE_MEMCPY_FRAC)
    if frac.value < c.t["pageable_idle_frac"]:
        return None
    c.cite(frac, "value", ">=", c.t["pageable_idle_frac"])
    c.fix(FixKind.PIN_MEMORY, "Pin host buffers", "pin_memory=True on host tensors that feed the GPU; "
          ".to(device, non_blocking=True).", gains.removal(frac.value, "the idle time around pageable copies"))
    return c.finding(0.5, f"Copies from pageable memory left the GPU idle {frac.value:.0%} of the window.")


RULES = (serving_thread_saturated, launch_gaps, small_kernel_storm, host_sync_stalls, pageable_memcpy)
