"""The tools `diagnoser mcp` offers: each a command of the CLI, its arguments declared once (the input schema the
assistant sees and the checks its call meets are both made from the declaration), turned into that command's own
argument list with `--json`. The command then runs as the CLI runs it (runner.py), so a tool's answer is the JSON
document the CLI prints for the same input, by construction.

What the assistant may not choose is not an argument: the Prometheus URL and its headers come from the user's
config file, and attach runs only against a port or PID the file allows, for at most the window it allows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnoser.errors import InputError
from diagnoser.mcp_tools.config import Config
from diagnoser.traces.windows import WINDOWS
from diagnoser.units import parse_duration

FLEET_GROUPINGS = ("node", "model", "namespace", "pod")  # checked equal to fleet.run.GROUPINGS by the tests
MAX_LIST = 16  # what-if values per list
MAX_TEXT = 4096  # characters of a string argument


@dataclass(frozen=True)
class Param:
    """One argument: its JSON type ("string", "integer", "number", "boolean", or "array" of `items`), bounds and
    whether it names a file ("file": a regular file, "path": a file or a folder) that must exist and be readable."""

    name: str
    type: str
    description: str
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    enum: tuple[str, ...] = ()
    items: str = ""
    file: str = ""

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.type == "array":
            out["items"] = {"type": self.items}
            out["maxItems"] = MAX_LIST
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.enum:
            out["enum"] = list(self.enum)
        return out


Build = Callable[[dict[str, Any], Config], list[str]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    build: Build  # checked arguments and the config -> the CLI's arguments (the command first, --json included)
    ok_codes: tuple[int, ...] = (0,)  # exit codes that still printed the document (fleet: 4, a partial result)

    def input_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {p.name: p.schema() for p in self.params},
                "required": [p.name for p in self.params if p.required], "additionalProperties": False}

    def timeout_s(self, args: dict[str, Any], config: Config) -> float:
        # An attach runs its window, then diagnoses: the longest window allowed is added to the limit, never cut by it.
        return config.timeout_s + (config.max_attach_s if self.name == "attach" else 0.0)


# --- checking one call's arguments ------------------------------------------------------------------------------------

_JSON_NAMES = {"string": "a string", "integer": "a whole number", "number": "a number", "boolean": "true or false",
               "array": "a list"}


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, list)


def _what(value: Any) -> str:
    return {bool: "true or false", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), "a number")


def _file(value: str, p: Param) -> str:
    """An absolute path to an existing, readable file (or folder, where the argument takes one); relative paths are
    the server's working directory's."""
    if not value.strip():
        raise InputError(f"'{p.name}' must be a path, not an empty string.")
    path = Path(value).expanduser().absolute()
    if not path.exists():
        raise InputError(f"'{p.name}': no such file {path}.")
    if path.is_dir() and p.file == "file":
        raise InputError(f"'{p.name}': {path} is a folder, not a file.")
    if not (path.is_dir() or path.is_file()):
        raise InputError(f"'{p.name}': {path} is not a regular file.")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise InputError(f"'{p.name}': {path} is not readable (permission denied).")
    return str(path)


def _num(value: float | None) -> str:
    """A bound or a value as a person writes it: 1000000, 0.1, 1e+300."""
    if value is None:
        return "none"
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _one(value: Any, p: Param) -> Any:
    if not _type_ok(value, p.type):
        raise InputError(f"'{p.name}' must be {_JSON_NAMES[p.type]}, not {_what(value)}.")
    if p.type == "array":
        if len(value) > MAX_LIST:
            raise InputError(f"'{p.name}' takes at most {MAX_LIST} values, not {len(value)}.")
        item = Param(f"{p.name}[]", p.items, "", minimum=p.minimum, maximum=p.maximum)
        return [_one(v, item) for v in value]
    if p.type == "integer":
        value = int(value)
    if p.type in ("integer", "number"):
        low, high = p.minimum, p.maximum
        if low is not None and value < low or high is not None and value > high:
            span = f"from {_num(low)} to {_num(high)}" if low is not None and high is not None else \
                f"at least {_num(low)}" if low is not None else f"at most {_num(high)}"
            raise InputError(f"'{p.name}' must be {span}, not {_num(value)}.")
    if p.type == "string":
        if len(value) > MAX_TEXT:
            raise InputError(f"'{p.name}' is longer than {MAX_TEXT} characters.")
        if "\0" in value:
            raise InputError(f"'{p.name}' holds a NUL character.")
        if value.startswith("-") and not p.file:  # a value, never an option of the command
            raise InputError(f"'{p.name}' must not start with '-', not {value!r}.")
        if p.enum and value not in p.enum:
            raise InputError(f"'{p.name}' must be one of {', '.join(p.enum)}, not {value!r}.")
        if p.file:
            return _file(value, p)
    return value


def check(tool: Tool, arguments: dict[str, Any] | None) -> dict[str, Any]:
    """The call's arguments checked against the tool's declaration; the first problem is one sentence."""
    arguments = arguments or {}
    known = {p.name: p for p in tool.params}
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        takes = ", ".join(known) or "no arguments"
        raise InputError(f"{tool.name} has no argument {', '.join(repr(u) for u in unknown)}; it takes: {takes}.")
    out: dict[str, Any] = {}
    for p in tool.params:
        if p.name not in arguments or arguments[p.name] is None:
            if p.required:
                raise InputError(f"{tool.name} needs the argument '{p.name}' ({p.description.rstrip('.')}).")
            continue
        out[p.name] = _one(arguments[p.name], p)
    return out


# --- each tool's command line -----------------------------------------------------------------------------------------

def _rules(config: Config) -> list[str]:
    return ["--rules-config", str(config.rules_config)] if config.rules_config is not None else []


def _flags(args: dict[str, Any], names: dict[str, str]) -> list[str]:
    """--flag value for each argument given, a list argument once per value."""
    out: list[str] = []
    for name, flag in names.items():
        value = args.get(name)
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            out += [flag, str(v)]  # a float as repr writes it: every digit the assistant gave
    return out


def _diagnose(args: dict[str, Any], config: Config) -> list[str]:
    return ["diagnose", args["capture"], "--json", *_rules(config)]


def _analyze(args: dict[str, Any], config: Config) -> list[str]:
    return ["analyze", args["trace"], "--json", "--max-trace-size", config.max_trace_size,
            *_flags(args, {"gpu": "--gpu", "model": "--model", "window": "--window"}), *_rules(config)]


def _compare(args: dict[str, Any], config: Config) -> list[str]:
    return ["compare", args["before"], args["after"], "--json", *_rules(config)]


_THEORY_FLAGS = {"model": "--model", "params": "--params", "gpu": "--gpu", "dtype": "--dtype",
                 "kv_dtype": "--kv-dtype", "batch": "--batch", "context": "--context", "gen_tokens": "--gen-tokens",
                 "tp": "--tp", "pp": "--pp", "mem_fraction": "--mem-fraction", "tokens_per_s": "--tokens-per-s",
                 "efficiency": "--efficiency", "power_w": "--power-w", "usd_per_hour": "--usd-per-hour",
                 "vs_dtype": "--vs-dtype", "vs_kv_dtype": "--vs-kv-dtype", "vs_gpu": "--vs-gpu",
                 "vs_batch": "--vs-batch", "vs_tp": "--vs-tp"}


def _theory(args: dict[str, Any], config: Config) -> list[str]:
    if args.get("list_models"):
        return ["theory", "--list-models", "--json"]
    return ["theory", "--json", *_flags(args, _THEORY_FLAGS)]


def _rules_tool(args: dict[str, Any], config: Config) -> list[str]:
    return ["rules", *([args["code"]] if args.get("code") else []), "--json", *_rules(config)]


def _fleet(args: dict[str, Any], config: Config) -> list[str]:
    if config.prometheus is None:
        raise InputError(f"no Prometheus is configured for the fleet tool: set [fleet] prometheus = \"http://...\" in "
                         f"{config.where} (docs/mcp.md).")
    since = args.get("since", "1h")
    seconds = parse_duration(since, "'since'", positive=True)
    if seconds > config.max_window_s:
        raise InputError(f"'since' may be at most {config.max_window_s:g} s ([fleet] max_window in {config.where}), "
                         f"not {since}.")
    limit = min(int(args.get("limit", config.max_rows)), config.max_rows)
    headers = [h for header in config.prometheus_headers for h in ("--header", header)]
    return ["fleet", "--prometheus", config.prometheus, "--json", "--since", since, "--limit", str(limit),
            "--timeout", f"{config.prometheus_timeout_s:g}", *headers,
            *_flags(args, {"node": "--node", "pod": "--pod", "gpu": "--gpu", "uuid": "--uuid",
                           "group_by": "--group-by"}), *_rules(config)]


def _attach(args: dict[str, Any], config: Config) -> list[str]:
    if not config.attach_allowed:
        raise InputError(f"live attach is off: list the ports or PIDs the assistant may attach to under [attach] "
                         f"(ports = [8000], pids = [...]) in {config.where} (docs/mcp.md).")
    pid, port = args.get("pid"), args.get("port")
    if (pid is None) == (port is None):
        raise InputError("attach takes one of 'pid' or 'port'.")
    if port is not None and port not in config.attach_ports:
        raise InputError(f"port {port} is not in the attach allow-list ([attach] ports in {config.where}).")
    if pid is not None and pid not in config.attach_pids:
        raise InputError(f"PID {pid} is not in the attach allow-list ([attach] pids in {config.where}).")
    duration = args.get("duration", min(10.0, config.max_attach_s))
    if duration > config.max_attach_s:
        raise InputError(f"'duration' may be at most {config.max_attach_s:g} s ([attach] max_duration_s in "
                         f"{config.where}), not {duration:g}.")
    target = [str(pid)] if pid is not None else ["--port", str(port)]
    return ["attach", *target, "--duration", str(duration), "--json",
            *_flags(args, {"model": "--model"}), *_rules(config)]


_MODEL = "The served model: a bundled name (theory's list_models lists them) or a config.json path."
TOOLS: tuple[Tool, ...] = (
    Tool("diagnose", "Diagnose a saved capture (.dgc, from attach, agent or analyze): the verdict, evidence and "
         "ranked fixes, as `diagnoser diagnose CAPTURE --json` prints them.",
         (Param("capture", "string", "Path to the capture file (.dgc).", required=True, file="file"),), _diagnose),
    Tool("analyze", "Analyse a torch.profiler (Kineto) trace, a .json/.json.gz file or a folder of per-rank files, "
         "and diagnose it, as `diagnoser analyze TRACE --json` prints it (the analysis is in context.trace).",
         (Param("trace", "string", "Path to the trace file or folder of per-rank traces.", required=True,
                file="path"),
          Param("gpu", "string", "The GPU the trace ran on (e.g. H100), when the trace does not say."),
          Param("model", "string", _MODEL),
          Param("window", "string", "The analysed window (auto: profiler steps if any, else the GPU's activity).",
                enum=WINDOWS)), _analyze),
    Tool("compare", "Compare two captures (or two traces) of the same server before and after a change: what "
         "changed, the verdicts, and each fix's predicted gain against the realised one, as `diagnoser compare "
         "BEFORE AFTER --json` prints it.",
         (Param("before", "string", "Path to the capture or trace before the change.", required=True, file="file"),
          Param("after", "string", "Path to the capture or trace after it.", required=True, file="file")),
         _compare),
    Tool("theory", "Ceilings from first principles for a model on a GPU (memory, decode and prefill speed, ridge "
         "batch, energy, cost) and what-ifs (another precision, GPU, batch or tensor parallelism), as `diagnoser "
         "theory --json` prints them. Give model or params.",
         (Param("model", "string", "A bundled model name (e.g. llama-2-7b) or a config.json path."),
          Param("params", "string", "A parameter count instead of model, e.g. 7B or 7e9."),
          Param("gpu", "string", "The GPU, e.g. h100-sxm (the default), a100-80gb-sxm, mi300x, L4."),
          Param("dtype", "string", "Weight precision (default: the model's)."),
          Param("kv_dtype", "string", "KV-cache precision (default: 16-bit)."),
          Param("batch", "integer", "Sequences decoded together.", minimum=1, maximum=1_000_000),
          Param("context", "integer", "Tokens per sequence (and the prompt size).", minimum=0, maximum=10_000_000),
          Param("gen_tokens", "integer", "Tokens each request generates, for vs_batch.", minimum=1,
                maximum=10_000_000),
          Param("tp", "integer", "Tensor-parallel GPUs.", minimum=1, maximum=1024),
          Param("pp", "integer", "Pipeline-parallel stages.", minimum=1, maximum=1024),
          Param("mem_fraction", "number", "Share of each GPU's memory the server may use, in (0, 1].", minimum=0,
                maximum=1),
          Param("tokens_per_s", "number", "Measured decode tokens/s at this setup: what-ifs add the realised gain.",
                minimum=0),
          Param("efficiency", "number", "Measured share of the decode ceiling, in (0, 1], instead.", minimum=0,
                maximum=1),
          Param("power_w", "number", "Power per GPU, W (default: TDP).", minimum=0),
          Param("usd_per_hour", "number", "Price per GPU hour, USD.", minimum=0),
          Param("vs_dtype", "array", "What-ifs: other weight precisions.", items="string"),
          Param("vs_kv_dtype", "array", "What-ifs: other KV-cache precisions.", items="string"),
          Param("vs_gpu", "array", "What-ifs: other GPUs.", items="string"),
          Param("vs_batch", "array", "What-ifs: other batch sizes.", items="integer", minimum=1, maximum=1_000_000),
          Param("vs_tp", "array", "What-ifs: other tensor-parallel sizes.", items="integer", minimum=1, maximum=1024),
          Param("list_models", "boolean", "List the bundled model configs instead.")), _theory),
    Tool("rules", "The diagnoser's rules: every rule (code, name, limiter, thresholds, page), or one rule's page by "
         "its code or name, as `diagnoser rules [CODE] --json` prints them.",
         (Param("code", "string", "A rule code (e.g. BW001) or name (e.g. kv-cache-full); none: every rule."),),
         _rules_tool),
    Tool("fleet", "Diagnose every GPU the configured Prometheus knows (via dcgm-exporter) over a window, most money "
         "at stake first, as `diagnoser fleet --json` prints it. The Prometheus is the user's config's, never an "
         "argument.",
         (Param("since", "string", "The window, ending now: 30m, 1h (the default), 2d."),
          Param("node", "string", "Only the GPUs of this node."),
          Param("pod", "string", "Only the GPUs of this pod, or namespace/pod."),
          Param("gpu", "integer", "Only GPUs with this index.", minimum=0, maximum=1024),
          Param("uuid", "string", "Only the GPU with this UUID (or a unique prefix)."),
          Param("group_by", "string", "Group the rows.", enum=FLEET_GROUPINGS),
          Param("limit", "integer", "At most this many rows, most at stake first (the config caps it).",
                minimum=1, maximum=10_000)), _fleet, ok_codes=(0, 4)),
    Tool("attach", "Attach to a running inference server the user's config allows (by TCP port or PID), observe it "
         "for a short window and diagnose it, as `diagnoser attach --json` prints it. Refused unless the config's "
         "[attach] allow-list names the port or PID.",
         (Param("port", "integer", "The TCP port the server listens on.", minimum=1, maximum=65535),
          Param("pid", "integer", "The server's PID.", minimum=1, maximum=2**22),
          Param("duration", "number", "Seconds to observe (default 10, or the config's cap if lower).", minimum=0.1,
                maximum=600),
          Param("model", "string", _MODEL)), _attach),
)

BY_NAME = {t.name: t for t in TOOLS}


def command_line(name: str, arguments: dict[str, Any] | None, config: Config) -> tuple[Tool, list[str], float]:
    """The tool, the CLI arguments for this call and its time limit; a problem is one sentence (InputError)."""
    tool = BY_NAME.get(name)
    if tool is None:
        raise InputError(f"no tool named {name!r}; the tools are {', '.join(BY_NAME)}.")
    args = check(tool, arguments)
    return tool, tool.build(args, config), tool.timeout_s(args, config)
