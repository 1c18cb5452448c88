"""Reading a vLLM /metrics page: diagnoser's line reader against prometheus_client's parser, in the same run.

    python benchmarks/exposition_parse.py

Prints the load average beside each figure; the claim is the ratio, not the milliseconds.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families

from diagnoser.collectors.exposition import parse_text
from diagnoser.collectors.server_maps import SERVER_MAPS
from tests.serving_pages import FIXTURES, scrapes


def best_of(fn: Callable[[], object], repeat: int = 5, number: int = 20) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def main() -> None:
    page = scrapes(FIXTURES / "vllm_v1_dp2.prom")[1]
    mapping = SERVER_MAPS["vllm"]

    def peer() -> None:
        for family in text_string_to_metric_families(page):
            for _ in family.samples:
                pass

    results = {
        "prometheus_client, whole page": best_of(peer),
        "line reader, whole page": best_of(lambda: parse_text(page)),
        "line reader, mapped names (histogram scrape)": best_of(lambda: parse_text(page, mapping.names())),
        "line reader, mapped names (light scrape)": best_of(lambda: parse_text(page, mapping.names(histograms=False))),
    }
    base = results["prometheus_client, whole page"]
    print(f"page: {page.count(chr(10))} lines; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name, seconds in results.items():
        print(f"{name:48s} {seconds * 1e3:7.2f} ms  {seconds / base:5.2f}x the peer")


if __name__ == "__main__":
    main()
