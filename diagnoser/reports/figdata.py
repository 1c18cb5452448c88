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
    """A reference value on a throughput axis (a ceiling). `key` is a stable identifier and `color` its colour: the
    same key means the same thing, in the same colour, in every report; `short` is the name drawn beside the mark
    ("batch 1"), `label` the longer one of the legend."""

    label: str
    value: float
    detail: str = ""
    key: str = ""
    short: str = ""
    color: str = ""


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


@dataclass
class GainPair:
    """One fix of a before/after comparison: the gain the physics predicted for the change made, and the one
    measured. An upper bound holds when the realised gain stays under it; an estimate when it lands in the band."""

    label: str
    predicted: float | None
    realised: float | None
    upper_bound: bool = False
    verdict: str = ""


@dataclass
class GainPairs:
    title: str
    pairs: list[GainPair]
    band: float = 0.25  # the agreement band around an estimate, as a fraction of it


@dataclass
class Ratio:
    """A measured quantity after over before, with the ratio's standard error (relative); `better` says which way is
    an improvement ("higher", "lower" or "" for neither)."""

    label: str
    ratio: float
    error: float | None = None
    better: str = ""
    detail: str = ""


@dataclass
class Ratios:
    title: str
    items: list[Ratio]


# --- trace views ----------------------------------------------------------------------------------------------

@dataclass
class Span:
    """One op on a timeline lane: µs from the window's start, its colour (its class or cause) and what it is."""

    start_us: float
    dur_us: float
    color: str
    name: str
    kind: str = ""


@dataclass
class Lane:
    label: str  # short, drawn beside the lane ("stream 7", "host 1")
    spans: list[Span]
    tip: str = ""  # the long name (thread id, device)


@dataclass
class Lanes:
    """A short window of the trace: host threads, GPU streams and the GPU's idle gaps as lanes of spans."""

    title: str
    lanes: list[Lane]
    length_us: float
    legend: list[tuple[str, str]]  # (label, colour), in the order drawn


@dataclass
class Histogram:
    """Kernel durations on 1-2-5 bins: how many kernels, and how much GPU time, fall in each; with percentiles."""

    title: str
    edges_us: list[float]  # upper edges of the bins shown; the bin before the first starts at edges_us[0] / 2 or 0
    counts: list[float]  # share of kernels per bin (0..1)
    times: list[float]  # share of kernel time per bin (0..1)
    markers: list[tuple[str, float]]  # ("p50", 1.8), in µs
    open_last: bool = False  # the last bin has no upper edge


@dataclass
class StackedRow:
    label: str
    segments: list[Segment]
    flag: str = ""  # drawn beside the label ("straggler")


@dataclass
class StackedRows:
    """Several bars of a whole split the same way (one per rank), on one scale with one legend."""

    title: str
    rows: list[StackedRow]
    legend: list[Segment]


@dataclass
class KernelRow:
    """One of the kernels holding the most GPU time, as the kernel table shows it."""

    name: str  # short
    full_name: str
    kind: str  # class label
    color: str
    count: int
    total_us: float
    share: float  # of GPU kernel time
    mean_us: float
    p50_us: float
    p90_us: float
    achieved: str = ""  # "79 GFLOP/s, 79 GB/s" where the op's shapes were recorded
    sol: float | None = None  # speed of light: the larger of FLOP/s over the compute roof and bytes/s over HBM's
    sol_roof: str = ""  # which roof binds ("of HBM 3.35 TB/s")
    why_no_sol: str = ""


@dataclass
class KernelTable:
    title: str
    rows: list[KernelRow]
    caption: str
    shown_share: float  # of GPU kernel time, held by the rows


FigureSpec = TimeSeries | StackedBar | Bars | Roofline | Bullet | GainPairs | Ratios | Lanes | Histogram | StackedRows


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
