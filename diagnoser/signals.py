"""The one vocabulary of signal names that collectors write and rules read.

Every collector maps its raw fields (NVML, GPM, DCGM, psutil, server metrics, traces) onto these names, so a rule
never cares where a number came from; the source stays attached to each series for the report. Ratios are 0..1
everywhere: GPM and NVML give percents and their collectors divide by 100; DCGM PROF fields are already ratios.

Each signal is a module constant, a `Sig`: a str (so a capture on disk, a dict key and a JSON field hold the plain
name) that also carries its unit and description. Code names signals by constant (`signals.GPU_BUSY`), never by a
string literal; `known(name)` turns a name read from outside (a TOML file, an old capture) into its constant and
refuses one that is not in the registry, which is how rule registration rejects a misspelt signal.
"""

from __future__ import annotations

from diagnoser.errors import InputError


class Sig(str):
    """A registered signal name with its unit and description."""

    unit: str
    description: str

    def __new__(cls, name: str, unit: str, description: str) -> Sig:
        self = super().__new__(cls, name)
        self.unit = unit
        self.description = description
        return self

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        # Pickled by name (fleet workers), restored as the registry's constant.
        name = str.__str__(self)
        if name in REGISTRY:
            return (known, (name,))
        return (Sig, (name, self.unit, self.description))

    @property
    def name(self) -> str:
        return str.__str__(self)

    @property
    def family(self) -> str:
        """gpu, host, server, trace, theory, energy, proc."""
        return self.split(".", 1)[0]


REGISTRY: dict[str, Sig] = {}


def _sig(name: str, unit: str, description: str) -> Sig:
    if name in REGISTRY:
        raise ValueError(f"signal {name} registered twice")
    REGISTRY[name] = s = Sig(name, unit, description)
    return s


# --- GPU activity ---------------------------------------------------------------------------------
GPU_BUSY = _sig(
    "gpu.busy", "ratio",
    "Fraction of time a kernel was running (NVML utilization.gpu, DCGM GR_ENGINE_ACTIVE); saturates easily.")
GPU_SM_ACTIVE = _sig(
    "gpu.sm_active", "ratio",
    "Fraction of cycles an SM had at least one warp (GPM SM_UTIL, DCGM SM_ACTIVE).")
GPU_SM_OCCUPANCY = _sig(
    "gpu.sm_occupancy", "ratio",
    "Resident warps vs the maximum (GPM SM_OCCUPANCY, DCGM SM_OCCUPANCY).")
GPU_TENSOR_ACTIVE = _sig(
    "gpu.tensor_active", "ratio",
    "Fraction of cycles the tensor pipes were active (GPM ANY_TENSOR_UTIL, DCGM PIPE_TENSOR_ACTIVE).")
GPU_FP16_ACTIVE = _sig("gpu.fp16_active", "ratio", "Non-tensor FP16 pipe activity.")
GPU_FP32_ACTIVE = _sig("gpu.fp32_active", "ratio", "FP32 pipe activity.")
GPU_DRAM_ACTIVE = _sig(
    "gpu.dram_active", "ratio",
    "Fraction of cycles the memory interface was busy (GPM DRAM_BW_UTIL, DCGM DRAM_ACTIVE); ~0.8 is the practical "
    "peak.")
GPU_MEM_BUSY = _sig("gpu.mem_busy", "ratio", "NVML utilization.memory: time the memory controller was busy (coarse).")

# --- memory ---------------------------------------------------------------------------------------
GPU_MEM_USED_BYTES = _sig("gpu.mem_used_bytes", "bytes", "Device memory in use.")
GPU_MEM_TOTAL_BYTES = _sig("gpu.mem_total_bytes", "bytes", "Device memory in all.")
GPU_MEM_USED_FRAC = _sig("gpu.mem_used_frac", "ratio", "Device memory in use over total (derived when both are known).")
PROC_GPU_MEM_BYTES = _sig("proc.gpu_mem_bytes", "bytes", "Device memory held by the target process and its children.")
PROC_GPU_BUSY = _sig(
    "proc.gpu_busy", "ratio",
    "SM utilisation of the target's own processes (NVML per-process samples).")

