"""The `diagnoser` console script: builds the typer app from one module per command.

Each module in COMMAND_MODULES defines `register(app)`. Errors derived from DiagnoserError become one sentence on
stderr and their exit code; nothing else about failures is printed unless DIAGNOSER_DEBUG=1.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import typer

from diagnoser import __version__
from diagnoser.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, DiagnoserError
from diagnoser.textsafe import one_line

COMMAND_MODULES = (
    "attach",
    "demo",
    "gpus",
    "doctor",
    "diagnose",
    "analyze",
    "trace",
    "rules",
    "theory",
    "calibrate",
    "selftest",
    "report",
    "dcgm",
    "fleet",
    "agent",
    "history",
)

app = typer.Typer(
    name="diagnoser",
    help="What limits this GPU inference server, and what to change.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"diagnoser {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """What limits this GPU inference server, and what to change."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"diagnoser.cli.{_name}").register(app)


def fail(message: str, code: int) -> None:
    typer.echo(f"diagnoser: {one_line(message)}", err=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="diagnoser", standalone_mode=True)
    except DiagnoserError as exc:
        if os.environ.get("DIAGNOSER_DEBUG"):
            raise
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted.", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # Output piped into `head` and closed: not an error worth a traceback.
        sys.stderr.close()
        raise SystemExit(0) from None
    except Exception as exc:  # a bug of ours: one sentence, and the traceback only when asked for
        if os.environ.get("DIAGNOSER_DEBUG"):
            raise
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        at = f" at {Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}" if where is not None else ""
        fail(f"internal error ({type(exc).__name__}: {exc}{at}); this is a bug in diagnoser: please report it with "
             "the command line (DIAGNOSER_DEBUG=1 shows the traceback). Files already written are kept.",
             EXIT_INTERNAL)


if __name__ == "__main__":
    main()
