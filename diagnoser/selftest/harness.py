"""`diagnoser selftest`: run each scenario workload, attach to it the way `diagnoser attach` does (counters, server
metrics and a trace window), diagnose, and compare with the known answer; then check the physics (measured tokens/s
against the predicted ceiling, predicted gain of batch 1 -> 16 against the measured gain).

Each scenario runs as its own child process (diagnoser.selftest.workload), so the attach path is the real one: PID,
process tree, /metrics, NVML. On the CPU the same scenarios run at toy size to test this harness end to end; their
verdicts are reported as "CPU run: not a GPU verdict" and never count as GPU results.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from diagnoser import physics
from diagnoser import signals as S
from diagnoser.capture import Capture, GpuInfo, ModelInfo, TraceSummary, save
from diagnoser.diagnosis import Diagnosis
from diagnoser.errors import DiagnoserError, InputError, SourceUnavailable
from diagnoser.evidence import Evidence
from diagnoser.pipeline import Pipeline
from diagnoser.selftest.scenarios import DEFAULT_ORDER, SCENARIOS, Scenario

CPU_VERDICT_NOTE = "CPU run: not a GPU verdict"
DEFAULT_WINDOW_S = {"cuda": 8.0, "cpu": 3.0}
DEFAULT_TRACE_S = {"cuda": 2.0, "cpu": 0.5}
INTERVAL_S = 0.1
READY_TIMEOUT_S = {"cuda": 600.0, "cpu": 180.0}
STOP_TIMEOUT_S = 30.0
# A workload lives this long past its window at most, so a crashed harness never leaves it running for long.
WORKLOAD_SLACK_S = 60.0

# Physics checks: measured over predicted must fall in these bands. The ceilings are upper bounds (datasheet or
# calibrated roofs, no kernel overheads), so efficiency may not exceed 1 by more than measurement noise and should not
# fall below what a CUDA-graph decode or a cuBLAS prefill reaches on any recent GPU.
DECODE_EFFICIENCY = (0.30, 1.05)
PREFILL_EFFICIENCY = (0.25, 1.05)
BATCH_GAIN_AGREEMENT = (0.70, 1.30)  # measured gain over predicted gain

ProgressFn = Callable[[str], None]


@dataclass
class ScenarioResult:
    scenario: str
    expected: tuple[str, ...]
    title: str = ""
    verdict: str = ""
    confidence: float = 0.0
    headline: str = ""
    passed: bool | None = None  # None on a CPU run, or when the scenario did not run
    cpu_run: bool = False
    measured_tokens_per_s: float | None = None
    ceiling_tokens_per_s: float | None = None
    rate: str = "generated"  # which tokens/s: "generated" (decode) or "prompt" (prefill)
    batch: float | None = None
    context: int = 0
    skipped: str = ""
    error: str = ""
    trace: str = ""
    trace_path: str = ""  # the full trace taken after the window, when there is one
    capture_path: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def shown_verdict(self) -> str:
        if self.skipped:
            return "skipped"
        if self.error:
            return "error"
        return f"{self.verdict} ({CPU_VERDICT_NOTE})" if self.cpu_run else self.verdict


@dataclass
class PhysicsCheck:
    name: str
    predicted: float | None
    measured: float | None
    unit: str
    ok: bool | None  # None when it could not be checked
    note: str = ""


@dataclass
class SelftestReport:
    device: str
    gpu_name: str = ""
    driver: str = ""
    roofs: str = ""
    size: str = "auto"
    out_dir: str = ""
    results: list[ScenarioResult] = field(default_factory=list)
    checks: list[PhysicsCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def cpu_run(self) -> bool:
        return self.device == "cpu"

    @property
    def failed(self) -> list[str]:
        """What went wrong: scenarios that failed to run anywhere; wrong verdicts and physics checks on a GPU."""
        out = [f"{r.scenario}: {r.error}" for r in self.results if r.error]
        out += [f"{r.scenario}: expected {' or '.join(r.expected)}, got {r.verdict}"
                for r in self.results if r.passed is False]
        out += [f"physics: {c.name}" for c in self.checks if c.ok is False]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_run"] = self.cpu_run
        d["failed"] = self.failed
        for r, out in zip(self.results, d["results"], strict=True):
            out["shown_verdict"] = r.shown_verdict
        return d


class ScenarioFailed(Exception):
    """A scenario workload could not be run or observed; the message is one sentence."""


class ScenarioSkipped(Exception):
    """The workload found that this device cannot run the scenario (FP8 weights on a GPU without FP8 units)."""


# --- one scenario ----------------------------------------------------------------------------------------------

def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        code = proc.poll()
        if code is not None:
            raise ScenarioFailed(f"the workload exited with code {code} before it was ready: {_tail(log)}")
        time.sleep(0.1)
    raise ScenarioFailed(f"the workload was not ready after {timeout_s:.0f} s: {_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _TraceWindow:
    """A trace of the workload taken right after the counter window, on a side thread so that a trace that never
    finishes is bounded by join's timeout (acquire_trace blocks)."""

    def __init__(self, pid: int, seconds: float, out_dir: Path) -> None:
        self.summary: TraceSummary | None = None
        self.status = ""
        self.path: Path | None = None
        self._thread = threading.Thread(target=self._run, args=(pid, seconds, out_dir), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.status = "trace: still being written when the window ended; left out"

    def _run(self, pid: int, seconds: float, out_dir: Path) -> None:
        try:
            from diagnoser.traces import analyze_trace
            from diagnoser.tracing import acquire_trace
        except ImportError as exc:
            self.status = f"trace: not available ({exc})"
            return
        try:
            path = acquire_trace(pid, seconds, out_dir)
            self.path = Path(path)
            self.summary = analyze_trace(path).summary
            self.status = f"trace of {seconds:g} s: {Path(path).name}"
        except DiagnoserError as exc:
            self.status = f"trace failed: {exc}"
        except Exception as exc:  # a trace is extra evidence; its failure must not lose the window
            self.status = f"trace failed: {type(exc).__name__}: {exc}"


def _workload_command(name: str, *, device: str, size: str, seconds: float, ready: Path, stats: Path,
                      compiled: bool = False) -> list[str]:
    return [sys.executable, "-m", "diagnoser.selftest.workload", name, "--size", size, "--device", device,
            "--seconds", f"{seconds:g}", "--ready-file", str(ready), "--stats-file", str(stats),
            *(["--compile"] if compiled else [])]


def _child_env(device: str, scratch: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if scratch is not None:
        # The workload's temporary files (torch's caches) and its trace hook's registry go inside the run's folder,
        # so that removing the folder leaves nothing behind; the hook client finds the registry from the
        # workload's own environment.
        (scratch / "tmp").mkdir(parents=True, exist_ok=True)
        env.update(TMPDIR=str(scratch / "tmp"), DIAGNOSER_HOOK_DIR=str(scratch / "hook"))
    return env


def observe(scn: Scenario, *, device: str, size: str, window_s: float, trace_s: float, out_dir: Path,
            interval_s: float = INTERVAL_S, compiled: bool = False,
            progress: ProgressFn | None = None) -> tuple[Capture, dict[str, Any], dict[str, Any]]:
    """Start the scenario's workload, attach to it for one window (with a trace when asked), stop it.
    Returns (capture, the workload's ready info, its final stats). `progress` hears each stage."""
    from diagnoser.collectors.session import collect
    from diagnoser.collectors.target import resolve_target

    say = progress or (lambda _msg: None)

    ready, stats, log = (out_dir / f"{scn.name}.{ext}" for ext in ("ready.json", "stats.json", "log"))
    for path in (ready, stats):
        path.unlink(missing_ok=True)
    cmd = _workload_command(scn.name, device=device, size=size, seconds=window_s + trace_s + WORKLOAD_SLACK_S,
                            ready=ready, stats=stats, compiled=compiled)
    scratch = out_dir / f".{scn.name}-scratch"
    say("  starting the workload (loading PyTorch, building the model)")
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(device, scratch))
    try:
        info = _wait_ready(proc, ready, log, READY_TIMEOUT_S[device])
        if info.get("skipped"):
            raise ScenarioSkipped(str(info["skipped"]))
        try:
            target = resolve_target(pid=proc.pid, metrics_url=info["metrics_url"])
        except DiagnoserError as exc:
            raise ScenarioFailed(f"cannot attach to the workload: {exc}") from None
        say(f"  observing {window_s:g} s window of PID {proc.pid}")
        capture = collect(target, duration_s=window_s, interval_s=interval_s, gpu=device == "cuda")
        # The trace comes after the counter window, as with `attach --trace`: the profiler pauses the process when it
        # starts and while it exports (1.7 s for 0.3 s of a 2.4B decode on an H100), which inside the window would
        # read as an idle GPU and a silent /metrics.
        if trace_s > 0 and info.get("trace_hook"):
            say(f"  tracing {trace_s:g} s")
            tracer = _TraceWindow(proc.pid, trace_s, out_dir)
            tracer.start()
            tracer.join(timeout=max(30.0, 10 * trace_s))
            capture.trace = tracer.summary
            if tracer.summary is not None and tracer.path is not None:
                info["trace_path"] = str(tracer.path)
            if tracer.status:
                capture.notes.append(f"selftest {tracer.status}")
        elif trace_s > 0:
            capture.notes.append("selftest: no trace (the workload could not load diagnoser.hook)")
    finally:
        _stop(proc)
        shutil.rmtree(scratch, ignore_errors=True)  # its caches: nothing anyone reads after the workload
    final = json.loads(stats.read_text()) if stats.exists() else {}
    return capture, info, final


def _spec(gpu: GpuInfo | None) -> Any:
    if gpu is None:
        return None
    spec = physics.match_gpu(gpu.name, gpu.memory_total_bytes)
    if spec is not None and gpu.measured:
        spec = physics.with_measured(spec, gpu.measured)
    return spec


def ceiling_tokens_per_s(model: ModelInfo, spec: Any, plan: dict[str, Any], batch: float, context: int) -> float | None:
    """The physics' most tokens/s for this scenario: the decode ceiling at its batch and context, or the prompt
    tokens/s of a compute-bound prefill."""
    if spec is None or not model.params:
        return None
    if plan.get("mode") == "prefill":
        tokens = int(plan["prefill_batch"]) * int(plan["prefill_len"])
        return tokens / physics.prefill_time_s(model, spec, tokens)
    return physics.decode_ceiling_tokens_per_s(model, spec, batch=max(1.0, batch), context=context)


def _measured_rate(ev: Evidence, mode: str, stats: dict[str, Any]) -> float | None:
    """Tokens/s over the window from the workload's own /metrics as attach read them; its totals if unread."""
    found = ev.get(S.SERVER_PROMPT_TOKENS_PER_S if mode == "prefill" else S.SERVER_GEN_TOKENS_PER_S)
    if found is not None and found.n:
        return found.mean
    value = stats.get("prompt_tokens_per_s" if mode == "prefill" else "gen_tokens_per_s")
    return float(value) if value else None


def run_scenario(scn: Scenario, *, device: str, size: str, window_s: float, trace_s: float,
                 out_dir: Path, compiled: bool = False,
                 progress: ProgressFn | None = None) -> tuple[ScenarioResult, Capture | None, Diagnosis | None]:
    result = ScenarioResult(scn.name, scn.expected, scn.title, cpu_run=device == "cpu")
    try:
        capture, info, stats = observe(scn, device=device, size=size, window_s=window_s, trace_s=trace_s,
                                       out_dir=out_dir, compiled=compiled, progress=progress)
    except ScenarioSkipped as exc:
        result.skipped = str(exc)
        return result, None, None
    except (ScenarioFailed, DiagnoserError) as exc:
        result.error = str(exc)
        return result, None, None
    plan = info.get("plan", {})
    model = msgspec.convert(info["model"], ModelInfo)
    if capture.model is None:
        capture.model = model
    context = int(info.get("context_read") or 0)
    if context and capture.serving.mean_context_tokens is None:
        capture.serving.mean_context_tokens = context
    capture.serving.selftest_scenario = capture.serving.selftest_scenario or scn.name
    capture.serving.engine = capture.serving.engine or "selftest"
    capture.origin = "selftest"
    if device == "cpu":
        capture.cpu_only = True
    capture.notes.append(f"selftest scenario {scn.name}: {scn.title}; expected {' or '.join(scn.expected)} "
                         f"because {scn.why}.")
    if progress is not None:
        progress("  diagnosing")
    outcome = Pipeline().diagnose(capture)
    ev, diagnosis = outcome.evidence, outcome.diagnosis
    result.verdict, result.confidence, result.headline = diagnosis.verdict, diagnosis.confidence, diagnosis.headline
    found = {f.limiter.value for f in diagnosis.findings}
    right = diagnosis.verdict in scn.expected and (not scn.required_finding or scn.required_finding in found)
    result.passed = None if device == "cpu" else right
    result.batch = float(info.get("batch") or 1)
    result.context = context
    result.model = info["model"]
    result.stats = {**stats, "torch": info.get("torch", "")}  # the workload reports its torch when ready
    result.rate = "prompt" if plan.get("mode") == "prefill" else "generated"
    result.measured_tokens_per_s = _measured_rate(ev, plan.get("mode", "decode"), stats)
    if device != "cpu":
        spec = _spec(capture.gpus[0] if capture.gpus else None)
        result.ceiling_tokens_per_s = ceiling_tokens_per_s(model, spec, plan, result.batch, context)
    result.trace_path = str(info.get("trace_path") or "")
    result.trace = next((n.removeprefix("selftest ") for n in capture.notes if n.startswith("selftest trace")
                         or n.startswith("selftest: no trace")), "")
    path = out_dir / f"{scn.name}.dgc"
    save(capture, path)
    result.capture_path = str(path)
    return result, capture, diagnosis


# --- physics checks ------------------------------------------------------------------------------------------

def _within(value: float, band: tuple[float, float]) -> bool:
    return band[0] <= value <= band[1]


def efficiency_check(name: str, r: ScenarioResult | None, band: tuple[float, float]) -> PhysicsCheck:
    """Measured tokens/s of one scenario against its predicted ceiling."""
    label = f"{name}: measured vs predicted ceiling"
    if r is None or r.error or r.skipped:
        return PhysicsCheck(label, None, None, "tokens/s", None, f"{name} did not run")
    if r.cpu_run:
        return PhysicsCheck(label, None, r.measured_tokens_per_s, "tokens/s", None,
                            "CPU run: no GPU roofs to predict from")
    if r.ceiling_tokens_per_s is None or r.measured_tokens_per_s is None:
        return PhysicsCheck(label, r.ceiling_tokens_per_s, r.measured_tokens_per_s, "tokens/s", None,
                            "GPU not in the physics table or tokens/s not measured")
    ratio = r.measured_tokens_per_s / r.ceiling_tokens_per_s
    return PhysicsCheck(label, r.ceiling_tokens_per_s, r.measured_tokens_per_s, "tokens/s", _within(ratio, band),
                        f"{ratio:.0%} of the ceiling (expected {band[0]:.0%} to {band[1]:.0%})")


def batch_gain_check(small: ScenarioResult | None, large: ScenarioResult | None, spec: Any) -> PhysicsCheck:
    """The predicted gain of raising the decode batch (physics.what_if) against the measured gain."""
    label = "batch gain: predicted vs measured"
    runs = [r for r in (small, large) if r is not None and not r.error and not r.skipped]
    if len(runs) < 2 or small is None or large is None:
        return PhysicsCheck(label, None, None, "x", None, "needs decode-b1 and decode-b16")
    label = f"batch {small.batch:g} -> {large.batch:g}: predicted vs measured gain"
    measured = (large.measured_tokens_per_s / small.measured_tokens_per_s
                if large.measured_tokens_per_s and small.measured_tokens_per_s else None)
    if small.cpu_run:
        return PhysicsCheck(label, None, measured, "x", None, "CPU run: no GPU roofs to predict from")
    if spec is None or measured is None or not small.model:
        return PhysicsCheck(label, None, measured, "x", None, "GPU not in the physics table or tokens/s not measured")
    model = msgspec.convert(small.model, ModelInfo)
    predicted = physics.what_if(model, spec, batch=small.batch or 1, context=small.context,
                                new_batch=large.batch).speedup
    if predicted is None:
        return PhysicsCheck(label, None, measured, "x", None, "the physics cannot compare these batches")
    agreement = measured / predicted
    return PhysicsCheck(label, predicted, measured, "x", _within(agreement, BATCH_GAIN_AGREEMENT),
                        f"measured/predicted {agreement:.2f} (expected {BATCH_GAIN_AGREEMENT[0]:.2f} to "
                        f"{BATCH_GAIN_AGREEMENT[1]:.2f})")


def quantisation_gain_check(base: ScenarioResult | None, quantised: ScenarioResult | None) -> PhysicsCheck:
    """The measured gain of FP8 weights at batch 1 against two predictions from the same ceilings: the ceilings'
    ratio (every byte of the step halves, as if the step ran at its floor) and the realised gain when the step's
    time beyond its floor stays (norms, casts, softmax, gaps: t_new = t_measured - (floor_bf16 - floor_fp8)).
    The check is against the realised one: a decode far from its floor cannot gain the whole ratio."""
    label = "FP8 weights: predicted vs measured gain"
    runs = [r for r in (base, quantised) if r is not None and not r.error and not r.skipped]
    if len(runs) < 2 or base is None or quantised is None:
        return PhysicsCheck(label, None, None, "x", None, "needs decode-b1 and decode-fp8")
    measured = (quantised.measured_tokens_per_s / base.measured_tokens_per_s
                if quantised.measured_tokens_per_s and base.measured_tokens_per_s else None)
    if base.cpu_run:
        return PhysicsCheck(label, None, measured, "x", None, "CPU run: no GPU roofs to predict from")
    if measured is None or not base.ceiling_tokens_per_s or not quantised.ceiling_tokens_per_s:
        return PhysicsCheck(label, None, measured, "x", None, "GPU not in the physics table or tokens/s not measured")
    assert base.measured_tokens_per_s is not None
    step = (base.batch or 1) / base.measured_tokens_per_s
    saved = (base.batch or 1) / base.ceiling_tokens_per_s - (quantised.batch or 1) / quantised.ceiling_tokens_per_s
    ceiling_gain = quantised.ceiling_tokens_per_s / base.ceiling_tokens_per_s
    if saved >= step:
        return PhysicsCheck(label, ceiling_gain, measured, "x", None,
                            "decode-b1 ran at or above its ceiling: the realised gain is not defined")
    predicted = step / (step - saved)
    agreement = measured / predicted
    return PhysicsCheck(label, predicted, measured, "x", _within(agreement, BATCH_GAIN_AGREEMENT),
                        f"measured/predicted {agreement:.2f} (expected {BATCH_GAIN_AGREEMENT[0]:.2f} to "
                        f"{BATCH_GAIN_AGREEMENT[1]:.2f}); the ceilings' ratio is {ceiling_gain:.2f}x, reached only "
                        "by a step at its floor")


def physics_checks(results: list[ScenarioResult], spec: Any) -> list[PhysicsCheck]:
    by_name = {r.scenario: r for r in results}
    checks = []
    if "decode-b1" in by_name:
        checks.append(efficiency_check("decode-b1", by_name["decode-b1"], DECODE_EFFICIENCY))
    if "decode-b1" in by_name and "decode-b16" in by_name:
        checks.append(batch_gain_check(by_name["decode-b1"], by_name["decode-b16"], spec))
    if "decode-b1" in by_name and "decode-fp8" in by_name:
        checks.append(quantisation_gain_check(by_name["decode-b1"], by_name["decode-fp8"]))
    if "prefill" in by_name:
        checks.append(efficiency_check("prefill", by_name["prefill"], PREFILL_EFFICIENCY))
    return checks


# --- the whole run -------------------------------------------------------------------------------------------

def resolve_device(device: str) -> str:
    if device in ("cuda", "cpu"):
        return device
    if device != "auto":
        raise InputError(f"--device must be auto, cuda or cpu, not '{device}'.")
    try:
        import torch
    except ImportError:
        raise SourceUnavailable("selftest needs PyTorch: pip install 'diagnoser[torch]'.") from None
    # is_available() initialises the driver but opens no context, so this process takes no GPU memory.
    return "cuda" if torch.cuda.is_available() else "cpu"


def scenario_names(requested: str | None) -> list[str]:
    if not requested:
        return list(DEFAULT_ORDER)
    names = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise InputError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_ORDER)}.")
    return names


