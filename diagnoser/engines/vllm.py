"""vLLM's scheduler knobs (V1 engine), as read from vLLM 0.32's own source: EngineArgs.get_batch_defaults and
_set_default_max_num_seqs_and_batched_tokens_args (engine/arg_utils.py), SchedulerConfig (config/scheduler.py),
CacheConfig (config/cache.py) and CpuPlatform.check_and_update_config (platforms/cpu.py). Defaults are those of the
OpenAI API server (`vllm serve`), the usage context diagnoser attaches to.

Each step the scheduler admits running and waiting requests while three budgets last: sequences
(max_num_seqs), tokens (max_num_batched_tokens: every decode costs one, a prompt chunk its length) and KV blocks
(the pool sized by the KV knobs). A prompt longer than the token budget is prefilled over several steps (chunked
prefill); a request longer than max_model_len is refused with HTTP 400 before it is queued.
"""

from __future__ import annotations

from diagnoser.diagnosis import FixKind
from diagnoser.engines.knobs import ByPlatform, Default, Direction, Knob

V1 = (0, 10)  # the V1 engine's defaults as tabled here hold from 0.10 (the API server's per-device table) on

MAX_NUM_SEQS = Knob(
    "max_num_seqs", "running-sequence limit", ("--max-num-seqs",),
    constrains="sequences in one step (the running batch)",
    binds="the running batch at the limit while requests wait and the KV cache and token budget have room",
    relieves=Direction.RAISE,
    trades="more KV memory in use and a longer step; past the device's ridge, longer inter-token latency",
    bounds="the decode physics at the larger batch (the ridge) where the model and device are known; the KV "
    "pool's room and the token budget otherwise",
    fixes={Direction.RAISE: FixKind.BATCH_MORE, Direction.LOWER: FixKind.STOP_PREEMPTION},
    defaults=(Default(V1, ByPlatform(cpu=128, gpu=256, gpu_70g=1024, gpu_160g=1024, per_rank=True),
                      "vLLM >= 0.10 default, API server"),),
)
MAX_NUM_BATCHED_TOKENS = Knob(
    "max_num_batched_tokens", "per-step token budget", ("--max-num-batched-tokens",),
    constrains="tokens in one step: one per decoding sequence, a prompt chunk's length per prefilling one",
    binds="prompts longer than the budget (each prefilled over several steps) or a step's decodes and chunks "
    "filling it, while requests wait with the running batch below its limit",
    relieves=Direction.RAISE,
    trades="raised: fewer, longer prefill steps (shorter time to first token, but the decodes that share a step "
    "wait longer); lowered: shorter steps (a tighter inter-token tail) and longer time to first token",
    bounds="prompt tokens per step: a prompt needs ceil(prompt / budget) steps, and no step runs faster than "
    "its compute",
    fixes={Direction.RAISE: FixKind.TOKEN_BUDGET, Direction.LOWER: FixKind.CAP_PREFILL},
    defaults=(Default(V1, ByPlatform(cpu=2048, gpu=2048, gpu_70g=8192, gpu_160g=16384, per_rank=True),
                      "vLLM >= 0.10 default, API server"),),
)
CHUNKED_PREFILL = Knob(
    "chunked_prefill", "chunked prefill", ("--enable-chunked-prefill",),
    constrains="whether a prompt longer than the token budget is split over steps",
    binds="long prompts holding whole steps (chunking off)",
    relieves=Direction.ON, trades="more steps per prompt", bounds="the decode stall a whole-prompt step causes",
    fixes={Direction.ON: FixKind.SPLIT_PREFILL},
    defaults=(Default(V1, True, "vLLM >= 0.10 default for generative models"),), kind=bool,
)
LONG_PREFILL_THRESHOLD = Knob(
    "long_prefill_token_threshold", "long-prefill chunk cap", ("--long-prefill-token-threshold",),
    constrains="prompt tokens one long request may take of a step (0: no cap)",
    binds="a long prompt's chunks filling steps while short requests decode (a tail of slow inter-token gaps)",
    relieves=Direction.LOWER, trades="longer time to first token for long prompts",
    bounds="the p99 inter-token latency falls at most to the median",
    fixes={Direction.LOWER: FixKind.CAP_PREFILL, Direction.RAISE: FixKind.TOKEN_BUDGET},
    defaults=(Default(V1, 0, "vLLM >= 0.10 default (no cap)"),), zero_is_unlimited=True,
)
MAX_MODEL_LEN = Knob(
    "max_model_len", "context length", ("--max-model-len",),
    constrains="prompt + output tokens of one request; longer prompts are refused (HTTP 400)",
    binds="4xx answers for prompts over the limit",
    relieves=Direction.RAISE, trades="more KV memory per sequence at the longest contexts",
    bounds="the model's own position limit (max_position_embeddings) and the KV pool",
    fixes={Direction.RAISE: FixKind.CONTEXT_LENGTH},
)
GPU_MEMORY_UTILIZATION = Knob(
    "gpu_memory_utilization", "GPU memory share", ("--gpu-memory-utilization",), page=("gpu_memory_utilization",),
    constrains="the KV pool (what is left of this share of GPU memory after weights and activations)",
    binds="KV use near full with requests waiting or preempted", relieves=Direction.RAISE,
    trades="memory other processes on the GPU could use", bounds="the sequences the larger pool holds",
    fixes={Direction.RAISE: FixKind.KV_MEMORY},
    defaults=(Default(V1, 0.92, "vLLM 0.32 default"),), kind=float,
)
NUM_GPU_BLOCKS_OVERRIDE = Knob(
    "num_gpu_blocks_override", "KV blocks pinned", ("--num-gpu-blocks-override",), page=("num_gpu_blocks_override",),
    constrains="the KV pool, in blocks, whatever the memory", binds="KV use near full with requests waiting",
    relieves=Direction.RAISE, trades="memory", bounds="the sequences the larger pool holds",
    fixes={Direction.RAISE: FixKind.KV_MEMORY},
)
KV_CACHE_MEMORY_BYTES = Knob(
    "kv_cache_memory_bytes", "KV pool bytes", ("--kv-cache-memory-bytes", "--kv-cache-memory"),
    env=("VLLM_CPU_KVCACHE_SPACE",), env_scale=float(1 << 30),
    constrains="the KV pool, in bytes (VLLM_CPU_KVCACHE_SPACE in GiB on a CPU build)",
    binds="KV use near full with requests waiting", relieves=Direction.RAISE, trades="memory",
    bounds="the sequences the larger pool holds", fixes={Direction.RAISE: FixKind.KV_MEMORY},
)
KV_CACHE_DTYPE = Knob(
    "kv_cache_dtype", "KV precision", ("--kv-cache-dtype",), page=("cache_dtype",),
    constrains="bytes per KV token", binds="KV use near full", relieves=None,
    trades="accuracy at FP8", bounds="twice the sequences at FP8 against 16-bit",
    fixes={}, defaults=(Default(V1, "auto", "vLLM default (the model's precision)"),), kind=str,
)
BLOCK_SIZE = Knob(
    "block_size", "KV block size", ("--block-size",), page=("block_size",),
    constrains="tokens per KV block (a sequence's last block is partly empty)",
    binds="many short sequences each wasting part of a block", relieves=Direction.LOWER,
    trades="kernel efficiency (the CPU build wants multiples of 32)", bounds="half a block per sequence",
    fixes={},
    defaults=(Default(V1, ByPlatform(cpu=128, gpu=16, gpu_70g=16, gpu_160g=16), "vLLM 0.32 default"),),
)
PREFIX_CACHING = Knob(
    "prefix_caching", "prefix caching", ("--enable-prefix-caching",),  # --no-enable-prefix-caching turns it off
    page=("enable_prefix_caching",),
    constrains="whether a prompt's blocks already in the pool are reused instead of prefilled",
    binds="prompts that share prefixes (hits against queries, with caching on) recomputed with it off",
    relieves=Direction.ON, trades="nothing measurable when prompts share nothing",
    bounds="the prompt tokens the hits would save", fixes={Direction.ON: FixKind.PREFIX_CACHING},
    defaults=(Default(V1, True, "vLLM >= 0.10 default for generative models"),), kind=bool,
)
SPECULATIVE_CONFIG = Knob(
    "speculative_config", "speculative decoding", ("--speculative-config",),
    constrains="draft tokens proposed and verified per step",
    binds="drafts rarely accepted, or rarely proposed, while the speculative path costs every step",
    relieves=Direction.OFF, trades="decode speed at high acceptance", bounds="the step time the path costs",
    fixes={Direction.OFF: FixKind.SPEC_DECODE, Direction.ON: FixKind.SPEC_DECODE}, kind=str,
)
TENSOR_PARALLEL_SIZE = Knob(
    "tensor_parallel_size", "tensor parallel size", ("--tensor-parallel-size", "-tp"),
    constrains="GPUs one step's weights are split over", binds="weights or KV not fitting one GPU",
    relieves=Direction.RAISE, trades="collectives every layer", bounds="the interconnect",
    fixes={Direction.RAISE: FixKind.ADD_GPUS, Direction.LOWER: FixKind.REDUCE_TP},
    defaults=(Default(V1, 1, "vLLM default"),),
)
DATA_PARALLEL_SIZE = Knob(
    "data_parallel_size", "data parallel size", ("--data-parallel-size", "-dp"),
    constrains="engine replicas behind one server", binds="every replica's batch at its limit",
    relieves=Direction.RAISE, trades="more GPUs, one engine replica each", bounds="the replicas added",
    fixes={Direction.RAISE: FixKind.ADD_GPUS},
    defaults=(Default(V1, 1, "vLLM default"),),
)
SCHEDULING_POLICY = Knob(
    "scheduling_policy", "scheduling policy", ("--scheduling-policy",),
    constrains="which waiting request is admitted first (fcfs or priority)", binds="a queue (waiting > 0)",
    relieves=None, trades="fairness", bounds="none: it reorders, it adds no capacity", fixes={},
    defaults=(Default(V1, "fcfs", "vLLM default"),), kind=str,
)
MAX_NUM_QUEUED_REQS = Knob(
    "max_num_queued_reqs", "admission limit", ("--max-num-queued-reqs",),
    constrains="requests in flight (waiting or running); beyond it new requests get HTTP 503",
    binds="a queue that grows all window (offered load above what the server serves)",
    relieves=Direction.LOWER, trades="refused requests (the client retries elsewhere) instead of unbounded waits",
    bounds="it adds no capacity: it bounds latency by refusing load",
    fixes={Direction.LOWER: FixKind.ADMISSION},
)

KNOBS: tuple[Knob, ...] = (
    MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, CHUNKED_PREFILL, LONG_PREFILL_THRESHOLD, MAX_MODEL_LEN,
    GPU_MEMORY_UTILIZATION, NUM_GPU_BLOCKS_OVERRIDE, KV_CACHE_MEMORY_BYTES, KV_CACHE_DTYPE, BLOCK_SIZE, PREFIX_CACHING,
    SPECULATIVE_CONFIG, TENSOR_PARALLEL_SIZE, DATA_PARALLEL_SIZE, SCHEDULING_POLICY, MAX_NUM_QUEUED_REQS,
)
BY_NAME = {k.name: k for k in KNOBS}
