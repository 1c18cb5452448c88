"""Datasheet roofs of NVIDIA GPUs, matching of NVML names to them, and the roofline ridge point.

All FLOP/s are dense tensor-core peaks (NVIDIA's datasheets print the 2:4-sparse figure, twice these, with an
asterisk). Memory capacities are NVIDIA's "GB", which for GPU memory are binary gigabytes: an "80GB" H100 reports
81559 MiB through NVML. NVLink and PCIe figures are the datasheets' totals over both directions.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from diagnoser.errors import InputError
from diagnoser.physics.precision import compute_candidates, normalise_dtype

GIB = 1024**3
GB = 1e9
TB = 1e12
T = 1e12  # tera-FLOP/s


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's peak numbers. `flops` maps a precision (fp32, tf32, bf16, fp16, fp8, int8) to dense FLOP/s
    (OP/s for int8); a precision the GPU has no units for is absent."""

    key: str
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float  # device memory bandwidth (HBM or GDDR)
    flops: Mapping[str, float] = field(hash=False)
    tdp_w: float
    interconnect: str
    nvlink_bytes_per_s: float | None
    pcie_bytes_per_s: float
    arch: str
    source: str
    # Roofs replaced by measurements (with_measured): "hbm" and/or precision names. A measured roof is what the GPU
    # reaches; a datasheet roof is a peak that streaming kernels reach only a share of (physics.realised).
    measured: frozenset[str] = frozenset()
    max_sm_clock_mhz: float | None = None  # the SM clock's maximum (nvidia-smi "Max Clocks"); None: not tabled

    def __post_init__(self) -> None:
        # Read-only and unshared: several entries are built from the same family dict.
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))


def _hopper(fp32: float, tf32: float, bf16: float, fp8: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16, "fp8": fp8, "int8": fp8}


def _ampere(fp32: float, tf32: float, bf16: float, int8: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16, "int8": int8}


def _ada(fp32: float, tf32: float, bf16: float, fp8: float, int8: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16, "fp8": fp8, "int8": int8}


_A100_FLOPS = _ampere(19.5 * T, 156 * T, 312 * T, 624 * T)
_H100_SXM_FLOPS = _hopper(67 * T, 494.7 * T, 989.4 * T, 1978.9 * T)
_H100_NVL_FLOPS = _hopper(60 * T, 417.5 * T, 835.5 * T, 1670.5 * T)
_PCIE4 = 64 * GB
_PCIE5 = 128 * GB

