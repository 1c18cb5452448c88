"""The agent's configuration: a TOML file, then command-line flags on top, then defaults for what neither set.

Durations are written the way people write them ("15m", "10s", "30d", "1h30m"); jitter as "10%" or 0.1. The file
may also carry `[thresholds.CODE]` tables, read by the rule engine exactly as a `--rules-config` file would be.
See docs/agent.md for every key.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from diagnoser.errors import InputError
from diagnoser.fileio import read_text_bounded
from diagnoser.units import parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_NAME_OK = re.compile(r"^[A-Za-z0-9_.:@/-]{1,120}$")


def parse_fraction(value: str | int | float, what: str = "jitter") -> float:
    """A fraction 0..1 from '10%' or 0.1."""
    try:
        if isinstance(value, str) and value.strip().endswith("%"):
            frac = float(value.strip()[:-1]) / 100
        else:
            frac = float(value)
    except ValueError:
        raise InputError(f"{what} must be a percentage such as 10% or a fraction such as 0.1, not '{value}'.") from None
    if not 0 <= frac <= 1:
        raise InputError(f"{what} must be between 0% and 100%, not '{value}'.")
    return frac


@dataclass
class TargetSpec:
    """One thing to diagnose. Exactly one of pid, port, match says how to find the process each cycle."""

    name: str
    pid: int | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    match: str | None = None  # regular expression over the command line, resolved every cycle
    metrics_url: str | None = None  # the server's /metrics when it is not on host:port
    window_s: float | None = None  # overrides the agent's window for this target
    model: str | None = None  # bundled model name or config.json path, for the physics (efficiency, gains)
    labels: dict[str, str] = field(default_factory=dict)  # e.g. pod = "llama-0": shown as metric labels
    discovered: bool = False  # found by NVML discovery rather than configured

    def describe(self) -> str:
        if self.pid is not None:
            return f"pid {self.pid}"
        if self.port is not None:
            return f"port {self.port}" if self.host in ("127.0.0.1", "localhost") else f"{self.host}:{self.port}"
        if self.match is not None:
            return f"process matching '{self.match}'"
        return self.metrics_url or self.name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetSpec:
        return cls(**data)


@dataclass
class SourcesConfig:
    nvml: bool = True
    server_metrics: bool = True
    dcgm_exporter: str | None = None  # URL of a dcgm-exporter /metrics
    prometheus: str | None = None  # URL of a Prometheus that scrapes dcgm-exporter


@dataclass
class AgentConfig:
    every_s: float = 900.0
    jitter: float = 0.1
    window_s: float = 10.0
    sample_interval_s: float = 0.5
    # Seconds a target may take beyond its window (start-up, diagnosis, report) before it is abandoned.
    grace_s: float = 60.0
    max_parallel: int = 4
    discover: bool | None = None  # None: discover GPU processes only when no target is configured
    targets: list[TargetSpec] = field(default_factory=list)
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    thresholds_path: Path | None = None
    db_path: Path = field(default_factory=lambda: state_dir() / "history.db")
    retention_s: float = 30 * 86400.0
    max_db_bytes: int = 256 << 20
    reports_dir: Path | None = field(default_factory=lambda: state_dir() / "reports")
    keep_reports: int = 20
    html_reports: bool = True
    reports_mode: int = 0o600  # files; folders get an execute bit per read bit (0700)
    metrics_port: int | None = 9464
    metrics_addr: str = "127.0.0.1"
    textfile: Path | None = None
    webhook: str | None = None
    webhook_timeout_s: float = 5.0
    notify_inconclusive: bool = False

    @property
    def discovering(self) -> bool:
        return self.discover if self.discover is not None else not self.targets

    def timeout_for(self, target: TargetSpec) -> float:
        return (target.window_s if target.window_s is not None else self.window_s) + self.grace_s


def state_dir() -> Path:
    """Where history and reports go by default: systemd's StateDirectory, else XDG state, else ~/.local/state."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "diagnoser"


