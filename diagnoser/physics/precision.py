"""Numeric precisions: canonical names, storage size, and which tensor-core rate a precision computes at."""

from __future__ import annotations

from diagnoser.errors import InputError

# Canonical precision names, the keys used everywhere else in the physics package.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4", "fp4", "int3", "int2")

_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "fp8": "fp8",
    "e4m3": "fp8",
    "fp8e4m3": "fp8",
    "float8e4m3fn": "fp8",
    "e5m2": "fp8",
    "fp8e5m2": "fp8",
    "float8e5m2": "fp8",
    "int8": "int8",
    "i8": "int8",
    "w8a8": "int8",
    "int4": "int4",
    "i4": "int4",
    "w4a16": "int4",
    # 3- and 2-bit integer weights (GPTQ, compressed-tensors): weight-only, dequantised to 16 bits in the matmul.
    "int3": "int3",
    "i3": "int3",
    "w3a16": "int3",
    "int2": "int2",
    "i2": "int2",
    "w2a16": "int2",
    # 4-bit floats (E2M1): NVIDIA's NVFP4 (16-weight groups, FP8 scales) and OCP's MXFP4 (32-weight groups, E8M0
    # scales) store half a byte a weight like INT4, and Blackwell computes on them at its FP4 rate.
    "fp4": "fp4",
    "e2m1": "fp4",
    "fp4e2m1": "fp4",
    "float4e2m1fnx2": "fp4",
    "nvfp4": "fp4",
    "mxfp4": "fp4",
}

# Bytes one stored element takes. TF32 is a compute mode: the tensors are stored as FP32.
# Quantised formats' group scales and the layers kept at 16 bits are added by physics.quant, not here.
_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "tf32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
    "int3": 0.375,  # GPTQ packs 32 3-bit weights into three 32-bit words
    "int2": 0.25,
}

# The tensor-core rate a precision runs at, best first; the first one the GPU has wins.
# FP8/INT8 weights on a GPU without those units are dequantised to 16-bit (weight-only kernels such as
# Marlin), and INT4 is always weight-only, so both fall back to the 16-bit rate.
# T4 has no BF16 units, so BF16 falls back to its FP32 rate there.
_COMPUTE_ORDER: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32",),
    "tf32": ("tf32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "fp16": ("fp16", "fp32"),
    "fp8": ("fp8", "bf16", "fp16"),
    "int8": ("int8", "bf16", "fp16"),
    "int4": ("bf16", "fp16"),
    "int3": ("bf16", "fp16"),
    "int2": ("bf16", "fp16"),
    "fp4": ("fp4", "bf16", "fp16"),
}


def _canonical(name: str) -> str | None:
    key = name.strip().lower().removeprefix("torch.")
    return _ALIASES.get(key.replace("_", "").replace("-", ""))


def normalise_dtype(name: str) -> str:
    """Map a user or framework spelling ("bfloat16", "half", "e4m3", "torch.float16") to a name in DTYPES."""
    found = _canonical(name)
    if found is None:
        raise InputError(f"unknown precision '{name}'; use one of {', '.join(DTYPES)}.")
    return found


def weight_only(dtype: str) -> bool:
    """Quantised weights with no tensor-core rate of their own (int4, int3, int2): dequantised to 16 bits in the
    matmul. False for a name that is no precision."""
    found = _canonical(dtype)
    return found is not None and found not in _COMPUTE_ORDER[found]


def bytes_per_element(dtype: str) -> float:
    """Storage bytes of one element: fp32/tf32 4, bf16/fp16 2, fp8/int8 1, int4/fp4 0.5 (scales not included)."""
    return _BYTES[normalise_dtype(dtype)]


def compute_candidates(dtype: str) -> tuple[str, ...]:
    """Tensor-core precisions, best first, that arithmetic on `dtype` tensors can run at."""
    return _COMPUTE_ORDER[normalise_dtype(dtype)]


def activation_dtype(weight_dtype: str) -> str:
    """The precision activations and, by default, the KV cache use for weights stored in `weight_dtype`.

    Serving engines keep activations in 16 bits for quantised weights (vLLM's kv_cache_dtype="auto").
    """
    dtype = normalise_dtype(weight_dtype)
    if dtype in ("fp32", "tf32"):
        return "fp32"
    if dtype == "fp16":
        return "fp16"
    return "bf16"
