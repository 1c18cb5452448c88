"""Datasheet roofs of NVIDIA and AMD GPUs, matching of device names to them, a user's own GPU from a file, and the
roofline ridge point.

All FLOP/s are dense tensor-core (matrix-core) peaks (NVIDIA's and AMD's datasheets print the 2:4-sparse figure,
twice these, with an asterisk or "with sparsity"). Memory capacities are the vendors' "GB", which for GPU memory are
binary gigabytes: an "80GB" H100 reports 81559 MiB through NVML. NVLink, Infinity Fabric and PCIe figures are the
datasheets' totals over both directions. Each row names its source; a precision a GPU has no tensor rate for (BF16
on V100 and T4, FP8 before Ada and Hopper) is absent, and math on it falls back (physics.precision).

Laptop, mobile and Max-Q parts share a desktop part's name but not its clocks, power or memory (an RTX 4090 Laptop
GPU has 16 GB at 576 GB/s against the desktop card's 24 GB at 1008 GB/s): they never match a desktop row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from diagnoser.errors import InputError
from diagnoser.fileio import read_text_bounded
from diagnoser.physics.precision import DTYPES, compute_candidates, normalise_dtype

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
_V100_SOURCE = ("NVIDIA V100 Tensor Core GPU datasheet (images.nvidia.com/content/technologies/volta/pdf/"
                "volta-v100-datasheet-update-us-1165301-r5.pdf)")

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
    GpuSpec("a30", "A30 24GB", 24 * GIB, 933 * GB, _ampere(10.3 * T, 82 * T, 165 * T, 330 * T), 165,
            "PCIe Gen4 (NVLink bridge)", 200 * GB, _PCIE4, "ampere",
            "NVIDIA A30 Tensor Core GPU datasheet (24 GB HBM2 at 933 GB/s; dense TF32 82, BF16/FP16 165 TFLOP/s, "
            "INT8 330 TOPS; 165 W; NVLink bridge 200 GB/s)"),
    GpuSpec("rtx-4090", "GeForce RTX 4090 24GB", 24 * GIB, 1008 * GB,
            _ada(82.6 * T, 82.6 * T, 165.2 * T, 330.3 * T, 660.6 * T), 450, "PCIe Gen4", None, _PCIE4, "ada",
            "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate)"),
    # Grace Hopper: the superchip's H100 (same SMs and clocks as the SXM5 part) with 96 GB HBM3 at 4 TB/s or 144 GB
    # HBM3e at 4.9 TB/s. Its power is the module's (Grace CPU and LPDDR5X included), programmable 450-1000 W.
    GpuSpec("gh200-96gb", "GH200 96GB HBM3", 96 * GIB, 4.0 * TB, _H100_SXM_FLOPS, 1000, "NVLink 4", 900 * GB,
            _PCIE5, "hopper", "NVIDIA GH200 Grace Hopper Superchip datasheet "
            "(resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip)"),
    GpuSpec("gh200-144gb", "GH200 144GB HBM3e", 144 * GIB, 4.9 * TB, _H100_SXM_FLOPS, 1000, "NVLink 4", 900 * GB,
            _PCIE5, "hopper", "NVIDIA GH200 Grace Hopper Superchip datasheet "
            "(resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip)"),
    # H20: a Hopper cut to about 15 % of the H100's compute for export; NVIDIA publishes no datasheet.
    GpuSpec("h20", "H20 96GB", 96 * GIB, 4.0 * TB, _hopper(44 * T, 74 * T, 148 * T, 296 * T), 400, "NVLink 4",
            900 * GB, _PCIE5, "hopper", "NVIDIA H20 product brief as reported by SemiAnalysis, \"Nvidia's New China "
            "AI Chips Circumvent US Restrictions\" (Nov 2023): no public NVIDIA datasheet"),
    # Volta: FP16 tensor cores only (125 TFLOP/s dense on the SXM2 part, FP32 accumulate); no BF16, TF32 or INT8
    # tensor rates, so BF16 math falls back to FP32 there (serve it as --dtype fp16).
    GpuSpec("v100-sxm2-16gb", "Tesla V100 SXM2 16GB", 16 * GIB, 900 * GB, {"fp32": 15.7 * T, "fp16": 125 * T},
            300, "NVLink 2", 300 * GB, 32 * GB, "volta", _V100_SOURCE),
    GpuSpec("v100-sxm2-32gb", "Tesla V100 SXM2 32GB", 32 * GIB, 900 * GB, {"fp32": 15.7 * T, "fp16": 125 * T},
            300, "NVLink 2", 300 * GB, 32 * GB, "volta", _V100_SOURCE),
    GpuSpec("v100-pcie-16gb", "Tesla V100 PCIe 16GB", 16 * GIB, 900 * GB, {"fp32": 14 * T, "fp16": 112 * T}, 250,
            "PCIe Gen3", None, 32 * GB, "volta", _V100_SOURCE),
    GpuSpec("v100-pcie-32gb", "Tesla V100 PCIe 32GB", 32 * GIB, 900 * GB, {"fp32": 14 * T, "fp16": 112 * T}, 250,
            "PCIe Gen3", None, 32 * GB, "volta", _V100_SOURCE),
    GpuSpec("v100s-pcie", "Tesla V100S PCIe 32GB", 32 * GIB, 1134 * GB, {"fp32": 16.4 * T, "fp16": 130 * T}, 250,
            "PCIe Gen3", None, 32 * GB, "volta", "NVIDIA V100S datasheet"),
    # GA102 professional and GeForce boards. GeForce runs FP16/BF16 tensor math with FP32 accumulate (what serving
    # kernels use) at half its FP16-accumulate rate; the professional RTX A6000 runs both at the full rate.
    GpuSpec("rtx-a6000", "RTX A6000 48GB", 48 * GIB, 768 * GB, _ampere(38.7 * T, 77.4 * T, 154.8 * T, 309.7 * T),
            300, "PCIe Gen4 (NVLink bridge)", 112.5 * GB, _PCIE4, "ampere",
            "NVIDIA RTX A6000 datasheet; NVIDIA Ampere GA102 GPU architecture whitepaper, appendix"),
    GpuSpec("rtx-3090", "GeForce RTX 3090 24GB", 24 * GIB, 936 * GB, _ampere(35.6 * T, 35.6 * T, 71 * T, 284 * T),
            350, "PCIe Gen4 (NVLink bridge)", 112.5 * GB, _PCIE4, "ampere",
            "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix (FP32 accumulate)"),
    GpuSpec("rtx-3090-ti", "GeForce RTX 3090 Ti 24GB", 24 * GIB, 1008 * GB,
            _ampere(40 * T, 40 * T, 80 * T, 320 * T), 450, "PCIe Gen4 (NVLink bridge)", 112.5 * GB, _PCIE4, "ampere",
            "NVIDIA GeForce RTX 3090 Ti specifications (10752 CUDA cores at 1.86 GHz: 40 TFLOP/s FP32; 21 Gbps "
            "GDDR6X on 384 bits); tensor rates the GA102 whitepaper's RTX 3090 ratios (FP32 accumulate)"),
    # AMD Instinct. Infinity Fabric stands in the NVLink fields: the GPU-to-GPU links' total over both directions.
    GpuSpec("mi300x", "Instinct MI300X 192GB", 192 * GIB, 5.3 * TB,
            {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T,
             "int8": 2614.9 * T}, 750, "Infinity Fabric", 896 * GB, _PCIE5, "cdna3",
            "AMD Instinct MI300X data sheet (amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
            "amd-instinct-mi300x-data-sheet.pdf)"),
    # An MI250X or MI250 is two dies (GCDs) that ROCm shows as two GPUs of 64 GB each, each with half the card's
    # bandwidth, compute, power and links: a row is one GCD, what a server's one GPU is.
    GpuSpec("mi250x", "Instinct MI250X (one GCD, 64GB)", 64 * GIB, 1638.4 * GB,
            {"fp32": 47.85 * T, "bf16": 191.5 * T, "fp16": 191.5 * T, "int8": 191.5 * T}, 250,
            "Infinity Fabric", 400 * GB, _PCIE4, "cdna2",
            "AMD Instinct MI250X data sheet (per card: 128 GB HBM2e, 3.2768 TB/s, 383 TFLOP/s FP16/BF16, 95.7 "
            "FP32 matrix, 500 W, 8 Infinity Fabric links of 100 GB/s), halved per GCD"),
    GpuSpec("mi250", "Instinct MI250 (one GCD, 64GB)", 64 * GIB, 1638.4 * GB,
            {"fp32": 45.25 * T, "bf16": 181.05 * T, "fp16": 181.05 * T, "int8": 181.05 * T}, 250,
            "Infinity Fabric", 300 * GB, _PCIE4, "cdna2",
            "AMD Instinct MI250 data sheet (per card: 128 GB HBM2e, 3.2768 TB/s, 362.1 TFLOP/s FP16/BF16, 90.5 "
            "FP32 matrix, 500 W, 6 Infinity Fabric links of 100 GB/s), halved per GCD"),
)

# Maximum SM clocks in MHz (NVIDIA datasheets' boost clocks, what NVML's max clock reports on these boards): the
# denominator of the SM clock fraction when DCGM does not export DCGM_FI_DEV_MAX_SM_CLOCK. Not tabled where the
# datasheet gives none (B200) or the board boosts past it (GeForce).
_MAX_SM_CLOCK_MHZ: dict[str, float] = {
    "a100-40gb-sxm": 1410, "a100-40gb-pcie": 1410, "a100-80gb-sxm": 1410, "a100-80gb-pcie": 1410,
    "h100-sxm": 1980, "h100-pcie": 1755, "h100-nvl": 1785, "h200": 1980, "h200-nvl": 1785,
    "a30": 1440, "l4": 2040, "l40": 2490, "l40s": 2520, "a10": 1695, "a10g": 1710, "t4": 1590,
    "v100-sxm2-16gb": 1530, "v100-sxm2-32gb": 1530, "v100-pcie-16gb": 1380, "v100-pcie-32gb": 1380,
}
GPUS: dict[str, GpuSpec] = {spec.key: dataclasses.replace(spec, max_sm_clock_mhz=_MAX_SM_CLOCK_MHZ.get(spec.key))
                            for spec in _SPECS}

# Short user spellings. Where one names a family, the common part is taken and resolve_gpu says so, naming the
# others (_ALTERNATIVES): "A100" is the 80 GB SXM part, but a 40 GB PCIe card has 76 % of its bandwidth.
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
    "gh200": "gh200-96gb",
    "v100": "v100-sxm2-32gb",
    "v100-sxm2": "v100-sxm2-32gb",
    "v100-pcie": "v100-pcie-32gb",
    "v100-16gb": "v100-sxm2-16gb",
    "v100-32gb": "v100-sxm2-32gb",
    "v100s": "v100s-pcie",
    "a6000": "rtx-a6000",
    "3090": "rtx-3090",
    "3090-ti": "rtx-3090-ti",
    "rtx3090": "rtx-3090",
}
_ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "h100": ("h100-pcie", "h100-nvl"),
    "h100-80gb": ("h100-pcie",),
    "a100": ("a100-40gb-sxm", "a100-80gb-pcie", "a100-40gb-pcie"),
    "a100-sxm": ("a100-40gb-sxm",),
    "a100-sxm4": ("a100-40gb-sxm",),
    "a100-80gb": ("a100-80gb-pcie",),
    "a100-pcie": ("a100-40gb-pcie",),
    "a100-40gb": ("a100-40gb-pcie",),
    "gh200": ("gh200-144gb",),
    "v100": ("v100-sxm2-16gb", "v100-pcie-32gb", "v100-pcie-16gb", "v100s-pcie"),
    "v100-sxm2": ("v100-sxm2-16gb",),
    "v100-pcie": ("v100-pcie-16gb",),
    "v100-16gb": ("v100-pcie-16gb",),
    "v100-32gb": ("v100-pcie-32gb",),
}


def _squash(text: str) -> str:
    """Lower case, letters and digits only, so "A100_80GB", "a100-80gb" and "A100 80GB" compare equal."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


