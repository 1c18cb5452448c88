"""Weight bytes as a decode step reads them: quantised matrices with their group scales, and the layers that stay
at 16 bits (input embedding, lm_head, norms).

A quantised checkpoint is not params x bits / 8. Each group of g weights carries a scale (and, for asymmetric
formats, a zero point), and the embedding, lm_head and norms are usually left at 16 bits. The scheme comes from the
model's quantisation fields (read from config.json by physics.models) or, where the config says nothing, from the
defaults below; docs/physics.md lists both with their sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from diagnoser.capture import ModelInfo
from diagnoser.errors import InputError
from diagnoser.physics.precision import (
    activation_dtype,
    bytes_per_element,
    normalise_dtype,
)

PER_CHANNEL = -1  # one scale per output channel: a row of in_features (about `hidden`) weights


@dataclass(frozen=True)
class QuantScheme:
    """How one precision's weights are stored. `group_size` weights share `scale_bytes` of scale and zero point
    (PER_CHANNEL: one per output row; 0: per tensor, negligible); `lm_head` says whether lm_head is quantised."""

    dtype: str
    method: str
    group_size: int
    scale_bytes: float
    lm_head: bool
    from_config: bool
    bits: float = 0.0  # a format's bits per weight, block scales included (GGUF, EXL2); 0: element + scale/group

    @property
    def quantised(self) -> bool:
        return bytes_per_element(self.dtype) < 2

    @property
    def gguf(self) -> bool:
        """A llama.cpp GGUF file: every matrix (the embedding too) at the format's bits, norms in FP32."""
        return self.method.startswith("GGUF ")

    def bytes_per_weight(self, hidden: int | None) -> float:
        """Element bytes plus the group's scale spread over its weights (a format's bits / 8 where it has them)."""
        if self.bits > 0:
            return self.bits / 8
        element = bytes_per_element(self.dtype)
        if self.group_size > 0:
            return element + self.scale_bytes / self.group_size
        if self.group_size == PER_CHANNEL and hidden:
            return element + self.scale_bytes / hidden
        return element

    def describe(self) -> str:
        if not self.quantised:
            return self.dtype
        if self.bits > 0:
            return f"{self.method} ({self.bits:.3g} bits a weight, block scales included)"
        if self.group_size > 0:
            groups = f"{self.scale_bytes:g} B of scale per {self.group_size} weights"
        elif self.group_size == PER_CHANNEL:
            groups = f"{self.scale_bytes:g} B of scale per output channel"
        else:
            groups = "one scale per tensor"
        head = "lm_head quantised" if self.lm_head else "lm_head 16-bit"
        return f"{self.method or self.dtype} ({groups}; {head})"


# (group size, scale bytes) for each precision when the config does not say; sources in docs/physics.md.
_DEFAULTS: dict[str, tuple[str, int, float]] = {
    "fp8": ("fp8 per-tensor", 0, 0.0),  # vLLM --quantization fp8: one FP32 scale per tensor
    "int8": ("int8 per-channel", PER_CHANNEL, 2.0),  # W8A8 (SmoothQuant, compressed-tensors): a 16-bit scale a row
    "int4": ("int4 g128", 128, 2.0),  # GPTQ/AWQ: an FP16 scale per 128 weights (a zero point adds half a byte)
    "fp4": ("nvfp4", 16, 1.0),  # NVFP4: an FP8 E4M3 scale per 16 weights
    "int3": ("int3 g128", 128, 2.0),  # GPTQ 3-bit: an FP16 scale per 128 weights
    "int2": ("int2 g128", 128, 2.0),
}
# Methods whose defaults differ from their precision's.
_METHOD_DEFAULTS: dict[str, tuple[int, float]] = {
    "mxfp4": (32, 1.0),  # OCP MX: an E8M0 scale per 32 weights
    "nvfp4": (16, 1.0),
    "awq": (128, 2.5),  # FP16 scale + 4-bit zero point per group (AWQ is asymmetric)
    "gptq": (128, 2.0),
    "bitsandbytes": (64, 4.0),  # NF4/FP4 blocks of 64 with an FP32 absmax (no double quantisation)
}


# --- llama.cpp's GGUF types and ExLlamaV2's EXL2 --------------------------------------------------------------------

