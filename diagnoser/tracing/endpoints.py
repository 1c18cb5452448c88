"""vLLM's and SGLang's own profiler endpoints: POST /start_profile, wait, POST /stop_profile, collect the files.

vLLM (0.2x/0.3x) mounts the endpoints only when started with a profiler config and writes one trace per worker
into its torch_profiler_dir (shared/research/data-sources.md §4.5); SGLang always has them and writes into the
`output_dir` the request names.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from diagnoser.collectors.process import pid_alive
from diagnoser.errors import SourceUnavailable
from diagnoser.tracing.hook_client import process_tree

# vLLM's defaults record Python stacks and dump a key-averages table after each trace: on a CPU build a 40 MB trace
# (769 MB of JSON) grew to 12.3 GB in that post-processing and the kernel killed the engine. The light settings
# below cost the server most of its throughput while tracing (83 % of its tokens/s for a 15 s trace, on a CPU build)
# and nothing after.
VLLM_LIGHT_FLAGS = ("--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=/abs/dir "
                    "--profiler-config.torch_profiler_with_stack=false "
                    "--profiler-config.torch_profiler_dump_cuda_time_total=false "
                    "--profiler-config.ignore_frontend=true")
VLLM_HOWTO = (f"restart vLLM with the light profiler settings `{VLLM_LIGHT_FLAGS}` (its defaults record stacks and "
              "dump a summary table that can grow a trace to gigabytes and kill the engine; older releases: set "
              "VLLM_TORCH_PROFILER_DIR=/abs/dir)")
VLLM_HEAVY = (("torch_profiler_with_stack", "true"), ("torch_profiler_dump_cuda_time_total", "true"),
              ("torch_profiler_with_memory", "true"), ("torch_profiler_record_shapes", "true"))
SGLANG_HOWTO = "SGLang mounts /start_profile by default; check the URL and that the server is SGLang"
TRACE_GLOBS = ("*.json", "*.json.gz")
SETTLE_S = 1.0  # a file whose size has not changed for this long, and whose text is whole, is complete
# vLLM's API-server frontend writes its own small trace beside the workers' (`<host>_<pid>.async_llm.*`); it is
# often on disk first, while a worker on a busy host is still serialising its larger file.
_FRONTEND_FILE = re.compile(r"(?:^|[._-])(?:async_llm|api_server|frontend)(?:[._-]|$)", re.IGNORECASE)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw if "=" in item)


def server_kind(pid: int) -> str | None:
    """'vllm' or 'sglang' from the command lines of the process tree, else None."""
    for p in process_tree(pid):
        text = " ".join(_cmdline(p)).lower()
        if "sglang" in text:
            return "sglang"
        if "vllm" in text:
            return "vllm"
    return None


def _profiler_config(args: list[str]) -> dict[str, str]:
    """vLLM's profiler settings on one command line: --profiler-config.KEY=VALUE (or KEY VALUE) and the JSON
    --profiler-config, key -> value as given."""
    found: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--profiler-config."):
            key, _, value = a[len("--profiler-config."):].partition("=")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            found[key] = value
        elif a.startswith("--profiler-config=") or (a == "--profiler-config" and i + 1 < len(args)):
            raw = a.split("=", 1)[1] if "=" in a else args[i + 1]
            try:
                cfg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(cfg, dict):
                found.update({str(k): str(v) for k, v in cfg.items()})
    return found


def vllm_profiler_dir(pid: int) -> Path | None:
    """Where vLLM writes its traces: --profiler-config.torch_profiler_dir, the JSON --profiler-config, or
    VLLM_TORCH_PROFILER_DIR in its environment."""
    for p in process_tree(pid):
        folder = _profiler_config(_cmdline(p)).get("torch_profiler_dir") or _environ(p).get("VLLM_TORCH_PROFILER_DIR")
        if folder:
            return Path(folder)
    return None


def vllm_profiler_flags(pid: int) -> dict[str, str] | None:
    """The profiler settings on the command lines of the tree (key -> value as given), or None when no process of
    it enables vLLM's profiler ({} when only its environment does)."""
    for p in process_tree(pid):
        found = _profiler_config(_cmdline(p))
        if found.get("profiler") or found.get("torch_profiler_dir"):
            return found
    if vllm_profiler_dir(pid) is not None:
        return {}
    return None


class ServerGone(SourceUnavailable):
    """The server died or stopped answering while it traced: nothing else is worth trying on it."""


