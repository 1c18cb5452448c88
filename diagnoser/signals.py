"""The one vocabulary of signal names that collectors write and rules read.

Every collector maps its raw fields (NVML, GPM, DCGM, psutil, server metrics, traces) onto these names, so a rule
never cares where a number came from; the source stays attached to each series for the report. Ratios are 0..1
everywhere: GPM and NVML give percents and their collectors divide by 100; DCGM PROF fields are already ratios.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SignalSpec:
    name: str
    unit: str
    description: str


_SPECS = [
    # GPU activity
    SignalSpec("gpu.busy", "ratio", "Fraction of time a kernel was running (NVML utilization.gpu, DCGM GR_ENGINE_ACTIVE); saturates easily."),
    SignalSpec("gpu.sm_active", "ratio", "Fraction of cycles an SM had at least one warp (GPM SM_UTIL, DCGM SM_ACTIVE)."),
    SignalSpec("gpu.sm_occupancy", "ratio", "Resident warps vs the maximum (GPM SM_OCCUPANCY, DCGM SM_OCCUPANCY)."),
    SignalSpec("gpu.tensor_active", "ratio", "Fraction of cycles the tensor pipes were active (GPM ANY_TENSOR_UTIL, DCGM PIPE_TENSOR_ACTIVE)."),
    SignalSpec("gpu.fp16_active", "ratio", "Non-tensor FP16 pipe activity."),
    SignalSpec("gpu.fp32_active", "ratio", "FP32 pipe activity."),
    SignalSpec("gpu.dram_active", "ratio", "Fraction of cycles the memory interface was busy (GPM DRAM_BW_UTIL, DCGM DRAM_ACTIVE); ~0.8 is the practical peak."),
    SignalSpec("gpu.mem_busy", "ratio", "NVML utilization.memory: time the memory controller was busy (coarse)."),
    # memory
    SignalSpec("gpu.mem_used_bytes", "bytes", "Device memory in use."),
    SignalSpec("gpu.mem_total_bytes", "bytes", "Device memory in all."),
    SignalSpec("gpu.mem_used_frac", "ratio", "Device memory in use over total (derived when both are known)."),
    SignalSpec("proc.gpu_mem_bytes", "bytes", "Device memory held by the target process and its children."),
    SignalSpec("proc.gpu_busy", "ratio", "SM utilisation of the target's own processes (NVML per-process samples)."),
    # clocks, power, throttling
    SignalSpec("gpu.sm_clock_frac", "ratio", "SM clock over its maximum."),
    SignalSpec("gpu.sm_clock_mhz", "MHz", "SM clock."),
    SignalSpec("gpu.mem_clock_frac", "ratio", "Memory clock over its maximum."),
    SignalSpec("gpu.power_w", "W", "Board power."),
    SignalSpec("gpu.power_limit_w", "W", "Enforced power limit."),
    SignalSpec("gpu.power_default_limit_w", "W", "The board's default power limit (NVML/DCGM power management default): an enforced limit below it is a lowered cap."),
    SignalSpec("gpu.temp_c", "C", "GPU temperature."),
    SignalSpec("gpu.throttle.power", "ratio", "1 while clocks are held down by the power cap (software or hardware), else 0."),
    SignalSpec("gpu.throttle.thermal", "ratio", "1 while clocks are held down by a thermal slowdown, else 0."),
    SignalSpec("gpu.throttle.other", "ratio", "1 while another clock event reason (sync boost, app clocks, HW slowdown) holds clocks, else 0."),
    # interconnect
    SignalSpec("gpu.pcie_tx_bps", "B/s", "PCIe bytes per second sent by the GPU."),
    SignalSpec("gpu.pcie_rx_bps", "B/s", "PCIe bytes per second received by the GPU."),
    SignalSpec("gpu.nvlink_tx_bps", "B/s", "NVLink bytes per second sent."),
    SignalSpec("gpu.nvlink_rx_bps", "B/s", "NVLink bytes per second received."),
    # errors
    SignalSpec("gpu.xid_errors", "count", "XID errors seen during the window."),
    SignalSpec("gpu.ecc_dbe", "count", "Double-bit (uncorrectable) ECC errors during the window."),
    SignalSpec("gpu.pcie_replays", "count", "PCIe replay counter increase during the window."),
    # host
    SignalSpec("host.target_cpu", "cores", "CPU used by the target process tree, in cores."),
    SignalSpec("host.target_busiest_thread", "ratio", "Busiest thread of the target, as a fraction of one core."),
    SignalSpec("host.cpu_frac", "ratio", "Whole-host CPU use over all cores."),
    SignalSpec("host.mem_used_frac", "ratio", "Host memory in use."),
    SignalSpec("host.target_rss_bytes", "bytes", "Resident memory of the target process tree."),
    SignalSpec("host.target_threads", "threads", "Threads in the target process tree."),
    SignalSpec("host.target_ctx_switches_per_s", "1/s", "Context switches of the target process tree per second."),
    # inference server
    SignalSpec("server.running", "requests", "Requests in the running batch."),
    SignalSpec("server.waiting", "requests", "Requests queued, waiting to be scheduled."),
    SignalSpec("server.kv_usage", "ratio", "KV-cache blocks in use."),
    SignalSpec("server.preemptions_per_s", "1/s", "Requests preempted (evicted from the KV cache) per second."),
    SignalSpec("server.prompt_tokens_per_s", "tokens/s", "Prompt (prefill) tokens processed per second."),
    SignalSpec("server.gen_tokens_per_s", "tokens/s", "Generated tokens per second."),
    SignalSpec("server.requests_per_s", "1/s", "Requests finished per second."),
    SignalSpec("server.ttft_p50_s", "s", "Time to first token, median over the window."),
    SignalSpec("server.ttft_p99_s", "s", "Time to first token, p99 over the window."),
    SignalSpec("server.itl_p50_s", "s", "Inter-token latency, median over the window."),
    SignalSpec("server.itl_p99_s", "s", "Inter-token latency, p99 over the window."),
    SignalSpec("server.batch_size", "sequences", "Sequences per engine iteration (mean over the window)."),
    # trace-derived (one value per window)
    SignalSpec("trace.gpu_idle_frac", "ratio", "Fraction of the traced window no kernel or copy ran."),
    SignalSpec("trace.idle.host_frac", "ratio", "Idle time while the host had not launched the next kernel."),
    SignalSpec("trace.idle.sync_frac", "ratio", "Idle time inside host synchronisations."),
    SignalSpec("trace.idle.pageable_memcpy_frac", "ratio", "Idle time around copies from pageable host memory."),
    SignalSpec("trace.idle.queue_dry_frac", "ratio", "Idle time with nothing to do (no work queued)."),
    SignalSpec("trace.idle.kernel_overhead_frac", "ratio", "Short kernel-to-kernel gaps."),
    SignalSpec("trace.share.gemm", "ratio", "Share of GPU busy time in GEMMs."),
    SignalSpec("trace.share.attention", "ratio", "Share of GPU busy time in attention kernels."),
    SignalSpec("trace.share.comm", "ratio", "Share of GPU busy time in communication (NCCL) kernels."),
    SignalSpec("trace.share.memcpy", "ratio", "Share of GPU busy time in copies."),
    SignalSpec("trace.share.elementwise", "ratio", "Share of GPU busy time in normalisation, elementwise and reduction kernels."),
    SignalSpec("trace.short_kernel_frac", "ratio", "Kernels shorter than their own launch call."),
    SignalSpec("trace.kernels_per_s", "1/s", "Kernels launched per second of the window."),
    SignalSpec("trace.cuda_graph_launches", "count", "CUDA graph replays in the window."),
    SignalSpec("trace.intensity", "FLOP/B", "Time-weighted arithmetic intensity of ops with known FLOPs and bytes."),
    SignalSpec("trace.decode_batch", "sequences", "Inferred batch of decode-like steps."),
    SignalSpec("trace.prefill_frac", "ratio", "Share of GPU time in prefill-like steps."),
    # physics (derived from hardware + model)
    SignalSpec("theory.ridge_flop_per_byte", "FLOP/B", "Ridge point of the GPU at the model's precision."),
    SignalSpec("theory.decode_ceiling_tokens_per_s", "tokens/s", "Decode tokens/s ceiling at the observed batch (weights + KV over bandwidth)."),
    SignalSpec("theory.ridge_batch", "sequences", "Decode batch at which intensity reaches the ridge."),
    SignalSpec("theory.weight_bytes", "bytes", "Bytes of the model's weights."),
    SignalSpec("theory.efficiency", "ratio", "Achieved generation tokens/s over the decode ceiling."),
    SignalSpec("theory.decode_share", "ratio", "Decode's share of the least GPU time the served tokens need (decode at its ceiling vs prefill at the tensor peak)."),
    # energy and cost (derived from measured rates and power)
    SignalSpec("energy.tokens_per_joule", "tokens/J", "Generated tokens per joule of GPU board energy."),
    SignalSpec("energy.usd_per_million_tokens", "USD", "GPU cost per million generated tokens at the given $/GPU-hour."),
]

SPECS: dict[str, SignalSpec] = {s.name: s for s in _SPECS}


def spec(name: str) -> SignalSpec:
    """The spec of a signal; unknown names get a neutral spec so a newer capture still renders."""
    return SPECS.get(name, SignalSpec(name, "", ""))
