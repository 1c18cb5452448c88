"""A real vLLM (CPU build) serving the tiny random Llama on 127.0.0.1, for the real-engine tier.

The engine lives in its own venv (scripts/install-vllm.sh, default .engines/vllm); `available()` says why it
cannot run here when it cannot. A server is started with the flags a situation needs and stopped with its whole
process group (API server, engine core and workers). Readiness is polled on /health with a generous deadline:
a start takes 1-3 minutes on two loaded cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.engines.process import stop_group

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".engines" / "vllm"))
PYTHON = VENV / "bin" / "python"
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = float(os.environ.get("VLLM_START_TIMEOUT_S", "600"))
# CPU-build settings: the KV pool in GiB (the CPU build's own knob), no thread binding to cores other work uses.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def available() -> str:
    """Empty when the engine's venv is installed; else why not."""
    if not PYTHON.exists():
        return f"no vLLM venv at {VENV} (run scripts/install-vllm.sh)"
    return ""


def slow_cpu() -> str:
    """Why this machine runs vLLM's CPU build far below the speed the situations are sized for, or "": its oneDNN
    matmuls need AVX-512 (without it the engine logs "fallback to torch linear" and runs tens of times slower)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    if "avx512f" in flags:
        return ""
    return ("this CPU has no AVX-512, so vLLM's CPU build falls back from oneDNN to plain torch matmuls (tens of times "
            "slower) and the situations' loads, sized for the oneDNN path, no longer make the set-ups they describe")


def version() -> str:
    out = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **ENGINE_ENV})
    return out.stdout.strip()


def build_model(folder: Path) -> dict[str, int]:
    out = subprocess.run([str(PYTHON), str(Path(__file__).with_name("tiny_llama.py")), str(folder)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, **ENGINE_ENV})
    if out.returncode != 0:
        raise RuntimeError(f"building the tiny model failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    model_dir: Path
    flags: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--max-model-len", "2048", *self.flags]

    def start(self) -> VllmServer:
        self.port = self.port or free_port()
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **ENGINE_ENV, **self.env}, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer /health within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return self.log.read_text(errors="replace")[-3000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        stop_group(self.proc, 60)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a server by hand: python -m tests.engines.vllm_server MODEL_DIR [flags...]
    server = VllmServer(Path(sys.argv[1]), sys.argv[2:], log=Path("/dev/stderr")).start()
    print(server.url, flush=True)
    try:
        server.proc.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        server.stop()