def _gone(pid: int) -> bool:
    """Whether the process has died (a zombie waiting to be reaped has)."""
    if not pid_alive(pid):
        return True
    try:
        import psutil

        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except Exception:
        return True


def heavy_settings(flags: dict[str, str]) -> list[str]:
    """The costly profiler settings in force: those set to true, and the defaults that are on unless turned off."""
    out = []
    for key, heavy in VLLM_HEAVY:
        default_on = key in ("torch_profiler_with_stack", "torch_profiler_dump_cuda_time_total")
        value = flags.get(key, "true" if default_on else "false").lower()
        if value == heavy:
            out.append(key)
    return out


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _post(url: str, body: dict | None, timeout: float) -> int:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceUnavailable(f"cannot reach {url}: {reason}.") from None


def _new_traces(directory: Path, since: float) -> list[Path]:
    if not directory.is_dir():
        return []
    found = {p for g in TRACE_GLOBS for p in directory.rglob(g) if p.is_file()}
    return sorted(p for p in found if p.stat().st_mtime >= since - 1)


def wait_for_traces(directory: Path, since: float, timeout: float, workers: int = 1) -> list[Path]:
    """Trace files written in `directory` after `since`, once at least `workers` of them are not a frontend's, their
    sizes have stopped changing and each is whole (its JSON closed, its gzip stream ended); after `timeout`, what
    is there."""
    deadline = time.monotonic() + timeout
    sizes: dict[Path, int] = {}
    whole: dict[tuple[Path, int], bool] = {}  # read once per size: a large gzip file costs a pass to check
    stable_since = None
    while time.monotonic() < deadline:
        files = _new_traces(directory, since)
        now = {p: p.stat().st_size for p in files}
        if files and now == sizes:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= SETTLE_S and worker_count(files) >= workers \
                    and all(_whole_cached(whole, p, n) for p, n in now.items()):
                return files
        else:
            stable_since = None
        sizes = now
        time.sleep(0.2)
    return _new_traces(directory, since)


def _whole_cached(cache: dict[tuple[Path, int], bool], path: Path, size: int) -> bool:
    if (path, size) not in cache:
        cache[(path, size)] = is_whole(path)
    return cache[(path, size)]


def worker_count(files: list[Path]) -> int:
    """The files that are not a serving frontend's trace (by vLLM's naming)."""
    return sum(1 for p in files if not _FRONTEND_FILE.search(p.name))


def is_whole(path: Path) -> bool:
    """Whether a trace file is written to its end: a plain one's last character closes its JSON; a gzip one's
    stream ends (a writer that paused mid-file leaves it open)."""
    try:
        if path.name.endswith(".gz"):
            return _gzip_tail(path) in (b"}", b"]")
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            return path.stat().st_size > 0 and f.read().rstrip()[-1:] in (b"}", b"]")
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile):
        return False


def _gzip_tail(path: Path) -> bytes:
    """The last non-blank byte of a gzip file's text, or b"" when its stream does not end."""
    last = b""
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            stripped = chunk.rstrip()
            if stripped:
                last = stripped[-1:]
    return last


def _world_size(pid: int) -> int:
    """The engine workers one vLLM writes a trace for: tensor x pipeline parallel ranks (1 where unreadable)."""
    args = _cmdline(pid)
    size = 1
    for flags in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = next((v for v in (_flag(args, f) for f in flags) if v is not None), None)
        if value is not None and value.isdigit() and int(value) > 0:
            size *= int(value)
    return size


