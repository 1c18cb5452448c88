"""Tensor- and pipeline-parallel costs: the collectives a sharded decode step waits for, and a pipeline's bubble.

Megatron-style tensor parallelism (Shoeybi et al. 2019, section 3) splits each attention and MLP block so that one
all-reduce of the block's output, batch x hidden activations, ends it: two per transformer layer, plus a gather of
the vocabulary-parallel logits per step. They sit between dependent matrix multiplies, so their time adds to the
step. Each all-reduce's bandwidth term is a ring's (Patarasuk & Yuan 2009): every GPU sends and receives 2(n-1)/n
of the message over its link. Its latency is one fixed figure per collective, whatever the GPU count: small messages
go by one-shot or tree algorithms (NCCL's LL protocol, vLLM's and TRT-LLM's custom all-reduce), not by a ring's
2(n-1) steps. A latency growing as log2(n) was tried against the published gpt-fast TP runs (tests/fixtures/
published): it under-predicted TP 8 by 12-17 % where the flat figure comes within 1-12 %, so the flat one stays.
docs/physics.md has the numbers and their sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.gpus import GpuSpec

# Per-collective latency: a small all-reduce inside one NVLink node takes a few microseconds (vLLM's and TRT-LLM's
# one-shot custom all-reduce kernels, NCCL's LL protocol); across PCIe and the host bridge it takes longer.
# NVLink: SGLang's custom all-reduce on 8 H100s, 3.7-7.8 µs for 512 B-32 KB, vLLM's 8.5-11.8 (sgl-project/sglang
# pull request 2904). AMD's Infinity Fabric (xGMI) is timed on its own figures: a one-shot all-reduce over the
# MI300X's full mesh of 8 takes 5 µs with kernels that fuse the wait into the reduction (Epliz/muiLLM pull request
# 6, "5us local all-reduce on 8x MI300x"), vLLM's custom all-reduce over the MI355X's mesh of 8 6.3-6.7 µs for
# 24-48 KB (vllm-project/vllm pull request 39080): 8 µs, the engines' custom kernels as on NVLink, not the best
# fused kernel. The MI250's GCDs take the same figure (no published small all-reduce of theirs).
NVLINK_LATENCY_S = 5e-6
INFINITY_FABRIC_LATENCY_S = 8e-6
PCIE_LATENCY_S = 10e-6
# The NVLink domain of every NVLink part in the GPU table: an HGX board of 8 GPUs. Tensor parallelism beyond it
# crosses nodes over the scale-out network: one 400 Gb/s NIC per GPU (InfiniBand NDR or RoCE), 50 GB/s each way, and
# a small all-reduce across nodes costs tens of microseconds (NCCL's inter-node latency).
NVLINK_DOMAIN_GPUS = 8
NETWORK_BYTES_PER_S = 50e9
NETWORK_LATENCY_S = 20e-6
ACTIVATION_BYTES = 2.0  # all-reduced activations are 16-bit


@dataclass(frozen=True)
class Interconnect:
    """The link a GPU's collectives use: bytes/s in one direction and a fixed latency per collective."""

    name: str
    bytes_per_s: float
    latency_s: float

    def describe(self) -> str:
        return f"{self.name}, {self.bytes_per_s / 1e9:g} GB/s each way, {self.latency_s * 1e6:g} µs per collective"


def interconnect(gpu: GpuSpec, tp: int = 2, kind: str | None = None) -> Interconnect:
    """The link tensor parallelism uses on `gpu`: NVLink when the GPU table gives the SKU NVLink (a PCIe card's
    NVLink bridge joins pairs only, so it serves tp 2 and PCIe serves more), else PCIe; `kind` ("nvlink", "pcie")
    overrides. The table's figures are both directions together; a ring sends and receives at once, so it gets
    half of each."""
    choice = (kind or "").strip().lower()
    if choice not in ("", "nvlink", "pcie"):
        raise InputError(f"unknown interconnect '{kind}'; use nvlink or pcie.")
    bridged = "bridge" in gpu.interconnect.lower()
    nvlink_ok = gpu.nvlink_bytes_per_s is not None and not (bridged and tp > 2)
    if choice == "nvlink" and gpu.nvlink_bytes_per_s is None:
        raise InputError(f"the {gpu.name} has no NVLink.")
    if tp > NVLINK_DOMAIN_GPUS:
        if choice == "nvlink":
            raise InputError(f"tensor parallelism over {tp} GPUs cannot stay on NVLink: an HGX board's NVLink joins "
                             f"{NVLINK_DOMAIN_GPUS}.")
        if choice == "":
            return Interconnect(f"the network between nodes (tp {tp} > {NVLINK_DOMAIN_GPUS} GPUs a node: 400 Gb/s a "
                                "GPU)", NETWORK_BYTES_PER_S, NETWORK_LATENCY_S)
    if choice == "nvlink" or (choice == "" and nvlink_ok):
        assert gpu.nvlink_bytes_per_s is not None
        fabric = "infinity fabric" in gpu.interconnect.lower()  # AMD's GPU links stand in the NVLink fields
        return Interconnect("NVLink bridge" if bridged else gpu.interconnect, gpu.nvlink_bytes_per_s / 2,
                            INFINITY_FABRIC_LATENCY_S if fabric else NVLINK_LATENCY_S)
    generation = "PCIe Gen5" if gpu.pcie_bytes_per_s >= 128e9 else "PCIe Gen4" if gpu.pcie_bytes_per_s >= 64e9 \
        else "PCIe Gen3"
    return Interconnect(generation, gpu.pcie_bytes_per_s / 2, PCIE_LATENCY_S)


