"""Host and launch rules: the GPU waits for the CPU (a saturated serving thread, launch gaps, syncs, copies)."""

from __future__ import annotations

from diagnoser.diagnosis import Finding, Limiter
from diagnoser.rules.base import Check, Page, Threshold, rule

_GRAPHS = "Capture the decode step in CUDA graphs (vLLM does by default unless --enforce-eager; torch.compile " \
    "mode='reduce-overhead'; SGLang --cuda-graph-max-bs) so one launch replaces hundreds."


def _gap_gain(idle_frac: float) -> tuple[float, str]:
    return 1.0 / max(0.05, 1.0 - idle_frac), f"removing {idle_frac:.0%} idle time: 1 / (1 - idle)"


@rule(
    code="HOST001",
    name="serving-thread-saturated",
    limiter=Limiter.HOST_LAUNCH,
    summary="A thread of the server is pinned near 100 % of a core while the GPU is not fully busy.",
    requires=("host.target_busiest_thread", "gpu.busy|gpu.sm_active|trace.gpu_idle_frac"),
    uses=("host.target_cpu",),
    thresholds={
        "thread_p50": Threshold(0.90, "busiest thread's share of one core (median) that counts as saturated"),
        "busy_max": Threshold(0.70, "GPU busy fraction below which the GPU is waiting on the host"),
    },
    page=Page(
        detects="The target's busiest thread at or above 90 % of one core for half the window while the GPU is "
        "busy less than 70 %.",
        why="Python serving loops (scheduling, sampling, detokenising, launching kernels) run on one thread; when "
        "that thread is saturated the GPU waits between steps however fast it is.",
        fixes=_GRAPHS + " Move tokenisation/detokenisation to other processes (vLLM's API server does), enable "
        "asynchronous scheduling/output processing, use a faster CPU.",
        sources="Nsight Systems CPU-bound heuristics; nvitop-style per-thread CPU; MLPerf inference practice "
        "(CPUBottleneck: GPU < 10 % and CPU > 90 %).",
    ),
)
def serving_thread_saturated(c: Check) -> Finding | None:
    thread = c.sig("host.target_busiest_thread")
    assert thread is not None
    busy = c.sig("gpu.busy") or c.sig("gpu.sm_active")
    idle = c.sig("trace.gpu_idle_frac")
    busy_frac = busy.mean if busy is not None else 1.0 - idle.values[0]  # type: ignore[union-attr]
    if thread.p50 < c.t["thread_p50"] or busy_frac >= c.t["busy_max"]:
        return None
    c.cite(thread, "p50", ">=", c.t["thread_p50"])
    if busy is not None:
        c.cite(busy, "mean", "<", c.t["busy_max"])
    elif idle is not None:
        c.cite(idle, "value")
    gain, basis = 1.0 / max(0.05, busy_frac), "if the GPU were kept busy: 1 / busy fraction"
    c.fix("Take launch work off the serving thread", _GRAPHS, min(gain, 5.0), basis)
    c.fix("Move CPU work off the loop", "Detokenise and post-process in other processes; enable async scheduling.")
    return c.finding(0.7, f"The server's busiest thread uses {thread.p50:.0%} of a core while the GPU is busy "
                     f"{busy_frac:.0%}: the host sets the pace.")


@rule(
    code="HOST002",
    name="launch-gaps",
    limiter=Limiter.HOST_LAUNCH,
    summary="The trace shows the GPU idle because the host had not launched the next kernel yet.",
    requires=("trace.idle.host_frac",),
    uses=("trace.gpu_idle_frac", "trace.kernels_per_s"),
    thresholds={"host_idle_frac": Threshold(0.15, "share of the window idle waiting for launches")},
    page=Page(
        detects="At least 15 % of the traced window with the GPU idle while the host was still preparing the next "
        "launch (the gap ends at a kernel whose launch call started inside the gap).",
        why="Each idle gap is time the GPU could have worked; a host that launches slower than the GPU executes "
        "caps throughput at the host's pace.",
        fixes=_GRAPHS + " Fuse small ops (torch.compile), move Python work out of the step.",
        sources="HolisticTraceAnalysis idle-time breakdown (host wait); Nsight Systems gpu_gaps rule.",
    ),
)
def launch_gaps(c: Check) -> Finding | None:
    host = c.sig("trace.idle.host_frac")
    assert host is not None
    if host.values[0] < c.t["host_idle_frac"]:
        return None
    c.cite(host, "value", ">=", c.t["host_idle_frac"])
    gain, basis = _gap_gain(host.values[0])
    c.fix("Launch with CUDA graphs", _GRAPHS, gain, basis)
    return c.finding(0.5 + min(0.4, host.values[0]), f"The GPU sat idle {host.values[0]:.0%} of the traced window "
                     "waiting for the host to launch work.")


