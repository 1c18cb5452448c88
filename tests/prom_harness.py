"""A real Prometheus for the tests and the fleet benchmark, and a small process that serves dcgm-exporter text.

`SimFleet` describes GPUs (nodes, UUIDs, MIG instances, pods, a workload profile each) and renders what dcgm-exporter
would print for them at a time t: values drift with t and counters accumulate, so Prometheus stores changing series.
`python -m tests.prom_harness serve ...` serves it over HTTP (one process for every node: /node/<n>/metrics, or
/metrics for all), and can take a node down (/control/down/<n>) to play an exporter that vanishes.
`PrometheusServer` starts the real prometheus binary on 127.0.0.1 with a temporary config and data directory and
stops it at the end. Both are started by pytest fixtures and by benchmarks/fleet_scale.py.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def find_prometheus() -> str | None:
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)


def find_victoria_metrics() -> str | None:
    return shutil.which("victoria-metrics") or \
        ("/usr/bin/victoria-metrics" if Path("/usr/bin/victoria-metrics").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(check: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> object:
    """Call check until it returns something truthy; fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last_error})" if last_error else ""))


# --- the simulated fleet ---------------------------------------------------------------------------------------------

# Per profile: the level of each field (ratios 0..1, memory as a fraction of the board, watts, MHz, and for the power
# violation counter the share of time throttled). Chosen so each profile trips one rule clearly.
# `reasons` is the clock event mask DCGM reports (0x1 GPU idle; 0x4 SW power cap + 0x80 HW power brake).
PROFILES: dict[str, dict[str, float]] = {
    "idle": dict(gr=0.02, sm=0.01, occ=0.01, tensor=0.0, dram=0.01, fb=0.05, power=70, clock=1980, reasons=0x1),
    "bandwidth": dict(gr=0.95, sm=0.85, occ=0.40, tensor=0.22, dram=0.72, fb=0.85, power=560, clock=1980),
    "compute": dict(gr=0.97, sm=0.93, occ=0.30, tensor=0.78, dram=0.35, fb=0.70, power=690, clock=1900),
    "batching": dict(gr=0.30, sm=0.22, occ=0.10, tensor=0.08, dram=0.12, fb=0.60, power=200, clock=1980),
    "vram": dict(gr=0.80, sm=0.85, occ=0.30, tensor=0.35, dram=0.42, fb=0.995, power=450, clock=1980),
    # Clocks held by the power cap about two thirds of the time: the mask toggles between 0x84 and 0.
    "throttled": dict(gr=0.92, sm=0.80, occ=0.30, tensor=0.45, dram=0.40, fb=0.80, power=700, clock=1190, pv=0.85,
                      reasons=0x84, released_below=-0.5),
    "xid": dict(gr=0.60, sm=0.50, occ=0.20, tensor=0.30, dram=0.30, fb=0.50, power=350, clock=1980, xid=79),
    # Busy, but neither SMs nor DRAM half used: small kernels, each step waiting on latency.
    "latency": dict(gr=0.93, sm=0.34, occ=0.12, tensor=0.05, dram=0.28, fb=0.72, power=310, clock=1980),
}
PROFILE_ORDER = tuple(PROFILES)
H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559
MAX_CLOCK = 1980

