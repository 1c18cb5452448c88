"""`python -m diagnoser.traces TRACE [--window W]`: the trace analysis as JSON, without the CLI or the rules.

For scripts and benchmarks that want only the analysis (the `diagnoser analyze` command adds the diagnosis).
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from diagnoser.errors import DiagnoserError
from diagnoser.traces.analysis import WINDOWS, analyze_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diagnoser.traces", description=__doc__)
    parser.add_argument("trace", help="a .json/.json.gz trace or a folder of per-rank traces")
    parser.add_argument("--window", choices=WINDOWS, default="auto")
    parser.add_argument("--gpu", default=None, help="the GPU the trace ran on, if deviceProperties lack it")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="processes reading a large trace (default: the cores other work leaves idle)")
    args = parser.parse_args(argv)
    try:
        analysis = analyze_trace(args.trace, window=args.window, gpu_name=args.gpu, jobs=args.jobs)
    except DiagnoserError as exc:
        print(f"diagnoser: {exc}", file=sys.stderr)
        return exc.exit_code
    # json.dump(indent=1) byte for byte: the C encoder, then msgspec's indentation (json's indenting encoder is Python)
    sys.stdout.write(msgspec.json.format(json.dumps(analysis.to_dict(), default=str), indent=1))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
