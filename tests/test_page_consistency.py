"""One page, no sentence that contradicts another: every recorded capture, public trace and exporter page rendered as
text, HTML and JSON, and each page read as an operator reads it.

- one direction per knob: no `--flag` raised in one sentence and lowered in another;
- no confidence word above a near tie ("confidence high" over "the window supports either about as well");
- no estimate above the figure it is said to be bounded by ("x1.16 at the ceiling ... so about x2.36").
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from diagnoser import signals as S
from diagnoser.capture import Capture, load, new_capture
from diagnoser.evidence_build import build_evidence
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.jsonout import JsonRenderer
from diagnoser.reports.model import build_report
from diagnoser.reports.terminal import TerminalRenderer
from diagnoser.rules.engine import diagnose_evidence

FIXTURES = Path(__file__).resolve().parent / "fixtures"
UP = re.compile(r"\b(raise|raising|raises|increase|increasing|higher|more)\b", re.I)
DOWN = re.compile(r"\b(lower|lowering|lowers|decrease|decreasing|reduce|reducing|fewer|smaller)\b", re.I)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
SENTENCES = re.compile(r"(?<=[.])\s+|\n\s*\n")
BLOCK = re.compile(r"</?(?:p|div|li|ul|ol|td|th|tr|table|h\d|section|header|details|summary|br)\b[^>]*>", re.I)
CEILING = re.compile(r"x(\d+(?:\.\d+)?) at the ceiling[^;]*;[^;]*?so about x(\d+(?:\.\d+)?)")


def _dcgm_captures() -> Iterator[tuple[str, Callable[[], Capture]]]:
    from diagnoser.collectors.dcgm import (
        FIELDS_BY_KEY,
        GpuWindow,
        add_gpu_window,
        mark_missing,
        parse_exporter_text,
    )

    for path in sorted((FIXTURES / "dcgm").glob("*.prom")):
        scrape = parse_exporter_text(path.read_text(), at=1_700_000_000.0)
        for key, gpu in scrape.gpus.items():
            def make(scrape: Any = scrape, key: Any = key, gpu: Any = gpu) -> Capture:
                window = GpuWindow(gpu)
                for field, value in scrape.values[key].items():
                    window.add(field, 0.0, value * FIELDS_BY_KEY[field].scale)
                cap = new_capture(gpu.describe(), started_at=1_700_000_000.0, duration_s=1.0)
                mark_missing(cap, set(add_gpu_window(cap, window)), fields_in_source=scrape.fields_seen)
                return cap
            yield f"dcgm/{path.stem}/{key}", make


def _inputs() -> list[tuple[str, Callable[[], Capture]]]:
    from diagnoser.traces import analyze_trace, capture_from_trace

    found: list[tuple[str, Callable[[], Capture]]] = [
        (str(p.relative_to(FIXTURES)), lambda p=p: load(p)) for p in sorted((FIXTURES / "gpu").rglob("*.dgc"))]
    traces = sorted((FIXTURES / "traces").rglob("*.json.gz")) + sorted((FIXTURES / "gpu" / "traces").glob("*.json.gz"))
    found += [(str(p.relative_to(FIXTURES)), lambda p=p: capture_from_trace(analyze_trace(p))) for p in traces]
    return found + list(_dcgm_captures())


INPUTS = _inputs()


def _pages(cap: Capture) -> dict[str, str]:
    ev = build_evidence(cap)
    report = build_report(cap, ev, diagnose_evidence(ev))
    buf = io.StringIO()
    TerminalRenderer(file=buf, color=False, width=200).render(report, verbose=True)
    page = html.unescape(re.sub(r"<[^>]+>", " ", BLOCK.sub("\n\n", HtmlRenderer().render(report))))
    return {"text": buf.getvalue(), "html": page, "json": JsonRenderer().render(report),
            "waiting_read": "yes" if S.SERVER_WAITING in ev else ""}


def _json_strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _json_strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _json_strings(value)


def knob_directions(text: str) -> dict[str, set[tuple[str, str]]]:
    """Each `--flag` the text advises, with the direction of the first raise/lower word of its sentence."""
    said: dict[str, set[tuple[str, str]]] = {}
    for sentence in SENTENCES.split(text):
        flags = set(FLAG.findall(sentence))
        up, down = UP.search(sentence), DOWN.search(sentence)
        if not flags or (up is None and down is None):
            continue
        direction = "up" if down is None or (up is not None and up.start() < down.start()) else "down"
        for flag in flags:
            said.setdefault(flag, set()).add((direction, " ".join(sentence.split())[:200]))
    return said


def test_the_checks_catch_what_they_look_for() -> None:
    """The page checks themselves, on sentences a page once held."""
    page = ("The batch then stops at the server's limit of 16 running sequences (--max-num-seqs 16): raising it "
            "toward 24 is the next fix.\n\nAdmit fewer sequences than the KV cache holds at peak (vLLM "
            "--max-num-seqs, SGLang --max-running-requests) or give the cache more memory.")
    assert {d for d, _ in knob_directions(page)["--max-num-seqs"]} == {"up", "down"}
    assert {d for d, _ in knob_directions(page)["--max-running-requests"]} == {"down"}
    found = CEILING.findall("batch 16 vs 6.8: x1.16 at the ceiling; the step runs at 0% of it and the time beyond "
                            "the roofline stays, so about x2.36")
    assert found == [("1.16", "2.36")]


@pytest.fixture(scope="module", params=INPUTS, ids=[name for name, _ in INPUTS])
def pages(request: pytest.FixtureRequest) -> dict[str, str]:
    _, make = request.param
    return _pages(make())


def test_one_direction_per_knob_per_page(pages: dict[str, str]) -> None:
    doc = json.loads(pages["json"])
    # The JSON's advice: its fixes, headline, notes and what to collect (each finding's own proposals are the record
    # of what the rules proposed before the judge, not advice).
    advice = [doc.get("fixes", []), doc.get("headline", ""), doc.get("near_tie", ""), doc.get("notes", []),
              doc.get("to_collect", [])]
    texts = {"text": pages["text"], "html": pages["html"], "json": "\n\n".join(_json_strings(advice))}
    for kind, text in texts.items():
        for flag, said in knob_directions(text).items():
            assert len({d for d, _ in said}) == 1, f"{kind}: {flag} advised both ways: {sorted(said)}"


def test_no_high_confidence_above_a_near_tie(pages: dict[str, str]) -> None:
    doc = json.loads(pages["json"])
    if doc.get("near_tie"):
        assert doc["confidence"] < 0.7, (doc["confidence"], doc["near_tie"])
        assert "confidence high" not in pages["text"], doc["near_tie"]
    for kind in ("text", "html"):
        if "near tie" in pages[kind].lower():
            assert not re.search(r"confidence\s+high", pages[kind], re.I), kind


def test_no_estimate_above_the_ceiling_ratio_it_is_read_from(pages: dict[str, str]) -> None:
    for kind in ("text", "html", "json"):
        for ceiling, about in CEILING.findall(" ".join(pages[kind].split())):
            assert float(about) <= float(ceiling) + 0.005, f"{kind}: x{about} read from x{ceiling} at the ceiling"


def test_a_sampled_traces_caveat_is_said_once_per_page(pages: dict[str, str]) -> None:
    """Why a trace is a sample (a long sentence) is said where the trace and the confidence are, not again in every
    fix it leaves unsized."""
    doc = json.loads(pages["json"])
    for fix in doc.get("fixes", []):
        assert "External ids" not in fix["basis"], fix["basis"]
    text = " ".join(pages["text"].split())
    assert text.count("consecutive External ids follow each other") <= 2, "the sample's reason repeated"


def test_the_hosts_share_has_one_value_per_page() -> None:
    """hf-static-compile-b1-fp32 once gave the host's idle share as 30 % (the trace's launch gaps), 34 % (those and the
    idle after syncs, unnamed) and 25 % (NVML's idle) on one page: one quantity, one number; another quantity, its
    own name."""
    page = " ".join(_pages(load(FIXTURES / "gpu/hf/precision/hf-static-compile-b1-fp32.dgc"))["text"].split())
    values = set(re.findall(r"idle (\d+)% of the traced window waiting for the host", page))
    values |= set(re.findall(r"the host's (\d+)%", page))
    values |= set(re.findall(r"the launch gaps \((\d+)%", page))
    assert len(values) == 1, values


def test_nested_ops_are_one_share() -> None:
    """hf-eager-b1's host sat in aten::scaled_dot_product_attention, which calls the cuDNN op, which calls its
    forward: one 50 % of the window, not three (their shares together exceed the time the host waited)."""
    headline = diagnose_evidence(build_evidence(load(FIXTURES / "gpu/hf/hf-eager-b1.dgc"))).headline
    shares = [int(v) for v in re.findall(r"\((\d+)% of the window", headline.split("The host was inside", 1)[1])]
    assert shares and sum(shares) <= 95, shares
    assert "nested" in headline and "aten::_cudnn_attention_forward" in headline


def test_nothing_waits_only_from_a_queue_metric(pages: dict[str, str]) -> None:
    """"Nothing waits" is a claim about the server's queue: said only where a queue metric was read."""
    if pages["waiting_read"]:
        return
    for kind in ("text", "html", "json"):
        assert "nothing waits" not in pages[kind].lower(), kind
