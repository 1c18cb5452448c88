"""Hardware rules: throttled clocks, saturated interconnects, and GPU errors."""

from __future__ import annotations

from diagnoser import signals as S
from diagnoser.diagnosis import Benefit, Finding, FixKind, GainKind, Limiter
from diagnoser.evidence import Evidence
from diagnoser.rules import formula as fm
from diagnoser.rules import gains
from diagnoser.rules.base import FRAC_ABOVE, MAX, MEAN, P90, VALUE, AnyOf, Check, Gain, Page, Threshold, rule

# THR001 as a formula: the larger throttled share (power or heat) at or above the bar with the clock below its bar,
# unless the GPU is nearly idle; stronger the lower the clock. The value is the clock's share where it fires.
_WORST_THROTTLE = fm.Named("throttled_frac", fm.Larger(fm.Read(S.GPU_THROTTLE_POWER, "frac_above:0.5"),
                                                         fm.Read(S.GPU_THROTTLE_THERMAL, "frac_above:0.5")))
_THROTTLED = ((fm.Read(S.GPU_SM_CLOCK_FRAC, MEAN) < fm.Bar("clock_frac_mean"))
              & (_WORST_THROTTLE >= fm.Bar("throttled_frac"))).unless(fm.Read(S.GPU_BUSY, MEAN) < 0.3)


