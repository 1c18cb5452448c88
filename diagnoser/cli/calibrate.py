"""`diagnoser calibrate`: measure this GPU's roofs and store them for attach/diagnose (docs/calibrate.md)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from diagnoser.calibration.store import CalibrationResult, default_store_path, load_store, save_result
from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import InputError
from diagnoser.units import fmt

MAX_BUDGET_S = 600.0


def _spec_values(result: CalibrationResult) -> dict[str, float]:
    """Datasheet numbers for the measured keys, when the GPU is in the physics table."""
    if result.device_kind != "cuda":
        return {}
    from diagnoser import physics

    spec = physics.match_gpu(result.device_name, result.memory_total_bytes)
    if spec is None:
        return {}
    out = {"mem_copy_bytes_per_s": spec.hbm_bytes_per_s, "mem_read_bytes_per_s": spec.hbm_bytes_per_s,
           "h2d_pinned_bytes_per_s": spec.pcie_bytes_per_s / 2, "h2d_pageable_bytes_per_s": spec.pcie_bytes_per_s / 2}
    out.update({f"{p}_flops": v for p, v in spec.flops.items()})
    return out


def render(result: CalibrationResult, console: Console, stored_at: Path | None) -> None:
    where = f"driver {result.driver}" if result.driver else "driver unknown"
    head = (f"Calibrated {result.device_name} ({where}, compute {result.cuda_capability})"
            if result.device_kind == "cuda" else f"CPU calibration of {result.device_name}")
    console.print(f"{head} in {result.duration_s:.1f} s (budget {result.budget_s:.0f} s), torch {result.torch_version}",
                  markup=False, highlight=False)
    if result.device_kind != "cuda":
        console.print("CPU run: these numbers describe the host; they are stored labelled as CPU and never used as "
                      "GPU roofs.", style="yellow")
    if result.forced:
        console.print(f"Forced: {result.forced}. These roofs may be low.", style="yellow", markup=False)
    spec = _spec_values(result)
    table = Table("measurement", "value", "spec sheet", "measured/spec", "how", box=None, show_header=True)
    for name, m in result.measurements.items():
        ref = spec.get(name)
        table.add_row(name, fmt(m.value, m.unit), fmt(ref, m.unit) if ref else "",
                      f"{m.value / ref:.0%}" if ref else "", m.how)
    console.print(table)
    for name, reason in result.skipped.items():
        console.print(f"  not measured: {name}: {reason}", markup=False, style="dim")
    for note in result.notes:
        console.print(f"! {note}", markup=False, style="yellow")
    if stored_at is None:
        console.print("Not stored (--no-save).")
    elif result.device_kind == "cuda":
        roofs = ", ".join(f"{k} {fmt(v, 'B/s' if k.endswith('_per_s') else 'FLOP/s')}"
                          for k, v in result.roofs().items())
        console.print(f"Stored in {stored_at} as '{result.key}'. attach and diagnose now use these roofs for this GPU "
                      f"and driver in place of the datasheet's: {roofs}.", markup=False)
    else:
        console.print(f"Stored in {stored_at} as '{result.key}' (CPU entry, never used as a GPU roof).", markup=False)


def list_store(path: Path, console: Console, as_json: bool) -> None:
    entries = load_store(path)
    if as_json:
        print_json({"store": str(path), "entries": [msgspec.to_builtins(e) | {"key": e.key, "roofs": e.roofs()}
                                                    for e in entries.values()]})
        return
    if not entries:
        console.print(f"No calibrations in {path}; run `diagnoser calibrate` on the GPU's host.", markup=False)
        return
    table = Table("entry", "measured", "memory B/W", "bf16", "fp8", "note", box=None, show_header=True)
    for e in entries.values():
        bw = max((e.measurements[n].value for n in ("mem_copy_bytes_per_s", "mem_read_bytes_per_s")
                  if n in e.measurements), default=None)
        flops = {p: e.measurements.get(f"{p}_flops") for p in ("bf16", "fp8")}
        note = "CPU: not a GPU roof" if e.device_kind != "cuda" else ("forced" if e.forced else "")
        table.add_row(e.key, time.strftime("%Y-%m-%d %H:%M", time.localtime(e.measured_at)), fmt(bw, "B/s"),
                      fmt(flops["bf16"].value if flops["bf16"] else None, "FLOP/s"),
                      fmt(flops["fp8"].value if flops["fp8"] else None, "FLOP/s"), note)
    console.print(f"Calibrations in {path}:", markup=False)
    console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    @handles_errors
    def calibrate_cmd(
        device: str = typer.Option("cuda", "--device", help="cuda (the GPU) or cpu (the same benchmarks on the CPU, "
                                   "to test the harness; stored as CPU, never used as GPU roofs)."),
        gpu: int = typer.Option(0, "--gpu", help="CUDA device index to calibrate."),
        budget: float = typer.Option(45.0, "--budget", help="Seconds the benchmarks may take in all (about)."),
        store: Path | None = typer.Option(None, "--store", help="Calibration store file (default: "
                                          "$XDG_DATA_HOME/diagnoser/calibration.json)."),
        force: bool = typer.Option(False, "--force", help="Calibrate even if another process uses the GPU (the "
                                   "results are marked forced)."),
        no_save: bool = typer.Option(False, "--no-save", help="Measure and print, but do not store."),
        list_only: bool = typer.Option(False, "--list", help="Show the stored calibrations and exit."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Measure this GPU's memory bandwidth, matmul throughput per precision, launch overhead and host-to-device
        bandwidth; store them so diagnoses use measured roofs instead of the datasheet's."""
        path = store or default_store_path()
        console = Console(file=sys.stdout, width=120, no_color=not sys.stdout.isatty(), highlight=False)
        if list_only:
            list_store(path, console, as_json)
            return
        device = device.strip().lower()
        if device not in ("cuda", "cpu"):
            raise InputError(f"--device must be cuda or cpu, not '{device}'.")
        if not 0 < budget <= MAX_BUDGET_S:
            raise InputError(f"--budget must be more than 0 and at most {MAX_BUDGET_S:.0f} seconds, not {budget}.")
        if gpu < 0:
            raise InputError(f"--gpu must be a CUDA device index (0 or more), not {gpu}.")
        if not no_save:
            load_store(path)  # a damaged store is reported before a minute of benchmarks, not after
        from diagnoser.calibration.bench import calibrate

        info, forced = None, ""
        if device == "cuda":
            from diagnoser.calibration.gpu_check import check_gpu

            check = check_gpu(gpu, force=force)  # before this process opens a CUDA context
            info, forced = check.gpu, check.forced
        err = Console(file=sys.stderr, no_color=True, highlight=False)
        progress = None if as_json else (lambda msg: err.print(f"  measuring {msg} ...", markup=False))
        result = calibrate(device, index=gpu, budget_s=budget, gpu=info, forced=forced, progress=progress)
        stored_at = None if no_save else save_result(result, path)
        if as_json:
            print_json(msgspec.to_builtins(result) | {"key": result.key, "roofs": result.roofs(),
                                                      "stored_at": str(stored_at) if stored_at else None})
            return
        render(result, console, stored_at)
