"""The real-vLLM situations (tests/engines/situations.py) run once, printed as the table in REAL_ENGINES.md: each
situation's verdict and first fix, and for each applied fix the predicted gain against the realised one, with the
load average beside every figure.

    .venv/bin/python -m benchmarks.real_vllm [OUT_DIR] [SITUATION ...]

Needs the engine's venv (scripts/install-vllm.sh). Takes 10-20 minutes on two cores (four server starts).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.engines import situations as sit
from tests.engines import vllm_server


def _gain(value: float | None, kind: str) -> str:
    if value is None:
        return "not predictable"
    return f"{'up to ' if kind == 'upper_bound' else 'about '}x{value:.2f}"


def main(argv: list[str]) -> int:
    why = vllm_server.available()
    if why:
        print(why, file=sys.stderr)
        return 2
    out = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    vllm_server.build_model(out / "model")
    t0 = time.monotonic()
    recordings = sit.record_all(out / "model", out, tuple(argv[1:]))
    print(f"vLLM {vllm_server.version()}, {os.cpu_count()} CPUs, {time.monotonic() - t0:.0f} s\n")
    print("| situation | verdict (expected) | first fix | client tokens/s | load |")
    print("|---|---|---|---:|---:|")
    rows = []
    for name, r in recordings.items():
        d, s = r.diagnosis, r.situation
        first = d["fixes"][0] if d["fixes"] else None
        fix = f"{first['kind']} {_gain(first['gain'], first['gain_kind'])}" if first else "none"
        print(f"| {name} | {d['verdict']} ({' or '.join(s.verdicts)}) | {fix} | {r.client['tokens_per_s']:.1f} | "
              f"{r.load_avg:.1f} |")
        if r.applied is not None and first is not None:
            (p,) = [p for p in r.compare["predictions"] if p["kind"] == first["kind"]] or [None]
            rows.append((name, s.applied, first, p, r, r.applied))
    print("\n| situation | fix applied | predicted | realised (server tokens/s) | graded | client tokens/s before -> "
          "after | load before / after |")
    print("|---|---|---|---:|---|---|---|")
    for name, applied, first, p, before, after in rows:
        realised = f"x{p['realised']:.2f}" if p and p["realised"] else "n/a"
        print(f"| {name} | {applied} server | {_gain(first['gain'], first['gain_kind'])} | {realised} | "
              f"{p['verdict'] if p else 'not found'} | {before.client['tokens_per_s']:.1f} -> "
              f"{after.client['tokens_per_s']:.1f} | {before.load_avg:.1f} / {after.load_avg:.1f} |")
    (out / "summary.json").write_text(json.dumps({n: {"diagnosis": r.diagnosis, "compare": r.compare,
                                                      "client": r.client, "load": r.load_avg}
                                                  for n, r in recordings.items()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