# Bytes per block and weights per block of ggml's quantised types, scales included: the block_* structs of ggml's
# ggml-common.h (QK_K = 256; e.g. block_q4_K: two FP16 super-scales, 12 bytes of 6-bit scales, 128 bytes of nibbles
# = 144 bytes per 256 weights = 4.5 bits a weight).
_GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "q4_0": (18, 32), "q4_1": (20, 32), "q5_0": (22, 32), "q5_1": (24, 32), "q8_0": (34, 32),
    "q2_k": (84, 256), "q3_k": (110, 256), "q4_k": (144, 256), "q5_k": (176, 256), "q6_k": (210, 256),
    "iq1_s": (50, 256), "iq1_m": (56, 256), "iq2_xxs": (66, 256), "iq2_xs": (74, 256), "iq2_s": (82, 256),
    "iq3_xxs": (98, 256), "iq3_s": (110, 256), "iq4_nl": (18, 32), "iq4_xs": (136, 256),
}
# File types that mix block types by tensor (llama.cpp's llama_model_quantize picks a type per tensor). Their
# effective bits per weight are what llama.cpp's tools/quantize/quantize.cpp (QUANT_OPTIONS, printed by
# `llama-quantize --help`) publishes: Llama-3-8B's file size in GiB ("Q4_K_M: 4.58G, +0.1754 ppl @ Llama-3-8B"),
# over its 8,030,261,248 weights, or a stated bpw ("IQ3_M: 3.66 bpw quantization mix").
_LLAMA3_8B_GIB: dict[str, float] = {
    "q2_k": 2.96, "q3_k_s": 3.41, "q3_k_m": 3.74, "q3_k_l": 4.03, "q4_k_s": 4.37, "q4_k_m": 4.58, "q5_k_s": 5.21,
    "q5_k_m": 5.33,
}
_LLAMA3_8B_WEIGHTS = 8_030_261_248
_STATED_BPW: dict[str, float] = {"iq2_m": 2.7, "iq3_xs": 3.3, "iq3_m": 3.66}
_GGUF_ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}  # llama-quantize's aliases for file types


@dataclass(frozen=True)
class WeightFormat:
    """A named storage format with its bits per weight: `method` as shown ("GGUF Q4_K_M", "EXL2 4.65 bpw"), and the
    precision class its bytes and compute rate go with (weight-only below 8 bits, dequantised in the matmul)."""

    method: str
    dtype: str
    bits: float


def ggml_type_bits(name: str) -> float | None:
    """Bits per weight of one ggml block type (a tensor's type, not a file's mix), scales included."""
    block = _GGML_BLOCKS.get(name.strip().lower())
    return block[0] * 8 / block[1] if block else None


def gguf_bits(name: str) -> float | None:
    """Bits per weight of a GGUF type or file type, scales included; None for a name that is neither."""
    key = name.strip().lower().replace("-", "_")
    key = _GGUF_ALIASES.get(key, key)
    if key in _LLAMA3_8B_GIB:
        return _LLAMA3_8B_GIB[key] * 1024**3 * 8 / _LLAMA3_8B_WEIGHTS
    if key in _STATED_BPW:
        return _STATED_BPW[key]
    return ggml_type_bits(key)


def _class_of(bits: float) -> str:
    return "int8" if bits >= 8 else "int4" if bits >= 4 else "int3" if bits >= 3 else "int2"


_EXL2 = re.compile(r"exl2[\s:_-]*([0-9]*\.?[0-9]+)\s*(?:bpw|b)?")


def weight_format(name: str) -> WeightFormat | None:
    """A GGUF type ("Q4_K_M", "gguf:q6_k") or EXL2 at its average bits ("exl2:4.65", "exl2-4.65bpw"); None for any
    other name. EXL2's bits must lie in 2 to 8, ExLlamaV2's range."""
    text = name.strip().lower()
    found = _EXL2.fullmatch(text)
    if found:
        bits = float(found.group(1))
        if not 2 <= bits <= 8:
            raise InputError(f"EXL2 at {bits:g} bits a weight is outside ExLlamaV2's 2 to 8 bits; write e.g. "
                             "exl2:4.65.")
        return WeightFormat(f"EXL2 {bits:g} bpw", _class_of(bits), bits)
    key = text.removeprefix("gguf").lstrip(":_- ")
    gguf = gguf_bits(key)
    if gguf is None:
        return None
    return WeightFormat(f"GGUF {_GGUF_ALIASES.get(key.replace('-', '_'), key.replace('-', '_')).upper()}",
                        _class_of(gguf), gguf)


def with_weight_format(model: ModelInfo, fmt: WeightFormat) -> ModelInfo:
    """The model stored in `fmt`: its precision class and the format's name, which quant_scheme reads back."""
    return msgspec.structs.replace(model, dtype=fmt.dtype, quant_method=fmt.method, quant_group_size=None,
                                   quant_scale_bytes=None, quant_lm_head=True)


