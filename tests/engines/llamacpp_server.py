"""A real llama.cpp `llama-server` (CPU build) serving the tiny GGUF Llama on 127.0.0.1, for the real-engine tier.

The binary is built by scripts/install-llamacpp.sh (default .engines/llama.cpp/bin/llama-server); `available()`
says why it cannot run here when it cannot. A server is started with the flags a situation needs (always with
`--metrics`, `/slots` on) and stopped by its process group. Readiness is polled on /health with a generous deadline:
the tiny model loads in a second, but two loaded cores can stretch that a lot.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.engines.process import stop_group

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("LLAMACPP_HOME", REPO / ".engines" / "llama.cpp"))
BINARY = HOME / "bin" / "llama-server"
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = float(os.environ.get("LLAMACPP_START_TIMEOUT_S", "180"))
THREADS = max(1, min(2, os.cpu_count() or 2))  # the situations are sized for two cores


def available() -> str:
    """Empty when the server binary is installed; else why not."""
    if not BINARY.exists():
        return f"no llama-server at {BINARY} (run scripts/install-llamacpp.sh)"
    return ""


def version() -> str:
    out = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LlamaCppServer:
    model: Path
    flags: Sequence[str] = ()
    log: Path | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [str(BINARY), "-m", str(self.model), "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port",
                str(self.port), "-t", str(THREADS), "--metrics", "--slots", "--no-webui", *self.flags]

    def start(self) -> LlamaCppServer:
        self.port = self.port or free_port()
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:  # 503 while the model loads, refused before the socket is bound
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return self.log.read_text(errors="replace")[-3000:]

    def page(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        stop_group(self.proc, 30)

    def __enter__(self) -> LlamaCppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a server by hand: python -m tests.engines.llamacpp_server MODEL.gguf [flags...]
    server = LlamaCppServer(Path(sys.argv[1]), sys.argv[2:], log=Path("/dev/stderr")).start()
    print(server.url, flush=True)
    try:
        server.proc.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        server.stop()
