"""One diagnosis run of one target, in its own process: `python -m diagnoser.agent.worker run JOB.json`.

Why a process and not a thread: a target can hang the collection (an endpoint that trickles bytes, an NVML call on a
GPU that fell off the bus), and a Python thread cannot be stopped. The agent kills a worker that overruns its
deadline and the loop goes on; and nothing a run allocates (the capture, the evidence, the report) can accumulate in
the long-lived agent. The price is a Python start-up per run (benchmarks/AGENT.md).

The worker finds the target, collects one window, saves the capture (before anything else can fail), diagnoses it,
writes the run's report folder and then its result as JSON to the job's result path. On SIGTERM it ends the window
early and still diagnoses what it has. `python -m diagnoser.agent.worker discover OUT.json` lists the serving
processes NVML sees on the node's GPUs instead.

With DIAGNOSER_STATUS_FD set (the agent's pipe), the worker writes one JSON line per stage to it ({"stage":
"observing 10 s window of PID 4242"}, "diagnosing", "writing the report") and, when it cannot write its result,
the run's one-sentence error ({"error": ...}): a pipe needs no disk, so a full disk is still told in the worker's own
words.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Set by SIGTERM from the agent (shutting down): the window ends now and what was captured is still stored. The
# handler goes in before the heavier imports below, so an early SIGTERM is not a silent death either.
_STOP = threading.Event()
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: _STOP.set())

from diagnoser import signals as S  # noqa: E402
from diagnoser.agent.config import SourcesConfig, TargetSpec  # noqa: E402
from diagnoser.agent.reports import DEFAULT_MODE, RunReports, write_error  # noqa: E402
from diagnoser.capture import Capture  # noqa: E402
from diagnoser.errors import EXIT_INPUT, EXIT_UNAVAILABLE, DiagnoserError, InputError, SourceUnavailable  # noqa: E402
from diagnoser.fileio import write_atomic  # noqa: E402

STATUS_FD_ENV = "DIAGNOSER_STATUS_FD"
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# Where a climb from a GPU process towards its server stops: init systems, shells, container runtimes.
_BOUNDARY_NAMES = {"systemd", "init", "bash", "sh", "dash", "zsh", "fish", "sudo", "su", "sshd", "tmux", "screen",
                   "containerd-shim", "containerd-shim-runc-v2", "conmon", "tini", "dumb-init", "runc", "docker-init",
                   "supervisord", "s6-supervise", "catatonit"}


def build_job(target: TargetSpec, *, window_s: float, interval_s: float, sources: SourcesConfig,
              thresholds_path: Path | None, reports_root: Path | None, keep_reports: int, html: bool,
              result_path: Path, reports_mode: int = DEFAULT_MODE) -> dict[str, Any]:
    return {
        "target": target.to_dict(), "window_s": window_s, "interval_s": interval_s,
        "sources": sources.__dict__, "thresholds_path": str(thresholds_path) if thresholds_path else None,
        "reports_root": str(reports_root) if reports_root else None, "keep_reports": keep_reports, "html": html,
        "reports_mode": reports_mode, "result_path": str(result_path),
    }


class Status:
    """The agent's status pipe (DIAGNOSER_STATUS_FD), or nothing when the worker runs without one."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = fd

    @classmethod
    def from_env(cls) -> Status:
        value = os.environ.get(STATUS_FD_ENV, "")
        return cls(int(value) if value.isdigit() else None)

    def stage(self, text: str) -> None:
        self._send({"stage": text})

    def error(self, sentence: str) -> None:
        self._send({"error": sentence[:1000]})

    def _send(self, message: dict[str, str]) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (json.dumps(message) + "\n").encode())  # far under PIPE_BUF: one write, whole
        except OSError:
            self.fd = None  # the agent is gone (EPIPE) or the fd is not a pipe: nothing more to tell


