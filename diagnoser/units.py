"""Formatting numbers with their units for people (terminal and HTML alike)."""

from __future__ import annotations

import math

_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "ratio":
        return f"{value * 100:.0f} %" if abs(value) >= 0.1 or value == 0 else f"{value * 100:.1f} %"
    if unit == "bytes":
        for name, size in _BINARY:
            if abs(value) >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if unit in ("B/s", "FLOP/s"):
        base = unit.split("/")[0]
        for name, size in _SI:
            if abs(value) >= size:
                return f"{value / size:.1f} {name}{base}/s"
        return f"{value:.0f} {unit}"
    if unit == "s":
        if abs(value) < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if abs(value) < 1:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    text = f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"
    return f"{text} {unit}".strip() if unit else text


def gain(multiplier: float | None) -> str:
    if multiplier is None:
        return "gain not predictable"
    if multiplier >= 1.995:
        return f"up to {multiplier:.1f}x"
    return f"up to +{(multiplier - 1) * 100:.0f} %"
