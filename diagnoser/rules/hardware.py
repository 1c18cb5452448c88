"""Hardware rules: throttled clocks, saturated interconnects, and GPU errors."""

from __future__ import annotations

from diagnoser.diagnosis import Finding, Limiter
from diagnoser.rules.base import Check, Page, Threshold, rule


@rule(
    code="THR001",
    name="clocks-throttled",
    limiter=Limiter.THROTTLING,
    summary="Clocks are held below their maximum by the power cap or a thermal slowdown while the GPU works.",
    requires=("gpu.throttle.power|gpu.throttle.thermal", "gpu.sm_clock_frac"),
    uses=("gpu.busy", "gpu.power_w", "gpu.power_limit_w", "gpu.temp_c"),
    thresholds={
        "throttled_frac": Threshold(0.20, "share of samples with a power or thermal clock event reason"),
        "clock_frac_mean": Threshold(0.90, "SM clock over max (mean) below which throttling costs speed"),
    },
    page=Page(
        detects="A power-cap or thermal clock event reason in at least 20 % of the samples with the SM clock below "
        "90 % of its maximum on average.",
        why="Compute throughput scales with the SM clock; a GPU held at 70 % clock does at most 70 % of its work. "
        "Power capping is normal under heavy tensor load, but a low cap or poor cooling costs throughput.",
        fixes="Check the enforced power limit (nvidia-smi -q -d POWER) against the board's default, the cooling "
        "and inlet temperature; on shared nodes look for a site power policy.",
        sources="NVML clock event reasons (nvmlDeviceGetCurrentClocksEventReasons); DCGM POWER/THERMAL_VIOLATION.",
    ),
)
def clocks_throttled(c: Check) -> Finding | None:
    clock = c.sig("gpu.sm_clock_frac")
    assert clock is not None
    reasons = [s for s in (c.sig("gpu.throttle.power"), c.sig("gpu.throttle.thermal")) if s is not None]
    worst = max(reasons, key=lambda s: s.frac_above(0.5))
    throttled = worst.frac_above(0.5)
    busy = c.sig("gpu.busy")
    if throttled < c.t["throttled_frac"] or clock.mean >= c.t["clock_frac_mean"]:
        return None
    if busy is not None and busy.mean < 0.3:
        return None  # an idle GPU's clocks do not matter
    c.cite(worst, "frac_above:0.5", ">=", c.t["throttled_frac"])
    c.cite(clock, "mean", "<", c.t["clock_frac_mean"])
    kind = "power cap" if worst.name.endswith("power") else "thermal slowdown"
    c.fix("Restore full clocks", f"The {kind} holds clocks at {clock.mean:.0%} of max: check the power limit "
          "(nvidia-smi -pl), cooling and inlet temperature.", 1.0 / max(0.3, clock.mean),
          "compute scales with SM clock: 1 / clock fraction (upper bound)")
    return c.finding(0.5 + min(0.4, (c.t["clock_frac_mean"] - clock.mean) * 2), f"The {kind} holds the SM clock at "
                     f"{clock.mean:.0%} of its maximum for {throttled:.0%} of the window.")


@rule(
    code="NET001",
    name="communication-bound",
    limiter=Limiter.INTERCONNECT,
    summary="Communication kernels (NCCL) take a large share of GPU time.",
    requires=("trace.share.comm",),
    thresholds={"comm_share": Threshold(0.30, "share of GPU busy time in communication kernels")},
    page=Page(
        detects="NCCL/communication kernels at or above 30 % of GPU busy time in the trace.",
        why="In tensor-parallel serving every layer ends in an all-reduce; over PCIe or a slow NVLink these "
        "dominate each step and more GPUs make it worse.",
        fixes="Use fewer tensor-parallel ranks (more replicas instead), keep TP inside one NVLink domain, overlap "
        "communication with compute, or use custom all-reduce kernels (vLLM's default on NVLink).",
        sources="XProf collectives rule (>= 30 %); torch-tb-profiler communication > 10 % rule.",
    ),
)
def communication_bound(c: Check) -> Finding | None:
    comm = c.sig("trace.share.comm")
    assert comm is not None
    if comm.values[0] < c.t["comm_share"]:
        return None
    c.cite(comm, "value", ">=", c.t["comm_share"])
    c.fix("Communicate less per token", "Fewer tensor-parallel ranks with more replicas, TP only within NVLink, "
          "overlapped or custom all-reduce.", 1.0 / max(0.05, 1.0 - comm.values[0] / 2),
          "halving communication time")
    return c.finding(0.5 + min(0.4, comm.values[0] - c.t["comm_share"]), f"Communication kernels take "
                     f"{comm.values[0]:.0%} of GPU time.")