_BY_SQUASHED: dict[str, str] = {_squash(k): k for k in GPUS} | {_squash(a): k for a, k in _ALIASES.items()}
_ALTERNATIVES_SQUASHED: dict[str, tuple[str, ...]] = {_squash(a): keys for a, keys in _ALTERNATIVES.items()}

# Device name patterns (NVML's, amd-smi's market names; upper case, '-' and '_' turned into spaces) to candidate
# keys; first match wins, then memory picks among the candidates. Order matters: "L40S" before "L40" before "L4",
# NVL before the plain family, "3090 Ti" before "3090". No candidates: the name is refused (match_gpu gives None):
# laptop, mobile and Max-Q parts, whose clocks, power and memory are not the desktop card's they are named after;
# amd-smi's "MI250X/MI250", which names either; the V100 SXM3 (DGX-2), whose clocks the table does not hold.
_MOBILE = r"\b(LAPTOP|MOBILE|MAX[ -]?Q)\b"
_NVML_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (_MOBILE, ()),
    (r"\bMI250X\s*/\s*MI250\b", ()),
    (r"\bMI300X\b", ("mi300x",)),
    (r"\bMI250X\b", ("mi250x",)),
    (r"\bMI250\b", ("mi250",)),
    (r"\bGH200\b.*\b144\s*GB?\b", ("gh200-144gb",)),
    (r"\bGH200\b.*\b480\s*GB\b", ("gh200-96gb",)),  # "GH200 480GB": 480 GB of LPDDR5X with 96 GB of HBM3
    (r"\bGH200\b", ("gh200-96gb", "gh200-144gb")),
    (r"\bB200\b", ("b200",)),
    (r"\bH200\b.*\bNVL\b", ("h200-nvl",)),
    (r"\bH200\b", ("h200",)),
    (r"\bH100\b.*\bNVL\b", ("h100-nvl",)),
    (r"\bH100\b.*\bPCIE\b", ("h100-pcie",)),
    (r"\bH100\b", ("h100-sxm",)),
    (r"\bH20\b", ("h20",)),
    (r"\bA100\b.*\bPCIE\b", ("a100-40gb-pcie", "a100-80gb-pcie")),
    (r"\bA100\b", ("a100-40gb-sxm", "a100-80gb-sxm")),
    (r"\bV100S\b", ("v100s-pcie",)),
    (r"\bV100\b.*\bSXM3\b", ()),
    (r"\bV100\b.*\bPCIE\b", ("v100-pcie-16gb", "v100-pcie-32gb")),
    (r"\bV100\b", ("v100-sxm2-16gb", "v100-sxm2-32gb")),
    (r"\bL40S\b", ("l40s",)),
    (r"\bL40\b", ("l40",)),
    (r"\bL4\b", ("l4",)),
    (r"\bA30\b", ("a30",)),
    (r"\bA10G\b", ("a10g",)),
    (r"\bA10\b", ("a10",)),
    (r"\bT4\b", ("t4",)),
    (r"\bA6000\b", ("rtx-a6000",)),
    (r"\b3090\s*TI\b", ("rtx-3090-ti",)),
    (r"\b3090\b", ("rtx-3090",)),
    (r"\b4090\b", ("rtx-4090",)),
)

