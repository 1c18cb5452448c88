"""FLOPs and minimal bytes of matmul, linear, convolution and attention ops from their recorded shapes.

Exported traces carry no FLOP field (even with with_flops=True), so the cost is derived from the op name, its
"Input Dims", "Input type" and "Concrete Inputs" (recorded with record_shapes=True). Bytes are the minimum a kernel
must move: every input read once and the output written once; real kernels move at least that, so the intensity
here is an upper bound of the true intensity (the standard roofline convention).

FLOP counts follow torch.utils.flop_counter (2 per multiply-add), except that causal self-attention counts half
of the score matrix, as FlashAttention's kernels skip the masked blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Element sizes and the roofline precision of the "Input type" strings torch records.
_TYPES: dict[str, tuple[int, str]] = {
    "float": (4, "fp32"),
    "double": (8, "fp32"),
    "c10::Half": (2, "fp16"),
    "c10::BFloat16": (2, "bf16"),
    "c10::Float8_e4m3fn": (1, "fp8"),
    "c10::Float8_e5m2": (1, "fp8"),
    "c10::Float8_e4m3fnuz": (1, "fp8"),
    "c10::Float8_e5m2fnuz": (1, "fp8"),
    "c10::Float8_e8m0fnu": (1, "fp8"),
    "signed char": (1, "int8"),
    "unsigned char": (1, "int8"),
    "short int": (2, "fp16"),
    "int": (4, "fp32"),
    "long int": (8, "fp32"),
    "bool": (1, "int8"),
}

GEMM_KIND = "gemm"
CONV_KIND = "conv"
ATTENTION_KIND = "attention"


@dataclass(frozen=True)
class OpCost:
    """The cost of one op. `tokens` is the M of a weight GEMM (rows through a weight matrix); for attention,
    `batch`, `q_len` and `kv_len` come from the query/key shapes."""

    kind: str
    flops: float
    bytes: float
    dtype: str
    tokens: int | None = None
    batch: int | None = None
    q_len: int | None = None
    kv_len: int | None = None

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes > 0 else math.inf


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _elt(types: Sequence[str], i: int) -> tuple[int, str] | None:
    return _TYPES.get(types[i]) if i < len(types) else None


def _shape(dims: Sequence[object], i: int) -> list[int] | None:
    if i >= len(dims):
        return None
    s = dims[i]
    if not isinstance(s, list) or not s or not all(isinstance(d, int) and d >= 0 for d in s):
        return None
    return s


_INT_LIST = re.compile(r"-?\d+")


def _ints(concrete: Sequence[str], i: int, default: list[int]) -> list[int]:
    if i >= len(concrete) or not concrete[i]:
        return default
    values = [int(v) for v in _INT_LIST.findall(concrete[i])]
    return values or default


def _int(concrete: Sequence[str], i: int, default: int) -> int:
    values = _ints(concrete, i, [default])
    return values[0]


def _bool(concrete: Sequence[str], i: int) -> bool:
    return i < len(concrete) and concrete[i].strip().lower() in ("true", "1")


def _gemm(m: int, n: int, k: int, batch: int, elt: int, dtype: str, extra_bytes: int = 0,
          tokens: int | None = None) -> OpCost:
    flops = 2.0 * batch * m * n * k
    nbytes = float(elt * batch * (m * k + k * n + m * n) + extra_bytes)
    return OpCost(GEMM_KIND, flops, nbytes, dtype, tokens=tokens)


def _mm(dims: Sequence[object], types: Sequence[str], a: int, b: int, bias: int | None = None) -> OpCost | None:
    sa, sb, e = _shape(dims, a), _shape(dims, b), _elt(types, a)
    if sa is None or sb is None or e is None or len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        return None
    bias_bytes = 0
    if bias is not None:
        sc = _shape(dims, bias)
        bias_bytes = _numel(sc) * e[0] if sc else 0
    return _gemm(sa[0], sb[1], sa[1], 1, e[0], e[1], bias_bytes, tokens=sa[0])


def _bmm(dims: Sequence[object], types: Sequence[str], a: int, b: int) -> OpCost | None:
    sa, sb, e = _shape(dims, a), _shape(dims, b), _elt(types, a)
    if sa is None or sb is None or e is None or len(sa) != 3 or len(sb) != 3 or sa[2] != sb[1]:
        return None
    return _gemm(sa[1], sb[2], sa[2], sa[0], e[0], e[1])


def _linear(dims: Sequence[object], types: Sequence[str]) -> OpCost | None:
    x, w, e = _shape(dims, 0), _shape(dims, 1), _elt(types, 0)
    if x is None or w is None or e is None or len(w) != 2 or x[-1] != w[1]:
        return None
    m = _numel(x[:-1])
    bias = _shape(dims, 2)
    bias_bytes = _numel(bias) * e[0] if bias else 0
    return _gemm(m, w[0], w[1], 1, e[0], e[1], bias_bytes, tokens=m)


def _cpu_linear(dims: Sequence[object], types: Sequence[str], weight: int | None) -> OpCost | None:
    """vLLM's CPU-build linear ops, which write into an output buffer passed first: `_C::onednn_mm(out [M, N],
    x [M, K], bias, handler)` (the weight lives packed in the oneDNN handler, so N comes from the output) and
    `_C::weight_packed_linear(out [M, N], x [M, K], weight [N, K], bias, is_vnni)`. Seen in vLLM 0.32's CPU trace
    with record_shapes (tests/fixtures/traces/vllm-cpu-0.32-shapes.json.gz)."""
    out, x, e = _shape(dims, 0), _shape(dims, 1), _elt(types, 1)
    if out is None or x is None or e is None or len(out) != 2 or len(x) != 2 or out[0] != x[0]:
        return None
    m, n, k = out[0], out[1], x[1]
    if weight is not None:
        w = _shape(dims, weight)
        if w is None or w != [n, k]:
            return None
    return _gemm(m, n, k, 1, e[0], e[1], tokens=m)


def _matmul(dims: Sequence[object], types: Sequence[str]) -> OpCost | None:
    a, b, e = _shape(dims, 0), _shape(dims, 1), _elt(types, 0)
    if a is None or b is None or e is None:
        return None
    if len(b) == 1:  # matrix-vector
        b = b + [1]
    if len(a) == 1:
        a = [1] + a
    if a[-1] != b[-2]:
        return None
    m, k, n = a[-2], a[-1], b[-1]
    batch_a, batch_b = a[:-2], b[:-2]
    batch = _numel(_broadcast(batch_a, batch_b)) if batch_a or batch_b else 1
    # A 2-D right operand is a weight: its rows-through count is the tokens of the step.
    tokens = _numel(a[:-1]) if len(b) == 2 else None
    if len(b) == 2:
        return _gemm(_numel(a[:-1]), n, k, 1, e[0], e[1], tokens=tokens)
    flops = 2.0 * batch * m * n * k
    nbytes = float(e[0] * (_numel(a) + _numel(b) + batch * m * n))
    return OpCost(GEMM_KIND, flops, nbytes, e[1])


def _broadcast(a: list[int], b: list[int]) -> list[int]:
    out = []
    for i in range(max(len(a), len(b))):
        x = a[-1 - i] if i < len(a) else 1
        y = b[-1 - i] if i < len(b) else 1
        out.append(max(x, y))
    return out[::-1]


# Positions of (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups) per conv op;
# None where the op has no such argument.
_CONV_ARGS: dict[str, tuple[int, int, int | None, int, int, int, int | None, int | None, int]] = {
    "aten::conv1d": (0, 1, 2, 3, 4, 5, None, None, 6),
    "aten::conv2d": (0, 1, 2, 3, 4, 5, None, None, 6),
    "aten::conv3d": (0, 1, 2, 3, 4, 5, None, None, 6),
    "aten::convolution": (0, 1, 2, 3, 4, 5, 6, 7, 8),
    "aten::_convolution": (0, 1, 2, 3, 4, 5, 6, 7, 8),
    "aten::cudnn_convolution": (0, 1, None, 3, 2, 4, None, None, 5),
    "aten::mkldnn_convolution": (0, 1, 2, 4, 3, 5, None, None, 6),
}


def _conv(name: str, dims: Sequence[object], types: Sequence[str], concrete: Sequence[str]) -> OpCost | None:
    i_in, i_w, i_b, i_stride, i_pad, i_dil, i_tr, _i_outpad, i_groups = _CONV_ARGS[name]
    x, w, e = _shape(dims, i_in), _shape(dims, i_w), _elt(types, i_in)
    if x is None or w is None or e is None or len(x) < 3 or len(w) != len(x):
        return None
    spatial = len(x) - 2
    kernel = w[2:]
    groups = max(1, _int(concrete, i_groups, 1))
    transposed = i_tr is not None and _bool(concrete, i_tr)
    n, c_in, in_sp = x[0], x[1], x[2:]
    if transposed:
        c_out = w[1] * groups
        flops = 2.0 * n * c_in * _numel(in_sp) * (c_out // groups) * _numel(kernel)
        out_elems = n * c_out * _numel(in_sp)  # lower bound; output_padding and stride enlarge it
    else:
        c_out = w[0]
        pad_text = concrete[i_pad] if i_pad < len(concrete) else ""
        stride = _expand(_ints(concrete, i_stride, [1]), spatial)
        dilation = _expand(_ints(concrete, i_dil, [1]), spatial)
        if "same" in pad_text:
            out_sp = [(s + st - 1) // st for s, st in zip(in_sp, stride, strict=True)]
        else:
            pad = _expand(_ints(concrete, i_pad, [0]), spatial)
            out_sp = [(s + 2 * p - d * (k - 1) - 1) // st + 1
                      for s, p, d, k, st in zip(in_sp, pad, dilation, kernel, stride, strict=True)]
        if any(o <= 0 for o in out_sp):
            return None
        flops = 2.0 * n * c_out * _numel(out_sp) * (c_in // groups) * _numel(kernel)
        out_elems = n * c_out * _numel(out_sp)
    bias = _shape(dims, i_b) if i_b is not None else None
    nbytes = float(e[0] * (_numel(x) + _numel(w) + out_elems + (_numel(bias) if bias else 0)))
    return OpCost(CONV_KIND, flops, nbytes, e[1])


def _expand(values: list[int], n: int) -> list[int]:
    return values * n if len(values) == 1 else values[:n] + [values[-1]] * (n - len(values))


# (query, key, value, is_causal position, layout) per attention op; layout BHLE = [batch, heads, length, dim],
# BLHE = [batch, length, heads, dim] (the FlashAttention/xFormers kernels' own layout).
_ATTN_ARGS: dict[str, tuple[int, int, int, int, str]] = {
    "aten::scaled_dot_product_attention": (0, 1, 2, 5, "BHLE"),
    "aten::_scaled_dot_product_flash_attention": (0, 1, 2, 4, "BHLE"),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 1, 2, 4, "BHLE"),
    "aten::_scaled_dot_product_efficient_attention": (0, 1, 2, 6, "BHLE"),
    "aten::_scaled_dot_product_cudnn_attention": (0, 1, 2, 6, "BHLE"),
    "aten::_scaled_dot_product_attention_math": (0, 1, 2, 5, "BHLE"),
    "aten::_flash_attention_forward": (0, 1, 2, 8, "BLHE"),
    "aten::_efficient_attention_forward": (0, 1, 2, 9, "BLHE"),
}


def _attention(name: str, dims: Sequence[object], types: Sequence[str], concrete: Sequence[str]) -> OpCost | None:
    iq, ik, iv, icausal, layout = _ATTN_ARGS[name]
    q, k, v, e = _shape(dims, iq), _shape(dims, ik), _shape(dims, iv), _elt(types, iq)
    if q is None or k is None or v is None or e is None or len(q) < 3 or len(k) != len(q) or len(v) != len(q):
        return None
    if layout == "BLHE":
        if len(q) != 4:
            return None
        batch, q_len, heads, dim = q
        kv_len, dim_v = k[1], v[3]
    else:
        batch, heads = q[0], _numel(q[1:-2])
        q_len, dim = q[-2], q[-1]
        kv_len, dim_v = k[-2], v[-1]
    scores = batch * heads * q_len * kv_len
    flops = 2.0 * scores * dim + 2.0 * scores * dim_v
    if _bool(concrete, icausal) and q_len == kv_len:
        flops /= 2
    out = batch * heads * q_len * dim_v
    nbytes = float(e[0] * (_numel(q) + _numel(k) + _numel(v) + out))
    return OpCost(ATTENTION_KIND, flops, nbytes, e[1], batch=batch, q_len=q_len, kv_len=kv_len,
                  tokens=batch * q_len)


def op_cost(name: str, dims: Sequence[object], types: Sequence[str], concrete: Sequence[str]) -> OpCost | None:
    """The cost of one recorded op, or None when the op is not one we cost or its shapes are incomplete."""
    try:
        if name in ("aten::mm", "aten::_int_mm"):
            return _mm(dims, types, 0, 1)
        if name in ("aten::addmm", "aten::_addmm_activation"):
            return _mm(dims, types, 1, 2, bias=0)
        if name == "aten::_scaled_mm":
            return _mm(dims, types, 0, 1)
        if name == "aten::bmm":
            return _bmm(dims, types, 0, 1)
        if name == "aten::baddbmm":
            return _bmm(dims, types, 1, 2)
        if name == "aten::linear":
            return _linear(dims, types)
        if name == "_C::onednn_mm":
            return _cpu_linear(dims, types, None)
        if name == "_C::weight_packed_linear":
            return _cpu_linear(dims, types, 2)
        if name == "aten::matmul":
            return _matmul(dims, types)
        if name in _CONV_ARGS:
            return _conv(name, dims, types, concrete)
        if name in _ATTN_ARGS:
            return _attention(name, dims, types, concrete)
    except (TypeError, ValueError, IndexError, ZeroDivisionError):
        return None
    return None


# Ops whose cost is known, as recorded by torch.profiler; an op nested inside another of these is not counted
# again (aten::linear -> aten::addmm, aten::conv2d -> aten::cudnn_convolution, sdpa -> its flash kernel op).
COSTED_OPS = frozenset(
    ["aten::mm", "aten::_int_mm", "aten::addmm", "aten::_addmm_activation", "aten::_scaled_mm", "aten::bmm",
     "aten::baddbmm", "aten::linear", "aten::matmul", "_C::onednn_mm", "_C::weight_packed_linear"]
    + list(_CONV_ARGS) + list(_ATTN_ARGS)
)


def is_weight_gemm(name: str, cost: OpCost) -> bool:
    """A GEMM through a weight matrix (linear layers): its M is the number of tokens in the step."""
    return cost.kind == GEMM_KIND and cost.tokens is not None and name != "aten::bmm" and name != "aten::baddbmm"
