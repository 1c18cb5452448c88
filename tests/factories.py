"""Build captures from explicit counter values, as a collector would have recorded them."""

from __future__ import annotations

import msgspec

from diagnoser.capture import Capture, GpuInfo, ModelInfo, Series, ServingConfig, TraceSummary, new_capture

H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES = 80 * 1024**3

SOURCE_OF = {"gpu": "gpm", "proc": "nvml", "host": "psutil", "server": "server"}
UNIT_OF_PREFIX = {"bytes": "bytes", "_w": "W", "_s": "s"}


def make_capture(
    signals: dict[str, float | list[float]],
    *,
    n: int = 30,
    interval: float = 0.5,
    gpu: str | None = H100,
    gpu_bytes: int | None = H100_BYTES,
    model: ModelInfo | None = None,
    trace: TraceSummary | None = None,
    serving: dict | None = None,
    target: str = "test target",
) -> Capture:
    """Each signal becomes a series of n samples (a scalar repeats; a list is used as is)."""
    cap = new_capture(target, started_at=1_700_000_000.0, duration_s=n * interval)
    if gpu is not None:
        cap.gpus.append(GpuInfo(index=0, name=gpu, memory_total_bytes=gpu_bytes, driver="550.54.15"))
    for name, value in signals.items():
        values = [float(v) for v in value] if isinstance(value, list) else [float(value)] * n
        source = "nvml" if name in ("gpu.busy", "gpu.mem_used_bytes", "gpu.sm_clock_frac") else \
            SOURCE_OF.get(name.split(".")[0], "user")
        cap.series.append(Series(name=name, unit=_unit(name), source=source,
                                 times=[i * interval for i in range(len(values))], values=values,
                                 labels={"gpu": "0"} if name.startswith("gpu.") else {}))
    cap.model = model
    cap.trace = trace
    cap.serving = msgspec.convert(serving or {}, ServingConfig)
    return cap


def _unit(name: str) -> str:
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_w"):
        return "W"
    if name.endswith("_s"):
        return "s"
    if name.endswith("_per_s"):
        return "1/s"
    return "ratio"


def llama_7b() -> ModelInfo:
    """Llama-2-7b's shape (public config.json values)."""
    return ModelInfo(name="llama-2-7b", params=6.74e9, active_params=6.74e9, layers=32, hidden=4096, heads=32,
                     kv_heads=32, head_dim=128, vocab=32000, dtype="bf16")