@rule(
    code="THR001",
    name="clocks-throttled",
    limiter=Limiter.THROTTLING,
    summary="Clocks are held below their maximum by the power cap or a thermal slowdown while the GPU works.",
    requires=(AnyOf(S.GPU_THROTTLE_POWER, S.GPU_THROTTLE_THERMAL), S.GPU_SM_CLOCK_FRAC),
    uses=(S.GPU_BUSY, S.GPU_POWER_W, S.GPU_POWER_LIMIT_W, S.GPU_POWER_DEFAULT_LIMIT_W, S.GPU_TEMP_C,
          S.GPU_THROTTLE_BRAKE),
    reads={S.GPU_SM_CLOCK_FRAC: (MEAN,), S.GPU_THROTTLE_POWER: (FRAC_ABOVE,), S.GPU_THROTTLE_THERMAL: (FRAC_ABOVE,),
           S.GPU_THROTTLE_BRAKE: (FRAC_ABOVE,), S.GPU_BUSY: (MEAN,), S.GPU_POWER_LIMIT_W: (MAX,),
           S.GPU_POWER_DEFAULT_LIMIT_W: (MAX,)},
    fleet=0.5 + fm.Clamp((fm.Bar("clock_frac_mean") - _THROTTLED) * 2, high=0.4),
    thresholds={
        "throttled_frac": Threshold(0.20, "share of samples with a power or thermal clock event reason", "ratio"),
        "clock_frac_mean": Threshold(0.90, "SM clock over max (mean) below which throttling costs speed", "ratio"),
        "lowered_cap": Threshold(0.97, "enforced power limit over the board's default below which the cap was "
                                 "lowered", "ratio"),
    },
    page=Page(
        detects="A power-cap or thermal clock event reason in at least {throttled_frac} of the samples with the SM "
        "clock below {clock_frac_mean} of its maximum on average.",
        why="Compute throughput scales with the SM clock; a GPU held at 70 % clock does at most 70 % of its work. "
        "Power capping at the board's default limit is normal under heavy tensor load (the GPU is power-bound, not "
        "misconfigured); a cap lowered below the default (under {lowered_cap} of it) or a thermal slowdown costs "
        "throughput that can be had back.",
        fixes="Compare the enforced power limit with the board's default (nvidia-smi -q -d POWER); restore the "
        "default if a site policy lowered it; check cooling and inlet temperature for thermal slowdowns. A HW "
        "power brake (clock event bit 0x80) is asserted from outside the GPU, by the power supply or the BMC: the "
        "GPU's limit is not the cause; check the node's power supplies and the BMC's power capping and event log.",
        sources="NVML clock event reasons (nvmlDeviceGetCurrentClocksEventReasons) and default power limit "
        "(nvmlDeviceGetPowerManagementDefaultLimit); DCGM clock-event reasons and POWER/THERMAL_VIOLATION.",
    ),
)
def clocks_throttled(c: Check) -> Finding | None:
    clock = c.req(S.GPU_SM_CLOCK_FRAC)
    reasons = [s for s in (c.opt(S.GPU_THROTTLE_POWER), c.opt(S.GPU_THROTTLE_THERMAL)) if s is not None]
    worst = max(reasons, key=lambda s: s.frac_above(0.5))
    throttled = worst.frac_above(0.5)
    busy = c.opt(S.GPU_BUSY)
    if throttled < c.t["throttled_frac"] or clock.mean >= c.t["clock_frac_mean"]:
        return None
    if busy is not None and busy.mean < 0.3:
        return None  # an idle GPU's clocks do not matter
    c.cite(worst, "frac_above:0.5", ">=", c.t["throttled_frac"])
    c.cite(clock, "mean", "<", c.t["clock_frac_mean"])
    thermal = worst.name == S.GPU_THROTTLE_THERMAL
    brake = c.opt(S.GPU_THROTTLE_BRAKE)
    bound = Gain(1.0 / max(0.3, clock.mean), f"compute scales with the SM clock: 1 / {clock.mean:.0%} clock "
                                             "(memory-bound work gains less)", GainKind.UPPER_BOUND)
    if not thermal and brake is not None and brake.frac_above(0.5) >= c.t["throttled_frac"]:
        # The brake is asserted from outside the GPU: its power limit is not the cause, the node's power is.
        c.cite(brake, "frac_above:0.5", ">=", c.t["throttled_frac"])
        c.fix(FixKind.POWER_COOLING, "Check the node's power supply", "The HW power brake (asserted by the power "
              "supply or the BMC, not the GPU's power limit) holds clocks down: check the node's PSUs and their "
              "redundancy, the BMC's power capping policy and its event log; nvidia-smi -q -d PERFORMANCE shows "
              "'HW Power Brake Slowdown: Active' while it holds.", bound)
        return c.finding(0.5 + min(0.4, (c.t["clock_frac_mean"] - clock.mean) * 2),
                         f"The HW power brake was asserted for {brake.frac_above(0.5):.0%} of the window and the "
                         f"SM clock averaged {clock.mean:.0%} of its maximum over it: the brake comes from outside "
                         "the GPU (power supply or BMC), not from its power limit.")
    limit, default = c.opt(S.GPU_POWER_LIMIT_W), c.opt(S.GPU_POWER_DEFAULT_LIMIT_W)
    lowered = None
    if not thermal and limit is not None and default is not None and default.max > 0:
        lowered = limit.max < c.t["lowered_cap"] * default.max
        c.cite(limit, "max", "<" if lowered else ">=", c.t["lowered_cap"] * default.max)
        c.cite(default, "max")
    if thermal:
        c.fix(FixKind.POWER_COOLING, "Cool the GPU", f"A thermal slowdown acted for {throttled:.0%} of the window "
              f"(the SM clock averaged {clock.mean:.0%} of max): check airflow, fan speeds and inlet temperature.",
              bound)
        what = "thermal slowdown"
    elif lowered:
        c.fix(FixKind.POWER_COOLING, "Restore the default power limit", f"The enforced limit ({limit.max:.0f} W) "  # type: ignore[union-attr]
              f"is below the board's default ({default.max:.0f} W): nvidia-smi -pl {default.max:.0f}, or lift the "  # type: ignore[union-attr]
              "site power policy.", bound)
        what = "lowered power cap"
    else:
        what = "power cap"
        if lowered is None:
            c.fix(FixKind.POWER_COOLING, "Check the enforced power limit", "Compare the enforced limit with the "
                  "board's default (nvidia-smi -q -d POWER): a limit lowered by a site policy costs clock speed; at "
                  "the default, the GPU is simply power-bound under this load.",
                  Gain.unknown("the enforced or default power limit was not read, so whether the cap was lowered is "
                               f"not known; if it was, up to 1 / {clock.mean:.0%} clock"))
    strength = 0.5 + min(0.4, (c.t["clock_frac_mean"] - clock.mean) * 2)
    if lowered is False:
        return c.finding(min(strength, 0.45), f"The board's default power cap ({default.max:.0f} W) held the "  # type: ignore[union-attr]
                         f"clocks down for {throttled:.0%} of the window, the SM clock averaging {clock.mean:.0%} of "
                         "its maximum: the GPU is power-bound under this load, which is how it is built to run, not "
                         "a setting to restore.")
    # The share is of the window's samples, the clock a mean over all of them: during the event it ran lower still.
    return c.finding(strength, f"The {what} held the clocks down for {throttled:.0%} of the window, the SM clock "
                     f"averaging {clock.mean:.0%} of its maximum over it.")