def trace_via_endpoint(url: str, pid: int, seconds: float, out_dir: Path, kind: str | None = None) -> list[Path]:
    """Start and stop the server's profiler over HTTP; return the trace files, copied into out_dir."""
    base = url.rstrip("/")
    kind = kind or server_kind(pid) or "vllm"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = (out_dir / f"{kind}-trace-{stamp}").resolve()
    if kind == "sglang":
        body: dict | None = {"output_dir": str(dest), "activities": ["CPU", "GPU"], "record_shapes": True,
                             "with_stack": False}
        source_dir: Path | None = dest
    else:
        body = None
        source_dir = vllm_profiler_dir(pid)
    since = time.time()
    status = _post(f"{base}/start_profile", body, timeout=30.0)
    if status in (404, 405):
        howto = SGLANG_HOWTO if kind == "sglang" else VLLM_HOWTO
        raise SourceUnavailable(f"{base} has no profiler endpoint (/start_profile answered {status}): {howto}.")
    if status >= 400:
        raise SourceUnavailable(f"{base}/start_profile answered HTTP {status}.")
    time.sleep(seconds)
    try:
        status = _post(f"{base}/stop_profile", None, timeout=600.0)
        failed = f"{base}/stop_profile answered HTTP {status}" if status >= 400 else ""
    except SourceUnavailable as exc:
        failed = str(exc).rstrip(".")
    if failed:
        gone = _gone(pid) or not _healthy(base)
        message = _stop_failed(failed, base, pid, kind, source_dir, since)
        raise ServerGone(message) if gone else SourceUnavailable(message)
    if source_dir is None:
        raise SourceUnavailable("the server profiled, but its torch_profiler_dir is not on its command line or in "
                                "its environment, so the trace cannot be found; pass the folder to "
                                "`diagnoser analyze` yourself.")
    workers = _world_size(pid) if kind == "vllm" else 1
    files = wait_for_traces(source_dir, since, timeout=max(60.0, seconds * 10), workers=workers)
    if not files:
        raise SourceUnavailable(f"the server accepted the profiling request but wrote no trace into {source_dir}.")
    if worker_count(files) == 0:
        raise SourceUnavailable(f"the server wrote only its frontend's trace into {source_dir} within "
                                f"{max(60.0, seconds * 10):g} s, no engine worker's; once the worker's file is "
                                f"there, `diagnoser analyze {source_dir}` reads it.")
    if source_dir != dest:
        dest.mkdir(parents=True, exist_ok=True)
        files = [Path(shutil.copy2(f, dest / f.name)) for f in files]
    return files


def _stop_failed(failed: str, base: str, pid: int, kind: str, source_dir: Path | None, since: float) -> str:
    """One sentence for a stop that failed: the server's death first, a complete trace it wrote if there is one,
    and the settings that make tracing cost what it did."""
    alive_now, healthy = not _gone(pid), _healthy(base)
    written = _new_traces(source_dir, since) if source_dir is not None else []
    kept = f"; a trace it wrote is in {written[0].parent} ({len(written)} file(s)): `diagnoser analyze` reads it" \
        if written else ""
    heavy = heavy_settings(vllm_profiler_flags(pid) or {}) if kind == "vllm" else []
    why = (f" with {', '.join(heavy)} on, which can grow a trace to gigabytes after the stop; use the light "
           f"settings: `{VLLM_LIGHT_FLAGS}`") if heavy else ""
    if not alive_now:
        return f"the server (process {pid}) died while its trace was being written{why}{kept} ({failed})."
    if not healthy:
        return f"the server (process {pid}) no longer answers {base}/health after the trace{why}{kept} ({failed})."
    return f"{failed}; the trace may be incomplete{why}{kept}."


def profiler_url(pid: int) -> str | None:
    """The base URL of a vLLM whose command line enables its profiler, or of an SGLang (which always mounts it):
    the port of the tree that answers HTTP with the engine's /metrics page."""
    kind = server_kind(pid)
    if kind is None or (kind == "vllm" and vllm_profiler_flags(pid) is None):
        return None
    named = _url_on_command_line(pid)
    if named:
        # The server's own --host/--port: a busy engine can miss the port probe's short deadline (a real vLLM under
        # load did, and the trace was refused as if no endpoint existed).
        return named
    from diagnoser.collectors.target import resolve_target

    try:
        target = resolve_target(pid=pid)
    except Exception:
        return None
    if not target.metrics_url:
        return None
    return target.metrics_url.rsplit("/", 1)[0].removesuffix("/v1")


def _url_on_command_line(pid: int) -> str | None:
    """http://HOST:PORT from the first command line of the tree that gives --port (a wildcard or missing host is
    this machine's loopback), else None."""
    for p in process_tree(pid):
        args = _cmdline(p)
        port = _flag(args, "--port")
        if port is None or not port.isdigit() or not 0 < int(port) < 65536:
            continue
        host = _flag(args, "--host") or "127.0.0.1"
        if host in ("0.0.0.0", "::", "", "localhost"):
            host = "127.0.0.1"
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return None


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def environ_of(pid: int) -> dict[str, str]:
    return _environ(pid)


__all__ = ["VLLM_LIGHT_FLAGS", "ServerGone", "environ_of", "heavy_settings", "profiler_url", "server_kind",
           "trace_via_endpoint", "vllm_profiler_dir", "vllm_profiler_flags", "wait_for_traces"]
