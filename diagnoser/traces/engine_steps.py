"""A serving engine's own step annotations, and where a CPU build's step time goes.

vLLM's model runner wraps each engine step in a user annotation `execute_context_N(T)_generation_M(G)`: N requests
in their prefill with T prompt tokens, M in decode with G generated tokens (vLLM 0.32, v1 worker; seen on the CPU
build, the same runner on GPUs). These are the engine's word for what each step held, so the step split (how much
time went to steps that carried a prefill, the decode batch) is read from them rather than inferred from shapes.

On a CPU build the model's work is CPU ops: the ops are put in classes by name (matmul, attention, kv_write,
sampling; what torch.compile fused into its graph stays unnamed, "other") and each class's share of the annotated
step time is its outermost ops' time inside the steps, so an op nested in another of a class is counted once.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from diagnoser.capture import EngineSteps

VLLM_STEP_PREFIX = "execute_context_"
VLLM_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")

# CPU op names by class (vLLM's CPU build and plain aten): the names a CPU-only trace holds for the model's work.
CPU_OP_CLASS: dict[str, str] = {
    **dict.fromkeys(("_C::onednn_mm", "_C::onednn_scaled_mm", "_C::weight_packed_linear", "_C::int8_scaled_mm",
                     "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
                     "mkldnn::_linear_pointwise", "aten::mkldnn_linear"), "matmul"),
    **dict.fromkeys(("vllm::unified_attention_with_output", "vllm::unified_attention",
                     "_C::cpu_attention_with_kv_cache", "_C::paged_attention_v1", "_C::paged_attention_v2",
                     "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"),
                    "attention"),
    **dict.fromkeys(("vllm::unified_kv_cache_update", "_C::cpu_attn_reshape_and_cache", "_C::reshape_and_cache",
                     "_C::reshape_and_cache_flash"), "kv_write"),
    **dict.fromkeys(("_C::greedy_argmax", "aten::argmax", "aten::topk", "aten::sort", "aten::multinomial",
                     "aten::exponential_", "aten::softmax", "aten::_softmax", "aten::log_softmax"), "sampling"),
}
CLASSES = ("matmul", "attention", "kv_write", "sampling")


def parse_step(name: str) -> tuple[int, int, int, int] | None:
    """(prefill requests, prompt tokens, decode requests, generated tokens) of a vLLM step annotation, else None."""
    m = VLLM_STEP.match(name)
    return (int(m[1]), int(m[2]), int(m[3]), int(m[4])) if m else None


def engine_step_stats(steps: list[tuple[float, float, int, int, int, int]],
                      classed: list[tuple[str, int, float, float]], window: tuple[float, float]) -> EngineSteps | None:
    """`steps`: (ts, dur, prefill requests, prompt tokens, decode requests, generated tokens) in µs; `classed`: (op
    class, thread, ts, dur) of the CPU ops named in CPU_OP_CLASS. Only steps inside the window count."""
    w0, w1 = window
    inside = sorted(s for s in steps if s[0] >= w0 and s[0] + s[1] <= w1 and s[1] > 0)
    if not inside:
        return None
    total = sum(s[1] for s in inside)
    with_prefill = [s for s in inside if s[2] > 0]
    decode_only = [s for s in inside if s[2] == 0 and s[4] > 0]
    out = EngineSteps(
        steps=len(inside), step_ms_p50=statistics.median(s[1] for s in inside) / 1e3,
        steps_frac=min(1.0, total / max(w1 - w0, 1e-9)),
        prefill_steps=len(with_prefill), prefill_time_frac=sum(s[1] for s in with_prefill) / total,
        prompt_tokens=sum(s[3] for s in inside), generated_tokens=sum(s[5] for s in inside),
        decode_batch=(statistics.fmean(s[4] for s in decode_only) if decode_only else None),
        decode_step_ms_p50=(statistics.median(s[1] for s in decode_only) / 1e3 if decode_only else None))
    if classed:
        spans = [(s[0], s[0] + s[1]) for s in inside]  # sorted, and a runner's steps do not overlap
        out.op_share = _shares(_class_time(spans, classed), total)
        outside = w1 - w0 - total
        if outside > 0:
            gaps, at = [], w0
            for a, b in spans:
                if a > at:
                    gaps.append((at, a))
                at = max(at, b)
            if at < w1:
                gaps.append((at, w1))
            out.outside_op_share = {c: v * outside / (w1 - w0)
                                    for c, v in _shares(_class_time(gaps, classed), outside).items()}
    return out


def _shares(used: dict[str, float], total: float) -> dict[str, float]:
    """Each class's time as a share of `total`; "other" the rest."""
    shares = {c: v / total for c, v in used.items() if v > 0}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def _class_time(spans: list[tuple[float, float]], classed: list[tuple[str, int, float, float]]) -> dict[str, float]:
    """Each class's outermost ops' time inside `spans` (sorted, not overlapping), in µs."""
    by_thread: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for cls, tid, ts, dur in classed:
        by_thread[tid].append((ts, ts + dur, cls))
    used: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    for ops in by_thread.values():
        ops.sort(key=lambda o: (o[0], -o[1]))
        outer_end = float("-inf")
        k = 0
        for a, b, cls in ops:
            if a < outer_end:
                continue  # nested in an op already counted
            outer_end = b
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            j = k
            while j < len(spans) and spans[j][0] < b:
                used[cls] += max(0.0, min(b, spans[j][1]) - max(a, spans[j][0]))
                j += 1
    return used


__all__ = ["CLASSES", "CPU_OP_CLASS", "VLLM_STEP_PREFIX", "engine_step_stats", "parse_step"]
