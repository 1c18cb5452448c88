"""The switch for the compiled parts (_scan.c, _gaps.c): DIAGNOSER_NO_C=1 makes every import site take the Python
they stand in for, as an install without a C compiler does (the same answers, slower). CI runs the trace tests once
so (tests/test_traces_pure_python.py), and anyone can compare the two paths on their own trace."""

from __future__ import annotations

import os

NO_C_ENV = "DIAGNOSER_NO_C"


def compiled_allowed() -> bool:
    """False when DIAGNOSER_NO_C is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get(NO_C_ENV, "").strip().lower() in ("", "0", "false", "no")


def require_compiled() -> None:
    """Raise ImportError when the compiled parts are switched off: an import site's `except ImportError` then takes
    the Python path, exactly as when the module was never built."""
    if not compiled_allowed():
        raise ImportError(f"the compiled trace modules are switched off ({NO_C_ENV} is set)")


__all__ = ["NO_C_ENV", "compiled_allowed", "require_compiled"]