# --- clocks, power, throttling --------------------------------------------------------------------
GPU_SM_CLOCK_FRAC = _sig("gpu.sm_clock_frac", "ratio", "SM clock over its maximum.")
GPU_SM_CLOCK_MHZ = _sig("gpu.sm_clock_mhz", "MHz", "SM clock.")
GPU_MEM_CLOCK_FRAC = _sig("gpu.mem_clock_frac", "ratio", "Memory clock over its maximum.")
GPU_POWER_W = _sig("gpu.power_w", "W", "Board power.")
GPU_POWER_LIMIT_W = _sig("gpu.power_limit_w", "W", "Enforced power limit.")
GPU_POWER_DEFAULT_LIMIT_W = _sig(
    "gpu.power_default_limit_w", "W",
    "The board's default power limit (NVML nvmlDeviceGetPowerManagementDefaultLimit, DCGM); else the spec TDP.")
GPU_TEMP_C = _sig("gpu.temp_c", "C", "GPU temperature.")
GPU_THROTTLE_POWER = _sig(
    "gpu.throttle.power", "ratio",
    "1 while clocks are held down by the power cap (software or hardware), else 0.")
GPU_THROTTLE_THERMAL = _sig(
    "gpu.throttle.thermal", "ratio",
    "1 while clocks are held down by a thermal slowdown, else 0.")
GPU_THROTTLE_BRAKE = _sig(
    "gpu.throttle.power_brake", "ratio",
    "1 while the HW power brake holds clocks down (asserted from outside the GPU, by the power supply or the BMC; "
    "a subset of gpu.throttle.power), else 0.")
GPU_THROTTLE_OTHER = _sig(
    "gpu.throttle.other", "ratio",
    "1 while another clock event reason (sync boost, app clocks, HW slowdown) holds clocks, else 0.")

# --- interconnect ---------------------------------------------------------------------------------
GPU_PCIE_TX_BPS = _sig("gpu.pcie_tx_bps", "B/s", "PCIe bytes per second sent by the GPU.")
GPU_PCIE_RX_BPS = _sig("gpu.pcie_rx_bps", "B/s", "PCIe bytes per second received by the GPU.")
GPU_NVLINK_TX_BPS = _sig("gpu.nvlink_tx_bps", "B/s", "NVLink bytes per second sent.")
GPU_NVLINK_RX_BPS = _sig("gpu.nvlink_rx_bps", "B/s", "NVLink bytes per second received.")

# --- errors ---------------------------------------------------------------------------------------
GPU_XID_ERRORS = _sig("gpu.xid_errors", "count", "XID errors seen during the window.")
GPU_ECC_DBE = _sig("gpu.ecc_dbe", "count", "Double-bit (uncorrectable) ECC errors during the window.")
GPU_PCIE_REPLAYS = _sig("gpu.pcie_replays", "count", "PCIe replay counter increase during the window.")

# --- host -----------------------------------------------------------------------------------------
HOST_TARGET_CPU = _sig("host.target_cpu", "cores", "CPU used by the target process tree, in cores.")
HOST_TARGET_BUSIEST_THREAD = _sig(
    "host.target_busiest_thread", "ratio",
    "Busiest thread of the target, as a fraction of one core.")
HOST_CPU_FRAC = _sig("host.cpu_frac", "ratio", "Whole-host CPU use over all cores.")
HOST_OTHERS_CPU = _sig(
    "host.others_cpu", "cores",
    "CPU used by every process outside the target's tree (other tenants, this tool, a load generator), in cores.")
