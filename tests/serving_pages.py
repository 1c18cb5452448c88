"""A real HTTP server that serves an engine's recorded /metrics page: the fixture's first scrape for the first
`--switch-after` answers, its second scrape from then on (tests/fixtures/serving/*.prom hold two scrapes each).

    python -m tests.serving_pages tests/fixtures/serving/vllm_v1_dp2.prom [--path /v1/metrics] [--switch-after 2]

Prints the port it listens on (127.0.0.1, chosen by the OS), then serves until killed. Extra arguments are ignored,
so a test can put an engine's name on this process's command line (a process that looks like vLLM but serves TGI).
Imported, `scrapes(path)` gives a fixture's pages.
"""

from __future__ import annotations

import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diagnoser.capture import Capture
    from diagnoser.collectors.server_metrics import ServerMetricsCollector

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "serving"
SEPARATOR = "# diagnoser-fixture: next scrape\n"


def scrapes(path: Path | str) -> list[str]:
    """The pages of one fixture file, in order."""
    text = Path(path).read_text()
    return text.split(SEPARATOR)


def read_two_pages(pages: list[str]) -> tuple[Capture, ServerMetricsCollector]:
    """One scrape at t=0 (the first page) and one at t=10 (the second) of a real HTTP server, then the end of the
    window: what the collector makes of them."""
    from diagnoser.capture import ServerInfo, new_capture
    from diagnoser.collectors.server_metrics import ServerMetricsCollector

    server = PageServer(pages, switch_after=1).serve_in_thread()
    try:
        capture = new_capture("test")
        capture.server = ServerInfo(kind="unknown", url=server.url)
        collector = ServerMetricsCollector(server.url)
        collector.start(capture)
        collector.sample(0.0)
        collector.sample(10.0)
        collector.stop(10.0)
    finally:
        server.close()
    return capture, collector


def values(capture: Capture, name: str) -> list[float]:
    """The values of the capture's series `name` ([] where it has none)."""
    found = capture.series_named(name)
    return found[0].values if found else []


def one(capture: Capture, name: str) -> float:
    """The single value of the capture's series `name`."""
    found = values(capture, name)
    assert len(found) == 1, (name, found)
    return found[0]


class PageServer:
    """Serves `pages[0]` for the first `switch_after` answers on `path`, then `pages[-1]`; anything else is 404."""

    def __init__(self, pages: list[str], *, path: str = "/metrics", switch_after: int = 2) -> None:
        self.pages, self.path, self.switch_after = pages, path, switch_after
        self.hits = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != owner.path:
                    self.send_error(404)
                    return
                with owner._lock:
                    owner.hits += 1
                    page = owner.pages[0] if owner.hits <= owner.switch_after else owner.pages[-1]
                data = page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}{path}"

    def serve_in_thread(self) -> PageServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("fixture")
    parser.add_argument("--path", default="/metrics")
    parser.add_argument("--switch-after", type=int, default=2)
    args, _ = parser.parse_known_args(argv)
    server = PageServer(scrapes(args.fixture), path=args.path, switch_after=args.switch_after)
    print(server.port, flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