def _say(text: str) -> None:
    """A line on stderr, which may be a file on a full disk: its failure must not turn into a traceback."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _print_traceback() -> None:
    try:
        traceback.print_exc(file=sys.stderr)
    except (OSError, ValueError):
        pass


# --- finding the process ----------------------------------------------------------------------------------------

def find_by_match(pattern: str) -> tuple[int, str]:
    """(PID, note) of the process whose command line matches `pattern`: the topmost of the matching tree, the oldest
    of several trees. The agent and this worker (whose own command lines may hold the pattern) are skipped."""
    import psutil

    regex = re.compile(pattern)
    ours = {os.getpid()}
    try:
        ours |= {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        pass
    matches: dict[int, tuple[int, float]] = {}  # pid -> (ppid, create time)
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "create_time"]):
        info = proc.info
        if info["pid"] in ours or not info["cmdline"]:
            continue
        if regex.search(" ".join(info["cmdline"])):
            matches[info["pid"]] = (info["ppid"], info["create_time"] or 0.0)
    if not matches:
        raise SourceUnavailable(f"no running process matches '{pattern}'.")
    roots = sorted((ct, pid) for pid, (ppid, ct) in matches.items() if ppid not in matches)
    note = ""
    if len(roots) > 1:
        note = (f"{len(roots)} separate processes match '{pattern}' (PIDs {', '.join(str(p) for _, p in roots[:5])}); "
                f"diagnosed the oldest, {roots[0][1]}. Make the pattern narrower to pick another.")
    return roots[0][1], note


def resolve(spec: TargetSpec, sources: SourcesConfig) -> tuple[Any, list[str]]:
    """The collectors' AttachTarget for a spec, and notes about how it was found."""
    from diagnoser.collectors.server_metrics import MetricsError
    from diagnoser.collectors.target import resolve_target

    notes: list[str] = []
    pid, port, url = spec.pid, spec.port, spec.metrics_url
    if spec.match is not None:
        pid, note = find_by_match(spec.match)
        if note:
            notes.append(note)
    if port is not None and spec.host not in ("127.0.0.1", "localhost", "::1"):
        # A server on another machine: only its metrics can be read from here.
        url, port = url or f"http://{spec.host}:{port}/metrics", None
    if not sources.server_metrics:
        url = None
    try:
        target = resolve_target(pid=pid, port=port, metrics_url=url)
    except MetricsError as exc:
        if url is None or (pid is None and port is None):
            raise  # the endpoint is all there is of this target: without it there is nothing to diagnose
        # Beside a process the server's /metrics is one source among several: down or over-size, the run goes on.
        target = resolve_target(pid=pid, port=port)
        target.metrics_url, target.metrics_problem = None, str(exc).rstrip(".")
    if not sources.server_metrics:
        target.metrics_url = None
        target.metrics_problem = "server metrics are turned off in the agent's [sources]"
    return target, notes


def pod_of(pid: int | None, proc_root: Path = Path("/proc")) -> str:
    """The Kubernetes pod UID of a process, from its cgroup path (kubepods...pod<uid>); empty outside Kubernetes."""
    if pid is None:
        return ""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return ""
    found = _POD_UID.search(text)
    return found.group(1).replace("_", "-") if found else ""


# --- one run --------------------------------------------------------------------------------------------------

