"""The self-test scenarios: real torch workloads whose limiter is known in advance, sized to the device at hand.

Each scenario is a `Scenario` (what it is, the verdicts that count as right) and a `Plan` (model shape, batch,
context, KV slots, host work), computed by `plan()` from the device's memory. `diagnoser.selftest.workload` runs a
plan as a child process with its own vLLM-named /metrics; `diagnoser.selftest.harness` attaches to it and compares.

Sizes: "auto" on a GPU is a 1-3B-parameter decoder in bf16 (2.4B where 32 GiB or more are free, else 1.1B) and a
small one for the launch-bound case; "toy" (and every CPU run) is a two-layer model that tests the harness end to end
in seconds. A CPU run's verdicts are never GPU verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from diagnoser.capture import ModelInfo

GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def params(self) -> int:
        """Exact parameter count of Decoder(self): attention and MLP matrices, norms, embeddings and the head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes

    def model_info(self, dtype: str, max_context: int, kv_dtype: str = "") -> ModelInfo:
        return ModelInfo(name=self.name, params=float(self.params()), active_params=float(self.params()),
                         layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                         head_dim=self.head_dim, vocab=self.vocab, dtype=dtype, kv_dtype=kv_dtype or dtype,
                         max_context=max_context)


SHAPES = {
    # Harness tests on the CPU.
    "toy": Shape("selftest-toy", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256),
    # Small enough that every kernel is a few microseconds on a GPU: launches, not math, set the pace.
    "tiny": Shape("selftest-tiny-22m", layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=688,
                  vocab=32000),
    # TinyLlama-1.1B's shape and Llama-like 2.4B: the 1-3B range the issue asks for.
    "1.1b": Shape("selftest-random-1.1b", layers=22, hidden=2048, heads=32, kv_heads=4, head_dim=64,
                  intermediate=5632, vocab=32000),
    "2.4b": Shape("selftest-random-2.4b", layers=32, hidden=2560, heads=20, kv_heads=4, head_dim=128,
                  intermediate=6912, vocab=32000),
}
BIG_MODEL_MIN_FREE = 32 * GIB


@dataclass(frozen=True)
class Scenario:
    name: str
    expected: tuple[str, ...]  # Limiter values that count as the right verdict
    title: str
    why: str  # why this workload has that limiter
    gpu_only: bool = False
    # A limiter that must be among the findings too (primary or secondary), when the verdict alone cannot say it.
    required_finding: str = ""


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("decode-b1", ("latency", "memory_bandwidth"), "decode at batch 1, CUDA graphs",
             "each step reads every weight to make one token: far below the ridge point, the memory-bound regime; "
             "whether HBM is saturated depends on the kernels (this workload's unfused ones reach about a third of "
             "the roof on an H100: kernel-bound)"),
    Scenario("decode-b16", ("latency", "memory_bandwidth"), "decode at batch 16, CUDA graphs",
             "16 tokens per weight read is still far below the ridge batch (hundreds on H100): the memory-bound "
             "regime, and about 16x the tokens/s of batch 1 (the batch-gain physics check)"),
    Scenario("decode-fp8", ("latency", "memory_bandwidth"), "decode at batch 1 with FP8 weights, CUDA graphs",
             "FP8 weights halve the bytes each step reads, but batch 1 stays far below the ridge point: still the "
             "memory-bound regime, faster than decode-b1 (the quantisation-gain physics check)"),
    Scenario("prefill", ("compute",), "long prefill (4 x 2048 tokens)",
             "thousands of tokens per weight read put every GEMM far above the ridge: the tensor cores set the pace"),
    Scenario("launch", ("batching", "host_launch"), "tiny model at batch 1, eager, host work between steps",
             "kernels of a few microseconds launched one by one with Python between steps, requests queued: the GPU "
             "idles between launches while work waits"),
    Scenario("kv-full", ("vram",), "KV cache filling the GPU memory, requests waiting",
             "every KV slot is taken and more requests wait: memory caps the batch"),
    Scenario("host-bound", ("host_launch",), "decode at batch 1 with Python work after every step",
             "the serving thread is busy with Python (sampling, detokenising) between steps and the GPU waits for it"),
    Scenario("throttled", ("throttling", "compute"), "long prefill on a power-capped GPU",
             "a power cap below the board default holds the SM clock down under tensor load; the prefill is "
             "compute-bound as well, so either may lead, but throttling must be found", gpu_only=True,
             required_finding="throttling"),
)}
DEFAULT_ORDER = ("decode-b1", "decode-b16", "decode-fp8", "prefill", "launch", "kv-full", "host-bound", "throttled")


