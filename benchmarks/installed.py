"""What an installed diagnoser has that a checkout may lack: its modules' bytecode.

pip compiles a package's .pyc files when it installs it; a checkout run with PYTHONDONTWRITEBYTECODE (or from a
read-only tree) compiles every module from source at each start, about 60 ms of a `fleet` start on the development VM.
A benchmark that times fresh processes compiles them once first, so it measures what a user's start costs."""

from __future__ import annotations

import compileall
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diagnoser"


def compile_bytecode() -> None:
    """Write the package's .pyc files (py_compile writes them whatever sys.dont_write_bytecode says)."""
    if not compileall.compile_dir(str(PACKAGE), quiet=1):
        raise SystemExit(f"could not compile {PACKAGE}: see the errors above")
