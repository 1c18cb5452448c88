"""`python -m diagnoser.hook -- <server command> [args...]`: run a server unchanged with the trace hook installed.

The command replaces this process (exec), so it keeps this pid: `diagnoser trace <pid>` reaches it. Every Python
process it starts imports diagnoser.hook at startup (through a sitecustomize on PYTHONPATH), so multi-process
servers (vLLM, SGLang workers) are hooked in each process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = "usage: python -m diagnoser.hook -- <server command> [args...]"


def command_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process of the command import diagnoser.hook."""
    env = dict(os.environ if environ is None else environ)
    boot = Path(__file__).resolve().parent / "_boot"
    package_parent = Path(__file__).resolve().parents[2]  # so another interpreter can import diagnoser too
    paths = [str(boot), str(package_parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["DIAGNOSER_HOOK_AUTO"] = "1"
    return env


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    # Importing diagnoser.hook to run this module installed the hook in this launcher; the exec'd program may not
    # be Python, so unregister first (its own Python processes register themselves at startup).
    from diagnoser import hook

    hook.uninstall()
    try:
        os.execvpe(args[0], args, command_env())
    except FileNotFoundError:
        print(f"diagnoser.hook: no command named '{args[0]}'.", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"diagnoser.hook: '{args[0]}' is not executable.", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