@rule(
    code="NET001",
    name="communication-bound",
    limiter=Limiter.INTERCONNECT,
    summary="Communication kernels (NCCL) take a large share of GPU time.",
    requires=(S.TRACE_SHARE_COMM,),
    uses=(S.TRACE_COMM_EXPOSED_FRAC,),
    reads={S.TRACE_SHARE_COMM: (VALUE,), S.TRACE_COMM_EXPOSED_FRAC: (VALUE,)},
    thresholds={"comm_share": Threshold(0.30, "share of GPU busy time in communication kernels", "ratio")},
    page=Page(
        detects="NCCL/communication kernels at or above {comm_share} of GPU busy time in the trace.",
        why="In tensor-parallel serving every layer ends in an all-reduce; over PCIe or a slow NVLink these "
        "dominate each step and more GPUs make it worse. In data-parallel training the gradient all-reduce costs "
        "time only where no backward compute overlaps it.",
        fixes="Serving: fewer tensor-parallel ranks (more replicas instead), TP only inside one NVLink domain, "
        "custom all-reduce kernels. Training: overlap the all-reduce with backward (DDP bucket_cap_mb, gradient "
        "compression or PowerSGD comm hooks), and balance the ranks. Removing the exposed (not overlapped) "
        "communication gives at most 1 / (1 - its share); overlapping it, at most 1 / max(share, 1 - share), as "
        "the step cannot be shorter than its communication.",
        sources="XProf collectives rule (>= 30 %); torch-tb-profiler communication > 10 % rule.",
    ),
)
def communication_bound(c: Check) -> Finding | None:
    comm = c.req(S.TRACE_SHARE_COMM)
    if comm.value < c.t["comm_share"]:
        return None
    c.cite(comm, "value", ">=", c.t["comm_share"])
    exposed = c.opt(S.TRACE_COMM_EXPOSED_FRAC)
    if exposed is not None:
        c.cite(exposed, "value")
        g = gains.removal(exposed.value, "the communication time no compute overlaps")
    else:
        g = Gain(1.0 / max(0.05, 1.0 - comm.value / 2), "halving communication time (overlap not measured)",
                 GainKind.UPPER_BOUND)
    if c.ev.workload == "training":
        kinds = c.ev.trace.comm_share_by_kind if c.ev.trace is not None else {}
        if kinds.get("all_to_all", 0.0) > kinds.get("all_reduce", 0.0):
            # The all-to-alls of embedding or expert parallelism, not DDP's gradient all-reduce, hold the time.
            title, action = "Overlap the all-to-all with compute", (
                "Pipeline the embedding or expert exchange with compute (TorchRec's train pipeline prefetches the "
                "next batch's embedding all-to-all; for MoE, overlap the dispatch with expert compute), shrink what "
                "is sent (fp16/bf16 or quantised embedding communication), and balance the sharding plan.")
        else:
            title, action = "Overlap the all-reduce with backward", (
                "Tune DDP's bucket_cap_mb so gradient buckets reduce while backward runs, or add a comm hook "
                "(fp16/bf16 compression, PowerSGD).")
        c.fix(FixKind.OVERLAP_COMM, title, action,
              gains.overlap(exposed.value, "the communication no compute overlaps") if exposed is not None else g)
    else:
        c.fix(FixKind.REDUCE_TP, "Communicate less per token", "Fewer tensor-parallel ranks with more replicas, TP "
              "only within NVLink, overlapped or custom all-reduce.", g)
    return c.finding(0.5 + min(0.4, comm.value - c.t["comm_share"]), f"Communication kernels take "
                     f"{comm.value:.0%} of GPU time"
                     + (f", {exposed.value:.0%} of the window with nothing overlapping them." if exposed is not None
                        else "."))