def collect_window(target: Any, job: dict[str, Any], stop: threading.Event) -> tuple[Capture, list[str]]:
    """One window with the session's collectors, plus DCGM from dcgm-exporter (sampled alongside) or Prometheus
    (queried over the window afterwards). A DCGM source that is down is recorded in the capture, not raised."""
    from diagnoser.collectors.session import Sampler, build_collectors, new_window, run_sampler

    sources = SourcesConfig(**job["sources"])
    pods: list[str] = []
    capture, tree = new_window(target)
    collectors = build_collectors(target, tree, interval_s=job["interval_s"], gpu=sources.nvml)
    selector = None
    if sources.dcgm_exporter or sources.prometheus:
        selector = _dcgm_selector(target, capture)
    if sources.dcgm_exporter and selector is not None:
        from diagnoser.collectors.dcgm_exporter import DcgmExporterCollector

        # The exporter is this node's own: its Hostname label need not match ours (a container's, a pod's name).
        live = dataclasses.replace(selector, node=None)
        collectors.append(DcgmExporterCollector(sources.dcgm_exporter, live, period_s=max(1.0, job["interval_s"])))
    sampler = Sampler(capture, collectors, duration_s=job["window_s"], interval_s=job["interval_s"], tree=tree,
                      stop_event=stop)
    run_sampler(sampler)
    for c in collectors:
        for identity in getattr(c, "targets", []) or []:
            pods.extend(identity.pod_names)
    if sources.prometheus and selector is not None:
        from diagnoser.collectors.dcgm_collect import collect_dcgm_into

        try:
            identities = collect_dcgm_into(capture, prometheus_url=sources.prometheus, selector=selector)
            for identity in identities:
                pods.extend(identity.pod_names)
        except DiagnoserError as exc:
            capture.mark_unavailable("dcgm", "dcgm.*", str(exc), "check the agent's [sources] prometheus URL")
    return capture, pods


def _dcgm_selector(target: Any, capture: Capture) -> Any:
    from diagnoser.collectors.dcgm import GpuSelector, selector_for_pid

    if target.pid is None:
        return GpuSelector()
    try:
        return selector_for_pid(target.pid)
    except DiagnoserError as exc:
        capture.mark_unavailable("dcgm", "dcgm.*", str(exc), "give the target's GPU in the agent config")
        return None


def attach_model(capture: Capture, spec: TargetSpec, target: Any) -> None:
    from diagnoser.physics.models import apply_serving_flags, load_hf_config, resolve_model

    try:
        if spec.model:
            capture.model = resolve_model(spec.model)
        elif getattr(target, "model_config", None) is not None:
            capture.model = load_hf_config(target.model_config)
    except DiagnoserError as exc:
        capture.notes.append(f"The model's shape could not be read: {exc}")
    apply_serving_flags(capture)


def _observing(job: dict[str, Any], target: Any) -> str:
    what = f"PID {target.pid}" if target.pid is not None else (target.metrics_url or "the target")
    return f"observing {job['window_s']:g} s window of {what}"


def run_job(job: dict[str, Any], stop: threading.Event, status: Status | None = None) -> dict[str, Any]:
    """Everything one run does; returns the result the agent stores. Raises DiagnoserError before a capture exists."""
    from diagnoser.pipeline import Pipeline
    from diagnoser.rules import load_thresholds

    status = status or Status()
    spec = TargetSpec.from_dict(job["target"])
    sources = SourcesConfig(**job["sources"])
    started = time.time()
    thresholds = load_thresholds(job["thresholds_path"]) if job.get("thresholds_path") else None
    target, notes = resolve(spec, sources)
    status.stage(_observing(job, target))
    capture, dcgm_pods = collect_window(target, job, stop)
    capture.origin = "agent"
    capture.notes.extend(notes)
    attach_model(capture, spec, target)

    reports = RunReports(job["reports_root"], job["keep_reports"], int(job.get("reports_mode", DEFAULT_MODE))) \
        if job.get("reports_root") else None
    staging = reports.staging(spec.name) if reports is not None else None
    pipeline = Pipeline(overrides=thresholds, save_to=staging / "capture.dgc" if staging is not None else None,
                        html=staging / "report.html" if staging is not None and job.get("html") else None)
    try:
        pipeline.checkpoint(capture)  # the ground truth first: whatever fails next, this stays
    except DiagnoserError as exc:
        raise InputError(write_error(f"save the capture to {pipeline.save_to}", exc)) from None
    result: dict[str, Any] = {
        "started_at": started, "gpu": ",".join(str(g.index) for g in capture.gpus),
        "pod": spec.labels.get("pod") or ",".join(sorted(set(dcgm_pods))) or pod_of(target.pid),
        # One line per source and reason (a source that is down is listed once per signal in the capture).
        "problems": list(dict.fromkeys(f"{u.source}: {u.reason}" for u in capture.unavailable)),
    }
    if capture.process is not None and capture.process.exited_at_s is not None:
        result["problems"].append(f"target: the process exited {capture.process.exited_at_s:.1f} s into the "
                                  "window; diagnosed what was captured until then")
    try:
        status.stage("diagnosing")
        outcome = pipeline.diagnose(capture)
        result.update(verdict_fields(outcome.evidence, outcome.diagnosis))
        if staging is not None and reports is not None:
            status.stage("writing the report")
            path = staging / "diagnosis.json"
            try:
                write_atomic(path, json.dumps(outcome.diagnosis.to_dict(), indent=2).encode(), mode=reports.mode)
            except OSError as exc:  # the verdict stands; the folder keeps the capture
                result["problems"].append("report: " + write_error(f"write {path}", exc))
            else:
                _write_html(pipeline, outcome, result)
    except DiagnoserError as exc:
        result.update(status="error", error=str(exc))
    except Exception as exc:  # a bug in diagnosis: the capture is kept for a bug report
        _print_traceback()
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        result.update(status="error", error=f"internal error while diagnosing: {last}")
    finally:
        if reports is not None and staging is not None:
            result["report_dir"] = str(reports.finalize(staging, capture.started_at))
    return result


