"""The compiled trace modules are optional at install time: setup.py builds them with `optional=True`, so a compiler
that is missing or fails leaves a build that succeeds without them (the Python path then runs; see
tests/test_traces_pure_python.py). Checked by building a copy of setup.py and the two C files with a compiler that
always fails and with one that does not exist. Where a C compiler and Python's headers are here, the install built
both (a broken C file would otherwise pass unseen, every comparison with the Python skipped); where not, that check
skips with the reason and the Python path is what runs."""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from diagnoser.traces.compiled import NO_C_ENV, compiled_allowed

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


def _c_compiler() -> str | None:
    """The compiler setup.py would use on a POSIX system ($CC, else the one Python was built with), if it is here."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or ""
    words = shlex.split(cc)
    return shutil.which(words[0]) if words else None


def test_the_compiled_modules_are_built_where_a_c_compiler_is() -> None:
    if not compiled_allowed():
        pytest.skip(f"{NO_C_ENV} is set: the compiled modules are switched off, the Python path runs")
    if sys.platform == "win32":
        pytest.skip("MSVC is found by setuptools, not by a name on PATH: whether it is here is not checked")
    cc = _c_compiler()
    if cc is None:
        pytest.skip("no C compiler here ($CC or the one Python was built with): the install took the Python path")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers here (Python.h; python3-dev): the install took the Python path")
    missing = []
    for name in ("_scan", "_gaps"):
        try:
            importlib.import_module(f"diagnoser.traces.{name}")
        except ImportError:
            missing.append(f"diagnoser/traces/{name}.c")
    if missing:
        pytest.fail(f"a C compiler ({cc}) and Python's headers are here, but {' and '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not built: `pip install -e .` (or `python setup.py "
                    "build_ext --inplace`) builds them and its output says why a build failed (setup.py builds them "
                    "optional, so a failed build does not stop the install).", pytrace=False)
