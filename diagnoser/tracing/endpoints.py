"""vLLM's and SGLang's own profiler endpoints: POST /start_profile, wait, POST /stop_profile, collect the files.

vLLM (0.2x/0.3x) mounts the endpoints only when started with a profiler config and writes one trace per worker
into its torch_profiler_dir (shared/research/data-sources.md §4.5); SGLang always has them and writes into the
`output_dir` the request names.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from diagnoser.errors import SourceUnavailable
from diagnoser.tracing.hook_client import process_tree

VLLM_HOWTO = ("restart vLLM with `--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=/abs/dir` "
              "(older releases: set VLLM_TORCH_PROFILER_DIR=/abs/dir)")
SGLANG_HOWTO = "SGLang mounts /start_profile by default; check the URL and that the server is SGLang"
TRACE_GLOBS = ("*.json", "*.json.gz")
SETTLE_S = 1.0  # a file whose size has not changed for this long is complete


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


def vllm_profiler_dir(pid: int) -> Path | None:
    """Where vLLM writes its traces: --profiler-config.torch_profiler_dir, the JSON --profiler-config, or
    VLLM_TORCH_PROFILER_DIR in its environment."""
    for p in process_tree(pid):
        args = _cmdline(p)
        for i, a in enumerate(args):
            if a.startswith("--profiler-config.torch_profiler_dir"):
                value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
                if value:
                    return Path(value)
            if a == "--profiler-config" and i + 1 < len(args) or a.startswith("--profiler-config="):
                raw = a.split("=", 1)[1] if "=" in a else args[i + 1]
                try:
                    cfg = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(cfg, dict) and cfg.get("torch_profiler_dir"):
                    return Path(str(cfg["torch_profiler_dir"]))
        env_dir = _environ(p).get("VLLM_TORCH_PROFILER_DIR")
        if env_dir:
            return Path(env_dir)
    return None


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


def wait_for_traces(directory: Path, since: float, timeout: float) -> list[Path]:
    """Trace files written in `directory` after `since`, once their sizes have stopped changing."""
    deadline = time.monotonic() + timeout
    sizes: dict[Path, int] = {}
    stable_since = None
    while time.monotonic() < deadline:
        files = _new_traces(directory, since)
        now = {p: p.stat().st_size for p in files}
        if files and now == sizes:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= SETTLE_S:
                return files
        else:
            stable_since = None
        sizes = now
        time.sleep(0.2)
    return _new_traces(directory, since)


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
    status = _post(f"{base}/stop_profile", None, timeout=600.0)
    if status >= 400:
        raise SourceUnavailable(f"{base}/stop_profile answered HTTP {status}; the trace may be incomplete.")
    if source_dir is None:
        raise SourceUnavailable("the server profiled, but its torch_profiler_dir is not on its command line or in "
                                "its environment, so the trace cannot be found; pass the folder to "
                                "`diagnoser analyze` yourself.")
    files = wait_for_traces(source_dir, since, timeout=max(60.0, seconds * 10))
    if not files:
        raise SourceUnavailable(f"the server accepted the profiling request but wrote no trace into {source_dir}.")
    if source_dir != dest:
        dest.mkdir(parents=True, exist_ok=True)
        files = [Path(shutil.copy2(f, dest / f.name)) for f in files]
    return files


def environ_of(pid: int) -> dict[str, str]:
    return _environ(pid)


__all__ = ["environ_of", "server_kind", "trace_via_endpoint", "vllm_profiler_dir", "wait_for_traces"]