def default_reports_dir(db_path: Path) -> Path:
    """The reports folder of a history: `reports/` beside the default `history.db`, `reports-<name>/` beside any
    other, so two histories in one folder never share (and sweep or rotate) each other's run folders."""
    if db_path.name == "history.db":
        return db_path.parent / "reports"
    return db_path.parent / ("reports-" + (re.sub(r"[^A-Za-z0-9_.@-]+", "-", db_path.name).strip("-.") or "history"))


def parse_mode(value: Any, what: str) -> int:
    """A file mode in octal ("0640", "640" or the TOML integer 0o640): read and write for the owner at least, no
    execute, setuid or sticky bits (folders get their execute bits from the read bits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        text = str(value).strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{3,4}", text):
            raise InputError(f"{what} must be an octal file mode such as \"0600\" or \"0640\", not '{value}'.")
        mode = int(text, 8)
    if mode & ~0o666 or mode & 0o600 != 0o600:
        raise InputError(f"{what} must give the owner read and write and nobody execute (e.g. \"0600\", \"0640\", "
                         f"\"0644\"), not {oct(mode)[2:].zfill(4)}.")
    return mode


# --- targets --------------------------------------------------------------------------------------------------

def parse_target(text: str) -> TargetSpec:
    """A target from the command line: '8000' or 'port:8000', 'host:port', 'pid:1234', 'match:REGEX',
    'url:http://host:port/metrics'; 'NAME=' in front names it."""
    name = ""
    spec = text.strip()
    if "=" in spec.split(":", 1)[0]:
        name, spec = spec.split("=", 1)
    kind, _, rest = spec.partition(":")
    data: dict[str, Any] = {}
    if spec.isdigit():
        data["port"] = spec
    elif kind in ("pid", "port", "match") and rest:
        data[kind] = rest
    elif kind == "url" and rest:
        data["metrics_url"] = rest
    elif kind in ("http", "https"):
        data["metrics_url"] = spec
    elif rest.isdigit():
        data["host"], data["port"] = kind, rest
    else:
        raise InputError(f"target '{text}' is not one of PORT, HOST:PORT, pid:PID, match:REGEX or url:URL.")
    if name:
        data["name"] = name
    return target_from_table(data, where="--targets")


def target_from_table(data: dict[str, Any], where: str) -> TargetSpec:
    known = {"name", "pid", "port", "host", "match", "metrics_url", "window", "labels", "model"}
    unknown = set(data) - known
    if unknown:
        raise InputError(f"{where}: unknown target key(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}.")
    ways = [k for k in ("pid", "port", "match") if data.get(k) not in (None, "")]
    if len(ways) > 1:
        raise InputError(f"{where}: give one of pid, port or match per target, not {' and '.join(ways)}.")
    if not ways and not data.get("metrics_url"):
        raise InputError(f"{where}: a target needs pid, port, match or metrics_url.")
    pid = _int(data.get("pid"), f"{where}: pid", 1) if data.get("pid") not in (None, "") else None
    port = _int(data.get("port"), f"{where}: port", 1, 65535) if data.get("port") not in (None, "") else None
    match = data.get("match")
    if match is not None:
        try:
            re.compile(str(match))
        except re.error as exc:
            raise InputError(f"{where}: match '{match}' is not a regular expression ({exc}).") from None
        match = str(match)
    url = data.get("metrics_url")
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise InputError(f"{where}: metrics_url must start with http:// or https://, not '{url}'.")
    labels = data.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise InputError(f"{where}: labels must be a table of name = \"text\".")
    window = parse_duration(data["window"], f"{where}: window") if "window" in data else None
    host = str(data.get("host") or "127.0.0.1")
    model = str(data["model"]) if data.get("model") else None
    spec = TargetSpec(name="", pid=pid, port=port, host=host, match=match,
                      metrics_url=str(url) if url else None, window_s=window, labels=dict(labels), model=model)
    name = str(data.get("name") or _default_name(spec))
    if not _NAME_OK.match(name):
        raise InputError(f"{where}: target name '{name}' may hold only letters, digits and . _ : @ / - "
                         "(at most 120).")
    return replace(spec, name=name)


def _default_name(spec: TargetSpec) -> str:
    if spec.pid is not None:
        return f"pid-{spec.pid}"
    if spec.port is not None:
        return f"port-{spec.port}" if spec.host in ("127.0.0.1", "localhost") else f"{spec.host}-{spec.port}"
    if spec.match is not None:
        return "match-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.match).strip("-")[:60]
    return re.sub(r"^https?://", "", spec.metrics_url or "target").replace(":", "-").split("/")[0]


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    try:
        number = int(str(value), 10)
    except ValueError:
        raise InputError(f"{what} must be a whole number, not '{value}'.") from None
    if number < low or (high is not None and number > high):
        raise InputError(f"{what} must be between {low} and {high}." if high else f"{what} must be at least {low}.")
    return number


# --- the file and the flags -----------------------------------------------------------------------------------

# Flag name -> (section, key) in the file; the CLI passes the flags the user gave under these names.
_SECTIONS: dict[str, set[str]] = {
    "agent": {"every", "jitter", "window", "sample_interval", "grace", "max_parallel", "discover", "rules_config"},
    "history": {"db", "retention", "max_db_mb"},
    "reports": {"dir", "keep", "html", "mode"},
    "metrics": {"port", "addr", "textfile"},
    "notify": {"webhook", "webhook_timeout", "notify_inconclusive"},
    "sources": {"nvml", "server_metrics", "dcgm_exporter", "prometheus"},
}
_TOP_LEVEL = set(_SECTIONS) | {"targets", "thresholds"}


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(read_text_bounded(path))  # bounded: never /dev/zero into memory
    except FileNotFoundError:
        raise InputError(f"no agent config at {path}.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read agent config {path}: {exc}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"agent config {path} is not valid TOML: {exc}.") from None
    unknown = set(data) - _TOP_LEVEL
    if unknown:
        raise InputError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(_TOP_LEVEL))}.")
    for section, keys in _SECTIONS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise InputError(f"{path}: [{section}] must be a table.")
        extra = set(table) - keys
        if extra:
            raise InputError(f"{path}: [{section}] has unknown key(s) {', '.join(sorted(extra))}; "
                             f"known: {', '.join(sorted(keys))}.")
    return data


def build_config(file: Path | None = None, flags: dict[str, Any] | None = None) -> AgentConfig:
    """Defaults, then the file, then the flags that were given (`flags` maps "section.key" to a value)."""
    data = read_config_file(file) if file is not None else {}
    merged: dict[str, Any] = {}
    for section in _SECTIONS:
        for key, value in data.get(section, {}).items():
            merged[f"{section}.{key}"] = value
    for key, value in (flags or {}).items():
        if value is not None:
            merged[key] = value
    where = str(file) if file is not None else "flags"
    cfg = AgentConfig()
    _apply(cfg, merged, where)

    targets: list[TargetSpec] = []
    if "targets" in (flags or {}) and flags and flags["targets"]:
        targets = [parse_target(t) for t in flags["targets"]]
    else:
        raw = data.get("targets", [])
        if not isinstance(raw, list):
            raise InputError(f"{where}: targets must be an array of tables ([[targets]]).")
        targets = [target_from_table(t, f"{where}: targets[{i}]") for i, t in enumerate(raw)]
    names = [t.name for t in targets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"{where}: target names must differ; {', '.join(dupes)} appears more than once.")
    cfg.targets = targets

    # A config file with [thresholds] is its own rules config; an explicit rules_config wins.
    if cfg.thresholds_path is None and file is not None and "thresholds" in data:
        cfg.thresholds_path = file
    _check(cfg)
    return cfg


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InputError(f"{what} must be true or false, not '{value}'.")


def _path(value: Any, what: str) -> Path:
    return Path(str(value)).expanduser()


def _text(value: Any, what: str) -> str:
    return str(value)


def _ranged(low: int, high: int | None = None, *, shift: int = 0) -> Callable[[Any, str], int]:
    return lambda value, what: _int(value, what, low, high) << shift


# The settings that map one key to one field: (key, field, parser, whether an empty value keeps the default). The
# parser names the key in its sentence; a key absent from the file and the flags keeps the field as it is.
_FIELDS: tuple[tuple[str, str, Callable[[Any, str], Any], bool], ...] = (
    ("agent.every", "every_s", parse_duration, False),
    ("agent.jitter", "jitter", parse_fraction, False),
    ("agent.window", "window_s", parse_duration, False),
    ("agent.sample_interval", "sample_interval_s", parse_duration, False),
    ("agent.grace", "grace_s", parse_duration, False),
    ("agent.max_parallel", "max_parallel", _ranged(1, 64), False),
    ("agent.discover", "discover", _bool, False),
    ("agent.rules_config", "thresholds_path", _path, True),
    ("history.db", "db_path", _path, True),
    ("history.retention", "retention_s", parse_duration, False),
    ("history.max_db_mb", "max_db_bytes", _ranged(1, shift=20), False),
    ("reports.mode", "reports_mode", parse_mode, False),
    ("reports.keep", "keep_reports", _ranged(0), False),
    ("reports.html", "html_reports", _bool, False),
    ("metrics.port", "metrics_port", lambda value, what: _int(value, what, 0, 65535) or None, False),
    ("metrics.addr", "metrics_addr", _text, True),
    ("notify.webhook", "webhook", _text, True),
    ("notify.webhook_timeout", "webhook_timeout_s", parse_duration, False),
    ("notify.notify_inconclusive", "notify_inconclusive", _bool, False),
    ("sources.nvml", "sources.nvml", _bool, False),
    ("sources.server_metrics", "sources.server_metrics", _bool, False),
)


def _apply(cfg: AgentConfig, merged: dict[str, Any], where: str) -> None:
    for key, name, parse, unless_empty in _FIELDS:
        if key not in merged or (unless_empty and not merged[key]):
            continue
        owner: Any = cfg.sources if name.startswith("sources.") else cfg
        setattr(owner, name.removeprefix("sources."), parse(merged[key], f"{where}: {key}"))
    if "reports.dir" in merged:
        value = str(merged["reports.dir"])
        cfg.reports_dir = Path(value).expanduser() if value else None
    elif "history.db" in merged:
        # Reports live beside the history unless told otherwise, in a folder of this history's own.
        cfg.reports_dir = default_reports_dir(cfg.db_path)
    if merged.get("metrics.textfile"):
        cfg.textfile = Path(str(merged["metrics.textfile"])).expanduser()
        if "metrics.port" not in merged:
            cfg.metrics_port = None  # the textfile instead of the endpoint
    for key in ("dcgm_exporter", "prometheus"):
        url = merged.get(f"sources.{key}")
        if url:
            if not str(url).startswith(("http://", "https://")):
                raise InputError(f"{where}: sources.{key} must be an http(s) URL, not '{url}'.")
            setattr(cfg.sources, key, str(url))


def _check(cfg: AgentConfig) -> None:
    if cfg.every_s < 0.05:
        raise InputError("the interval (--every) must be at least 50 ms.")
    if cfg.window_s <= 0:
        raise InputError("the window (--window) must be longer than 0 s.")
    if cfg.sample_interval_s <= 0 or cfg.sample_interval_s > cfg.window_s:
        raise InputError("the sample interval must be longer than 0 s and no longer than the window.")
    if cfg.webhook is not None and not cfg.webhook.startswith(("http://", "https://")):
        raise InputError(f"the webhook must be an http(s) URL, not '{cfg.webhook}'.")
    if cfg.thresholds_path is not None and not cfg.thresholds_path.is_file():
        raise InputError(f"no rules config at {cfg.thresholds_path}.")


def validate(cfg: AgentConfig) -> None:
    """Checks that read other files (rule thresholds, model configs), run once at start so that a typo fails the
    agent at once with one sentence instead of failing every run."""
    from diagnoser.physics.models import resolve_model
    from diagnoser.rules import load_thresholds

    if cfg.thresholds_path is not None:
        load_thresholds(cfg.thresholds_path)
    for t in cfg.targets:
        if t.model:
            try:
                resolve_model(t.model)
            except InputError as exc:
                raise InputError(f"target {t.name}: {exc}") from None
