"""Helpers shared by the command modules: error handling and output."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from diagnoser.errors import EXIT_INTERRUPTED, DiagnoserError
from diagnoser.textsafe import one_line

F = TypeVar("F", bound=Callable[..., Any])


def handles_errors(func: F) -> F:
    """Turn a DiagnoserError into one sentence on stderr and its exit code (also under typer's test runner)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DiagnoserError as exc:
            typer.echo(f"diagnoser: {one_line(str(exc))}", err=True)  # errors quote labels, names, answers
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("diagnoser: interrupted.", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
