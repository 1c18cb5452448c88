"""Errors a user can cause or meet, each carrying one sentence and the exit code the CLI uses.

Exit codes (documented in README.md):
  0  success
  1  a limiter named in --fail-on was diagnosed
  2  bad input: a missing, corrupt or unsupported file, a bad option value
  3  a target or source is unavailable: no such process, no permission, endpoint down, no GPU where one is needed
  4  a partial result: a fleet statistic lost after a retry (the report is written, its rows marked partial)
  130 interrupted before anything was captured
  143 ended by SIGTERM (timeout, systemd, Kubernetes): what was captured until then was still saved and diagnosed
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAIL_ON = 1
EXIT_INPUT = 2
EXIT_UNAVAILABLE = 3
EXIT_PARTIAL = 4  # a result was given, from part of what was asked: a fleet statistic lost after a retry
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a program SIGTERM killed
EXIT_INTERNAL = 70  # a bug in diagnoser itself (EX_SOFTWARE)


class DiagnoserError(Exception):
    """Base of errors shown to the user as one sentence; never a traceback."""

    exit_code = EXIT_INPUT


class InputError(DiagnoserError):
    """The user gave something we cannot read or use."""

    exit_code = EXIT_INPUT


class SourceUnavailable(DiagnoserError):
    """A process, GPU, endpoint or permission the command needs is not there."""

    exit_code = EXIT_UNAVAILABLE