# field key -> (legacy name, DCGM 4.6 name, how the simulator computes it)
_SIM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("gr_engine_active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    ("gpu_util", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO"),
    ("sm_active", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO"),
    ("sm_occupancy", "DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO"),
    ("tensor_active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
    ("dram_active", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO"),
    ("fb_used", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED"),
    ("fb_free", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_FREE"),
    ("sm_clock", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK"),
    ("max_sm_clock", "DCGM_FI_DEV_MAX_SM_CLOCK", "DCGM_FI_DEV_MAX_SM_CLOCK"),
    ("power", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
    ("temp", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
    ("power_violation", "DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_POWER_VIOLATION"),
    ("thermal_violation", "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_DEV_THERMAL_VIOLATION"),
    ("pcie_tx", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES"),
    ("pcie_rx", "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES"),
    ("xid", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"),
    ("clock_reasons", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
)
_COUNTERS = {"power_violation", "thermal_violation"}
# What a MIG GPU reports once for the whole board (no GPU_I_ID) rather than per instance.
_DEVICE_LEVEL = {"max_sm_clock", "power", "temp", "power_violation", "thermal_violation", "xid", "sm_clock",
                 "clock_reasons"}


@dataclass(frozen=True)
class SimGpu:
    node: int
    index: int
    uuid: str
    profile: str
    mig_id: str = ""
    mig_profile: str = ""
    namespace: str = ""
    pod: str = ""
    seed: float = 0.0

    @property
    def hostname(self) -> str:
        return f"node-{self.node:04d}"


def _ratio(level: float, wave: float, swing: float = 0.04) -> float:
    """An activity ratio swinging with the wave around its profile's level, within 0..1; 0 stays 0."""
    return round(min(1.0, max(0.0, level + swing * wave)), 6) if level > 0 else 0.0


# Activity fields: the profile's level each reads.
_ACTIVITY = {"gr_engine_active": "gr", "sm_active": "sm", "sm_occupancy": "occ", "tensor_active": "tensor",
             "dram_active": "dram"}
# The other fields, from (profile, wave, seconds since start, board MiB).
_READINGS: dict[str, Callable[[dict[str, float], float, float, int], float]] = {
    "gpu_util": lambda p, wave, elapsed, board: float(round(_ratio(p["gr"], wave) * 100)),
    "fb_used": lambda p, wave, elapsed, board: float(round(board * min(0.999, p["fb"] + (
        0.002 * wave if p["fb"] < 0.99 else 0.0)))),
    "sm_clock": lambda p, wave, elapsed, board: float(round(p["clock"] - (
        30 * abs(wave) if p["clock"] < MAX_CLOCK else 0))),
    "max_sm_clock": lambda p, wave, elapsed, board: float(MAX_CLOCK),
    "power": lambda p, wave, elapsed, board: round(p["power"] + 15 * wave, 3),
    "temp": lambda p, wave, elapsed, board: float(round(35 + p["power"] / 20 + 2 * wave)),
    "power_violation": lambda p, wave, elapsed, board: float(round(p.get("pv", 0.0) * elapsed * 1e9)),
    "thermal_violation": lambda p, wave, elapsed, board: 0.0,
    "pcie_tx": lambda p, wave, elapsed, board: float(round(2e8 * p["gr"] * (1.1 + wave))),
    "pcie_rx": lambda p, wave, elapsed, board: float(round(2e8 * p["gr"] * (1.1 + wave))),
    "xid": lambda p, wave, elapsed, board: float(p.get("xid", 0)),
    "clock_reasons": lambda p, wave, elapsed, board: 0.0 if wave < p.get("released_below", -2.0)
    else float(p.get("reasons", 0)),
}


@dataclass
class SimFleet:
    """GPUs spread over nodes, each with a profile (cycled in `profiles` order unless `assign` says otherwise)."""

    n_gpus: int
    gpus_per_node: int = 4
    names: str = "legacy"  # or "dcgm46", or "lowercase" (dcgm_fi_* names, uuid/pod_name labels: older exporters)
    host_label: str = "Hostname"  # or "hostname" (dcgm-exporter after 4.5.3-4.8.2)
    mig_nodes: tuple[int, ...] = ()  # on these nodes GPU 0 is split into MIG instances 1 and 2 (3g.40gb)
    omit: tuple[str, ...] = ()  # field keys not exported (as with dcgm-exporter's default counters)
    profiles: tuple[str, ...] = PROFILE_ORDER
    assign: dict[int, str] = field(default_factory=dict)  # global GPU number -> profile
    pods: dict[int, str] = field(default_factory=dict)  # global GPU number -> pod name (hostile ones, say)
    model: str = H100
    start: float = field(default_factory=time.time)
    refresh_s: float = 0.0  # > 0: values change only every refresh_s seconds, like dcgm-exporter's -c interval
    first_node: int = 0  # node numbers (and so UUIDs and hostnames) start here: two simulators, distinct GPUs
    gpus: list[SimGpu] = field(init=False)

    def __post_init__(self) -> None:
        self.gpus = []
        n = 0
        node = self.first_node
        while n < self.n_gpus:
            for index in range(self.gpus_per_node):
                if n >= self.n_gpus:
                    break
                parent = self._uuid(node, index)
                instances = ["1", "2"] if node in self.mig_nodes and index == 0 else [""]
                for mig_id in instances:
                    profile = self.assign.get(n, self.profiles[n % len(self.profiles)])
                    with_pod = n % 5 != 4
                    self.gpus.append(SimGpu(
                        node=node, index=index, uuid=parent, profile=profile, mig_id=mig_id,
                        mig_profile="3g.40gb" if mig_id else "", namespace=f"team-{n % 3}" if with_pod else "",
                        pod=self.pods.get(n, f"{profile}-server-{n:05d}-7f9c") if with_pod else "",
                        seed=(n * 0.7) % 6.28))
                    n += 1
            node += 1
        self.nodes = list(range(self.first_node, node))
        self._nodes: dict[int, list[SimGpu]] = {}
        for g in self.gpus:
            self._nodes.setdefault(g.node, []).append(g)
        self._label_cache: dict[tuple[SimGpu, bool], str] = {}

    @staticmethod
    def _uuid(node: int, index: int) -> str:
        h = hashlib.sha1(f"{node}/{index}".encode()).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def on_node(self, node: int) -> list[SimGpu]:
        return self._nodes.get(node, [])

    def by_profile(self, profile: str) -> list[SimGpu]:
        return [g for g in self.gpus if g.profile == profile]

    def _name(self, key: str) -> str:
        for k, legacy, new in _SIM_FIELDS:
            if k == key:
                if self.names == "lowercase":
                    return legacy.lower()
                return new if self.names == "dcgm46" else legacy
        raise KeyError(key)

    def _labels(self, g: SimGpu, *, board: bool = False) -> str:
        cached = self._label_cache.get((g, board))
        if cached is None:
            cached = self._label_cache[(g, board)] = self._make_labels(g, board=board)
        return cached

    def _make_labels(self, g: SimGpu, *, board: bool = False) -> str:
        old = self.names == "lowercase"  # dcgm-exporter's --use-old-namespace label names
        parts = [f'gpu="{g.index}"', f'{"uuid" if old else "UUID"}="{g.uuid}"',
                 f'pci_bus_id="00000000:{0x18 + g.index:02X}:00.0"', f'device="nvidia{g.index}"',
                 f'modelName="{self.model}"']
        if g.mig_id and not board:
            parts += [f'GPU_I_PROFILE="{g.mig_profile}"', f'GPU_I_ID="{g.mig_id}"']
        parts += [f'{self.host_label}="{g.hostname}"', 'DCGM_FI_DRIVER_VERSION="550.54.15"']
        if not board:
            pod, namespace, container = ("pod_name", "pod_namespace", "container_name") if old else \
                ("pod", "namespace", "container")
            parts += [f'{container}="{"server" if g.pod else ""}"', f'{namespace}="{g.namespace}"',
                      f'{pod}="{g.pod}"']
        return "{" + ",".join(parts) + "}"

    def value(self, g: SimGpu, key: str, t: float) -> float:
        p = PROFILES[g.profile]
        if self.refresh_s > 0:
            t = self.start + math.floor((t - self.start) / self.refresh_s) * self.refresh_s
        wave = math.sin(2 * math.pi * (t - self.start) / 20.0 + g.seed)
        board = H100_MIB // 2 if g.mig_id else H100_MIB
        if key in _ACTIVITY:
            return _ratio(p[_ACTIVITY[key]], wave)
        if key == "fb_free":
            return float(board - self.value(g, "fb_used", t))
        return _READINGS[key](p, wave, max(0.0, t - self.start), board)  # an unknown key: KeyError

    def render(self, gpus: Iterable[SimGpu], t: float | None = None) -> str:
        """dcgm-exporter's text for these GPUs at time t (HELP/TYPE per family, one line per GPU or instance)."""
        t = time.time() if t is None else t
        gpus = list(gpus)
        out: list[str] = []
        for key, _, _ in _SIM_FIELDS:
            if key in self.omit:
                continue
            name = self._name(key)
            kind = "counter" if key in _COUNTERS else "gauge"
            lines = []
            boards_done: set[str] = set()
            for g in gpus:
                if g.mig_id and key == "gpu_util":
                    continue  # not reported for MIG instances
                if g.mig_id and key in _DEVICE_LEVEL:
                    if g.uuid in boards_done:
                        continue
                    boards_done.add(g.uuid)
                    lines.append(f"{name}{self._labels(g, board=True)} {_num(self.value(g, key, t))}")
                    continue
                lines.append(f"{name}{self._labels(g)} {_num(self.value(g, key, t))}")
            if lines:
                out.append(f"# HELP {name} simulated {key}")
                out.append(f"# TYPE {name} {kind}")
                out.extend(lines)
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    return f"{v:.6f}" if v != int(v) or abs(v) < 1 else f"{int(v)}"


# --- serving it --------------------------------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    fleet: SimFleet
    down: set[int]
    served: dict[str, int]  # path -> requests answered, for tests that wait for readings

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        parts = [p for p in urllib.parse.urlparse(self.path).path.split("/") if p]
        if parts == ["metrics"]:
            body = self.fleet.render([g for g in self.fleet.gpus if g.node not in self.down])
        elif len(parts) == 3 and parts[0] == "node" and parts[2] == "metrics" and parts[1].isdigit():
            node = int(parts[1])
            if node in self.down or not self.fleet.on_node(node):
                self.send_error(503 if node in self.down else 404)
                return
            body = self.fleet.render(self.fleet.on_node(node))
        elif len(parts) == 3 and parts[0] == "control" and parts[1] in ("down", "up") and parts[2].isdigit():
            (self.down.add if parts[1] == "down" else self.down.discard)(int(parts[2]))
            body = "ok\n"
        elif parts == ["healthz"]:
            body = "ok\n"
        elif parts == ["stats"]:
            body = json.dumps(self.served)
        else:
            self.send_error(404)
            return
        data = body.encode()
        self.served[self.path] = self.served.get(self.path, 0) + 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(fleet: SimFleet, port: int = 0, port_file: str | None = None) -> None:
    handler = type("Handler", (_Handler,), {"fleet": fleet, "down": set(), "served": {}})
    http.server.ThreadingHTTPServer.daemon_threads = True
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.request_queue_size = 1024
    if port_file:
        Path(port_file + ".tmp").write_text(str(server.server_address[1]))
        os.replace(port_file + ".tmp", port_file)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()


def fleet_args(fleet: SimFleet) -> list[str]:
    args = ["--gpus", str(fleet.n_gpus), "--gpus-per-node", str(fleet.gpus_per_node), "--names", fleet.names,
            "--host-label", fleet.host_label, "--start", repr(fleet.start), "--refresh", str(fleet.refresh_s),
            "--profiles", ",".join(fleet.profiles), "--first-node", str(fleet.first_node)]
    if fleet.mig_nodes:
        args += ["--mig-nodes", ",".join(map(str, fleet.mig_nodes))]
    if fleet.omit:
        args += ["--omit", ",".join(fleet.omit)]
    if fleet.assign:
        args += ["--assign", json.dumps(fleet.assign)]
    if fleet.pods:
        args += ["--pods", json.dumps(fleet.pods)]
    if fleet.model != H100:
        args += ["--model", fleet.model]
    return args


class ExporterProcess:
    """The simulator served from a child process; `url(node)` is one node's exporter endpoint."""

    def __init__(self, fleet: SimFleet, workdir: Path) -> None:
        self.fleet = fleet
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 60) -> ExporterProcess:
        port_file = self.workdir / f"exporter-{os.getpid()}-{id(self)}.port"
        cmd = [sys.executable, "-m", "tests.prom_harness", "serve", "--port-file", str(port_file), *fleet_args(self.fleet)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        poll(lambda: port_file.exists() or self._died(), timeout, "the exporter simulator's port")
        self.port = int(port_file.read_text())
        poll(lambda: _get(f"http://127.0.0.1:{self.port}/healthz", 2) == b"ok\n", timeout, "the exporter simulator")
        return self

    def _died(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"exporter simulator exited: {err[-2000:]}")
        return False

    def url(self, node: int | None = None) -> str:
        path = "metrics" if node is None else f"node/{node}/metrics"
        return f"http://127.0.0.1:{self.port}/{path}"

    def served(self, node: int | None = None) -> int:
        """Readings answered so far on one node's endpoint (or /metrics)."""
        stats = json.loads(_get(f"http://127.0.0.1:{self.port}/stats", 5))
        return stats.get("/metrics" if node is None else f"/node/{node}/metrics", 0)

    def set_down(self, node: int, down: bool = True) -> None:
        _get(f"http://127.0.0.1:{self.port}/control/{'down' if down else 'up'}/{node}", 5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> ExporterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


# --- Prometheus ------------------------------------------------------------------------------------------------------


@dataclass
class ScrapeTarget:
    address: str  # host:port
    path: str
    instance: str


class PrometheusServer:
    """The real prometheus binary on 127.0.0.1 with a temporary config and data directory."""

    def __init__(self, workdir: Path, targets: list[ScrapeTarget], *, scrape_interval_s: float = 1.0,
                 extra_args: Iterable[str] = (), data_dir: Path | None = None, binary: str | None = None,
                 rule_files: Iterable[Path] = ()) -> None:
        self.workdir = workdir.resolve()  # prometheus runs in workdir: every path it gets must be absolute
        self.targets = targets
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval_s = scrape_interval_s
        self.extra_args = list(extra_args)
        self.data_dir = (data_dir or self.workdir / "prom-data").resolve()
        self.binary = binary or find_prometheus()
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self) -> Path:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        lines = ["global:", f"  scrape_interval: {interval}", f"  scrape_timeout: {interval}"]
        if self.rule_files:
            lines += [f"  evaluation_interval: {interval}", "rule_files:"] + [f"  - '{p}'" for p in self.rule_files]
        if self.targets:
            lines += ["scrape_configs:", "  - job_name: dcgm", "    honor_labels: true", "    static_configs:"]
        for t in self.targets:
            lines += [f"      - targets: ['{t.address}']", "        labels:",
                      f"          __metrics_path__: '{t.path}'", f"          instance: '{t.instance}'"]
        config = self.workdir / "prometheus.yml"
        config.write_text("\n".join(lines) + "\n")
        return config

    def command(self, config: Path) -> list[str]:
        return [str(self.binary), f"--config.file={config}", f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn", *self.extra_args]

    def _missing_binary(self) -> str:
        return NO_PROMETHEUS

    def start(self, timeout: float = 60) -> PrometheusServer:
        if self.binary is None:
            raise RuntimeError(self._missing_binary())
        config = self.write_config()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # a free port can be taken between choosing and binding it
            self.port = free_port()
            cmd = self.command(config)
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
            try:
                poll(self._ready, timeout, "Prometheus /-/ready")
                return self
            except (TimeoutError, RuntimeError):
                self.stop()
                if "address already in use" not in self.log.read_text(errors="replace").lower():
                    raise
        raise RuntimeError("could not find a free port for the time-series database")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}")
        try:
            return bool(_get(f"{self.url}/-/ready", 2))
        except (urllib.error.URLError, OSError):
            return False

    def query(self, promql: str) -> list[dict]:
        data = _get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", 10)
        return json.loads(data)["data"]["result"]

    def wait_for_samples(self, n: int, timeout: float = 120, metric: str = "DCGM_FI_DEV_FB_USED") -> None:
        """Until every target has been scraped at least n times (counted over the last hour)."""
        def enough() -> bool:
            result = self.query(f"min(count_over_time({metric}[1h]))")
            return bool(result) and float(result[0]["value"][1]) >= n
        poll(enough, timeout, f"{n} scrapes of {metric}", every=0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VictoriaMetricsServer(PrometheusServer):
    """Single-node VictoriaMetrics (Debian's `victoria-metrics`) on 127.0.0.1, scraping the same targets with the same
    config file, and answering the same HTTP query API. Samples are visible to queries at once (no 30 s latency
    offset), so short test windows ending now see their data."""

    def __init__(self, workdir: Path, targets: list[ScrapeTarget], *, scrape_interval_s: float = 1.0,
                 extra_args: Iterable[str] = (), data_dir: Path | None = None, binary: str | None = None) -> None:
        super().__init__(workdir, targets, scrape_interval_s=scrape_interval_s, extra_args=extra_args,
                         data_dir=data_dir or workdir.resolve() / "vm-data",
                         binary=binary or find_victoria_metrics())
        self.log = workdir / "victoria-metrics.log"

    def command(self, config: Path) -> list[str]:
        return [str(self.binary), f"-storageDataPath={self.data_dir}", f"-httpListenAddr=127.0.0.1:{self.port}",
                "-search.latencyOffset=0s", "-search.disableCache", "-loggerLevel=WARN", "-retentionPeriod=100y",
                *([f"-promscrape.config={config}"] if self.targets else []), *self.extra_args]

    def _missing_binary(self) -> str:
        return NO_VICTORIA_METRICS

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"victoria-metrics exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}")
        try:
            return _get(f"{self.url}/health", 2).strip() == b"OK"
        except (urllib.error.URLError, OSError):
            return False


def node_targets(exporter: ExporterProcess) -> list[ScrapeTarget]:
    return [ScrapeTarget(f"127.0.0.1:{exporter.port}", f"/node/{n}/metrics", f"node-{n:04d}")
            for n in exporter.fleet.nodes]


# --- command line: serve the simulator --------------------------------------------------------------------------------


def _parse(argv: list[str]) -> tuple[argparse.Namespace, SimFleet]:
    ap = argparse.ArgumentParser(prog="python -m tests.prom_harness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve simulated dcgm-exporter text")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--port-file")
    s.add_argument("--gpus", type=int, default=8)
    s.add_argument("--gpus-per-node", type=int, default=4)
    s.add_argument("--names", choices=("legacy", "dcgm46", "lowercase"), default="legacy")
    s.add_argument("--host-label", choices=("Hostname", "hostname"), default="Hostname")
    s.add_argument("--mig-nodes", default="")
    s.add_argument("--omit", default="")
    s.add_argument("--profiles", default=",".join(PROFILE_ORDER))
    s.add_argument("--assign", default="{}")
    s.add_argument("--start", type=float, default=None)
    s.add_argument("--refresh", type=float, default=0.0)
    s.add_argument("--first-node", type=int, default=0)
    s.add_argument("--pods", default="{}")
    s.add_argument("--model", default=H100)
    args = ap.parse_args(argv)
    fleet = SimFleet(
        n_gpus=args.gpus, gpus_per_node=args.gpus_per_node, names=args.names, host_label=args.host_label,
        mig_nodes=tuple(int(x) for x in args.mig_nodes.split(",") if x), omit=tuple(x for x in args.omit.split(",") if x),
        profiles=tuple(args.profiles.split(",")), assign={int(k): v for k, v in json.loads(args.assign).items()},
        pods={int(k): v for k, v in json.loads(args.pods).items()}, model=args.model,
        refresh_s=args.refresh, first_node=args.first_node, **({"start": args.start} if args.start is not None else {}))
    return args, fleet


if __name__ == "__main__":
    parsed, sim = _parse(sys.argv[1:])
    serve(sim, parsed.port, parsed.port_file)


# --- pytest fixtures (imported by the test modules that need a running stack) -------------------------------------------

try:
    import pytest
except ImportError:  # the benchmark imports this module without pytest
    pytest = None  # type: ignore[assignment]

PROFILE_VERDICT = {"idle": "idle", "bandwidth": "memory_bandwidth", "compute": "compute", "batching": "batching",
                   "vram": "vram", "throttled": "throttling", "xid": "errors", "latency": "latency"}
# The rule that names each planted class (the primary finding).
PROFILE_RULE = {"idle": "IDLE001", "bandwidth": "BW001", "compute": "CMP001", "batching": "BAT003", "vram": "VRAM003",
                "throttled": "THR001", "xid": "ERR001", "latency": "LAT001"}
NO_PROMETHEUS = "the prometheus binary is not installed (scripts/install-test-deps.sh installs it)"
NO_VICTORIA_METRICS = "the victoria-metrics binary is not installed (scripts/install-test-deps.sh installs it)"


@dataclass
class DcgmStack:
    """Three exporters (legacy names + `Hostname` with MIG; DCGM 4.6 names + `hostname` with default-counters
    omissions and clock event reasons; lower-case `dcgm_fi_*` names with `uuid`/`pod_name` labels) scraped every
    second by one real Prometheus or VictoriaMetrics (`prom`)."""

    prom: PrometheusServer
    legacy: ExporterProcess
    renamed: ExporterProcess
    old: ExporterProcess
    started: float

    @property
    def gpus(self) -> list[SimGpu]:
        return self.legacy.fleet.gpus + self.renamed.fleet.gpus + self.old.fleet.gpus

    def gpu(self, profile: str, *, renamed: bool = False, mig: bool = False) -> SimGpu:
        fleet = (self.renamed if renamed else self.legacy).fleet
        return next(g for g in fleet.gpus if g.profile == profile and bool(g.mig_id) == mig)


def legacy_fleet() -> SimFleet:
    # Nodes 0-1: four GPUs each; node 2: GPU 0 split into MIG instances 1 and 2.
    return SimFleet(n_gpus=10, gpus_per_node=4, mig_nodes=(2,))


def renamed_fleet() -> SimFleet:
    # Close to dcgm-exporter's default counters: no SM_ACTIVE, no violation counters, no maximum clock; plus the
    # clock event reasons (DCGM 4.x name), which tell the throttled GPU from the spec table's maximum clock.
    return SimFleet(n_gpus=5, gpus_per_node=5, first_node=5, names="dcgm46", host_label="hostname",
                    omit=("sm_active", "power_violation", "thermal_violation", "max_sm_clock"),
                    profiles=("compute", "idle", "bandwidth", "batching", "throttled"))


# Label values an attacker controls: a pod name holding a token, a model name with terminal escapes (clear the
# screen, write the clipboard through OSC 52).
HOSTILE_POD = "idle-sk-proj-AbCdEfGhIjKlMnOpQrStUv"
HOSTILE_MODEL = "NVIDIA H100 80GB HBM3\x1b[2J\x1b]52;c;aGk=\x07"


def old_fleet() -> SimFleet:
    # An older exporter: dcgm_fi_* names in lower case, uuid / pod_name / pod_namespace labels; hostile labels.
    return SimFleet(n_gpus=2, gpus_per_node=2, first_node=8, names="lowercase", profiles=("compute", "idle"),
                    pods={1: HOSTILE_POD}, model=HOSTILE_MODEL)


def start_stack(workdir: Path, engine: type[PrometheusServer] = PrometheusServer) -> DcgmStack:
    exporters = [ExporterProcess(f, workdir) for f in (legacy_fleet(), renamed_fleet(), old_fleet())]
    prom = None
    try:
        for e in exporters:
            e.start()
        prom = engine(workdir, [t for e in exporters for t in node_targets(e)]).start()
        started = time.time()
        prom.wait_for_samples(16, timeout=180)
        return DcgmStack(prom, *exporters, started)  # type: ignore[arg-type]
    except BaseException:
        if prom is not None:
            prom.stop()
        for e in exporters:
            e.stop()
        raise


def stop_stack(stack: DcgmStack) -> None:
    stack.prom.stop()
    for e in (stack.legacy, stack.renamed, stack.old):
        e.stop()


if pytest is not None:

    @pytest.fixture(scope="session")
    def dcgm_stack(tmp_path_factory):  # type: ignore[no-untyped-def]
        if find_prometheus() is None:
            pytest.skip(NO_PROMETHEUS)
        stack = start_stack(tmp_path_factory.mktemp("dcgm-stack"))
        try:
            yield stack
        finally:
            stop_stack(stack)

    @pytest.fixture(scope="session")
    def vm_stack(tmp_path_factory):  # type: ignore[no-untyped-def]
        """The same exporters scraped by VictoriaMetrics instead of Prometheus."""
        if find_victoria_metrics() is None:
            pytest.skip(NO_VICTORIA_METRICS)
        stack = start_stack(tmp_path_factory.mktemp("vm-stack"), VictoriaMetricsServer)
        try:
            yield stack
        finally:
            stop_stack(stack)