HOST_CORES = _sig("host.cores", "cores", "Logical CPUs of the host (psutil.cpu_count).")
HOST_TARGET_CPU_WAIT = _sig(
    "host.target_cpu_wait", "ratio",
    "Largest share of the time any working thread of the target (5 % of a core or more) was ready to run but "
    "waited for a CPU (Linux schedstat run-queue delay): the server starved of cores.")
HOST_MEM_USED_FRAC = _sig("host.mem_used_frac", "ratio", "Host memory in use.")
HOST_TARGET_RSS_BYTES = _sig("host.target_rss_bytes", "bytes", "Resident memory of the target process tree.")
HOST_TARGET_THREADS = _sig("host.target_threads", "threads", "Threads in the target process tree.")
HOST_TARGET_CTX_SWITCHES_PER_S = _sig(
    "host.target_ctx_switches_per_s", "1/s",
    "Context switches of the target process tree per second.")

# --- inference server -----------------------------------------------------------------------------
SERVER_RUNNING = _sig("server.running", "requests", "Requests in the running batch.")
SERVER_WAITING = _sig("server.waiting", "requests", "Requests queued, waiting to be scheduled.")
SERVER_KV_USAGE = _sig("server.kv_usage", "ratio", "KV-cache blocks in use.")
SERVER_PREEMPTIONS_PER_S = _sig(
    "server.preemptions_per_s", "1/s",
    "Requests preempted (evicted from the KV cache) per second.")
SERVER_PROMPT_TOKENS_PER_S = _sig(
    "server.prompt_tokens_per_s", "tokens/s",
    "Prompt (prefill) tokens processed per second.")
SERVER_GEN_TOKENS_PER_S = _sig("server.gen_tokens_per_s", "tokens/s", "Generated tokens per second.")
SERVER_REQUESTS_PER_S = _sig(
    "server.requests_per_s", "1/s",
    "Requests finished per second, served to the end (vLLM: finished for a stop or length; aborts and errors are not "
    "successes).")
SERVER_ABORTS_PER_S = _sig(
    "server.aborts_per_s", "1/s",
    "Requests aborted per second: the client went away (a timeout, a cancel) before the answer was done (vLLM "
    "request_success_total{finished_reason=\"abort\"}).")
SERVER_HTTP_REQUESTS_PER_S = _sig(
    "server.http_requests_per_s", "1/s",
    "Inference API requests answered per second by the HTTP layer (vLLM's http_requests_total for /v1/ handlers), "
    "those whose client had gone counted too: against the engine's finished requests it shows the abandoned ones.")
SERVER_WAITING_GROWTH_PER_S = _sig(
    "server.waiting_growth_per_s", "1/s",
    "How fast the queue of waiting requests grew over the window: the lesser of the least-squares slopes of the "
    "server's waiting gauge over each half of the window (derived, needs 6 samples over 5 s). Positive: the queue "
    "grew all window, requests arriving faster than the server serves them; a queue that filled once and held "
    "reads about zero.")
SERVER_HTTP_REJECTED_PER_S = _sig(
    "server.http_rejected_per_s", "1/s",
    "Inference API requests the HTTP layer answered with a 4xx status per second (vLLM's http_requests_total, status "
    "4xx, for /v1/ handlers): refused before the engine ran them, such as a prompt longer than --max-model-len.")
SERVER_REQUEST_ERRORS_PER_S = _sig(
    "server.request_errors_per_s", "1/s", "Requests that ended in an engine error per second (vLLM).")
SERVER_PROMPT_TOKENS_CACHED_PER_S = _sig(
    "server.prompt_tokens_cached_per_s", "tokens/s",
    "Prompt tokens served from the prefix cache per second, not computed (vLLM prompt_tokens_cached).")
SERVER_EST_FLOPS_PER_S = _sig(
    "server.est_flops_per_s", "FLOP/s",
    "FLOP/s per GPU the engine estimates its work performs (vLLM estimated_flops_per_gpu_total; zero on its CPU "
    "build, so then absent).")