_MIG_SUFFIX = re.compile(r"\s+MIG\s+\S+.*$")
_NAME_GB = re.compile(r"\b(\d+)\s*GB\b")
# A device with this much more memory than the one row its name matches is a variant the table lacks (an H20 with
# 141 GB of HBM3e has more bandwidth too): refused rather than sized as the smaller part.
_LARGER_VARIANT = 1.2


def _upper_name(name: str) -> str:
    return name.upper().replace("-", " ").replace("_", " ")


def _candidates(name: str) -> tuple[str, ...] | None:
    """The first pattern's candidate keys for an upper-cased name (empty: refused), or None when none matches."""
    for pattern, keys in _NVML_PATTERNS:
        if re.search(pattern, name):
            return keys
    return None


@functools.lru_cache(maxsize=256)  # a pure lookup, called once per GPU diagnosed (10,000 in a fleet run)
def match_gpu(nvml_name: str, memory_bytes: int | None = None) -> GpuSpec | None:
    """The table entry for a name as NVML or amd-smi reports it ("NVIDIA A100-SXM4-80GB", "Tesla T4"), or None.

    A MIG instance ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is its parent GPU's row scaled to the slice (mig_spec:
    1/7 of the H100's SMs, 1/8 of its memory and bandwidth); the parent is picked by its name, not by the slice's
    own `memory_bytes`; a profile the parent has no such slices for is None. Otherwise memory, or a size in the
    name, picks among same-family entries. Laptop, mobile and Max-Q parts never match (None), nor a device with
    much more memory than its one row.
    """
    name = _upper_name(nvml_name)
    is_mig = bool(_MIG_SUFFIX.search(name))
    name = _MIG_SUFFIX.sub("", name)
    keys = _candidates(name)
    if not keys:
        return None
    specs = [GPUS[k] for k in keys]
    if len(specs) == 1 and memory_bytes and not is_mig and memory_bytes > _LARGER_VARIANT * specs[0].memory_bytes:
        return None
    parent = _closest_memory(specs, _memory_hint(name, None if is_mig else memory_bytes))
    if not is_mig:
        return parent
    found = mig_slice(nvml_name)
    return mig_spec(parent, found) if found is not None else None


