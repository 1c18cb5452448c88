"""The `diagnoser` console script.

Commands load when they run: `COMMANDS` names each command's module and its one-line summary, so `diagnoser
--help` and `diagnoser --version` import no command code at all, and `diagnoser rules` imports only the rules (the
NVML seam, the Prometheus client, the HTML renderer and torch load with the commands that use them). Each module
defines `register(app)`; a test checks that every summary here matches its command's docstring.

Errors derived from DiagnoserError become one sentence on stderr and their exit code; nothing else about failures is
printed unless DIAGNOSER_DEBUG=1.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from diagnoser import __version__
from diagnoser.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, DiagnoserError
from diagnoser.textsafe import one_line

# name -> (module in diagnoser.cli, summary); the summary is the first sentence of the command's docstring.
COMMANDS: dict[str, tuple[str, str]] = {
    "attach": ("attach", "Attach to a running inference server, observe it, and say what limits it."),
    "demo": ("demo", "Run the demo: a real (tiny) inference server under load, attached to and diagnosed."),
    "gpus": ("gpus", "List the GPUs and the processes on them."),
    "doctor": ("doctor", "Say which sources (NVML, GPM, DCGM, counters, server metrics) work here and how to enable "
               "the rest."),
    "diagnose": ("diagnose", "Diagnose a saved capture: verdict, evidence, ranked fixes."),
    "verify": ("verify", "Diagnose a server, wait for it to come back with a change, measure again, and grade the "
               "first fix."),
    "analyze": ("analyze", "Analyse a torch.profiler trace: idle causes, kernel classes, intensity, phases, then the "
                "verdict."),
    "trace": ("trace", "Take a torch.profiler trace of a running PyTorch server (hook, vLLM/SGLang endpoints, or "
              "Kineto daemon)."),
    "rules": ("rules", "List every rule, or print one rule's page: what it detects, why it matters, how to fix it."),
    "theory": ("theory", "Ceilings from first principles: memory, decode and prefill speed, ridge batch, and "
               "what-ifs."),
    "calibrate": ("calibrate", "Measure this GPU's memory bandwidth, matmul throughput per precision, launch "
                  "overhead and host-to-device bandwidth; store them so diagnoses use measured roofs instead of the "
                  "datasheet's."),
    "selftest": ("selftest", "Run workloads whose limiter is known (bandwidth, compute, batching/launch, VRAM, "
                 "host) under attach, and check each verdict and the physics on this machine."),
    "compare": ("compare", "Compare two captures or traces: what changed, and each fix's predicted gain against the "
                "realised one."),
    "report": ("report", "Write an HTML report to forward: verdict, fixes, charts, evidence, context. One file, "
               "works offline."),
    "dcgm": ("dcgm", "Diagnose a GPU, MIG instance, pod or process from DCGM counters (dcgm-exporter or "
             "Prometheus)."),
    "fleet": ("fleet", "Diagnose every GPU a Prometheus knows (via dcgm-exporter): idle, underused, limited, "
              "throttled, failing."),
    "agent": ("agent", "Diagnose this node's inference servers on a schedule; keep a history; export metrics."),
    "history": ("history", "Show how each target's verdict changed over time (from `diagnoser agent`'s history)."),
    "mcp": ("mcp", "Serve the commands to an AI assistant as Model Context Protocol tools over stdio."),
}


class LazyGroup(TyperGroup):
    """A command group that imports a command's module only when that command is asked for."""

    # Typed loosely: typer vendors click in recent releases and depends on it in older ones.
    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        importlib.import_module(f"diagnoser.cli.{entry[0]}").register(sub)
        command = typer.main.get_command(sub)  # one command and no callback: the command itself
        return command.get_command(ctx, cmd_name) if hasattr(command, "get_command") else command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = [(name, summary) for name, (_, summary) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


app = typer.Typer(
    name="diagnoser",
    cls=LazyGroup,
    help="What limits this GPU inference server, and what to change.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # the root help lists COMMANDS as plain text: nothing to import
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