SERVER_EST_READ_BYTES_PER_S = _sig(
    "server.est_read_bytes_per_s", "B/s",
    "Bytes per second per GPU the engine estimates it reads from memory (vLLM estimated_read_bytes_per_gpu_total).")
SERVER_EST_WRITE_BYTES_PER_S = _sig(
    "server.est_write_bytes_per_s", "B/s",
    "Bytes per second per GPU the engine estimates it writes to memory (vLLM estimated_write_bytes_per_gpu_total).")
SERVER_ADMISSION_REJECTIONS_PER_S = _sig(
    "server.admission_rejections_per_s", "1/s",
    "Requests refused at admission per second because the queue was full (vLLM admission_rejections_total).")
SERVER_TTFT_P50_S = _sig("server.ttft_p50_s", "s", "Time to first token, median over the window.")
SERVER_TTFT_P99_S = _sig("server.ttft_p99_s", "s", "Time to first token, p99 over the window.")
SERVER_ITL_P50_S = _sig("server.itl_p50_s", "s", "Inter-token latency, median over the window.")
SERVER_ITL_P99_S = _sig("server.itl_p99_s", "s", "Inter-token latency, p99 over the window.")
SERVER_BATCH_SIZE = _sig("server.batch_size", "sequences", "Sequences per engine iteration (mean over the window).")
# inference server: what the engines' own pages add (collectors/server_maps.py says which name gives which)
SERVER_WAITING_DEFERRED = _sig(
    "server.waiting_deferred", "requests",
    "Requests waiting for a transient reason (LoRA budget, KV transfer), not for capacity (vLLM).")
SERVER_KV_USED_TOKENS = _sig("server.kv_used_tokens", "tokens", "KV-cache tokens in use (SGLang num_used_tokens).")
SERVER_CPU_KV_USAGE = _sig("server.cpu_kv_usage", "ratio", "CPU (swap) KV-cache blocks in use (vLLM V0).")
SERVER_SWAPPED = _sig("server.swapped", "requests", "Requests swapped out to CPU memory (vLLM V0).")
SERVER_RETRACTED = _sig(
    "server.retracted", "requests",
    "Requests retracted from the running batch for lack of KV space (SGLang gauge).")
SERVER_RETRACTIONS_PER_S = _sig(
    "server.retractions_per_s", "1/s",
    "Requests retracted per second for lack of KV space (SGLang counter).")
SERVER_PAUSED = _sig(
    "server.paused", "requests",
    "Requests paused for lack of KV blocks (TensorRT-LLM in-flight batcher).")
SERVER_PAUSED_WEIGHT_SYNC = _sig(
    "server.paused_weight_sync", "requests",
    "Requests paused while the engine takes new weights (SGLang num_paused_reqs: async weight sync), not for KV.")
SERVER_PREFILL_REQUESTS = _sig(
    "server.prefill_requests", "requests",
    "Requests in their context (prefill) phase in the current step (TensorRT-LLM).")
SERVER_BATCH_RESERVED_TOKENS = _sig(
    "server.batch_reserved_tokens", "tokens",
    "Tokens the running batch has reserved: prompts plus max_new_tokens (TGI).")
SERVER_PREFIX_CACHE_HIT_RATE = _sig(
    "server.prefix_cache_hit_rate", "ratio",
    "Prompt tokens served from the prefix cache over prompt tokens queried, over the window.")
SERVER_SPEC_ACCEPTANCE_RATE = _sig(
    "server.spec_acceptance_rate", "ratio",
    "Draft tokens accepted over draft tokens proposed (speculative decoding), over the window.")
SERVER_SPEC_MEAN_ACCEPT_LEN = _sig(
    "server.spec_mean_accept_len", "tokens",
    "Tokens emitted per verification step, the bonus token included (speculative decoding).")
SERVER_SPEC_DRAFTS_PER_TOKEN = _sig(
    "server.spec_drafts_per_token", "ratio",
    "Speculative drafts proposed per generated token over the window (vLLM spec_decode_num_drafts_total over "
    "generation_tokens_total): about the share of a sequence's decode steps that carried a draft.")