@rule(
    code="NET002",
    name="pcie-saturated",
    limiter=Limiter.INTERCONNECT,
    summary="PCIe traffic is near the link's bandwidth.",
    requires=(AnyOf(S.GPU_PCIE_RX_BPS, S.GPU_PCIE_TX_BPS),),
    reads={S.GPU_PCIE_RX_BPS: (P90,), S.GPU_PCIE_TX_BPS: (P90,)},
    thresholds={"link_frac_p90": Threshold(0.60, "PCIe traffic (p90, one direction) over the link's bandwidth",
                                           "ratio")},
    page=Page(
        detects="Host-device traffic in either direction at or above {link_frac_p90} of the GPU's PCIe bandwidth "
        "(p90).",
        why="Weights or KV blocks swapped over PCIe, CPU offload, or large inputs copied each step run at a few "
        "percent of HBM speed.",
        fixes="Keep weights and KV cache resident (no CPU offload or swap space in the hot path), pin and batch "
        "input copies, or use a GPU with more memory.",
        sources="Nsight Compute SOL 60 % 'heavily used' threshold applied to the link.",
    ),
)
def pcie_saturated(c: Check) -> Finding | None:
    gpu = c.ev.gpu_spec
    link = gpu.pcie_bytes_per_s if gpu is not None else None
    if not link:
        return None
    worst = max((s for s in (c.opt(S.GPU_PCIE_RX_BPS), c.opt(S.GPU_PCIE_TX_BPS)) if s is not None),
                key=lambda s: s.p90)
    if worst.p90 < c.t["link_frac_p90"] * link:
        return None
    c.cite(worst, "p90", ">=", c.t["link_frac_p90"] * link)
    c.fix(FixKind.KEEP_DATA_ON_GPU, "Keep data on the GPU", "No CPU offload or KV swapping in the hot path; pin and "
          "batch host copies.")
    return c.finding(0.6, f"PCIe carries {worst.p90 / link:.0%} of the link's bandwidth (p90).")


@rule(
    code="ERR001",
    name="gpu-errors",
    limiter=Limiter.ERRORS,
    summary="The GPU reported XID or uncorrectable ECC errors during the window.",
    requires=(AnyOf(S.GPU_XID_ERRORS, S.GPU_ECC_DBE),),
    uses=(S.GPU_PCIE_REPLAYS,),
    reads={S.GPU_XID_ERRORS: (MAX,), S.GPU_ECC_DBE: (MAX,)},
    fleet=(fm.Larger(fm.Read(S.GPU_XID_ERRORS, MAX), fm.Read(S.GPU_ECC_DBE, MAX)) > fm.Bar("errors")).valued(0.95),
    thresholds={"errors": Threshold(0.0, "any XID or double-bit ECC error above this count", "count")},
    page=Page(
        detects="XID errors or uncorrectable (double-bit) ECC errors above {errors} during the window.",
        why="XIDs signal driver-visible faults (from an application's illegal access to a GPU falling off the "
        "bus); uncorrectable ECC errors kill the processes that touch the memory and need a reset or a "
        "retired page. Performance numbers from a failing GPU mean little.",
        fixes="Look up the XID in NVIDIA's XID catalogue; drain the node for uncorrectable ECC or repeated XIDs "
        "(79: fallen off the bus, 48/94/95: ECC) and reset or RMA the GPU.",
        sources="NVIDIA XID errors guide; DCGM health checks (DCGM_FI_DEV_XID_ERRORS, ECC_DBE_VOL_TOTAL).",
    ),
)
def gpu_errors(c: Check) -> Finding | None:
    found = [s for s in (c.opt(S.GPU_XID_ERRORS), c.opt(S.GPU_ECC_DBE)) if s is not None and s.max > c.t["errors"]]
    if not found:
        return None
    for s in found:
        c.cite(s, "max", ">", c.t["errors"])
    c.fix(FixKind.DRAIN_GPU, "Drain and check the GPU", "Read the XID in the kernel log (dmesg | grep -i xid), run "
          "dcgmi diag, and reset or replace the GPU before tuning anything.",
          Gain(None, "a failing GPU, not a speed question", benefit=Benefit.HEALTH))
    return c.finding(0.95, "The GPU reported " + " and ".join(f"{s.name.split('.')[-1]} = {s.max:.0f}" for s in found)
                     + " during the window.")


