"""How many processes a parallel step may use by default: the cores this process may run on."""

from __future__ import annotations

import os


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


__all__ = ["default_jobs"]