@rule(
    code="NET002",
    name="pcie-saturated",
    limiter=Limiter.INTERCONNECT,
    summary="PCIe traffic is near the link's bandwidth.",
    requires=("gpu.pcie_rx_bps|gpu.pcie_tx_bps",),
    thresholds={"link_frac_p90": Threshold(0.60, "PCIe traffic (p90, one direction) over the link's bandwidth")},
    page=Page(
        detects="Host-device traffic in either direction at or above 60 % of the GPU's PCIe bandwidth (p90).",
        why="Weights or KV blocks swapped over PCIe, CPU offload, or large inputs copied each step run at a few "
        "percent of HBM speed.",
        fixes="Keep weights and KV cache resident (no CPU offload or swap space in the hot path), pin and batch "
        "input copies, or use a GPU with more memory.",
        sources="Nsight Compute SOL 60 % 'heavily used' threshold applied to the link.",
    ),
)
def pcie_saturated(c: Check) -> Finding | None:
    gpu = c.ev.gpu_spec
    link = getattr(gpu, "pcie_bytes_per_s", None)
    if not link:
        return None
    worst = max((s for s in (c.sig("gpu.pcie_rx_bps"), c.sig("gpu.pcie_tx_bps")) if s is not None),
                key=lambda s: s.p90)
    if worst.p90 < c.t["link_frac_p90"] * link:
        return None
    c.cite(worst, "p90", ">=", c.t["link_frac_p90"] * link)
    c.fix("Keep data on the GPU", "No CPU offload or KV swapping in the hot path; pin and batch host copies.")
    return c.finding(0.6, f"PCIe carries {worst.p90 / link:.0%} of the link's bandwidth (p90).")


@rule(
    code="ERR001",
    name="gpu-errors",
    limiter=Limiter.ERRORS,
    summary="The GPU reported XID or uncorrectable ECC errors during the window.",
    requires=("gpu.xid_errors|gpu.ecc_dbe",),
    uses=("gpu.pcie_replays",),
    thresholds={"errors": Threshold(0.0, "any XID or double-bit ECC error above this count")},
    page=Page(
        detects="Any XID error or uncorrectable (double-bit) ECC error during the window.",
        why="XIDs signal driver-visible faults (from an application's illegal access to a GPU falling off the "
        "bus); uncorrectable ECC errors kill the processes that touch the memory and need a reset or a "
        "retired page. Performance numbers from a failing GPU mean little.",
        fixes="Look up the XID in NVIDIA's XID catalogue; drain the node for uncorrectable ECC or repeated XIDs "
        "(79: fallen off the bus, 48/94/95: ECC) and reset or RMA the GPU.",
        sources="NVIDIA XID errors guide; DCGM health checks (DCGM_FI_DEV_XID_ERRORS, ECC_DBE_VOL_TOTAL).",
    ),
)
def gpu_errors(c: Check) -> Finding | None:
    found = [s for s in (c.sig("gpu.xid_errors"), c.sig("gpu.ecc_dbe")) if s is not None and s.max > c.t["errors"]]
    if not found:
        return None
    for s in found:
        c.cite(s, "max", ">", c.t["errors"])
    c.fix("Drain and check the GPU", "Read the XID in the kernel log (dmesg | grep -i xid), run dcgmi diag, and "
          "reset or replace the GPU before tuning anything.")
    return c.finding(0.95, "The GPU reported " + " and ".join(f"{s.name.split('.')[-1]} = {s.max:.0f}" for s in found)
                     + " during the window.")