@rule(
    code="NET003",
    name="collective-waits",
    limiter=Limiter.INTERCONNECT,
    summary="The GPU idles with work queued, waiting on another stream or a collective, not on the host.",
    requires=(S.TRACE_IDLE_STREAM_WAIT_FRAC, S.TRACE_SHARE_COMM),
    uses=(S.TRACE_RANK_IMBALANCE, S.TRACE_SHARE_ALL_TO_ALL),
    reads={S.TRACE_IDLE_STREAM_WAIT_FRAC: (VALUE,), S.TRACE_SHARE_COMM: (VALUE,), S.TRACE_RANK_IMBALANCE: (VALUE,)},
    thresholds={
        "wait_frac": Threshold(0.15, "share of the window idle with work queued on the device", "ratio"),
        "comm_share": Threshold(0.05, "communication kernels' share of busy time that makes the waits collective "
                                "ones", "ratio"),
    },
    page=Page(
        detects="At least {wait_frac} of the traced window idle while the next kernels were already queued (the host "
        "had launched them long before), in a trace with communication kernels (at least {comm_share} of busy "
        "time).",
        why="A GPU with work queued that does not run it is waiting: on an event another stream records, on a "
        "collective whose peers have not arrived, on a copy. The host is not the limiter there (graphs or faster "
        "launches would not help); the slowest peer or the serial dependency between streams is.",
        fixes="Overlap the collectives with compute (DDP bucket sizes, all-to-all dispatch overlapped with expert or "
        "dense compute), balance the ranks' work so none waits for a straggler (embedding-table sharding, data), and "
        "look in the timeline for which stream's event the idle one waits on.",
        sources="HolisticTraceAnalysis idle-time breakdown (queue length, cross-stream waits); Nsight Systems NCCL "
        "and stream-dependency views.",
    ),
)
def collective_waits(c: Check) -> Finding | None:
    wait, comm = c.req(S.TRACE_IDLE_STREAM_WAIT_FRAC), c.req(S.TRACE_SHARE_COMM)
    if wait.value < c.t["wait_frac"] or comm.value < c.t["comm_share"]:
        return None
    c.cite(wait, "value", ">=", c.t["wait_frac"])
    c.cite(comm, "value", ">=", c.t["comm_share"])
    g = gains.removal(wait.value, "the waits on other streams and collectives")
    blocked = _read_back(c.ev, wait.value)
    also = (f" The host meanwhile sits in {blocked[0]} ({blocked[1]:.0%} of the window), a read-back it waits for: "
            "it cannot queue the next step's work behind the wait." if blocked else "")
    if c.ev.workload == "training":
        if blocked:
            c.fix(FixKind.PIN_MEMORY, "Move the read-back off the step's path", f"The host waits in {blocked[0]} "
                  "while the GPU waits on peers: copy into a pinned buffer with non_blocking=True and wait on its "
                  "event where the values are used, or pipeline the input one batch ahead (TorchRec's "
                  "TrainPipelineSparseDist for the all-to-all's sizes), so the host queues the next step's work.",
                  gains.removal(blocked[1], "the host's blocking read-back"))
        c.fix(FixKind.OVERLAP_COMM, "Overlap the collectives with compute", "Start each collective as soon as its "
              "input is ready and keep compute queued behind it (DDP bucket_cap_mb, torch.distributed async ops, "
              "TorchRec pipelined all-to-all), so waits on peers hide behind work.", g)
        # Whether the waits are for stragglers is the other ranks' to say: one rank's file cannot show when they
        # arrived, so from one rank the fix is named without a size.
        ranks = c.opt(S.TRACE_RANK_IMBALANCE)
        c.fix(FixKind.BALANCE_RANKS, "Balance the ranks", "A collective finishes when its slowest rank arrives: "
              "rebalance the work (embedding-table sharding plan, data per rank) so no rank idles waiting.",
              g if ranks is not None else Gain.unknown(
                  "one rank's trace cannot show when the other ranks arrived, so how much of the wait is for "
                  "stragglers is unknown: analyze the other ranks' traces of the same steps too (a folder of them)"))
    else:
        c.fix(FixKind.REDUCE_TP, "Wait less on collectives per token", "Fewer tensor-parallel ranks with more "
              "replicas, TP only within NVLink, overlapped or custom all-reduce.", g)
    return c.finding(0.5 + min(0.35, wait.value), f"The GPU sat idle {wait.value:.0%} of the traced window with "
                     "work already queued, waiting on other streams and collectives rather than on the host." + also)