SERVER_SPEC_DRAFT_LEN = _sig(
    "server.spec_draft_len", "tokens",
    "Draft tokens proposed per draft (the speculative length k).")
SERVER_LORA_RUNNING_ADAPTERS = _sig(
    "server.lora_running_adapters", "adapters",
    "Distinct LoRA adapters in the running batch.")
SERVER_LORA_WAITING_ADAPTERS = _sig(
    "server.lora_waiting_adapters", "adapters",
    "Distinct LoRA adapters among waiting requests.")
SERVER_TTFT_MEAN_S = _sig("server.ttft_mean_s", "s", "Time to first token, mean over the window.")
SERVER_ITL_MEAN_S = _sig("server.itl_mean_s", "s", "Inter-token latency, mean over the window.")
SERVER_TPOT_P50_S = _sig("server.tpot_p50_s", "s", "Per request, mean time per output token, median over the window.")
SERVER_TPOT_P99_S = _sig("server.tpot_p99_s", "s", "Per request, mean time per output token, p99 over the window.")
SERVER_TPOT_MEAN_S = _sig("server.tpot_mean_s", "s", "Per request, mean time per output token, mean over the window.")
SERVER_QUEUE_TIME_P50_S = _sig(
    "server.queue_time_p50_s", "s",
    "Per request, time waiting to be scheduled, median over the window.")
SERVER_QUEUE_TIME_P99_S = _sig(
    "server.queue_time_p99_s", "s",
    "Per request, time waiting to be scheduled, p99 over the window.")
SERVER_QUEUE_TIME_MEAN_S = _sig(
    "server.queue_time_mean_s", "s",
    "Per request, time waiting to be scheduled, mean over the window.")
SERVER_PREFILL_TIME_P50_S = _sig(
    "server.prefill_time_p50_s", "s",
    "Per request, time in prefill, median over the window.")
SERVER_PREFILL_TIME_P99_S = _sig("server.prefill_time_p99_s", "s", "Per request, time in prefill, p99 over the window.")
SERVER_PREFILL_TIME_MEAN_S = _sig(
    "server.prefill_time_mean_s", "s",
    "Per request, time in prefill, mean over the window.")
SERVER_PREFILL_TIME_PER_TOKEN_P50_S = _sig(
    "server.prefill_time_per_token_p50_s", "s",
    "Per request, prefill time per prompt token, median over the window.")
SERVER_PREFILL_TIME_PER_TOKEN_P99_S = _sig(
    "server.prefill_time_per_token_p99_s", "s",
    "Per request, prefill time per prompt token, p99 over the window.")
SERVER_PREFILL_TIME_PER_TOKEN_MEAN_S = _sig(
    "server.prefill_time_per_token_mean_s", "s",
    "Per request, prefill time per prompt token, mean over the window.")
SERVER_DECODE_TIME_P50_S = _sig("server.decode_time_p50_s", "s", "Per request, time in decode, median over the window.")
SERVER_DECODE_TIME_P99_S = _sig("server.decode_time_p99_s", "s", "Per request, time in decode, p99 over the window.")
SERVER_DECODE_TIME_MEAN_S = _sig("server.decode_time_mean_s", "s", "Per request, time in decode, mean over the window.")
SERVER_INFERENCE_TIME_P50_S = _sig(
    "server.inference_time_p50_s", "s",
    "Per request, time running (prefill + decode), median over the window.")
SERVER_INFERENCE_TIME_P99_S = _sig(
    "server.inference_time_p99_s", "s",
    "Per request, time running (prefill + decode), p99 over the window.")
SERVER_INFERENCE_TIME_MEAN_S = _sig(
    "server.inference_time_mean_s", "s",
    "Per request, time running (prefill + decode), mean over the window.")
