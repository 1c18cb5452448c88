"""Readable kernel names: 'void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,
at::detail::Array<char*, 3> >(int, ...)' becomes 'vectorized_elementwise_kernel<CUDAFunctor_add>'.

Kineto writes kernel names demangled (CUPTI does it); a few libraries' kernels arrive mangled (Composable Kernel,
aiter, sglang's HIP kernels), and only their nested name is recovered here (no full demangler). The short name is the
function's own name without namespaces, template arguments or parameters; for the generic wrappers that PyTorch and
CUTLASS instantiate for every operation (elementwise, reduce, cutlass::Kernel), the operation inside the template
arguments is what tells kernels apart, so it is kept.
"""

from __future__ import annotations

import re
from functools import lru_cache

MAX_SHORT = 80
MAX_FULL = 512

# Wrappers whose own name says little: the functor or kernel in their template arguments is kept.
_GENERIC = frozenset({
    "vectorized_elementwise_kernel", "elementwise_kernel", "unrolled_elementwise_kernel",
    "elementwise_kernel_manual_unroll", "reduce_kernel", "Kernel", "Kernel2", "device_kernel",
    "multi_tensor_apply_kernel", "index_elementwise_kernel", "vectorized_templated_elementwise_kernel",
    "elementwise_kernel_with_index", "distribution_elementwise_grid_stride_kernel", "kernel",
})
# Template-argument words that never name the operation.
_NOISE = frozenset({
    "at", "native", "detail", "Array", "char", "float", "double", "int", "long", "short", "unsigned", "signed",
    "bool", "void", "c10", "Half", "BFloat16", "Float8_e4m3fn", "Float8_e5m2", "anonymous", "namespace", "const",
    "func_wrapper_t", "lambda", "gpu_kernel_impl", "gpu_kernel_impl_nocast", "ReduceOp", "OffsetCalculator",
    "TrivialOffsetCalculator", "LoadWithoutCast", "StoreWithoutCast", "true", "false", "decltype", "nullptr",
    "TensorListMetadata", "TensorIteratorBase", "operator", "std", "cutlass", "cute", "TensorIterator", "memory",
    "policies", "LoadWithCast", "StoreWithCast", "torch", "headeronly", "RestrictPtrTraits", "DefaultPtrTraits",
    "GenericPackedTensorAccessor", "PackedTensorAccessor32", "PackedTensorAccessor64", "__hip_bfloat16", "__half",
    "__nv_bfloat16", "half", "uint8_t", "int8_t", "int64_t", "int32_t", "size_t", "cub", "thrust", "ulong", "uint",
})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TELLING = re.compile(r"Functor|Ops$|_kernel_cuda|_kernel|kernel_|Op$|_impl$|^cutlass|tensorop|gemm|Adam|SGD|Lamb|"
                      r"Norm|norm|softmax|Softmax|copy|fill|Fill", re.IGNORECASE)
_SOURCE_NAME = re.compile(r"<(?P<n>\d+)")


@lru_cache(maxsize=65536)
def short_name(name: str) -> str:
    """The readable name of a kernel (see the module docstring); memcpy/memset names are kept as they are."""
    if name.startswith(("Memcpy", "Memset")):
        return name[:MAX_SHORT]
    if name.startswith("_Z"):
        parts = [p for p in demangle(name).split("::") if not p.startswith("(")]
        return (parts[-1] if parts else name)[:MAX_SHORT]
    if name.startswith("Cijk_"):
        return _tensile(name)
    text = name.strip().replace("(anonymous namespace)::", "")
    text = text.removeprefix("void ")
    qual, targs = _split(text)
    base = qual.rsplit("::", 1)[-1] or qual
    if base in _GENERIC and targs:
        inner = _telling_word(targs)
        if inner:
            out = inner if inner.startswith("cutlass") else f"{base}<{inner}>"
            return out[:MAX_SHORT]
    if not base and targs:
        return targs[:MAX_SHORT]
    return (base or text)[:MAX_SHORT]


def _tensile(name: str) -> str:
    """Tensile's (rocBLAS/hipBLASLt) names spell every tuning parameter; the layout, the data type and the macro
    and matrix-instruction tiles tell GEMMs apart: 'Cijk_Alik_Bljk_SB_MT64x16x32_MI16x16x1'."""
    tokens = name.split("_")
    keep = tokens[:4] + [t for t in tokens[4:] if re.fullmatch(r"(MT|MI)\d+x\d+(x\d+)*", t)]
    return "_".join(keep)[:MAX_SHORT]


def full_name(name: str) -> str:
    return name if len(name) <= MAX_FULL else name[: MAX_FULL - 1] + "…"


def _split(text: str) -> tuple[str, str]:
    """(qualified name, its template arguments) of a demangled signature 'ns::f<args>(params)'; the return type, if
    any, dropped."""
    depth = 0
    name_end = len(text)
    targ_start = targ_end = -1
    for i, ch in enumerate(text):
        if ch == "<":
            if depth == 0 and targ_start < 0:
                targ_start = i
            depth += 1
        elif ch == ">":
            depth -= 1
            if depth == 0 and targ_end < 0:
                targ_end = i
        elif ch == "(" and depth == 0:
            name_end = i
            break
    head_end = targ_start if 0 <= targ_start < name_end else name_end
    qual = text[:head_end].strip()
    if " " in qual:  # a return type before the name
        qual = qual.rsplit(" ", 1)[-1]
    targs = text[targ_start + 1:targ_end] if 0 <= targ_start < name_end and targ_end > targ_start else ""
    return qual, targs


def _telling_word(targs: str) -> str:
    words = [w for w in _IDENT.findall(targs) if w not in _NOISE and not w.isdigit()]
    for w in words:
        if _TELLING.search(w):
            return w
    return words[0] if words else ""


def demangle(name: str) -> str:
    """The qualified name in an Itanium-mangled symbol ('_ZN5aiter24add_rmsnorm_quant_kernelI...' -> 'aiter::
    add_rmsnorm_quant_kernel'); the name itself when it cannot be read. Template arguments and parameters are not
    decoded."""
    i = 2
    nested = name.startswith("_ZN")
    if nested:
        i = 3
        while i < len(name) and name[i] in "rVKRO":  # cv- and ref-qualifiers of a member function
            i += 1
    parts: list[str] = []
    while i < len(name):
        if name.startswith("St", i):
            parts.append("std")
            i += 2
            continue
        m = re.match(r"\d+", name[i:])
        if m is None:
            break
        n = int(m.group(0))
        i += len(m.group(0))
        ident = name[i:i + n]
        if len(ident) < n:
            break
        parts.append("(anonymous namespace)" if ident.startswith("_GLOBAL__N") else ident)
        i += n
        if not nested:
            break
        if i < len(name) and name[i] in "EI":
            break
    return "::".join(parts) if parts else name
