"""The fleet's HTML page at 100,000 GPUs: its size, the time to build and render it, and the memory it adds to the
`fleet` process, for this checkout against a baseline checkout, in the same run.

The rows are real triage rows: the planted GPU classes of the test suite (tests/test_fleet_units.py) diagnosed by
the rule engine, then repeated with their own node and UUID up to --gpus, and packed as the triage's workers hand
them to the parent (diagnoser/fleet/pack.py). Each variant runs in a fresh process that unpacks the rows (as `fleet`
holds them), records its peak RSS, builds the fleet view, renders the page, and records its peak RSS again; the
difference is what the page costs the process.

Run:  .venv/bin/python benchmarks/fleet_html.py --gpus 100000 --baseline /path/to/other/checkout
Prints one JSON line per variant and repeat, with the load average; see benchmarks/FLEET.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, resource, sys, time
from diagnoser.fleet.model import FleetReport
from diagnoser.fleet.pack import unpack_rows
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.model import build_fleet_view
rows, _ = unpack_rows(open(sys.argv[1], "rb").read())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
page = HtmlRenderer().render_fleet(build_fleet_view(FleetReport("bench", 1e9, 1e9 + 3600, rows=rows)))
seconds = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rows": len(rows), "page_mb": len(page.encode()) / 2**20, "seconds": round(seconds, 2),
                  "rss_rows_mb": round(before / 1024), "rss_page_mb": round((after - before) / 1024)}))
"""


def make_rows(gpus: int, path: Path) -> None:
    """The planted classes triaged once, repeated to `gpus` rows with their own identities, packed to `path`."""
    sys.path.insert(0, str(ROOT))
    from diagnoser.fleet.pack import RowPacker
    from diagnoser.fleet.run import triage_rows
    from tests.test_fleet_parallel import _fleet

    base, _ = triage_rows(_fleet(700), processes=1)
    packer = RowPacker()
    for i in range(gpus):
        row = base[i % len(base)]
        packer.add(dataclasses.replace(row, node=f"node-{i // 8:05d}", gpu=str(i % 8), uuid=f"GPU-{i:08d}",
                                       diagnosis=dataclasses.replace(row.diagnosis)))
    path.write_bytes(packer.finish())


def run_variant(checkout: Path, rows: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(rows)], env=env, capture_output=True, text=True,
                         timeout=3600, cwd=checkout)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: the page was not made ({out.stderr.strip().splitlines()[-1:]})")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=100_000)
    ap.add_argument("--baseline", type=Path, help="another checkout of diagnoser, timed in the same run")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.gpus < 1 or args.repeat < 1:
        raise SystemExit("--gpus and --repeat must be at least 1")
    if args.baseline is not None and not (args.baseline / "diagnoser" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline} is not a diagnoser checkout")
    variants = {"this": ROOT, **({"baseline": args.baseline} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.msgpack"
        make_rows(args.gpus, rows)
        for repeat in range(args.repeat):
            for name, checkout in variants.items():
                result = run_variant(checkout, rows)
                print(json.dumps({"variant": name, "repeat": repeat, **result,
                                  "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