SERVER_E2E_P50_S = _sig("server.e2e_p50_s", "s", "Per request, end-to-end latency, median over the window.")
SERVER_E2E_P99_S = _sig("server.e2e_p99_s", "s", "Per request, end-to-end latency, p99 over the window.")
SERVER_E2E_MEAN_S = _sig("server.e2e_mean_s", "s", "Per request, end-to-end latency, mean over the window.")
SERVER_PREFILL_STEP_P50_S = _sig(
    "server.prefill_step_p50_s", "s",
    "One prefill forward pass of a batch, median over the window.")
SERVER_PREFILL_STEP_P99_S = _sig(
    "server.prefill_step_p99_s", "s",
    "One prefill forward pass of a batch, p99 over the window.")
SERVER_PREFILL_STEP_MEAN_S = _sig(
    "server.prefill_step_mean_s", "s",
    "One prefill forward pass of a batch, mean over the window.")
SERVER_DECODE_STEP_P50_S = _sig(
    "server.decode_step_p50_s", "s",
    "One decode forward pass of a batch, median over the window.")
SERVER_DECODE_STEP_P99_S = _sig(
    "server.decode_step_p99_s", "s",
    "One decode forward pass of a batch, p99 over the window.")
SERVER_DECODE_STEP_MEAN_S = _sig(
    "server.decode_step_mean_s", "s",
    "One decode forward pass of a batch, mean over the window.")
SERVER_PROMPT_LEN_P50 = _sig("server.prompt_len_p50", "tokens", "Prompt tokens per request, median over the window.")
SERVER_PROMPT_LEN_P99 = _sig("server.prompt_len_p99", "tokens", "Prompt tokens per request, p99 over the window.")
SERVER_PROMPT_LEN_MEAN = _sig("server.prompt_len_mean", "tokens", "Prompt tokens per request, mean over the window.")
SERVER_GEN_LEN_P50 = _sig("server.gen_len_p50", "tokens", "Generated tokens per request, median over the window.")
SERVER_GEN_LEN_P99 = _sig("server.gen_len_p99", "tokens", "Generated tokens per request, p99 over the window.")
SERVER_GEN_LEN_MEAN = _sig("server.gen_len_mean", "tokens", "Generated tokens per request, mean over the window.")
SERVER_MAX_TOKENS_P50 = _sig(
    "server.max_tokens_p50", "tokens",
    "The max_tokens (max_new_tokens) requests asked for, median over the window.")
SERVER_MAX_TOKENS_P99 = _sig(
    "server.max_tokens_p99", "tokens",
    "The max_tokens (max_new_tokens) requests asked for, p99 over the window.")
SERVER_MAX_TOKENS_MEAN = _sig(
    "server.max_tokens_mean", "tokens",
    "The max_tokens (max_new_tokens) requests asked for, mean over the window.")
SERVER_MAX_GEN_LEN_P50 = _sig(
    "server.max_gen_len_p50", "tokens",
    "Per request, the most tokens any of its n sequences generated, median over the window.")
SERVER_MAX_GEN_LEN_P99 = _sig(
    "server.max_gen_len_p99", "tokens",
    "Per request, the most tokens any of its n sequences generated, p99 over the window.")
SERVER_MAX_GEN_LEN_MEAN = _sig(
    "server.max_gen_len_mean", "tokens",
    "Per request, the most tokens any of its n sequences generated, mean over the window.")
SERVER_PARAMS_N_P50 = _sig(
    "server.params_n_p50", "sequences",
    "The n (parallel sequences) requests asked for, median over the window.")
SERVER_PARAMS_N_P99 = _sig(
    "server.params_n_p99", "sequences",
    "The n (parallel sequences) requests asked for, p99 over the window.")
SERVER_PARAMS_N_MEAN = _sig(
    "server.params_n_mean", "sequences",
    "The n (parallel sequences) requests asked for, mean over the window.")
SERVER_ITERATION_TOKENS_P50 = _sig(
    "server.iteration_tokens_p50", "tokens",
    "Tokens per engine step (prefill + decode), median over the window.")