def _memory_hint(name: str, memory_bytes: int | None) -> float | None:
    found = _NAME_GB.search(name)
    if found:
        return int(found.group(1)) * GIB
    return float(memory_bytes) if memory_bytes else None


def _closest_memory(candidates: list[GpuSpec], memory: float | None) -> GpuSpec:
    if memory is None or len(candidates) == 1:
        return candidates[-1]  # the larger part is listed last and is the more common one today
    return min(candidates, key=lambda spec: abs(spec.memory_bytes - memory))


def resolve_gpu(text: str) -> tuple[GpuSpec, str]:
    """The entry for a user's spelling, and a sentence saying which part was assumed where the spelling names a
    family ("A100": the 80 GB SXM part; the 40 GB and PCIe ones differ), else "". Laptop parts are refused."""
    squashed = _squash(text)
    if squashed in _BY_SQUASHED:
        spec = GPUS[_BY_SQUASHED[squashed]]
        others = _ALTERNATIVES_SQUASHED.get(squashed, ())
        return spec, _assumed(text, spec, others)
    name = _MIG_SUFFIX.sub("", _upper_name(text))
    keys = _candidates(name) if squashed else None
    if keys is not None and not keys:
        if re.search(_MOBILE, name):
            raise InputError(f"'{text}' is a laptop part, which diagnoser has no row for (its clocks, power and "
                             "memory are not the desktop card's); give its figures with --gpu-spec.")
        raise InputError(f"'{text}' names more than one part, or one diagnoser has no row for; name a row "
                         f"({', '.join(GPUS)}) or give its figures with --gpu-spec.")
    if keys:
        sized = _NAME_GB.search(name) is not None
        spec = _closest_memory([GPUS[k] for k in keys], _memory_hint(name, None))
        others = () if sized else tuple(k for k in keys if k != spec.key)
        found = mig_slice(text) if _MIG_SUFFIX.search(_upper_name(text)) else None
        if found is not None:
            sliced = mig_spec(spec, found)
            if sliced is None:
                raise InputError(f"'{text}' names a MIG profile the {spec.name} has no slices for.")
            return sliced, _assumed(text, spec, others)
        return spec, _assumed(text, spec, others)
    raise InputError(f"unknown GPU '{text}'; known: {', '.join(GPUS)}; or give its figures with --gpu-spec.")


