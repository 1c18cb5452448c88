"""Micro-benchmarks of the roofs this device actually reaches, in torch.

What is measured (names are the keys of CalibrationResult.measurements):
- mem_copy_bytes_per_s: large device-to-device copies (bytes read + bytes written per second);
- mem_read_bytes_per_s: a streaming read (a sum over a large tensor);
- <precision>_flops: dense square matmuls per precision the device has (fp32 with TF32 off, tf32, bf16, fp16, and
  fp8 through torch._scaled_mm on compute capability 8.9 or newer);
- launch_overhead_s: host time to enqueue one tiny kernel back to back; launch_sync_s: one tiny kernel plus a
  synchronize, the round trip a `.item()` pays;
- h2d_pinned_bytes_per_s / h2d_pageable_bytes_per_s: host-to-device copies from pinned and from pageable memory.

Each benchmark gets a share of the time budget: a warm-up, then timed trials until its share is spent, keeping the
best trial (the roof is what the device *can* reach). GPU trials are timed with CUDA events, CPU ones with
perf_counter. On the CPU (`device="cpu"`) the same code runs to test the harness; those numbers describe the host and
are never used as GPU roofs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from diagnoser.calibration.store import CalibrationResult, Measurement
from diagnoser.errors import SourceUnavailable

DEFAULT_BUDGET_S = 45.0
# Shares of the budget, in the order the benchmarks run.
_SHARES = {"memory": 0.25, "matmul": 0.5, "launch": 0.1, "h2d": 0.15}
_TRIAL_S = 0.02  # a trial lasts at least this long, so timer and sync costs vanish in it
_MAX_TRIALS = 50
_MAX_CALLS = 1000


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark's operands are on this device."""

    mem_bytes: int  # per tensor of the copy / read benchmarks
    matmul_n: int  # square matmul side (TF32/BF16/FP16/FP8)
    matmul_fp32_n: int  # plain FP32 is 8-15x slower on tensor-core GPUs: a smaller side keeps trials short
    launches: int
    h2d_bytes: int