SERVER_ITERATION_TOKENS_P99 = _sig(
    "server.iteration_tokens_p99", "tokens",
    "Tokens per engine step (prefill + decode), p99 over the window.")
SERVER_ITERATION_TOKENS_MEAN = _sig(
    "server.iteration_tokens_mean", "tokens",
    "Tokens per engine step (prefill + decode), mean over the window.")

# --- trace-derived (one value per window) ---------------------------------------------------------
TRACE_GPU_IDLE_FRAC = _sig("trace.gpu_idle_frac", "ratio", "Fraction of the traced window no kernel or copy ran.")
TRACE_IDLE_HOST_FRAC = _sig(
    "trace.idle.host_frac", "ratio",
    "Idle time while the host had not launched the next kernel.")
TRACE_IDLE_SYNC_FRAC = _sig("trace.idle.sync_frac", "ratio", "Idle time in gaps that began with the host in a "
                            "synchronisation or a blocking copy.")
TRACE_IDLE_PAGEABLE_MEMCPY_FRAC = _sig(
    "trace.idle.pageable_memcpy_frac", "ratio",
    "Idle time around copies from pageable host memory.")
TRACE_IDLE_QUEUE_DRY_FRAC = _sig("trace.idle.queue_dry_frac", "ratio", "Idle time with nothing to do (no work queued).")
TRACE_IDLE_KERNEL_OVERHEAD_FRAC = _sig("trace.idle.kernel_overhead_frac", "ratio", "Short kernel-to-kernel gaps.")
TRACE_SHARE_GEMM = _sig("trace.share.gemm", "ratio", "Share of GPU busy time in GEMMs.")
TRACE_SHARE_ATTENTION = _sig("trace.share.attention", "ratio", "Share of GPU busy time in attention kernels.")
TRACE_SHARE_COMM = _sig("trace.share.comm", "ratio", "Share of GPU busy time in communication (NCCL) kernels.")
TRACE_SHARE_MEMCPY = _sig("trace.share.memcpy", "ratio", "Share of GPU busy time in copies.")
TRACE_SHARE_ELEMENTWISE = _sig(
    "trace.share.elementwise", "ratio",
    "Share of GPU busy time in normalisation, elementwise and reduction kernels.")
TRACE_SHORT_KERNEL_FRAC = _sig("trace.short_kernel_frac", "ratio", "Kernels shorter than their own launch call.")
TRACE_KERNELS_PER_S = _sig("trace.kernels_per_s", "1/s", "Kernels launched per second of the window.")
TRACE_CUDA_GRAPH_LAUNCHES = _sig("trace.cuda_graph_launches", "count", "CUDA graph replays in the window.")
TRACE_IDLE_STREAM_WAIT_FRAC = _sig(
    "trace.idle.stream_wait_frac", "ratio",
    "Idle time while work was already queued: waits on another stream, an event or a collective, not on the host.")
TRACE_SHARE_EMBEDDING = _sig(
    "trace.share.embedding", "ratio",
    "Share of GPU busy time in embedding gathers and permutes (fbgemm split_embedding_*, index_select): memory-bound.")
TRACE_SHARE_ALL_TO_ALL = _sig(
    "trace.share.all_to_all", "ratio", "Share of GPU busy time in all-to-all collectives (MoE, sharded embeddings).")
TRACE_FP32_SHARE = _sig(
    "trace.fp32_share", "ratio",
    "Share of GPU busy time in the trace's top kernels that are FP32 or TF32 GEMMs (by their names).")
TRACE_RANK_IMBALANCE = _sig(
    "trace.rank_imbalance", "ratio",
    "The busiest rank's compute share over the median rank's, in a multi-rank trace (1 = balanced).")
TRACE_GRAPH_KERNEL_FRAC = _sig(
    "trace.graph_kernel_frac", "ratio",
    "Share of the traced kernels launched from CUDA (or HIP) graph replays.")