_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("a100-40gb-sxm", "A100 SXM4 40GB", 40 * GIB, 1555 * GB, _A100_FLOPS, 400, "NVLink 3", 600 * GB,
            _PCIE4, "ampere", "NVIDIA A100 datasheet"),
    GpuSpec("a100-40gb-pcie", "A100 PCIe 40GB", 40 * GIB, 1555 * GB, _A100_FLOPS, 250, "PCIe Gen4 (NVLink bridge)",
            600 * GB, _PCIE4, "ampere", "NVIDIA A100 datasheet"),
    GpuSpec("a100-80gb-sxm", "A100 SXM4 80GB", 80 * GIB, 2039 * GB, _A100_FLOPS, 400, "NVLink 3", 600 * GB,
            _PCIE4, "ampere", "NVIDIA A100 datasheet"),
    GpuSpec("a100-80gb-pcie", "A100 PCIe 80GB", 80 * GIB, 1935 * GB, _A100_FLOPS, 300, "PCIe Gen4 (NVLink bridge)",
            600 * GB, _PCIE4, "ampere", "NVIDIA A100 datasheet"),
    GpuSpec("h100-sxm", "H100 SXM5 80GB", 80 * GIB, 3.35 * TB, _H100_SXM_FLOPS, 700, "NVLink 4", 900 * GB,
            _PCIE5, "hopper", "NVIDIA H100 datasheet"),
    GpuSpec("h100-pcie", "H100 PCIe 80GB", 80 * GIB, 2.0 * TB, _hopper(51 * T, 378 * T, 756.5 * T, 1513 * T), 350,
            "PCIe Gen5 (NVLink bridge)", 600 * GB, _PCIE5, "hopper", "NVIDIA H100 datasheet"),
    GpuSpec("h100-nvl", "H100 NVL 94GB", 94 * GIB, 3.9 * TB, _H100_NVL_FLOPS, 400, "PCIe Gen5 (NVLink bridge)",
            600 * GB, _PCIE5, "hopper", "NVIDIA H100 datasheet"),
    GpuSpec("h200", "H200 SXM 141GB", 141 * GIB, 4.8 * TB, _H100_SXM_FLOPS, 700, "NVLink 4", 900 * GB, _PCIE5,
            "hopper", "NVIDIA H200 datasheet"),
    GpuSpec("h200-nvl", "H200 NVL 141GB", 141 * GIB, 4.8 * TB, _H100_NVL_FLOPS, 600, "PCIe Gen5 (NVLink bridge)",
            900 * GB, _PCIE5, "hopper", "NVIDIA H200 datasheet"),
    GpuSpec("b200", "B200 180GB", 180 * GIB, 8.0 * TB,
            {**_hopper(75 * T, 1125 * T, 2250 * T, 4500 * T), "fp4": 9000 * T}, 1000,
            "NVLink 5", 1800 * GB, _PCIE5, "blackwell", "NVIDIA HGX B200 datasheet (per GPU)"),
    GpuSpec("l4", "L4 24GB", 24 * GIB, 300 * GB, _ada(30.3 * T, 60 * T, 121 * T, 242.5 * T, 242.5 * T), 72,
            "PCIe Gen4", None, _PCIE4, "ada", "NVIDIA L4 datasheet"),
    GpuSpec("l40", "L40 48GB", 48 * GIB, 864 * GB, _ada(90.5 * T, 90.5 * T, 181.05 * T, 362 * T, 362 * T), 300,
            "PCIe Gen4", None, _PCIE4, "ada", "NVIDIA L40 datasheet"),
    GpuSpec("l40s", "L40S 48GB", 48 * GIB, 864 * GB, _ada(91.6 * T, 183 * T, 362.05 * T, 733 * T, 733 * T), 350,
            "PCIe Gen4", None, _PCIE4, "ada", "NVIDIA L40S datasheet"),
    GpuSpec("a10", "A10 24GB", 24 * GIB, 600 * GB, _ampere(31.2 * T, 62.5 * T, 125 * T, 250 * T), 150, "PCIe Gen4",
            None, _PCIE4, "ampere", "NVIDIA A10 datasheet"),
    GpuSpec("a10g", "A10G 24GB", 24 * GIB, 600 * GB, _ampere(35 * T, 35 * T, 70 * T, 140 * T), 300, "PCIe Gen4",
            None, _PCIE4, "ampere",
            "AWS EC2 G5 specifications (no NVIDIA datasheet; tensor rates as published for the G5 A10G)"),
    GpuSpec("t4", "T4 16GB", 16 * GIB, 320 * GB, {"fp32": 8.1 * T, "fp16": 65 * T, "int8": 130 * T}, 70,
            "PCIe Gen3", None, 32 * GB, "turing", "NVIDIA T4 datasheet"),
    GpuSpec("rtx-4090", "GeForce RTX 4090 24GB", 24 * GIB, 1008 * GB,
            _ada(82.6 * T, 82.6 * T, 165.2 * T, 330.3 * T, 660.6 * T), 450, "PCIe Gen4", None, _PCIE4, "ada",
            "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate)"),
)

# Maximum SM clocks in MHz (NVIDIA datasheets' boost clocks, what NVML's max clock reports on these boards): the
# denominator of the SM clock fraction when DCGM does not export DCGM_FI_DEV_MAX_SM_CLOCK. Not tabled where the
# datasheet gives none (B200) or the board boosts past it (GeForce).
_MAX_SM_CLOCK_MHZ: dict[str, float] = {
    "a100-40gb-sxm": 1410, "a100-40gb-pcie": 1410, "a100-80gb-sxm": 1410, "a100-80gb-pcie": 1410,
    "h100-sxm": 1980, "h100-pcie": 1755, "h100-nvl": 1785, "h200": 1980, "h200-nvl": 1785,
    "l4": 2040, "l40": 2490, "l40s": 2520, "a10": 1695, "a10g": 1710, "t4": 1590,
}
GPUS: dict[str, GpuSpec] = {spec.key: dataclasses.replace(spec, max_sm_clock_mhz=_MAX_SM_CLOCK_MHZ.get(spec.key))
                            for spec in _SPECS}

# Short user spellings for the common choice within a family: the SXM part, and the larger A100.
_ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "a100": "a100-80gb-sxm",
    "a100-sxm": "a100-80gb-sxm",
    "a100-sxm4": "a100-80gb-sxm",
    "a100-80gb": "a100-80gb-sxm",
    "a100-pcie": "a100-80gb-pcie",
    "a100-40gb": "a100-40gb-sxm",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
}