def verdict_fields(evidence: Any, diagnosis: Any) -> dict[str, Any]:
    """What the history row and the metrics keep of a diagnosis: verdict, confidence, efficiency against the
    physical ceiling (the evidence's theory.efficiency), the top-ranked fix and its predicted gain."""
    eff = evidence.get(S.THEORY_EFFICIENCY)
    top = diagnosis.fixes[0] if diagnosis.fixes else None
    return {"status": "ok", "verdict": diagnosis.verdict, "confidence": diagnosis.confidence,
            "headline": diagnosis.headline, "efficiency": eff.value if eff is not None else None,
            "top_fix": top.title if top else None, "top_fix_rule": top.rule if top else "",
            "top_fix_gain": top.gain if top else None, "diagnosis": diagnosis.to_dict()}


def _write_html(pipeline: Any, outcome: Any, result: dict[str, Any]) -> None:
    """The HTML report when asked for; optional: the capture and diagnosis.json are the record."""
    if pipeline.html is None:
        return
    try:
        pipeline.write(outcome)
    except ImportError:
        return
    except DiagnoserError as exc:
        result["problems"].append("report: " + write_error(f"write {pipeline.html}", exc))


def _discover(out: Path) -> int:
    try:
        servers = discover_servers()
    except DiagnoserError as exc:
        write_atomic(out, json.dumps({"error": str(exc)}).encode())
        return exc.exit_code
    write_atomic(out, json.dumps({"servers": servers}).encode())
    return 0


def discover_servers() -> list[dict[str, Any]]:
    """The serving processes on this node's GPUs: NVML's compute processes, each climbed up to the top of its
    server (vLLM's API server above its engine and workers), grouped, with the GPUs each server holds."""
    import psutil

    from diagnoser.collectors.nvml import NvmlUnavailable, inventory
    from diagnoser.collectors.target import kind_from_cmdline

    try:
        rows = inventory()
    except NvmlUnavailable as exc:
        hint = f" ({exc.hint})" if getattr(exc, "hint", "") else ""
        raise SourceUnavailable(f"cannot discover GPU processes: {exc.reason}{hint}.") from None
    servers: dict[int, dict[str, Any]] = {}
    for row in rows:
        for gp in row.processes:
            root = _server_root(gp.pid)
            entry = servers.setdefault(root, {"pid": root, "gpus": set(), "name": "", "kind": ""})
            entry["gpus"].add(row.info.index)
    for root, entry in servers.items():
        try:
            proc = psutil.Process(root)
            cmd = proc.cmdline()
            entry["name"] = proc.name()
        except psutil.Error:
            cmd = []
        entry["kind"] = kind_from_cmdline(cmd) or ""
        entry["gpus"] = sorted(entry["gpus"])
    return sorted(servers.values(), key=lambda e: (e["gpus"], e["pid"]))