def allreduce_s(message_bytes: float, gpus: int, link: Interconnect) -> float:
    """One all-reduce of `message_bytes` over `gpus`: latency + 2(n-1)/n x bytes / link bandwidth."""
    if gpus <= 1:
        return 0.0
    return link.latency_s + 2.0 * (gpus - 1) / gpus * message_bytes / link.bytes_per_s


def allgather_s(total_bytes: float, gpus: int, link: Interconnect) -> float:
    """One all-gather ending with `total_bytes` on every GPU: latency + (n-1)/n x bytes / link bandwidth."""
    if gpus <= 1:
        return 0.0
    return link.latency_s + (gpus - 1) / gpus * total_bytes / link.bytes_per_s


def check_layout(model: ModelInfo, tp: int, pp: int = 1, flag: str = "--tp") -> None:
    """Refuse a layout no serving engine runs: attention heads split unevenly over the tensor-parallel GPUs (vLLM
    and SGLang require heads % tp == 0, and KV heads either divisible by tp or replicated to it), or more pipeline
    stages than layers."""
    name = model.name or "the model"
    if model.heads and (tp > model.heads or model.heads % tp):
        raise InputError(f"{flag} {tp} does not divide {name}'s {model.heads} attention heads; engines need "
                         f"heads % tp == 0 (try {_divisors(model.heads, tp)}).")
    if model.kv_heads and tp > 1 and model.kv_heads % tp and tp % model.kv_heads:
        raise InputError(f"{flag} {tp} neither divides {name}'s {model.kv_heads} KV heads nor is a multiple of them "
                         "(engines split or replicate whole KV heads).")
    if model.layers and pp > model.layers:
        raise InputError(f"--pp {pp} asks for more pipeline stages than {name}'s {model.layers} layers.")


def _divisors(n: int, near: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(found, key=lambda d: (abs(d - near), d))[:3])


def has_tp_shape(model: ModelInfo) -> bool:
    """Whether the collectives can be sized: layers and hidden size known."""
    return bool(model.layers and model.hidden)


def tp_comm_s(model: ModelInfo, tokens: float, tp: int, link: Interconnect) -> float:
    """Collective time of one forward pass over `tokens` tokens (the batch at decode, the prompt tokens at
    prefill) at tensor-parallel degree `tp`: 2 x layers all-reduces of tokens x hidden x 2 bytes, and one
    all-gather of the logits (tokens x vocab x 2 bytes; at decode one row per sequence). 0 at tp 1, and 0 when
    the shape is unknown (has_tp_shape), which keeps a ceiling an upper bound."""
    if tp < 1:
        raise InputError(f"the tensor-parallel degree must be at least 1, not {tp}.")
    if tp == 1 or not has_tp_shape(model):
        return 0.0
    assert model.layers and model.hidden
    per_layer = 2 * allreduce_s(tokens * model.hidden * ACTIVATION_BYTES, tp, link)
    logits = allgather_s(tokens * (model.vocab or 0) * ACTIVATION_BYTES, tp, link) if model.vocab else 0.0
    return model.layers * per_layer + logits


@dataclass(frozen=True)
class Pipeline:
    """A decode step split into `stages` pipeline stages fed `microbatches` micro-batches.

    `stage_s` is one stage's time for one micro-batch (its share of the weights and KV cache, plus the activation
    hand-off to the next stage); `bubble` the share of time each stage waits; `tokens_per_s` the whole pipeline's
    steady-state rate."""

    stages: int
    microbatches: int
    stage_weight_bytes: float
    stage_s: float
    handoff_s: float
    bubble: float
    tokens_per_s: float


def pipeline_decode(
    stage_bytes_s: float,
    stage_compute_s: float,
    batch: float,
    stages: int,
    microbatches: int,
    *,
    stage_weight_bytes: float,
    hidden: int | None,
    link: Interconnect,
) -> Pipeline:
    """Steady-state decode through a pipeline. Each micro-batch of batch/m sequences passes the p stages in turn and
    cannot start its next token before its last stage finishes, so a micro-batch comes back every max(p, m) stage
    times and the stages idle a share 1 - m/max(p, m) of the time (the bubble: (p-1)/p for a single sequence). Tokens
    per second: batch / (max(p, m) x stage time). `stage_bytes_s` and `stage_compute_s` are one stage's memory and
    compute time for one micro-batch; the hand-off sends batch/m x hidden x 2 bytes to the next stage."""
    if stages < 1 or microbatches < 1:
        raise InputError("a pipeline needs at least one stage and one micro-batch.")
    if batch < microbatches:
        raise InputError(f"{microbatches} micro-batches need at least as many sequences, not {batch:g}.")
    per_micro = batch / microbatches
    handoff = 0.0 if stages == 1 or not hidden else link.latency_s + per_micro * hidden * ACTIVATION_BYTES \
        / link.bytes_per_s
    stage = max(stage_bytes_s, stage_compute_s) + handoff
    cycle = max(stages, microbatches)
    bubble = 1.0 - microbatches / cycle
    return Pipeline(stages, microbatches, stage_weight_bytes, stage, handoff, bubble,
                    batch / (cycle * stage) if stage > 0 else math.inf)
