"""The compiled trace modules are optional at install time: setup.py builds them with `optional=True`, so a compiler
that is missing or fails leaves a build that succeeds without them (the Python path then runs; see
tests/test_traces_pure_python.py). Checked by building a copy of setup.py and the two C files with a compiler that
always fails and with one that does not exist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform == "win32", reason="CC and LDSHARED name the compiler on POSIX systems only")
@pytest.mark.parametrize("cc", ["/bin/false", "/nonexistent/cc"], ids=["failing-compiler", "no-compiler"])
def test_a_failed_compile_leaves_a_working_build(tmp_path: Path, cc: str) -> None:
    pytest.importorskip("setuptools")
    (tmp_path / "diagnoser" / "traces").mkdir(parents=True)
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for name in ("_scan.c", "_gaps.c"):
        shutil.copy(ROOT / "diagnoser" / "traces" / name, tmp_path / "diagnoser" / "traces" / name)
    env = {**os.environ, "CC": cc, "LDSHARED": cc}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for name in ("_scan", "_gaps"):
        assert f'building extension "diagnoser.traces.{name}" failed' in out, out[-3000:]
    assert not [p.name for p in (tmp_path / "diagnoser" / "traces").iterdir() if p.suffix in (".so", ".pyd")]