def _squash(text: str) -> str:
    """Lower case, letters and digits only, so "A100_80GB", "a100-80gb" and "A100 80GB" compare equal."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


_BY_SQUASHED: dict[str, str] = {_squash(k): k for k in GPUS} | {_squash(a): k for a, k in _ALIASES.items()}

# NVML name patterns (upper case, '-' and '_' turned into spaces) to candidate keys; first match wins, then memory
# picks among the candidates. Order matters: "L40S" before "L40" before "L4", NVL before the plain family.
_NVML_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"\bB200\b", ("b200",)),
    (r"\bH200\b.*\bNVL\b", ("h200-nvl",)),
    (r"\bH200\b", ("h200",)),
    (r"\bH100\b.*\bNVL\b", ("h100-nvl",)),
    (r"\bH100\b.*\bPCIE\b", ("h100-pcie",)),
    (r"\bH100\b", ("h100-sxm",)),
    (r"\bA100\b.*\bPCIE\b", ("a100-40gb-pcie", "a100-80gb-pcie")),
    (r"\bA100\b", ("a100-40gb-sxm", "a100-80gb-sxm")),
    (r"\bL40S\b", ("l40s",)),
    (r"\bL40\b", ("l40",)),
    (r"\bL4\b", ("l4",)),
    (r"\bA10G\b", ("a10g",)),
    (r"\bA10\b", ("a10",)),
    (r"\bT4\b", ("t4",)),
    (r"\b4090\b", ("rtx-4090",)),
)

_MIG_SUFFIX = re.compile(r"\s+MIG\s+\S+.*$")
_NAME_GB = re.compile(r"\b(\d+)\s*GB\b")


@functools.lru_cache(maxsize=256)  # a pure lookup, called once per GPU diagnosed (10,000 in a fleet run)
def match_gpu(nvml_name: str, memory_bytes: int | None = None) -> GpuSpec | None:
    """The table entry for a name as NVML reports it ("NVIDIA A100-SXM4-80GB", "Tesla T4"), or None.

    A MIG instance ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") maps to its parent GPU; its own memory is a slice, so
    `memory_bytes` is ignored for it. Otherwise memory, or a size in the name, picks among same-family entries.
    """
    name = nvml_name.upper().replace("-", " ").replace("_", " ")
    is_mig = bool(_MIG_SUFFIX.search(name))
    name = _MIG_SUFFIX.sub("", name)
    for pattern, keys in _NVML_PATTERNS:
        if re.search(pattern, name):
            return _closest_memory([GPUS[k] for k in keys], _memory_hint(name, None if is_mig else memory_bytes))
    return None


def _memory_hint(name: str, memory_bytes: int | None) -> float | None:
    found = _NAME_GB.search(name)
    if found:
        return int(found.group(1)) * GIB
    return float(memory_bytes) if memory_bytes else None


def _closest_memory(candidates: list[GpuSpec], memory: float | None) -> GpuSpec:
    if memory is None or len(candidates) == 1:
        return candidates[-1]  # the larger part is listed last and is the more common one today
    return min(candidates, key=lambda spec: abs(spec.memory_bytes - memory))


def get_gpu(key: str) -> GpuSpec:
    """The entry for a user's spelling: a key ("h100-sxm"), a short name ("H100", "a100-80gb") or an NVML name."""
    squashed = _squash(key)
    if squashed in _BY_SQUASHED:
        return GPUS[_BY_SQUASHED[squashed]]
    matched = match_gpu(key) if squashed else None
    if matched is not None:
        return matched
    raise InputError(f"unknown GPU '{key}'; known: {', '.join(GPUS)}.")


def compute_dtype(gpu: GpuSpec, dtype: str) -> str:
    """The tensor-core precision that math on `dtype` tensors runs at on `gpu` (e.g. int4 -> bf16, fp8 on A100
    -> bf16), so peak FLOP/s for weight-only quantisation is the 16-bit rate."""
    for candidate in compute_candidates(dtype):
        if candidate in gpu.flops:
            return candidate
    raise InputError(f"the {gpu.name} has no compute rate listed for {normalise_dtype(dtype)}.")


def peak_flops(gpu: GpuSpec, dtype: str) -> float:
    """Dense peak FLOP/s for math on `dtype` tensors (see compute_dtype)."""
    return gpu.flops[compute_dtype(gpu, dtype)]


def ridge_point(gpu: GpuSpec, dtype: str) -> float:
    """Roofline ridge, FLOP per byte: peak FLOP/s / memory bytes/s. Kernels below it are memory-bound.

    Source: Williams, Waterman, Patterson, "Roofline: an insightful visual performance model" (CACM 2009).
    """
    return peak_flops(gpu, dtype) / gpu.hbm_bytes_per_s


def with_measured(gpu: GpuSpec, measured: Mapping[str, float]) -> GpuSpec:
    """A copy of `gpu` with measured roofs (GpuInfo.measured: "hbm_bytes_per_s", "<dtype>_flops") in place of the
    datasheet's, so ceilings use what this GPU can actually reach."""
    flops = dict(gpu.flops)
    replaced = set(gpu.measured)
    for name, value in measured.items():
        if name.endswith("_flops") and value > 0:
            dtype = normalise_dtype(name.removesuffix("_flops"))
            flops[dtype] = value
            replaced.add(dtype)
    bandwidth = gpu.hbm_bytes_per_s
    if measured.get("hbm_bytes_per_s", 0) > 0:
        bandwidth = measured["hbm_bytes_per_s"]
        replaced.add("hbm")
    return dataclasses.replace(gpu, flops=flops, hbm_bytes_per_s=bandwidth, measured=frozenset(replaced))
