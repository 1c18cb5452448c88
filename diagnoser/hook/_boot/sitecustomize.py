"""Put on PYTHONPATH by `python -m diagnoser.hook -- <command>`: every Python process the command starts (and the
processes those start: vLLM/SGLang workers) imports diagnoser.hook at startup, then runs the sitecustomize this
one shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("DIAGNOSER_HOOK_AUTO") == "1":
    try:
        import diagnoser.hook  # noqa: F401  (installs the trigger)
    except Exception as exc:
        sys.stderr.write(f"diagnoser.hook: not installed in pid {os.getpid()}: {exc}\n")


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or not spec.origin or os.path.dirname(spec.origin) == here:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
