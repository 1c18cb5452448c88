"""The data of the report's figures: what each chart shows, as plain numbers and labels.

The report model (reports/model.py) fills these from the capture, the evidence and the diagnosis; the HTML renderer
draws them (reports/svg.py). Nothing here computes evidence or draws: a figure is data until a renderer draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Okabe-Ito: distinguishable with the common colour-vision deficiencies, and in greyscale print by position.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#7F7F7F", "#000000")
ROOF = "#24292f"


@dataclass
class Line:
    label: str
    times: Sequence[float]
    values: Sequence[float]
    color: str | None = None
    dashed: bool = False


@dataclass
class HLine:
    """A horizontal reference: a rule's threshold or a hardware limit."""

    value: float
    label: str
    color: str = ROOF


@dataclass
class Band:
    """A shaded span of time, e.g. while clocks were throttled."""

    start: float
    end: float
    label: str


@dataclass
class Roof:
    label: str
    flops: float  # FLOP/s
    primary: bool = True


@dataclass
class RoofPoint:
    """A workload: its arithmetic intensity and, when measured, its achieved FLOP/s (else drawn as a line).
    A point that does not describe the workload (`trusted` False) is drawn hollow, and `note` says why."""

    label: str
    intensity: float
    flops: float | None = None
    color: str = PALETTE[5]
    trusted: bool = True
    note: str = ""


@dataclass
class Segment:
    label: str
    value: float  # a fraction of the whole (0..1)
    color: str
    detail: str = ""


@dataclass
class Mark:
    """A reference value on a throughput axis (a ceiling). `key` is a stable short name: the same key means the same
    thing in every report."""

    label: str
    value: float
    detail: str = ""
    key: str = ""


# --- figure specs: one per kind of chart -----------------------------------------------------------------------

@dataclass
class TimeSeries:
    title: str
    lines: list[Line]
    unit: str
    x_max: float | None = None
    y_max: float | None = None
    hlines: list[HLine] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)


@dataclass
class StackedBar:
    title: str
    segments: list[Segment]
    width: float = 520
    note: str = ""


@dataclass
class Bars:
    title: str
    items: list[tuple[str, float]]
    unit: str = "ratio"


@dataclass
class Roofline:
    title: str
    bandwidth: float
    roofs: list[Roof]
    points: list[RoofPoint]


@dataclass
class Bullet:
    title: str
    achieved: float | None
    marks: list[Mark]
    unit: str = "tokens/s"


FigureSpec = TimeSeries | StackedBar | Bars | Roofline | Bullet


@dataclass
class Figure:
    key: str
    title: str
    spec: FigureSpec
    caption: str
    wide: bool = False


@dataclass
class NotDrawn:
    title: str
    why: str
