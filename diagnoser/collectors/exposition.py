"""Prometheus text exposition, read line by line: one malformed line is skipped and counted, not the whole page lost.

A serving engine's /metrics is written by several libraries at once (prometheus_client, a Rust exporter, a sidecar);
one bad line from any of them used to make the whole scrape "not Prometheus metrics". Here every sample line is
parsed on its own: `name{label="value",...} value [timestamp]`. Comment lines (# HELP, # TYPE) carry nothing the
mapping needs and are skipped. A page with no readable sample at all is still rejected, in one sentence.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Everything after the name: an optional label block up to the last "}", then the value and an optional timestamp.
_REST = re.compile(r"(?:\{(?P<labels>.*)\})?[ \t]+(?P<value>\S+)(?:[ \t]+(?P<ts>-?\d+(?:\.\d*)?))?[ \t]*\Z")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|\Z)')
_UNESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}
_EXCERPT = 60


class ParseError(ValueError):
    """The text holds no readable sample; the message says what the first bad line was."""


# Series read from one page. A vLLM page holds hundreds to a few thousand samples (tens of thousands with many LoRA
# adapters or label sets); 600,000 drove `attach` to 420 MB, past the agent unit's 512 MB. The rest of a longer page is
# not read, and the capture says so (ParseReport.unread).
MAX_PAGE_SERIES = 50_000


@dataclass
class ParseReport:
    """What reading one page skipped: how many sample lines were malformed, and the first of them; how many lines
    were left unread past MAX_PAGE_SERIES."""

    skipped: int = 0
    first_bad: str = ""  # "line N: why (excerpt)", with control characters escaped
    unread: int = 0  # lines after the MAX_PAGE_SERIES-th series, not read

    def cut_note(self, origin: str) -> str:
        """One sentence for the capture's notes when the page was cut."""
        return (f"{origin} had more than {MAX_PAGE_SERIES:,} series on one page: reading stopped there and "
                f"{self.unread:,} more lines were not read, so the server signals cover the first series only.")

    def note(self, origin: str) -> str:
        """One sentence for the capture's notes."""
        lines = "line" if self.skipped == 1 else "lines"
        return f"{origin} had {self.skipped} malformed {lines}, skipped (first: {self.first_bad})."


def safe_excerpt(text: str, limit: int = _EXCERPT) -> str:
    """A short, printable form of untrusted text: control characters (ESC, CR, C1...) escaped, long text cut."""
    cut = text[:limit]
    out = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in cut)
    return out + ("..." if len(text) > limit else "")


def _labels(block: str) -> Labels | None:
    out: Labels = {}
    pos = 0
    block = block.rstrip(" \t,")
    while pos < len(block):
        m = _LABEL.match(block, pos)
        if m is None:
            return None
        out[m.group(1)] = _UNESCAPE.sub(lambda e: _ESCAPES.get(e.group(1), e.group(0)), m.group(2))
        pos = m.end()
    return out


def _value(text: str) -> float | None:
    if "_" in text:  # Python's float() accepts 1_000; the exposition format does not
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_line(line: str) -> tuple[str, Labels, float] | str:
    """(name, labels, value) of one sample line, or why it is not one."""
    m = _NAME.match(line)
    if m is None:
        return "invalid metric name"
    rest = _REST.match(line, m.end())
    if rest is None:
        return "no value after the metric name"
    labels: Labels = {}
    if rest.group("labels") is not None:
        parsed = _labels(rest.group("labels"))
        if parsed is None:
            return "malformed labels"
        labels = parsed
    value = _value(rest.group("value"))
    if value is None:
        return "value is not a number"
    return m.group(0), labels, value


def parse_text(text: str, names: tuple[str, ...] | None = None) -> tuple[Samples, ParseReport]:
    """Sample name -> [(labels, value)], and what was skipped. With `names`, only lines whose metric name starts with
    one of them are read (a vLLM page carries hundreds of families the diagnosis never reads).

    Raises ParseError when the text has sample lines but none readable (an HTML page, a JSON answer)."""
    out: Samples = defaultdict(list)
    report = ParseReport()
    read = 0
    for number, start, raw in _lines(text):
        if read >= MAX_PAGE_SERIES:
            report.unread = text.count("\n", start) + (not text.endswith("\n"))
            break
        line = raw.rstrip("\r")
        if not line or line[0] == "#" or (names is not None and not line.startswith(names)):
            continue
        if line.isspace():
            continue
        parsed = parse_line(line)
        if isinstance(parsed, str):
            report.skipped += 1
            if not report.first_bad:
                report.first_bad = f"{parsed} on line {number}: {safe_excerpt(line.strip())}"
            continue
        name, labels, value = parsed
        out[name].append((labels, value))
        read += 1
    if not out and report.skipped:
        raise ParseError(report.first_bad)
    return dict(out), report


def _lines(text: str) -> Iterator[tuple[int, int, str]]:
    """(number, offset, line) of each line, one at a time: a page is not split into a list of all its lines."""
    start, number = 0, 1
    while start < len(text):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        yield number, start, text[start:end]
        start, number = end + 1, number + 1


def finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]
