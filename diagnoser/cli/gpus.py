"""`diagnoser gpus`: the GPUs NVML sees, what they are doing now, and the processes on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import SourceUnavailable
from diagnoser.textsafe import one_line
from diagnoser.units import fmt

if TYPE_CHECKING:
    from diagnoser.collectors.nvml import GpuRow


def _process_name(pid: int) -> tuple[str, str]:
    """(name, user) of a PID in this namespace; NVML's PIDs may belong to another namespace (then '?')."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.name(), proc.username()
    except (psutil.Error, KeyError):
        return "?", "?"


def _row_dict(row: GpuRow) -> dict[str, Any]:
    info = row.info
    return {
        "index": info.index, "name": info.name, "uuid": info.uuid, "driver": info.driver,
        "cuda_capability": info.cuda_capability, "memory_total_bytes": info.memory_total_bytes,
        "memory_used_bytes": row.used_bytes, "busy": row.busy, "temp_c": row.temp_c, "power_w": row.power_w,
        "power_limit_w": info.power_limit_w, "mig_mode": info.mig_mode, "spec": info.spec_name,
        "processes": [{"pid": p.pid, "used_bytes": p.used_bytes, "gpu_instance": p.gpu_instance,
                       **dict(zip(("name", "user"), _process_name(p.pid), strict=True))} for p in row.processes],
        "problems": row.problems,
    }


def register(app: typer.Typer) -> None:
    @app.command("gpus")
    @handles_errors
    def gpus_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """List the GPUs and the processes on them."""
        from diagnoser.collectors.nvml import NvmlUnavailable, inventory

        try:
            rows = inventory()
        except NvmlUnavailable as exc:
            hint = f"; {exc.hint}" if exc.hint else ""
            raise SourceUnavailable(f"no GPU visible: {exc.reason}{hint}.") from None
        data = [_row_dict(r) for r in rows]
        if as_json:
            print_json(data)
            return
        # Names come from the driver and from processes: no markup, control characters shown (textsafe.py).
        console = Console(highlight=False, markup=False)
        table = Table("GPU", "name", "memory", "busy", "temp", "power", "processes", box=None)
        for d in data:
            total = d["memory_total_bytes"]
            used = d["memory_used_bytes"]
            memory = f"{fmt(used, 'bytes')} / {fmt(total, 'bytes')}" if used is not None and total else "n/a"
            procs = one_line(", ".join(f"{p['pid']} {p['name']} ({p['user']}) {fmt(p['used_bytes'], 'bytes')}"
                                       for p in d["processes"]) or "-")
            name = one_line(d["name"]) + (" [MIG]" if d["mig_mode"] else "")
            power = fmt(d["power_w"], "W") + (f" / {fmt(d['power_limit_w'], 'W')}" if d["power_limit_w"] else "")
            table.add_row(str(d["index"]), name, memory, fmt(d["busy"], "ratio"), fmt(d["temp_c"], "C"), power, procs)
        console.print(table)
        for d in data:
            for problem in d["problems"]:
                console.print(one_line(f"GPU {d['index']}: could not read {problem}"), markup=False)