def _server_root(pid: int) -> int:
    """Climb from a GPU process to the top of its server: up to a parent that names a serving engine, or while
    the process is a worker its parent started (multiprocessing spawn/fork, a setproctitle name); never into
    init, a shell or a container runtime. The climb itself is attach's (collectors/target.server_parents)."""
    from diagnoser.collectors.target import kind_from_cmdline, server_parents

    def through(proc: Any, parent: Any) -> bool:
        return parent.name() not in _BOUNDARY_NAMES and (kind_from_cmdline(parent.cmdline()) is not None
                                                         or _is_worker_of(proc, parent))

    parents = server_parents(pid, through)
    return parents[-1] if parents else pid


def _is_worker_of(proc: Any, parent: Any) -> bool:
    cmd, parent_cmd = proc.cmdline(), parent.cmdline()
    joined = " ".join(cmd)
    if "spawn_main" in joined or "multiprocessing.forkserver" in joined or "torchrun" in " ".join(parent_cmd):
        return True
    if cmd == parent_cmd:
        return True  # forked, not exec'd
    # Engines rename their workers (setproctitle: "VLLM::Worker_TP0", "sglang::scheduler"): one word, no path.
    return len(cmd) == 1 and "/" not in cmd[0] and "::" in cmd[0]


def _die_with_agent() -> None:
    """Ask Linux to SIGTERM this worker when the agent that started it dies (even by SIGKILL), so no orphaned
    worker keeps sampling a target nobody will read."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    agent = os.environ.get("DIAGNOSER_AGENT_PID", "")
    if agent.isdigit() and os.getppid() != int(agent):
        os._exit(EXIT_UNAVAILABLE)  # the agent died before the request took effect


def main(argv: list[str]) -> int:
    _die_with_agent()
    signal.signal(signal.SIGTERM, lambda *_: _STOP.set())  # also when main() is called from elsewhere
    return run_main(argv, _STOP, Status.from_env())


def run_main(argv: list[str], stop: threading.Event, status: Status) -> int:
    """The worker's command line, with its stop event and status pipe given (in-process callers: the tests)."""
    if len(argv) != 2 or argv[0] not in ("run", "discover"):
        _say("usage: python -m diagnoser.agent.worker run JOB.json | discover OUT.json")
        return EXIT_INPUT
    if argv[0] == "discover":
        return _discover(Path(argv[1]))
    try:
        job = json.loads(Path(argv[1]).read_text())
    except (OSError, ValueError) as exc:
        sentence = f"the worker cannot read its job {argv[1]}: {exc}"
        status.error(sentence)
        _say(f"diagnoser worker: {sentence}")
        return EXIT_INPUT
    result_path = Path(job["result_path"])
    code = 0
    try:
        result = run_job(job, stop, status)
    except DiagnoserError as exc:
        result, code = {"status": "error", "error": str(exc)}, exc.exit_code
    except Exception as exc:  # a bug: report it as this run's error, the agent goes on
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        _print_traceback()
        result, code = {"status": "error", "error": f"internal error: {last}"}, EXIT_UNAVAILABLE + 1
    result["finished_at"] = time.time()
    if result.get("status") != "ok" and code == 0:
        code = EXIT_UNAVAILABLE + 1
    try:
        write_atomic(result_path, json.dumps(result, default=str).encode())
    except OSError as exc:
        # The run's own error if it had one (a full disk usually failed an earlier write), else this one.
        sentence = str(result.get("error") or "") or write_error(f"write the run's result to {result_path}", exc)
        status.error(sentence)
        _say(f"diagnoser worker: {sentence}")
        return EXIT_INPUT
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