def _assumed(text: str, spec: GpuSpec, others: tuple[str, ...]) -> str:
    if not others:
        return ""
    return (f"'{text.strip()}' is taken as the {spec.name} ({spec.key}); for "
            f"{'the other part' if len(others) == 1 else 'another part'} name {' or '.join(others)}.")


def get_gpu(key: str) -> GpuSpec:
    """The entry for a user's spelling: a key ("h100-sxm"), a short name ("H100", "a100-80gb") or an NVML name
    (resolve_gpu, without its note on the part assumed)."""
    return resolve_gpu(key)[0]


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


# --- a GPU of the user's own ---------------------------------------------------------------------------------

_SPEC_KEYS = {
    "name", "memory_bytes", "memory_gb", "hbm_bandwidth", "hbm_bytes_per_s", "hbm_tb_per_s", "flops", "tflops",
    "tdp_w", "interconnect", "nvlink_gb_per_s", "pcie_gb_per_s", "arch", "source", "max_sm_clock_mhz",
}
_BANDWIDTH_UNITS = {"tb/s": 1e12, "gb/s": 1e9, "b/s": 1.0}
_FLOP_UNITS = {"pflops": 1e15, "pflop/s": 1e15, "tflops": 1e12, "tflop/s": 1e12, "tops": 1e12, "gflops": 1e9,
               "gflop/s": 1e9, "flops": 1.0, "flop/s": 1.0}
_SPEC_EXAMPLE = ('name = "My GPU", memory_gb = 80, hbm_tb_per_s = 3.35, tdp_w = 700 and a [tflops] table such as '
                 "bf16 = 989.4")


# Plausible ranges of a user's figures for one GPU (or one GCD), wide enough for every part from a T4 to a B300
# and its successors, narrow enough that a figure in the wrong unit (GB/s given as TB/s: 1,000x) falls outside:
# (low, high, unit as the key takes it).
SPEC_BOUNDS: dict[str, tuple[float, float, str]] = {
    "memory_gb": (1, 1024, "GB"),
    "memory_bytes": (1 * GIB, 1024 * GIB, "bytes"),
    "hbm_bytes_per_s": (2e10, 3e13, "bytes/s"),  # 20 GB/s to 30 TB/s (B200: 8 TB/s)
    "flops": (1e11, 5e16, "FLOP/s"),  # 0.1 TFLOP/s to 50 PFLOP/s dense (B200 FP4: 9 PFLOP/s)
    "tdp_w": (5, 3000, "W"),
    "nvlink_gb_per_s": (10, 10_000, "GB/s"),  # both directions; NVLink 5: 1,800
    "pcie_gb_per_s": (4, 512, "GB/s"),  # both directions; PCIe 6 x16: 256
    "max_sm_clock_mhz": (300, 4000, "MHz"),
}


