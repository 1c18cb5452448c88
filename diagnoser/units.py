"""Numbers with their units, for people: formatting them (terminal and HTML alike) and reading durations."""

from __future__ import annotations

import math
import re

from diagnoser.errors import InputError

_BINARY: tuple[tuple[str, float], ...] = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI: tuple[tuple[str, float], ...] = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


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


def fmt_bucket(value: float | None, unit: str, bucket: tuple[float, float] | None) -> str:
    """A number that may be a histogram quantile: interpolated inside a bucket, it says only which bucket its rank
    falls in, so the bucket is shown, never the interpolated value as if measured ("<= 1 tokens (first bucket)",
    "20.00 s to 40.00 s (histogram bucket)"); a value above the last finite bound is "> bound"."""
    if bucket is None:
        return fmt(value, unit)
    low, high = bucket
    if math.isinf(high):
        return f"> {fmt(low, unit)} (above the histogram's last bound)"
    if low <= 0:
        return f"<= {fmt(high, unit)} (the histogram's first bucket)"
    return f"{fmt(low, unit)} to {fmt(high, unit)} (histogram bucket)"


def gain(multiplier: float | None) -> str:
    if multiplier is None:
        return "gain not predictable"
    if multiplier >= 1.995:
        return f"up to {multiplier:.1f}x"
    return f"up to +{(multiplier - 1) * 100:.0f} %"


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(value: str | int | float, what: str = "duration", *, positive: bool = False) -> float:
    """Seconds from '90s', '15m', '1h30m', '500ms', '2d', '1w' or a bare number of seconds (spaces ignored); one
    sentence naming `what` otherwise. Zero is allowed unless `positive`."""
    if isinstance(value, bool):
        raise InputError(f"{what} must be a duration such as 90s, 15m, 1h30m or 2d, not {value!r}.")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_PART.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise InputError(f"{what} must be a duration such as 90s, 15m, 1h30m or 2d, not '{value}'.") from None
            seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds != seconds or seconds < 0 or (positive and seconds == 0):
        raise InputError(f"{what} must be {'positive' if positive else 'zero or more'}, not '{value}'.")
    return seconds