@dataclass(frozen=True)
class Plan:
    """How one scenario runs on one device."""

    scenario: str
    shape: Shape
    dtype: str  # "bf16" on a GPU, "fp32" on the CPU: activations, KV cache, embeddings, head
    mode: str  # "decode" or "prefill"
    batch: int = 1  # decode: most sequences per step (the scheduler's limit, like vLLM --max-num-seqs)
    kv_slots: int = 16  # decode: sequences the KV pool holds; usage = running sequences / kv_slots
    max_ctx: int = 1024  # decode: tokens per KV slot (each step reads all of them)
    prompt: int = 128  # decode: prompt tokens prefilled when a sequence starts
    prefill_batch: int = 4
    prefill_len: int = 2048
    clients: int = 1  # concurrent requests; those beyond `batch` wait in the queue
    graph: bool = True  # decode replays a CUDA graph (GPU only)
    host_work: float = 0.0  # Python work after each step, as a multiple of the measured step time
    sync_every_step: bool = False  # read the new tokens back each step, as a server that streams them does
    fill_memory: float = 0.0  # decode: size the KV pool to this fraction of free device memory, batch = pool
    weights: str = ""  # "fp8": attention and MLP weights in FP8 (needs FP8 tensor cores on a GPU); "": as dtype
    compiled: bool = False  # decode: the step goes through torch.compile (selftest --compile)

    @property
    def weight_dtype(self) -> str:
        return self.weights or self.dtype


def big_shape(free_bytes: int | None) -> Shape:
    return SHAPES["2.4b"] if free_bytes is not None and free_bytes >= BIG_MODEL_MIN_FREE else SHAPES["1.1b"]


def plan(name: str, *, device: str, size: str = "auto", free_bytes: int | None = None) -> Plan:
    """The plan of scenario `name` on `device` ("cuda" or "cpu"). CPU runs are always toy-sized."""
    if name not in SCENARIOS:
        raise KeyError(name)
    toy = size == "toy" or device == "cpu"
    shape = SHAPES["toy"] if toy else big_shape(free_bytes)
    base = Plan(name, shape, "fp32" if device == "cpu" else "bf16", "decode", graph=device != "cpu" and not toy)
    if toy:
        base = replace(base, max_ctx=128, prompt=16, prefill_batch=2, prefill_len=64)
    if name == "decode-b1":
        return base
    if name == "decode-b16":
        return replace(base, batch=16, kv_slots=64, clients=16)
    if name == "decode-fp8":
        return replace(base, weights="fp8")
    if name in ("prefill", "throttled"):
        return replace(base, mode="prefill", clients=base.prefill_batch)
    if name == "launch":
        tiny = base.shape if toy else SHAPES["tiny"]
        return replace(base, shape=tiny, graph=False, clients=8, host_work=1.0, sync_every_step=True,
                       max_ctx=min(base.max_ctx, 512))
    if name == "kv-full":
        if toy:
            return replace(base, batch=8, kv_slots=8, clients=12)
        return replace(base, max_ctx=2048, prompt=256, fill_memory=0.9)
    if name == "host-bound":
        return replace(base, host_work=1.5, sync_every_step=True)
    raise KeyError(name)


def kv_slots_to_fill(shape: Shape, element_bytes: int, max_ctx: int, free_bytes: int, fraction: float,
                     reserve_bytes: int) -> int:
    """KV slots of `max_ctx` tokens that fill `fraction` of the free memory after the weights are loaded, keeping
    `reserve_bytes` for activations and the CUDA graph's pool."""
    room = free_bytes * fraction - reserve_bytes
    per_slot = shape.kv_bytes_per_token(element_bytes) * max_ctx
    return max(1, int(room // per_slot))
