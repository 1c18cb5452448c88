"""The one place that imports pynvml (package nvidia-ml-py).

Collectors call NVML only through `nvml()`, so tests can put a fake with the same function names in its place
(`use(fake)`); the fake raises the real pynvml error classes, which are re-exported here for the collectors' `except`
clauses. Nothing else in the project imports pynvml.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError
NotSupported = pynvml.NVMLError_NotSupported
NoPermission = pynvml.NVMLError_NoPermission
GpuIsLost = pynvml.NVMLError_GpuIsLost
NotFound = pynvml.NVMLError_NotFound
Timeout = pynvml.NVMLError_Timeout
FunctionNotFound = pynvml.NVMLError_FunctionNotFound
LibraryNotFound = pynvml.NVMLError_LibraryNotFound
DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
Uninitialized = pynvml.NVMLError_Uninitialized
# Raised by pynvml's versioned wrappers when the driver lacks the symbol.
LibraryMismatch = getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError_FunctionNotFound)

_override: Any | None = None
_lock = threading.Lock()


def nvml() -> Any:
    """The pynvml module, or the fake a test installed."""
    return _override if _override is not None else pynvml


@contextlib.contextmanager
def use(fake: Any) -> Iterator[Any]:
    """Replace NVML with `fake` for the duration of the block (tests only)."""
    global _override
    with _lock:
        previous, _override = _override, fake
    try:
        yield fake
    finally:
        with _lock:
            _override = previous


def describe(exc: BaseException) -> str:
    """NVML's own words for an error ("Not Supported", "GPU is lost"), without the class name."""
    text = str(exc).strip()
    return text or type(exc).__name__