def sizes_for(device_kind: str, free_bytes: int | None = None) -> Sizes:
    if device_kind == "cuda":
        # 1 GiB tensors (two live at once) defeat any cache (H100 L2 is 50 MB); less on a small or crowded GPU.
        mem = 1 << 30 if free_bytes is None else max(64 << 20, min(1 << 30, free_bytes // 8))
        return Sizes(mem_bytes=mem, matmul_n=8192, matmul_fp32_n=4096, launches=2000, h2d_bytes=256 << 20)
    return Sizes(mem_bytes=64 << 20, matmul_n=512, matmul_fp32_n=512, launches=2000, h2d_bytes=0)


ProgressFn = Callable[[str], None]


class _Timer:
    """Seconds for `calls` back-to-back calls of fn: CUDA events on a GPU (device time), perf_counter on the CPU."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], Any], calls: int) -> float:
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0


def best_rate(timer: _Timer, fn: Callable[[], Any], work: float, deadline: float) -> tuple[float, int]:
    """(best work-per-second over timed trials, number of trials). Always at least one trial after the warm-up,
    then more until `deadline` (time.monotonic) or _MAX_TRIALS."""
    fn()
    timer.sync()
    one = max(timer.seconds(fn, 1), 1e-7)
    calls = max(1, min(_MAX_CALLS, math.ceil(_TRIAL_S / one)))
    best, trials = 0.0, 0
    while trials == 0 or (time.monotonic() < deadline and trials < _MAX_TRIALS):
        elapsed = timer.seconds(fn, calls)
        trials += 1
        if elapsed > 0:
            best = max(best, work * calls / elapsed)
    return best, trials


class Calibrator:
    """Runs the benchmarks on one device and gathers a CalibrationResult."""

    def __init__(self, torch: Any, device: str, budget_s: float, sizes: Sizes, progress: ProgressFn | None) -> None:
        self.torch = torch
        self.device = device
        self.kind = "cuda" if device.startswith("cuda") else "cpu"
        self.budget_s = budget_s
        self.sizes = sizes
        self.progress = progress or (lambda _msg: None)
        self.timer = _Timer(torch, device)
        self.measurements: dict[str, Measurement] = {}
        self.skipped: dict[str, str] = {}
        self.start = time.monotonic()
        self.end = self.start + budget_s

    def _deadline(self, share: float) -> float:
        return min(self.end, time.monotonic() + share * self.budget_s)

    def _record(self, name: str, value: float, unit: str, how: str) -> None:
        self.measurements[name] = Measurement(value=value, unit=unit, how=how)

    # --- device memory ----------------------------------------------------------------------------------------

    def memory(self) -> None:
        torch, n = self.torch, self.sizes.mem_bytes // 4
        self.progress(f"memory bandwidth ({self.sizes.mem_bytes / 2**30:.2f} GiB tensors)")
        src = torch.ones(n, dtype=torch.float32, device=self.device)
        mib, share = src.nbytes / 2**20, _SHARES["memory"] / 2
        dst = torch.empty_like(src)
        rate, trials = best_rate(self.timer, partial(dst.copy_, src), 2.0 * src.nbytes, self._deadline(share))
        self._record("mem_copy_bytes_per_s", rate, "B/s",
                     f"copy of {mib:.0f} MiB, bytes read + written, best of {_plural(trials, 'trial')}")
        dst = None  # free it before the next benchmark
        rate, trials = best_rate(self.timer, partial(torch.sum, src), float(src.nbytes), self._deadline(share))
        self._record("mem_read_bytes_per_s", rate, "B/s",
                     f"sum over {mib:.0f} MiB (streaming read), best of {_plural(trials, 'trial')}")

    # --- matmul throughput ----------------------------------------------------------------------------------

    def _capability(self) -> tuple[int, int]:
        if self.kind != "cuda":
            return (0, 0)
        return tuple(self.torch.cuda.get_device_capability(self.device))

    def precisions(self) -> list[str]:
        """Precisions to measure here; the others go to `skipped` with the reason."""
        cap = self._capability()
        wanted = ["fp32", "tf32", "bf16", "fp16", "fp8"]
        if self.kind != "cuda":
            self.skipped["tf32_flops"] = "TF32 is a tensor-core mode of NVIDIA GPUs"
            self.skipped["fp8_flops"] = "FP8 matmuls are measured on GPUs with FP8 tensor cores only"
            return ["fp32", "bf16", "fp16"]
        if cap < (8, 0):
            self.skipped["tf32_flops"] = "no TF32 before compute capability 8.0 (Ampere)"
            self.skipped["bf16_flops"] = "no BF16 tensor cores before compute capability 8.0 (Ampere)"
            wanted = [p for p in wanted if p not in ("tf32", "bf16")]
        if cap < (8, 9):
            self.skipped["fp8_flops"] = (f"no FP8 tensor cores on compute capability {cap[0]}.{cap[1]} "
                                         "(needs 8.9 or newer)")
            wanted.remove("fp8")
        return wanted

    def _operands(self, precision: str, n: int) -> Callable[[], Any]:
        torch, dev = self.torch, self.device
        if precision == "fp8":
            a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
            # _scaled_mm wants its second operand column-major.
            b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=dev, dtype=torch.float32)
            return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        out = torch.empty(n, n, device=dev, dtype=dtype)
        return lambda: torch.mm(a, b, out=out)

    def matmuls(self) -> None:
        torch = self.torch
        wanted = self.precisions()
        share = _SHARES["matmul"] / max(1, len(wanted))
        previous = torch.get_float32_matmul_precision()
        try:
            for precision in wanted:
                n = self.sizes.matmul_fp32_n if precision == "fp32" else self.sizes.matmul_n
                self.progress(f"{precision} matmul ({n}x{n})")
                # "highest" keeps FP32 matmuls in FP32; "high" lets them use TF32 tensor cores.
                torch.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
                try:
                    fn = self._operands(precision, n)
                    rate, trials = best_rate(self.timer, fn, 2.0 * n**3, self._deadline(share))
                except (RuntimeError, TypeError, NotImplementedError) as exc:
                    self.skipped[f"{precision}_flops"] = f"{precision} matmul failed: {str(exc).splitlines()[0]}"
                    continue
                finally:
                    self._free()
                self._record(f"{precision}_flops", rate, "FLOP/s",
                             f"{n}x{n} @ {n}x{n} dense matmul, 2n^3 FLOP, best of {_plural(trials, 'trial')}")
        finally:
            torch.set_float32_matmul_precision(previous)

    # --- launch overhead --------------------------------------------------------------------------------------

    def launch(self) -> None:
        torch, count = self.torch, self.sizes.launches
        self.progress("kernel launch overhead")
        x = torch.zeros(1, device=self.device)
        deadline = self._deadline(_SHARES["launch"])
        best = math.inf
        trials = 0
        while trials == 0 or (time.monotonic() < deadline and trials < 10):
            self.timer.sync()
            t0 = time.perf_counter()
            for _ in range(count):
                x.add_(1.0)
            best = min(best, (time.perf_counter() - t0) / count)  # host time to enqueue, before any sync
            self.timer.sync()
            trials += 1
        what = "tiny kernel" if self.kind == "cuda" else "tiny op (CPU dispatch)"
        self._record("launch_overhead_s", best, "s",
                     f"host time per {what} launched back to back ({count} per trial, best of {trials})")
        if self.kind != "cuda":
            self.skipped["launch_sync_s"] = "no device to synchronise with on a CPU run"
            return
        rounds = max(1, count // 10)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(rounds):
                x.add_(1.0)
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / rounds)
        self._record("launch_sync_s", best, "s",
                     f"tiny kernel + synchronize, round trip ({rounds} per trial, best of 3)")

    # --- host to device ----------------------------------------------------------------------------------------

    def h2d(self) -> None:
        if self.kind != "cuda":
            reason = "no host-to-device link on a CPU run"
            self.skipped["h2d_pinned_bytes_per_s"] = reason
            self.skipped["h2d_pageable_bytes_per_s"] = reason
            return
        torch, nbytes = self.torch, self.sizes.h2d_bytes
        self.progress(f"host-to-device copies ({nbytes >> 20} MiB)")
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        share = _SHARES["h2d"] / 2
        for kind in ("pinned", "pageable"):
            try:
                host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
            except RuntimeError as exc:
                self.skipped[f"h2d_{kind}_bytes_per_s"] = f"cannot allocate {kind} host memory: {exc}"
                continue
            rate, trials = best_rate(self.timer, partial(dev.copy_, host, non_blocking=True), float(nbytes),
                                     self._deadline(share))
            self._record(f"h2d_{kind}_bytes_per_s", rate, "B/s",
                         f"{nbytes >> 20} MiB from {kind} host memory, best of {_plural(trials, 'trial')}")
            del host

    def _free(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.empty_cache()

    def run(self) -> None:
        for step in (self.memory, self.matmuls, self.launch, self.h2d):
            step()
            self._free()


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise SourceUnavailable("calibrate needs PyTorch: pip install 'diagnoser[torch]'.") from None
    return torch


def cuda_device(torch: Any, index: int) -> str:
    """'cuda:N' when torch sees that GPU, else SourceUnavailable with the reason in one sentence."""
    if not torch.cuda.is_available():
        why = ("this PyTorch build has no CUDA" if torch.version.cuda is None
               else "PyTorch sees no CUDA device (driver missing or no GPU assigned)")
        raise SourceUnavailable(f"calibrate needs a CUDA GPU and {why}; `diagnoser calibrate --device cpu` runs the "
                                "same benchmarks on the CPU (labelled CPU, never used as GPU roofs).")
    count = torch.cuda.device_count()
    if index >= count:
        raise SourceUnavailable(f"there is no CUDA device {index}; PyTorch sees {count}.")
    return f"cuda:{index}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def calibrate(
    device: str = "cuda",
    *,
    index: int = 0,
    budget_s: float = DEFAULT_BUDGET_S,
    gpu: Any | None = None,
    forced: str = "",
    sizes: Sizes | None = None,
    progress: ProgressFn | None = None,
) -> CalibrationResult:
    """Run every benchmark on `device` ("cuda" or "cpu") within about `budget_s` seconds.

    `gpu` is the GpuInfo NVML gave for the device (its name and driver key the store); the busy check
    (gpu_check.check_gpu) must run before this, while this process holds no CUDA context.
    """
    torch = _import_torch()
    started = time.time()
    notes: list[str] = []
    if device == "cpu":
        name, driver, capability, total = _cpu_name(), "", "", None
        threads = torch.get_num_threads()
        notes.append(f"CPU run with {threads} torch threads: host numbers, not GPU roofs.")
        torch_device = "cpu"
        sizes = sizes or sizes_for("cpu")
    else:
        torch_device = cuda_device(torch, index)
        props = torch.cuda.get_device_properties(index)
        name = gpu.name if gpu is not None else torch.cuda.get_device_name(index)
        driver = gpu.driver if gpu is not None else ""
        if not driver:
            from diagnoser.calibration.gpu_check import driver_from_proc

            driver = driver_from_proc()
        capability = f"{props.major}.{props.minor}"
        total = int(props.total_memory)
        if gpu is not None and _squash(props.name) != _squash(gpu.name):
            notes.append(f"PyTorch names device {index} '{props.name}' but NVML '{gpu.name}': check "
                         "CUDA_DEVICE_ORDER=PCI_BUS_ID if this machine mixes GPU models.")
        torch.cuda.set_device(index)
        free, _total = torch.cuda.mem_get_info(index)
        sizes = sizes or sizes_for("cuda", int(free))
    cal = Calibrator(torch, torch_device, budget_s, sizes, progress)
    with torch.inference_mode():
        cal.run()
    return CalibrationResult(
        device_kind="cuda" if device != "cpu" else "cpu",
        device_name=name,
        driver=driver,
        cuda_capability=capability,
        memory_total_bytes=total,
        torch_version=str(torch.__version__),
        host=os.uname().nodename,
        measured_at=started,
        duration_s=round(time.monotonic() - cal.start, 3),
        budget_s=budget_s,
        measurements=cal.measurements,
        skipped=cal.skipped,
        forced=forced,
        notes=notes,
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _squash(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())
