"""Where calibrations live: one JSON file of entries keyed by device name and driver.

The default file is $XDG_DATA_HOME/diagnoser/calibration.json (~/.local/share/diagnoser/calibration.json when
XDG_DATA_HOME is unset). Writes are atomic (a temporary file renamed over the old one), so a crash never leaves half
a store. The collectors call `lookup(gpu_name, driver)` to fill GpuInfo.measured; only GPU entries are ever
returned there: a CPU calibration (`diagnoser calibrate --device cpu`) is stored, labelled, and never used as a roof.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from diagnoser.errors import InputError
from diagnoser.fileio import write_atomic

FORMAT_NAME = "diagnoser-calibration"
FORMAT_VERSION = 1

# Measurement name -> the GpuInfo.measured key the physics module reads (physics.with_measured).
FLOPS_MEASUREMENTS = ("fp32_flops", "tf32_flops", "bf16_flops", "fp16_flops", "fp8_flops")
BANDWIDTH_MEASUREMENTS = ("mem_copy_bytes_per_s", "mem_read_bytes_per_s")


class Measurement(msgspec.Struct, kw_only=True):
    """One number a micro-benchmark reached, in `unit`, and how it was obtained."""

    value: float
    unit: str
    how: str = ""


class CalibrationResult(msgspec.Struct, kw_only=True):
    """What `diagnoser calibrate` measured on one device.

    `device_kind` is "cuda" or "cpu"; `forced` says why a GPU calibration ran despite the busy check (empty when the
    GPU was idle), so a reader can discount it.
    """

    device_kind: str
    device_name: str
    driver: str = ""
    cuda_capability: str = ""
    memory_total_bytes: int | None = None
    torch_version: str = ""
    host: str = ""
    measured_at: float = 0.0
    duration_s: float = 0.0
    budget_s: float = 0.0
    measurements: dict[str, Measurement] = msgspec.field(default_factory=dict)
    skipped: dict[str, str] = msgspec.field(default_factory=dict)
    forced: str = ""
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def key(self) -> str:
        return store_key(self.device_name, self.driver, self.device_kind)

    def roofs(self) -> dict[str, float]:
        """The roofs in GpuInfo.measured form ({"hbm_bytes_per_s": ..., "bf16_flops": ...}); empty for a CPU run.

        Device memory bandwidth is the better of the copy and the streaming read: both are reachable, and the
        physics asks what is reachable.
        """
        if self.device_kind != "cuda":
            return {}
        out: dict[str, float] = {}
        bandwidths = [self.measurements[n].value for n in BANDWIDTH_MEASUREMENTS if n in self.measurements]
        if bandwidths:
            out["hbm_bytes_per_s"] = max(bandwidths)
        for name in FLOPS_MEASUREMENTS:
            if name in self.measurements and self.measurements[name].value > 0:
                out[name] = self.measurements[name].value
        return out


class _StoreFile(msgspec.Struct):
    format: str
    version: int
    entries: list[CalibrationResult] = msgspec.field(default_factory=list)


def store_key(device_name: str, driver: str, device_kind: str = "cuda") -> str:
    """GPU entries are per model and driver (a driver update can move the roofs, so it gets its own entry); other
    devices are prefixed with their kind ("cpu:AMD EPYC") so no GPU lookup can ever match them."""
    if device_kind != "cuda":
        return f"{device_kind}:{device_name.strip()}"
    return f"{device_name.strip()} | driver {driver.strip() or 'unknown'}"


def default_store_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "diagnoser" / "calibration.json"


def load_store(path: str | Path | None = None) -> dict[str, CalibrationResult]:
    """All entries by key; an absent store is empty. A damaged store raises InputError (one sentence)."""
    path = Path(path) if path is not None else default_store_path()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except IsADirectoryError:
        raise InputError(f"the calibration store {path} is a directory, not a file.") from None
    except OSError as exc:
        raise InputError(f"cannot read the calibration store {path}: {exc.strerror or exc}.") from None
    try:
        parsed = msgspec.json.decode(data, type=_StoreFile)
    except (msgspec.DecodeError, UnicodeDecodeError, msgspec.ValidationError) as exc:
        raise InputError(f"the calibration store {path} is damaged ({exc}); delete it or pass --store to use "
                         "another file.") from None
    if parsed.format != FORMAT_NAME:
        raise InputError(f"{path} is a '{parsed.format}' file, not a diagnoser calibration store.")
    if parsed.version > FORMAT_VERSION:
        raise InputError(f"the calibration store {path} has format version {parsed.version}, newer than this "
                         f"diagnoser reads (up to {FORMAT_VERSION}).")
    return {entry.key: entry for entry in parsed.entries}


def save_result(result: CalibrationResult, path: str | Path | None = None) -> Path:
    """Add or replace the entry for the result's device and driver; other entries are kept."""
    path = Path(path) if path is not None else default_store_path()
    entries = load_store(path)
    entries[result.key] = result
    body = msgspec.json.format(
        msgspec.json.encode(_StoreFile(FORMAT_NAME, FORMAT_VERSION, sorted(entries.values(), key=lambda e: e.key))),
        indent=2,
    )
    try:
        write_atomic(path, body + b"\n")
    except OSError as exc:
        raise InputError(f"cannot write the calibration store {path}: {exc.strerror or exc}.") from None
    return path


def find(device_name: str, driver: str, path: str | Path | None = None) -> CalibrationResult | None:
    """The stored GPU calibration for this device and driver, or None."""
    return load_store(path).get(store_key(device_name, driver, "cuda"))


def lookup(gpu_name: str, driver: str, path: str | Path | None = None) -> dict[str, float] | None:
    """Measured roofs for a GPU as NVML names it and its driver, in GpuInfo.measured form, or None.

    For collectors: never raises. An absent or unreadable store, or no entry for exactly this GPU and driver, gives
    None, and the physics module keeps its datasheet roofs (`diagnoser calibrate --list` shows a damaged store).
    """
    try:
        entry = find(gpu_name, driver, path)
    except InputError:
        return None
    if entry is None:
        return None
    return entry.roofs() or None