@rule(
    code="HOST003",
    name="small-kernel-storm",
    limiter=Limiter.HOST_LAUNCH,
    summary="Most kernels are shorter than their own launch call and no CUDA graphs are used.",
    requires=("trace.short_kernel_frac", "trace.cuda_graph_launches"),
    uses=("trace.kernels_per_s",),
    thresholds={"short_kernel_frac": Threshold(0.50, "share of kernels shorter than their launch call")},
    page=Page(
        detects="Half or more of the kernels run for less time than the CPU spends launching them, with no "
        "cudaGraphLaunch in the trace.",
        why="When a kernel is shorter than its launch, the GPU drains faster than the host fills it; the run is "
        "launch-bound no matter how fast the GPU is.",
        fixes=_GRAPHS + " Fuse elementwise chains with torch.compile.",
        sources="XProf kernel-launch share; HTA kernel launch statistics (short kernels).",
    ),
)
def small_kernel_storm(c: Check) -> Finding | None:
    short, graphs = c.sig("trace.short_kernel_frac"), c.sig("trace.cuda_graph_launches")
    assert short is not None and graphs is not None
    if short.values[0] < c.t["short_kernel_frac"] or graphs.values[0] > 0:
        return None
    c.cite(short, "value", ">=", c.t["short_kernel_frac"])
    c.cite(graphs, "value", "=", 0)
    c.fix("Capture CUDA graphs", _GRAPHS)
    return c.finding(0.6, f"{short.values[0]:.0%} of kernels are shorter than their launch and no CUDA graph is "
                     "replayed: launch overhead dominates.")


@rule(
    code="SYNC001",
    name="host-sync-stalls",
    limiter=Limiter.HOST_LAUNCH,
    summary="The GPU idles while the host blocks in synchronisations.",
    requires=("trace.idle.sync_frac",),
    thresholds={"sync_idle_frac": Threshold(0.10, "share of the window idle inside host synchronisations")},
    page=Page(
        detects="At least 10 % of the traced window idle around cudaStreamSynchronize / cudaDeviceSynchronize / "
        "blocking copies (`.item()`, `.cpu()`, `.tolist()`).",
        why="A sync empties the GPU's queue: the host waits for the GPU, then the GPU waits for the host to launch "
        "again. In a decode loop this happens every step.",
        fixes="Keep sampling and stopping checks on the GPU; read results back once per step with non_blocking "
        "copies into pinned buffers; overlap the next step's launch with the copy (async scheduling).",
        sources="Nsight Systems sync-API rule; HTA idle breakdown.",
    ),
)
def host_sync_stalls(c: Check) -> Finding | None:
    sync = c.sig("trace.idle.sync_frac")
    assert sync is not None
    if sync.values[0] < c.t["sync_idle_frac"]:
        return None
    c.cite(sync, "value", ">=", c.t["sync_idle_frac"])
    gain, basis = _gap_gain(sync.values[0])
    c.fix("Remove per-step host syncs", "Avoid .item()/.cpu()/.tolist() inside the step; copy results with "
          "non_blocking=True into pinned memory and read them one step later.", gain, basis)
    return c.finding(0.5 + min(0.4, sync.values[0]), f"The GPU idled {sync.values[0]:.0%} of the traced window "
                     "inside host synchronisations.")


@rule(
    code="COPY001",
    name="pageable-memcpy",
    limiter=Limiter.HOST_LAUNCH,
    summary="Copies from pageable host memory stall the GPU.",
    requires=("trace.idle.pageable_memcpy_frac",),
    thresholds={"pageable_idle_frac": Threshold(0.05, "share of the window idle around pageable copies")},
    page=Page(
        detects="At least 5 % of the traced window idle around host-to-device copies from pageable memory.",
        why="A copy from pageable memory is staged through a driver buffer and is synchronous with respect to the "
        "host; it cannot overlap compute.",
        fixes="Allocate host tensors with pin_memory=True and copy with non_blocking=True.",
        sources="Nsight Systems cuda-async-memcpy / pageable memcpy rule.",
    ),
)
def pageable_memcpy(c: Check) -> Finding | None:
    frac = c.sig("trace.idle.pageable_memcpy_frac")
    assert frac is not None
    if frac.values[0] < c.t["pageable_idle_frac"]:
        return None
    c.cite(frac, "value", ">=", c.t["pageable_idle_frac"])
    gain, basis = _gap_gain(frac.values[0])
    c.fix("Pin host buffers", "pin_memory=True on host tensors that feed the GPU; .to(device, non_blocking=True).",
          gain, basis)
    return c.finding(0.5, f"Copies from pageable memory left the GPU idle {frac.values[0]:.0%} of the window.")
