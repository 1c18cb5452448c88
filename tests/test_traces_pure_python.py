"""The pure-Python path of the trace analysis, run as its own job of the suite: the public traces analysed in a
process with DIAGNOSER_NO_C=1 (every compiled part switched off at its import site, as an install without a C
compiler has them) give the same JSON, to the last digit, as in a process with the compiled modules where they are
built. Without a build (no compiler) both processes take the Python path and the test still runs it end to end."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from diagnoser.traces.compiled import NO_C_ENV

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "traces"
PUBLIC = sorted(FIXTURES.glob("*.json.gz")) + sorted((HERE / "fixtures" / "gpu" / "traces").glob("*.json.gz"))

_SCRIPT = r"""
import json, sys
from diagnoser.traces import kernels, tables, timeline
from diagnoser.traces.analysis import analyze_trace
compiled = {"scan": tables._scan is not None, "gaps": timeline._gap_causes is not None,
            "kernels": kernels._unions is not None}
out = {p: analyze_trace(p, jobs=1).to_dict() for p in sys.argv[1:]}
print(json.dumps({"compiled": compiled, "analyses": out}, sort_keys=True, default=str))
"""


def _run(paths: list[Path], no_c: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != NO_C_ENV}
    if no_c:
        env[NO_C_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *map(str, paths)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def test_the_python_path_gives_the_same_json_as_the_compiled_one(tmp_path: Path) -> None:
    # one plain copy too: a plain file is read by offset and scanned where the scan is built
    plain = tmp_path / "a100_ddp_2rank_nccl_rank0.json"
    plain.write_bytes(gzip.decompress((FIXTURES / "a100_ddp_2rank_nccl_rank0.json.gz").read_bytes()))
    paths = [*PUBLIC, plain, FIXTURES / "recsys-sampled-2of128"]
    python = _run(paths, no_c=True)
    assert python["compiled"] == {"scan": False, "gaps": False, "kernels": False}  # the switch took every part off
    default = _run(paths, no_c=False)
    assert python["analyses"] == default["analyses"]
    analyses = python["analyses"]
    assert isinstance(analyses, dict) and len(analyses) == len(paths)