def _out_of_range(label: str, what: str, value: float, bound: str) -> InputError:
    low, high, unit = SPEC_BOUNDS[bound]
    return InputError(f"{label}: {what} is {value:.4g} {unit}, outside the plausible {low:.4g} to {high:.4g} {unit} "
                      "for one GPU; check its unit.")


def _spec_number(data: Mapping[str, Any], key: str, label: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{label}: {key} must be a number, not {value!r:.40}.")
    low, high, _ = SPEC_BOUNDS[key]
    if not low <= value <= high:
        raise _out_of_range(label, key, value, key)
    return float(value)


def _with_unit(value: object, units: Mapping[str, float], key: str, label: str, scale: float = 1.0) -> float:
    """A number, or a string with a unit ("3.35 TB/s", "989.4 TFLOPS"), in base units; a bare number is in
    `scale` base units (1e12 for the TB/s and TFLOP/s keys)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * scale
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*", str(value).lower())
    if found is None or found.group(2) not in {**units, "": 1.0}:
        raise InputError(f"{label}: {key} must be a number or a number with one of the units "
                         f"{', '.join(units)}, not {value!r:.40}.")
    return float(found.group(1)) * units.get(found.group(2), scale)


def _one_of(data: Mapping[str, Any], keys: tuple[str, ...], label: str, what: str) -> str:
    given = [k for k in keys if data.get(k) is not None]
    if len(given) != 1:
        raise InputError(f"{label}: give the {what} as exactly one of {', '.join(keys)}"
                         + (f", not {' and '.join(given)}" if given else "") + ".")
    return given[0]


def _spec_flops(data: Mapping[str, Any], label: str) -> dict[str, float]:
    key = _one_of(data, ("tflops", "flops"), label, "peak dense FLOP/s per precision (a table)")
    table = data[key]
    if not isinstance(table, Mapping) or not table:
        raise InputError(f"{label}: {key} must be a table of precision = dense peak, e.g. [tflops] bf16 = 989.4.")
    flops: dict[str, float] = {}
    for name, value in table.items():
        try:
            dtype = normalise_dtype(str(name))
        except InputError:
            raise InputError(f"{label}: {key} names '{name!s:.20}', not a precision ({', '.join(DTYPES)}).") from None
        if dtype in ("int4", "int3", "int2"):
            raise InputError(f"{label}: {dtype} has no tensor rate of its own (weight-only; it runs at the 16-bit "
                             "rate); leave it out.")
        rate = _with_unit(value, _FLOP_UNITS, f"{key}.{name}", label, 1e12 if key == "tflops" else 1.0)
        low, high, _ = SPEC_BOUNDS["flops"]
        if not (math.isfinite(rate) and low <= rate <= high):
            raise InputError(f"{label}: {key}.{name} is {rate:.4g} FLOP/s, outside the plausible {low:.4g} to "
                             f"{high:.4g} FLOP/s for one GPU; check its unit ([tflops] takes TFLOP/s, [flops] "
                             "FLOP/s).")
        flops[dtype] = rate
    if not {"bf16", "fp16", "fp32"} & set(flops):
        raise InputError(f"{label}: {key} needs a bf16, fp16 or fp32 rate, which 16-bit models' math runs at.")
    if "bf16" in flops and "fp16" not in flops:
        flops["fp16"] = flops["bf16"]  # every GPU with BF16 tensor cores runs FP16 at the same rate; not the reverse
    return flops


def gpu_spec_from_mapping(data: Mapping[str, Any], label: str = "the GPU spec") -> GpuSpec:
    """A GpuSpec from a user's figures (keys in _SPEC_KEYS; docs/physics.md, "Your own GPU"): the name; memory as
    memory_bytes or memory_gb (GPU "GB" are binary, as vendors print them); memory bandwidth as hbm_bytes_per_s,
    hbm_tb_per_s or hbm_bandwidth ("3.35 TB/s"); dense peak FLOP/s as a [tflops] (TFLOP/s) or [flops] (FLOP/s, or
    strings with units) table by precision, a bf16 rate serving fp16 too unless fp16 is given; tdp_w; optionally
    interconnect, nvlink_gb_per_s (both directions), pcie_gb_per_s (default 64, PCIe Gen4 x16), arch, source,
    max_sm_clock_mhz. Every problem is one InputError."""
    unknown = sorted(set(data) - _SPEC_KEYS)
    if unknown:
        raise InputError(f"{label}: unknown key '{unknown[0]!s:.40}'; known: {', '.join(sorted(_SPEC_KEYS))}.")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 80:
        raise InputError(f"{label}: name must be the GPU's name, 1 to 80 characters (e.g. {_SPEC_EXAMPLE}).")
    memory_key = _one_of(data, ("memory_bytes", "memory_gb"), label, "memory")
    memory = _spec_number(data, memory_key, label)
    assert memory is not None
    memory_bytes = int(memory if memory_key == "memory_bytes" else memory * GIB)
    bandwidth_key = _one_of(data, ("hbm_bytes_per_s", "hbm_tb_per_s", "hbm_bandwidth"), label, "memory bandwidth")
    bandwidth = _with_unit(data[bandwidth_key], _BANDWIDTH_UNITS, bandwidth_key, label,
                           1e12 if bandwidth_key == "hbm_tb_per_s" else 1.0)
    low, high, _ = SPEC_BOUNDS["hbm_bytes_per_s"]
    if not (math.isfinite(bandwidth) and low <= bandwidth <= high):
        raise InputError(f"{label}: {bandwidth_key} comes to {bandwidth / 1e12:.4g} TB/s, outside the plausible "
                         f"{low / 1e12:.4g} to {high / 1e12:.4g} TB/s for one GPU; check its unit (hbm_tb_per_s "
                         "takes TB/s, hbm_bytes_per_s bytes/s).")
    tdp = _spec_number(data, "tdp_w", label)
    if tdp is None:
        raise InputError(f"{label}: tdp_w, the board power in watts, is missing (it prices tokens per joule).")
    nvlink = _spec_number(data, "nvlink_gb_per_s", label)
    pcie = _spec_number(data, "pcie_gb_per_s", label) or 64.0
    clock = _spec_number(data, "max_sm_clock_mhz", label)
    texts = {}
    for key in ("interconnect", "arch", "source"):
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 200):
            raise InputError(f"{label}: {key} must be a string of at most 200 characters.")
        texts[key] = value
    link = texts["interconnect"] or ("NVLink" if nvlink else "PCIe")
    return GpuSpec(f"user-{_squash(name)[:40] or 'gpu'}", name.strip(), memory_bytes, bandwidth,
                   _spec_flops(data, label), tdp, link, nvlink * GB if nvlink else None, pcie * GB,
                   texts["arch"] or "user", texts["source"] or f"user figures ({label})", max_sm_clock_mhz=clock)


def _inline_spec(text: str) -> dict[str, Any]:
    """"name=X,memory_gb=80,hbm_tb_per_s=3.35,tdp_w=700,tflops.bf16=989.4" as a mapping."""
    data: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise InputError(f"cannot read '{part.strip()!s:.40}' in the GPU spec; write key=value pairs separated "
                             "by commas, e.g. name=X,memory_gb=80,hbm_tb_per_s=3.35,tdp_w=700,tflops.bf16=989.4.")
        try:
            number: Any = float(value)
        except ValueError:
            number = value
        table, dot, sub = key.partition(".")
        if dot:
            inner = data.setdefault(table, {})
            if not isinstance(inner, dict):
                raise InputError(f"the GPU spec gives {table} both as a value and as a table.")
            inner[sub] = number
        else:
            data[key] = number
    return data


def load_gpu_spec(source: str) -> GpuSpec:
    """A GPU from a TOML or JSON file of its figures (gpu_spec_from_mapping), or from the same keys written inline
    as key=value pairs separated by commas."""
    path = Path(source).expanduser()
    if not path.exists() and "=" in source:
        return gpu_spec_from_mapping(_inline_spec(source), "the --gpu-spec values")
    if not path.is_file():
        raise InputError(f"no GPU spec file at {source}; give a TOML or JSON file, or key=value pairs "
                         "(e.g. name=X,memory_gb=80,hbm_tb_per_s=3.35,tdp_w=700,tflops.bf16=989.4).")
    try:
        text = read_text_bounded(path)
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}.") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path} is not valid TOML ({str(exc).rstrip('.')}).") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a table of the GPU's figures.")
    return gpu_spec_from_mapping(data, str(path))


def looks_like_spec_file(text: str) -> bool:
    """Whether a --gpu value names a spec file (an existing file, or a .toml/.json name) rather than a table row."""
    return text.lower().endswith((".toml", ".json")) or Path(text).expanduser().is_file()


# --- MIG slices ---------------------------------------------------------------------------------------------------

# A MIG profile as NVML and dcgm-exporter name it: "1g.10gb", "3g.40gb", "1g.10gb+me", or a compute instance inside
# a GPU instance, "1c.3g.40gb" (one of the instance's three compute slices).
_MIG_PROFILE = re.compile(r"(?<![\w.])(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+me)?(?![\w.])", re.IGNORECASE)


@dataclass(frozen=True)
class MigSlice:
    """One MIG instance's profile: its compute slices (GPCs; a compute instance's own, when it names one) and its
    memory in GB as the profile names it."""

    profile: str
    compute_slices: int
    memory_gb: int

    @property
    def smallest(self) -> bool:
        """One compute slice, the least any profile has (A100 1g.5gb, A30 1g.6gb, H100 1g.10gb, H100 NVL 1g.12gb,
        H200 1g.18gb): no profile splits this GPU's compute finer."""
        return self.compute_slices <= 1