def _read_back(ev: Evidence, waited: float) -> tuple[str, float] | None:
    """The blocking copy the host sat in during the device-side waits, when it covers a real part of them."""
    trace = ev.trace
    if trace is None or not trace.blocked_in_waits:
        return None
    name, frac = max(trace.blocked_in_waits.items(), key=lambda kv: kv[1])
    return (name, frac) if frac >= 0.1 * waited else None


@rule(
    code="NET005",
    name="small-collectives",
    limiter=Limiter.HOST_LAUNCH,
    summary="Hundreds of tiny collectives a training step: each a latency and a launch, which bucketing removes "
    "together.",
    requires=(S.TRACE_COLLECTIVES_PER_STEP, S.TRACE_COLLECTIVE_S_P50, S.TRACE_COMM_EXPOSED_FRAC),
    uses=(S.TRACE_IDLE_HOST_FRAC, S.TRACE_COLLECTIVE_HOST_FRAC),
    reads={S.TRACE_COLLECTIVES_PER_STEP: (VALUE,), S.TRACE_COLLECTIVE_S_P50: (VALUE,),
           S.TRACE_COMM_EXPOSED_FRAC: (VALUE,), S.TRACE_IDLE_HOST_FRAC: (VALUE,),
           S.TRACE_COLLECTIVE_HOST_FRAC: (VALUE,)},
    thresholds={
        "per_step": Threshold(64, "collectives a profiler step"),
        "latency": Threshold(50e-6, "median time of one collective: under it, a latency, not a link's bandwidth",
                             "s"),
    },
    page=Page(
        detects="A training job's trace with at least {per_step} communication kernels a profiler step whose "
        "median runs {latency} or less.",
        why="A collective of a few kilobytes costs its latency (NCCL's low-latency protocol: about 10 µs) whatever it "
        "carries, and a host call to issue it (the c10d op, record_param_comms, the kernel launch). Hundreds a step "
        "(a gradient all-reduced per parameter, DDP with tiny buckets, FSDP wrapping every layer) are mostly latency "
        "and launches: the GPU waits on both. The tiny collectives and the launch gaps are one cause, so the fix that "
        "removes them is sized from both.",
        fixes="Fewer, larger collectives: let DDP bucket the gradients (a raised bucket_cap_mb, not an all_reduce "
        "per parameter), flatten them into one buffer, or coalesce collectives (FSDP with larger wrapped units). The "
        "gain is at most 1 / (1 - exposed - gaps), with exposed the communication nothing overlaps and gaps the "
        "host's idle share, no more than the share of the window the host spends issuing collectives; it ranks "
        "first where that is a larger share than the host gaps other fixes address.",
        sources="PyTorch DDP design notes (gradient bucketing, bucket_cap_mb); NCCL's LL/LL128/Simple protocols "
        "(latency under 64 KiB); HolisticTraceAnalysis' communication-computation overlap.",
    ),
)
def small_collectives(c: Check) -> Finding | None:
    if c.ev.workload != "training":
        return None  # a server's per-layer all-reduces wait on each layer's output: nothing to bucket
    n, each = c.req(S.TRACE_COLLECTIVES_PER_STEP), c.req(S.TRACE_COLLECTIVE_S_P50)
    if n.value < c.t["per_step"] or each.value > c.t["latency"]:
        return None
    c.cite(n, "value", ">=", c.t["per_step"])
    c.cite(each, "value", "<=", c.t["latency"])
    exposed = c.cite(c.req(S.TRACE_COMM_EXPOSED_FRAC), "value")
    host, issuing = c.opt(S.TRACE_IDLE_HOST_FRAC), c.opt(S.TRACE_COLLECTIVE_HOST_FRAC)
    gaps = 0.0
    if host is not None and issuing is not None:
        # The host gaps the collectives' calls sit in: no more than the host's idle share, nor than the time it
        # spends issuing them.
        gaps = min(c.cite(host, "value"), c.cite(issuing, "value"))
    removed = min(0.99, exposed + gaps)
    kinds = c.ev.trace.comm_share_by_kind if c.ev.trace is not None else {}
    reduce = kinds.get("all_reduce", 0.0) >= max(kinds.values(), default=0.0)
    action = ("Let DDP bucket the gradients: DistributedDataParallel (not an all_reduce per parameter) with "
              "bucket_cap_mb large enough that a step runs a handful of all-reduces, or flatten the gradients into "
              "one buffer and reduce it once; each bucket then fills the link instead of paying a latency and a "
              "launch.") if reduce else (
              "Coalesce the collectives: wrap larger units (FSDP's auto-wrap policy with fewer, larger modules), "
              "batch them in torch.distributed's coalescing manager, or flatten what each carries into one buffer; "
              "each then fills the link instead of paying a latency and a launch.")
    c.fix(FixKind.BUCKET_COMM, "Bucket the collectives: fewer, larger ones", action,
          gains.removal(removed, "the collectives' exposed time and the host gaps their calls sit in"))
    also = f", and the host issuing them {gaps:.0%} of the window while the GPU waited" if gaps > 0 else ""
    what = "all-reduces" if reduce else "collectives"
    return c.finding(0.5 + min(0.45, removed),
                     f"{n.value:.0f} {what} a step of {each.value * 1e6:.0f} µs each (median): latency, not "
                     f"bandwidth; {exposed:.0%} of the window in communication nothing overlaps{also}.")