def run_selftest(names: list[str], *, device: str = "auto", size: str = "auto", window_s: float | None = None,
                 trace_s: float | None = None, out_dir: Path, force: bool = False, compiled: bool = False,
                 progress: ProgressFn | None = None) -> tuple[SelftestReport, list[Capture | None]]:
    """Run the scenarios one after another and check the physics. Returns the report and each scenario's capture.
    `compiled` runs the decode steps through torch.compile (prefill stays eager)."""
    say = progress or (lambda _msg: None)
    device = resolve_device(device)
    if size not in ("auto", "toy"):
        raise InputError(f"--size must be auto or toy, not '{size}'.")
    window = window_s if window_s is not None else DEFAULT_WINDOW_S[device]
    trace = trace_s if trace_s is not None else DEFAULT_TRACE_S[device]
    if window <= 0 or trace < 0 or trace > window:
        raise InputError("the window must be positive and the trace window between 0 and the window.")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = SelftestReport(device=device, size="toy" if device == "cpu" else size, out_dir=str(out_dir))
    if compiled:
        report.notes.append("Decode steps compiled with torch.compile (norms, casts and softmax fused); the "
                            "scenarios' expected verdicts are those of the eager runs.")
    capped, cap_reason = False, ""
    if device == "cuda":
        from diagnoser.calibration.gpu_check import check_gpu, power_capped

        say("checking that GPU 0 is free")
        check = check_gpu(0, force=force)
        if check.forced:
            report.notes.append(f"Forced: {check.forced}; verdicts and rates may reflect the other work.")
        if check.gpu is not None:
            report.gpu_name, report.driver = check.gpu.name, check.gpu.driver
        if "throttled" in names:
            capped, cap_reason = power_capped(0)
    else:
        report.notes.append(f"{CPU_VERDICT_NOTE}: the scenarios ran at toy size on the CPU to test the harness end "
                            "to end. Server and host signals are real; GPU verdicts need a GPU.")
    captures: list[Capture | None] = []
    for i, name in enumerate(names, 1):
        scn = SCENARIOS[name]
        if scn.gpu_only and device != "cuda":
            say(f"[{i}/{len(names)}] {name}: skipped (needs a GPU)")
            report.results.append(ScenarioResult(name, scn.expected, scn.title, skipped="needs a GPU", cpu_run=True))
            captures.append(None)
            continue
        if name == "throttled" and not capped:
            say(f"[{i}/{len(names)}] {name}: skipped ({cap_reason})")
            report.results.append(ScenarioResult(name, scn.expected, scn.title, skipped=cap_reason))
            captures.append(None)
            continue
        say(f"[{i}/{len(names)}] {name}: {scn.title}")
        result, capture, _diagnosis = run_scenario(scn, device=device, size=size, window_s=window, trace_s=trace,
                                                   out_dir=out_dir, compiled=compiled, progress=progress)
        report.results.append(result)
        captures.append(capture)
        if capture is not None and any("Ctrl-C" in note for note in capture.notes):
            raise KeyboardInterrupt  # attach ended this window on Ctrl-C: the user wants the whole run to stop
    first = next((c for c in captures if c is not None and c.gpus), None)
    spec = _spec(first.gpus[0]) if first is not None else None
    if first is not None:
        gpu = first.gpus[0]
        report.gpu_name, report.driver = report.gpu_name or gpu.name, report.driver or gpu.driver
        # The attach collector fills GpuInfo.measured from the calibration store (diagnoser calibrate).
        report.roofs = "measured (diagnoser calibrate)" if gpu.measured else "spec sheet"
    report.checks = physics_checks(report.results, spec)
    return report, captures
