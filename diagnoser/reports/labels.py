"""One table of the names and colours every renderer gives a verdict, an idle cause, a kernel class, a collective and a
host call: the terminal, the HTML page, the SVG charts and the trace analysis printed by `analyze` read them from here,
so a new limiter or cause is named once (tests/test_labels.py checks that each has an entry).

A verdict's label is the engine's own (`Limiter.label`, which the headline starts with); this table adds how each
renderer colours it. Nothing here imports more than the diagnosis, so the CLI can use it before any analysis runs.
"""

from __future__ import annotations

from typing import NamedTuple

from diagnoser.diagnosis import Limiter, Verdict
from diagnoser.reports.figdata import PALETTE

VERDICT_FALLBACK_COLOR = "#6e7781"


class Look(NamedTuple):
    """A name and a colour (a tuple, so `label, color = look` reads as before)."""

    label: str
    color: str


class VerdictLook(NamedTuple):
    label: str
    color: str  # charts, the HTML page's verdict badge and the fleet's bar
    term: str  # rich style of the verdict word in the terminal


class IdleLook(NamedTuple):
    label: str  # short, for a chart's legend
    color: str
    text: str  # the longer sentence the trace analysis prints


def _verdict(limiter: Limiter, color: str, term: str) -> tuple[str, VerdictLook]:
    return limiter.value, VerdictLook(limiter.label, color, term)


# In the Limiter's order: the HTML page's CSS classes are written in this order.
VERDICTS: dict[str, VerdictLook] = dict([
    _verdict(Limiter.VRAM, "#8250df", "bold magenta"),
    _verdict(Limiter.MEMORY_BANDWIDTH, "#0969da", "bold blue"),
    _verdict(Limiter.COMPUTE, "#bf3989", "bold magenta"),
    _verdict(Limiter.LATENCY, "#116329", "bold cyan"),
    _verdict(Limiter.BATCHING, "#bc4c00", "bold yellow"),
    _verdict(Limiter.HOST_LAUNCH, "#9a6700", "bold yellow"),
    _verdict(Limiter.THROTTLING, "#cf222e", "bold red"),
    _verdict(Limiter.INTERCONNECT, "#1a7f37", "bold green"),
    _verdict(Limiter.IDLE, "#57606a", "bold"),
    _verdict(Limiter.ERRORS, "#a40e26", "bold red"),
    (Verdict.INCONCLUSIVE.value, VerdictLook(Verdict.INCONCLUSIVE.value, VERDICT_FALLBACK_COLOR, "bold yellow")),
])
VERDICT_COLORS: dict[str, str] = {key: look.color for key, look in VERDICTS.items()}

# Idle causes (traces.timeline.IDLE_CAUSES; TraceSummary.idle_frac_by_cause), in that order.
IDLE_STYLE: dict[str, IdleLook] = {
    "host": IdleLook("host launch gaps", "#D55E00", "host had not launched yet"),
    "sync": IdleLook("host syncs", "#E69F00", "host synchronisation"),
    "pageable_memcpy": IdleLook("pageable copies", "#CC79A7", "pageable-memory copy"),
    "queue_dry": IdleLook("nothing queued", "#56B4E9", "nothing to do (queue dry)"),
    "kernel_overhead": IdleLook("kernel-to-kernel gaps", "#F0B37E", "kernel-to-kernel overhead"),
    "stream_wait": IdleLook("waiting on another stream", "#9F8FD0",
                            "queued work waiting on the device (another stream, a collective)"),
}

# Kernel classes (traces.classify.KERNEL_CLASSES; the keys of TraceSummary.kernel_share): colours apart from the idle
# causes' (shared with the time-share bar), so a lane of kernels and a lane of gaps never look alike.
KERNEL_STYLE: dict[str, Look] = {
    "gemm": Look("GEMM (matmul)", "#0072B2"), "attention": Look("attention", "#6A3D9A"),
    "embedding": Look("embedding / gather", "#1B7837"), "norm_elementwise": Look("norm / elementwise", "#7FBC41"),
    "reduction": Look("reduction", "#1F9E89"), "comm": Look("communication (NCCL)", "#B2182B"),
    "memcpy": Look("memcpy", "#8C510A"), "memset": Look("memset", "#BF9B6B"), "other": Look("other", "#999999"),
}

# Collectives (TraceSummary.comm_share_by_kind).
COLLECTIVES: dict[str, str] = {
    "all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all", "send_recv": "send/recv", "other": "other collectives",
}

# Host calls on a timeline window's CPU lanes (TimelineWindow.host_calls).
HOST_STYLE: dict[str, Look] = {
    "launch": Look("kernel launch", "#57606a"), "graph": Look("graph launch", "#24292f"),
    "copy": Look("copy call", "#C2A5CF"), "sync": Look("sync (host waits)", "#E69F00"),
}


def verdict_color(key: str) -> str:
    return VERDICTS[key].color if key in VERDICTS else VERDICT_FALLBACK_COLOR


def limiter_label(key: str) -> str:
    """A verdict key's label; a key this version does not know (a newer agent's row) is shown as it is."""
    return VERDICTS[key].label if key in VERDICTS else key


def verdict_term_style(key: str) -> str:
    return VERDICTS[key].term if key in VERDICTS else "bold"


def kernel_label(kind: str) -> str:
    return KERNEL_STYLE[kind].label if kind in KERNEL_STYLE else kind


def idle_look(cause: str) -> IdleLook:
    """A cause's look; one this table does not know (a newer capture) is named as it is, in grey."""
    return IDLE_STYLE.get(cause) or IdleLook(cause, PALETTE[6], cause)


__all__ = ["COLLECTIVES", "HOST_STYLE", "IDLE_STYLE", "KERNEL_STYLE", "VERDICTS", "VERDICT_COLORS",
           "IdleLook", "Look", "VerdictLook", "idle_look", "kernel_label", "limiter_label", "verdict_color",
           "verdict_term_style"]