def mig_slice(name: str) -> MigSlice | None:
    """The MIG profile a device or instance name carries ("NVIDIA A30 MIG 1g.6gb", "1c.3g.40gb"), or None."""
    found = _MIG_PROFILE.search(name)
    if found is None:
        return None
    compute, gpcs, memory = found.group(1), int(found.group(2)), int(found.group(3))
    if gpcs < 1 or memory < 1:
        return None
    return MigSlice(found.group(0).lower(), int(compute) if compute else gpcs, memory)


# Compute slices (GPCs) and memory slices a MIG-capable GPU is cut into, NVIDIA Multi-Instance GPU User Guide,
# "Supported MIG Profiles" (docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html): the A30
# is cut into 4 of each (1g.6gb: 1/4 of the SMs, 1/4 of the memory); A100, H100, H200, GH200, H20 and B200 into 7
# compute and 8 memory slices (H100 1g.10gb: 1/7 of the SMs, 1/8 of the memory; 3g.40gb: 3/7 and 4/8). A memory
# slice carries its share of the memory controllers and L2, so bandwidth goes with memory.
_MIG_SLICES: dict[str, tuple[int, int]] = {"a30": (4, 4)}
_MIG_CAPABLE = frozenset({"a100-40gb-sxm", "a100-40gb-pcie", "a100-80gb-sxm", "a100-80gb-pcie", "a30", "h100-sxm",
                          "h100-pcie", "h100-nvl", "h200", "h200-nvl", "gh200-96gb", "gh200-144gb", "h20", "b200"})