@rule(
    code="NET004",
    name="straggler-rank",
    limiter=Limiter.INTERCONNECT,
    summary="One rank of a multi-rank job computes clearly longer than the others: they wait for it in collectives.",
    requires=(S.TRACE_RANK_IMBALANCE,),
    reads={S.TRACE_RANK_IMBALANCE: (VALUE,)},
    thresholds={"imbalance": Threshold(1.10, "busiest rank's compute share over the median rank's")},
    page=Page(
        detects="In a trace of several ranks of one job, the busiest rank's compute share at least {imbalance}x the "
        "median rank's.",
        why="Every collective ends when its slowest rank arrives, so each step runs at the straggler's pace and the "
        "other ranks' lead is spent waiting.",
        fixes="Balance the work across ranks (sharding plan, batch per rank, data skew); check the straggler's GPU "
        "for throttling or errors. The gain is at most the straggler's lead over the median.",
        sources="HolisticTraceAnalysis temporal breakdown across ranks; MLPerf training practice.",
    ),
)
def straggler_rank(c: Check) -> Finding | None:
    imbalance = c.req(S.TRACE_RANK_IMBALANCE)
    if imbalance.value < c.t["imbalance"]:
        return None
    c.cite(imbalance, "value", ">=", c.t["imbalance"])
    c.fix(FixKind.BALANCE_RANKS, "Balance the ranks", "Give the straggler less work (or find why it is slow: its "
          "GPU's clocks and errors, its shard's size) so the others stop waiting for it in each collective.",
          Gain(imbalance.value, f"every rank at the median's pace: the straggler's lead x{imbalance.value:.2f}",
               GainKind.UPPER_BOUND))
    straggler = c.ev.trace.straggler if c.ev.trace is not None else ""
    return c.finding(0.55 + min(0.3, imbalance.value - c.t["imbalance"]),
                     (straggler[:1].upper() + straggler[1:].rstrip(".") + ": " if straggler else "")
                     + f"the busiest rank computes {imbalance.value:.2f}x the median rank's share, and the others "
                     "wait for it in every collective.")


RULES = (clocks_throttled, communication_bound, collective_waits, straggler_rank, small_collectives, pcie_saturated,
         gpu_errors)