TRACE_COMM_EXPOSED_FRAC = _sig(
    "trace.comm_exposed_frac", "ratio",
    "Share of the window in communication kernels that no compute kernel overlapped.")
TRACE_COLLECTIVES_PER_STEP = _sig(
    "trace.collectives_per_step", "count",
    "Communication kernels (collectives) a profiler step, per device.")
TRACE_COLLECTIVE_S_P50 = _sig("trace.collective_s_p50", "s", "Median time of one communication kernel.")
TRACE_COLLECTIVE_HOST_FRAC = _sig(
    "trace.collective_host_frac", "ratio",
    "Share of the window the host spent issuing collectives (c10d ops, record_param_comms).")
TRACE_INTENSITY = _sig(
    "trace.intensity", "FLOP/B",
    "Time-weighted arithmetic intensity of ops with known FLOPs and bytes.")
TRACE_DECODE_BATCH = _sig("trace.decode_batch", "sequences", "Batch of the decode steps: the engine's own step "
                          "annotations where it wrote them, else inferred from the kernels.")
TRACE_PREFILL_FRAC = _sig("trace.prefill_frac", "ratio", "Share of step time in prefill steps: the engine's own step "
                          "annotations where it wrote them, else inferred from the GPU kernels.")

# --- physics (derived from hardware + model) ------------------------------------------------------
THEORY_RIDGE_FLOP_PER_BYTE = _sig(
    "theory.ridge_flop_per_byte", "FLOP/B",
    "Ridge point of the GPU at the model's precision.")
THEORY_DECODE_CEILING_TOKENS_PER_S = _sig(
    "theory.decode_ceiling_tokens_per_s", "tokens/s",
    "Decode tokens/s ceiling at the observed batch (weights + KV over bandwidth).")
THEORY_RIDGE_BATCH = _sig("theory.ridge_batch", "sequences", "Decode batch at which intensity reaches the ridge.")
THEORY_WEIGHT_BYTES = _sig("theory.weight_bytes", "bytes", "Bytes of the model's weights.")
THEORY_INTENSITY = _sig(
    "theory.intensity", "FLOP/B",
    "Arithmetic intensity of a decode step at the observed batch: 2 x active params x batch over the bytes it reads.")
THEORY_HBM_ROOF_FRAC = _sig(
    "theory.hbm_roof_frac", "ratio",
    "Bytes the decode steps read per second (from the measured token rate) over the memory bandwidth roof.")
THEORY_COMPUTE_ROOF_FRAC = _sig(
    "theory.compute_roof_frac", "ratio",
    "Model FLOP/s (2 x active params per prompt or generated token, from the measured rates) over the tensor peak.")
THEORY_EFFICIENCY = _sig("theory.efficiency", "ratio", "Achieved generation tokens/s over the decode ceiling.")
THEORY_DECODE_SHARE = _sig(
    "theory.decode_share", "ratio",
    "Decode's share of the least GPU time the served tokens need (decode at its ceiling vs prefill at the tensor "
    "peak).")

# --- energy and cost (derived from measured rates and power) --------------------------------------
ENERGY_TOKENS_PER_JOULE = _sig("energy.tokens_per_joule", "tokens/J", "Generated tokens per joule of GPU board energy.")
ENERGY_USD_PER_MILLION_TOKENS = _sig(
    "energy.usd_per_million_tokens", "USD",
    "GPU cost per million generated tokens at the given $/GPU-hour.")


# Kept for readers of the old name: the registry by name.
SPECS = REGISTRY


def known(name: str) -> Sig:
    """The registered signal of this name; one sentence if there is none."""
    found = REGISTRY.get(name)
    if found is None:
        raise InputError(f"'{name}' is not a known signal name (diagnoser.signals lists them).")
    return found


def spec(name: str) -> Sig:
    """The signal of this name; an unknown name (a newer capture's) gets a neutral one, so it still renders."""
    found = REGISTRY.get(name)
    return found if found is not None else Sig(name, "", "")