def mig_spec(parent: GpuSpec, found: MigSlice) -> GpuSpec | None:
    """A MIG instance's roofs: the parent's FLOP/s scaled by its share of the SMs (compute slices over the GPU's),
    memory and bandwidth by its share of the memory slices (the profile's GB over the parent's, in whole slices).
    Power and clocks are the board's (NVML reads a slice's power and power limit as the whole board's, and the
    power rules compare them with this TDP); MIG has no peer-to-peer between instances, so no NVLink. None where
    the parent has no such profile (not MIG-capable, or more compute or memory slices than it has)."""
    if parent.key not in _MIG_CAPABLE:
        return None
    compute_total, memory_total = _MIG_SLICES.get(parent.key, (7, 8))
    memory_slices = round(memory_total * found.memory_gb * GIB / parent.memory_bytes)
    if not (1 <= found.compute_slices <= compute_total and 1 <= memory_slices <= memory_total):
        return None
    compute = found.compute_slices / compute_total
    memory = memory_slices / memory_total
    profile = found.profile.removesuffix("+me")
    return dataclasses.replace(
        parent, key=f"{parent.key}-mig-{profile}", name=f"{parent.name} MIG {profile}",
        memory_bytes=int(parent.memory_bytes * memory), hbm_bytes_per_s=parent.hbm_bytes_per_s * memory,
        flops={dtype: rate * compute for dtype, rate in parent.flops.items()},
        interconnect="MIG instance (no peer-to-peer)", nvlink_bytes_per_s=None,
        source=(f"{parent.source}; MIG {profile}: {found.compute_slices}/{compute_total} of the SMs, "
                f"{memory_slices}/{memory_total} of the memory and its bandwidth (NVIDIA Multi-Instance GPU User "
                "Guide, Supported MIG Profiles)"))


# --- 16-bit math -----------------------------------------------------------------------------------------------

def sixteen_bit_dtype(gpu: GpuSpec) -> str | None:
    """The 16-bit float a GPU has tensor-core units for, bf16 first (it needs no loss scaling): "bf16" from Ampere
    and CDNA2 on, "fp16" on Volta and Turing (V100, T4), None on a GPU with neither."""
    for dtype in ("bf16", "fp16"):
        if dtype in gpu.flops:
            return dtype
    return None


def fp32_matmul_dtype(gpu: GpuSpec, tf32: bool) -> str:
    """The rate FP32 matmuls run at: TF32 tensor cores where the kernels use them and the GPU has them, else the
    FP32 pipes (V100 and T4 have no TF32)."""
    return "tf32" if tf32 and "tf32" in gpu.flops else "fp32"
