"""What `diagnoser mcp` may do, from the user's TOML file (never from the assistant).

The file is `--config PATH`, else `$DIAGNOSER_MCP_CONFIG`, else `$XDG_CONFIG_HOME/diagnoser/mcp.toml`
(`~/.config/diagnoser/mcp.toml`); none at the default place means the defaults: no Prometheus, no live attach.

    rules_config = "~/thresholds.toml"   # optional: --rules-config for every tool that diagnoses

    [limits]
    timeout_s = 300                       # one tool call, the command's whole run
    max_output_bytes = 4000000            # a larger result is refused, never cut (a cut JSON document is no document)
    max_trace_size = "2G"                 # analyze / compare: JSON bytes after gunzip

    [fleet]
    prometheus = "http://prometheus:9090" # the only Prometheus the fleet tool asks
    headers = ["Authorization: Bearer ..."]
    timeout_s = 30                        # each query
    max_window = "1d"                     # the longest `since` the assistant may ask for
    max_rows = 200                        # the most rows a fleet result holds

    [attach]
    ports = [8000]                        # servers the assistant may attach to, by the TCP port they listen on
    pids = []                             # ... or by PID
    max_duration_s = 60                   # the longest window it may ask for

docs/mcp.md describes it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.errors import InputError
from diagnoser.fileio import read_text_bounded
from diagnoser.units import parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_VAR = "DIAGNOSER_MCP_CONFIG"
# Hard caps: a config file may lower the limits below these, never raise them past.
MAX_TIMEOUT_S = 3600.0
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
MAX_ATTACH_S = 600.0
MAX_ROWS = 10_000


@dataclass(frozen=True)
class Config:
    """The server's limits and permissions; `path` is the file they came from (None: the defaults)."""

    path: Path | None = None
    rules_config: Path | None = None
    timeout_s: float = 300.0
    max_output_bytes: int = 4_000_000
    max_trace_size: str = "2G"
    prometheus: str | None = None
    prometheus_headers: tuple[str, ...] = ()
    prometheus_timeout_s: float = 30.0
    max_window_s: float = 86400.0
    max_rows: int = 200
    attach_ports: frozenset[int] = field(default_factory=frozenset)
    attach_pids: frozenset[int] = field(default_factory=frozenset)
    max_attach_s: float = 60.0

    @property
    def where(self) -> str:
        """The file to edit, as a sentence names it."""
        return str(self.path) if self.path is not None else str(default_path())

    @property
    def attach_allowed(self) -> bool:
        return bool(self.attach_ports or self.attach_pids)


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "diagnoser" / "mcp.toml"


def load(path: Path | None = None) -> Config:
    """The configuration from `path`, $DIAGNOSER_MCP_CONFIG or the default place; a file named explicitly must exist,
    the default one may be absent. Every problem is one sentence (InputError)."""
    explicit = path if path is not None else (Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else None)
    target = (explicit or default_path()).expanduser()
    try:
        text = read_text_bounded(target)
    except FileNotFoundError:
        if explicit is not None:
            raise InputError(f"no MCP config at {target}.") from None
        return Config()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the MCP config {target}: {exc}.") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"the MCP config {target} is not valid TOML: {exc}.") from None
    return _parse(data, target)


_KNOWN = {"": {"rules_config", "limits", "fleet", "attach"},
          "limits": {"timeout_s", "max_output_bytes", "max_trace_size"},
          "fleet": {"prometheus", "headers", "timeout_s", "max_window", "max_rows"},
          "attach": {"ports", "pids", "max_duration_s"}}


def _table(data: dict[str, Any], name: str, where: Path) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise InputError(f"{where}: [{name}] must be a table.")
    unknown = sorted(set(table) - _KNOWN[name])
    if unknown:
        raise InputError(f"{where}: [{name}] has unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(_KNOWN[name]))}.")
    return table


def _number(table: dict[str, Any], key: str, section: str, where: Path, default: float, top: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= top:
        raise InputError(f"{where}: [{section}] {key} must be a number above 0 and at most {top:g}, not {value!r}.")
    return float(value)


def _ids(table: dict[str, Any], key: str, where: Path, top: int) -> frozenset[int]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= top
                                              for v in value):
        raise InputError(f"{where}: [attach] {key} must be a list of whole numbers from 1 to {top}, not {value!r}.")
    return frozenset(value)


def _parse(data: dict[str, Any], where: Path) -> Config:
    unknown = sorted(set(data) - _KNOWN[""])
    if unknown:
        raise InputError(f"{where} has unknown key(s) {', '.join(unknown)}; known: rules_config, [limits], [fleet], "
                         "[attach].")
    limits, fleet, attach = (_table(data, name, where) for name in ("limits", "fleet", "attach"))
    rules_config = data.get("rules_config")
    if rules_config is not None and not (isinstance(rules_config, str) and rules_config):
        raise InputError(f"{where}: rules_config must be a path, not {rules_config!r}.")
    trace_size = limits.get("max_trace_size", "2G")
    if not isinstance(trace_size, (str, int)) or isinstance(trace_size, bool):
        raise InputError(f"{where}: [limits] max_trace_size must be a size such as 2G, not {trace_size!r}.")
    from diagnoser.traces.decode import parse_size

    parse_size(str(trace_size))  # a bad size fails here, in one sentence, not at the first analyze
    prometheus = fleet.get("prometheus")
    if prometheus is not None and not (isinstance(prometheus, str) and prometheus.startswith(("http://", "https://"))):
        raise InputError(f"{where}: [fleet] prometheus must be an http:// or https:// URL.")
    headers = fleet.get("headers", [])
    if not isinstance(headers, list) or not all(isinstance(h, str) for h in headers):
        raise InputError(f"{where}: [fleet] headers must be a list of 'Name: value' strings.")
    window = fleet.get("max_window", "1d")
    if not isinstance(window, (str, int, float)) or isinstance(window, bool):
        raise InputError(f"{where}: [fleet] max_window must be a duration such as 1d, not {window!r}.")
    return Config(
        path=where,
        rules_config=Path(rules_config).expanduser() if rules_config else None,
        timeout_s=_number(limits, "timeout_s", "limits", where, 300.0, MAX_TIMEOUT_S),
        max_output_bytes=int(_number(limits, "max_output_bytes", "limits", where, 4_000_000, MAX_OUTPUT_BYTES)),
        max_trace_size=str(trace_size),
        prometheus=prometheus,
        prometheus_headers=tuple(headers),
        prometheus_timeout_s=_number(fleet, "timeout_s", "fleet", where, 30.0, 600.0),
        max_window_s=parse_duration(window, f"{where}: [fleet] max_window", positive=True),
        max_rows=int(_number(fleet, "max_rows", "fleet", where, 200, MAX_ROWS)),
        attach_ports=_ids(attach, "ports", where, 65535),
        attach_pids=_ids(attach, "pids", where, 2**22),
        max_attach_s=_number(attach, "max_duration_s", "attach", where, 60.0, MAX_ATTACH_S),
    )