def quant_scheme(model: ModelInfo, dtype: str | None = None) -> QuantScheme:
    """The storage scheme of the weights at `dtype` (default: the model's). The model's own quantisation fields
    apply when `dtype` is its precision; another precision (a what-if) gets that precision's defaults."""
    own = normalise_dtype(model.dtype) if model.dtype else ""
    wanted = normalise_dtype(dtype) if dtype else (own or "bf16")
    if bytes_per_element(wanted) >= 2:
        return QuantScheme(wanted, "", 0, 0.0, True, False)
    name, group, scale = _DEFAULTS[wanted]
    if wanted != own:
        return QuantScheme(wanted, name, group, scale, False, False)
    fmt = weight_format(model.quant_method) if model.quant_method[:4].lower() in ("gguf", "exl2") else None
    if fmt is not None:
        return QuantScheme(wanted, fmt.method, 0, 0.0, True, True, bits=fmt.bits)
    method = model.quant_method.lower()
    if method in _METHOD_DEFAULTS:
        group, scale = _METHOD_DEFAULTS[method]
    from_config = model.quant_group_size is not None or model.quant_scale_bytes is not None
    if model.quant_group_size is not None:
        group = model.quant_group_size
    if model.quant_scale_bytes is not None:
        scale = model.quant_scale_bytes
    if group < PER_CHANNEL or scale < 0:
        raise InputError(f"a quantisation group of {group} weights with {scale} scale bytes is not a valid scheme.")
    return QuantScheme(wanted, method or name, group, scale, model.quant_lm_head, from_config or bool(method))


@dataclass(frozen=True)
class WeightBytes:
    """The weights' bytes by part, all GPUs together. `embedding` is the input table (untied models only: a tied
    table is lm_head and counted there); `linear` holds the attention and MLP/expert matrices with their scales."""

    linear: float
    lm_head: float
    embedding: float
    norms: float
    scheme: QuantScheme

    @property
    def total(self) -> float:
        return self.linear + self.lm_head + self.embedding + self.norms

    @property
    def sixteen_bit(self) -> float:
        """Bytes of the parts a quantised checkpoint keeps at the activation precision."""
        if not self.scheme.quantised:
            return 0.0
        return self.embedding + self.norms + (0.0 if self.scheme.lm_head else self.lm_head)


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts by part: the matrices a quantiser converts, and the rest."""

    linear: float
    lm_head: float
    embedding: float
    norms: float


def param_split(model: ModelInfo) -> ParamSplit:
    """Embedding = vocab x hidden; lm_head = vocab x hidden unless tied (then the embedding is the head); norms =
    hidden x (2 x layers + 1) (two RMSNorms a layer and the final one); linear = the rest. Without vocab and hidden
    every parameter counts as linear."""
    params = model.params or 0.0
    if params <= 0:
        raise InputError("the model's parameter count is unknown.")
    if not (model.vocab and model.hidden):
        return ParamSplit(params, 0.0, 0.0, 0.0)
    table = float(model.vocab * model.hidden)
    norms = float(model.hidden * (2 * (model.layers or 0) + 1))
    if model.tied_embeddings:
        head, embedding = table, 0.0
    else:
        head, embedding = table, table
    linear = params - head - embedding - norms
    if linear <= 0:
        raise InputError("the model's parameter count is smaller than its embeddings; check vocab and hidden.")
    return ParamSplit(linear, head, embedding, norms)


def weight_breakdown(model: ModelInfo, dtype: str | None = None) -> WeightBytes:
    """Bytes of each part at `dtype`: linear x (element + scale/group); lm_head likewise when the scheme quantises it,
    else 16-bit; embedding and norms 16-bit. Unquantised precisions store everything at their own size."""
    scheme = quant_scheme(model, dtype)
    split = param_split(model)
    if not scheme.quantised:
        element = bytes_per_element(scheme.dtype)
        return WeightBytes(split.linear * element, split.lm_head * element, split.embedding * element,
                           split.norms * element, scheme)
    per_weight = scheme.bytes_per_weight(model.hidden)
    wide = bytes_per_element(activation_dtype(scheme.dtype))
    if scheme.gguf:  # llama.cpp quantises the token embedding too, and keeps norms in FP32
        return WeightBytes(split.linear * per_weight, split.lm_head * per_weight, split.embedding * per_weight,
                           split.norms * 4.0, scheme)
    head = split.lm_head * (per_weight if scheme.lm_head else wide)
    return WeightBytes(split.linear * per_weight, head, split.embedding * wide, split.norms * wide, scheme)
