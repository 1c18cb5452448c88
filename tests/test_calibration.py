"""`diagnoser calibrate`: the micro-benchmarks on the CPU, the store round trip, measured roofs reaching the
diagnosis, and the refusal to calibrate a busy GPU (NVML through the fake seam: no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest
from typer.testing import CliRunner

from diagnoser import physics
from diagnoser.calibration.gpu_check import check_gpu, driver_from_proc, nvml_handle, power_capped
from diagnoser.calibration.store import (
    CalibrationResult,
    Measurement,
    find,
    load_store,
    lookup,
    save_result,
    store_key,
)
from diagnoser.cli.app import app
from diagnoser.collectors import nvml_seam
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import diagnose
from tests.factories import H100, llama_7b, make_capture
from tests.fake_nvml import FakeGpu, FakeNvml, FakeProcess

runner = CliRunner()
DRIVER = "550.54.15"
TB, T = 1e12, 1e12


def h100_result(driver: str = DRIVER, copy_bw: float = 2.6 * TB, read_bw: float = 3.0 * TB) -> CalibrationResult:
    m = {
        "mem_copy_bytes_per_s": Measurement(value=copy_bw, unit="B/s", how="copy"),
        "mem_read_bytes_per_s": Measurement(value=read_bw, unit="B/s", how="sum"),
        "bf16_flops": Measurement(value=700 * T, unit="FLOP/s", how="mm"),
        "fp8_flops": Measurement(value=1300 * T, unit="FLOP/s", how="_scaled_mm"),
        "launch_overhead_s": Measurement(value=4e-6, unit="s", how="add_"),
        "h2d_pinned_bytes_per_s": Measurement(value=50e9, unit="B/s", how="pinned"),
    }
    return CalibrationResult(device_kind="cuda", device_name=H100, driver=driver, cuda_capability="9.0",
                             memory_total_bytes=80 * 2**30, measurements=m, measured_at=1.7e9, budget_s=45)


class Fake(FakeNvml):
    """The shared fake plus the two calls only calibrate makes (power default limit, handle by UUID)."""

    def __init__(self, gpus: list[FakeGpu], *, default_limit_mw: int = 700_000, **kw: object) -> None:
        super().__init__(gpus, **kw)  # type: ignore[arg-type]
        self.default_limit_mw = default_limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: object) -> int:
        self._enter("nvmlDeviceGetPowerManagementDefaultLimit", handle)  # type: ignore[arg-type]
        return self.default_limit_mw

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:
        self._enter("nvmlDeviceGetHandleByUUID")
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return self.nvmlDeviceGetHandleByIndex(i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


# --- the store -------------------------------------------------------------------------------------------------

def test_store_round_trip_keyed_by_gpu_and_driver(tmp_path):
    store = tmp_path / "cal.json"
    save_result(h100_result(), store)
    roofs = lookup(H100, DRIVER, store)
    # The better of copy and streaming read is the bandwidth roof; FLOP/s keys are what physics.with_measured reads.
    assert roofs == {"hbm_bytes_per_s": 3.0 * TB, "bf16_flops": 700 * T, "fp8_flops": 1300 * T}
    assert lookup(H100, "560.28.03", store) is None  # another driver: its own entry, none yet
    assert lookup("NVIDIA A100-SXM4-80GB", DRIVER, store) is None

    save_result(h100_result(driver="560.28.03", read_bw=3.1 * TB), store)
    save_result(h100_result(read_bw=2.9 * TB), store)  # same GPU and driver again: replaces
    entries = load_store(store)
    assert sorted(entries) == sorted([store_key(H100, DRIVER), store_key(H100, "560.28.03")])
    assert lookup(H100, DRIVER, store)["hbm_bytes_per_s"] == 2.9 * TB
    assert lookup(H100, "560.28.03", store)["hbm_bytes_per_s"] == 3.1 * TB
    back = find(H100, DRIVER, store)
    assert back is not None and back.measurements["launch_overhead_s"].value == 4e-6
    assert json.loads(store.read_text())["format"] == "diagnoser-calibration"
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]  # the atomic write leaves no temporary file


def test_cpu_entries_are_never_gpu_roofs(tmp_path):
    store = tmp_path / "cal.json"
    cpu = CalibrationResult(device_kind="cpu", device_name=H100, driver=DRIVER,
                            measurements={"mem_read_bytes_per_s": Measurement(value=30e9, unit="B/s")})
    save_result(cpu, store)
    assert cpu.roofs() == {}
    assert lookup(H100, DRIVER, store) is None  # even under the very name and driver of a GPU
    assert store_key(H100, DRIVER, "cpu").startswith("cpu:")


def test_damaged_store(tmp_path):
    store = tmp_path / "cal.json"
    store.write_text('{"format": "diagnoser-calibration", "version": 1, "entries": [')
    assert lookup(H100, DRIVER, store) is None  # collectors never fail on it
    with pytest.raises(InputError, match="damaged"):
        load_store(store)
    result = runner.invoke(app, ["calibrate", "--list", "--store", str(store)])
    assert result.exit_code == 2 and "damaged" in result.output and "Traceback" not in result.output
    # Refused before a minute of benchmarks, not after.
    result = runner.invoke(app, ["calibrate", "--device", "cpu", "--store", str(store)])
    assert result.exit_code == 2 and "damaged" in result.output
    store.write_text('{"format": "something-else", "version": 1, "entries": []}')
    with pytest.raises(InputError, match="not a diagnoser calibration store"):
        load_store(store)


def test_measured_roofs_replace_the_datasheet_in_the_diagnosis(tmp_path):
    store = tmp_path / "cal.json"
    save_result(h100_result(), store)
    signals = {"gpu.busy": 0.97, "gpu.dram_active": 0.7, "gpu.tensor_active": 0.1, "server.running": 1.0,
               "server.waiting": 0.0, "server.gen_tokens_per_s": 150.0}
    spec_capture = make_capture(signals, model=llama_7b())
    measured_capture = make_capture(signals, model=llama_7b())
    measured_capture.gpus[0].measured = lookup(H100, DRIVER, store)

    assert diagnose(spec_capture).context["roofs"] == "spec sheet"
    assert diagnose(measured_capture).context["roofs"] == "measured (diagnoser calibrate)"
    # At batch 1 and no context the decode ceiling is weight bytes over bandwidth: it scales with the measured roof.
    before = build_evidence(spec_capture)["theory.decode_ceiling_tokens_per_s"].values[0]
    after = build_evidence(measured_capture)["theory.decode_ceiling_tokens_per_s"].values[0]
    assert after / before == pytest.approx(3.0 * TB / physics.get_gpu("h100-sxm").hbm_bytes_per_s)


# --- the benchmarks, on the CPU ----------------------------------------------------------------------------------

def test_cpu_calibration_end_to_end(tmp_path):
    import torch

    torch.set_num_threads(1)
    store = tmp_path / "cal.json"
    result = runner.invoke(app, ["calibrate", "--device", "cpu", "--budget", "3", "--store", str(store), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["device_kind"] == "cpu" and doc["roofs"] == {}
    measured = doc["measurements"]
    for name in ("mem_copy_bytes_per_s", "mem_read_bytes_per_s", "fp32_flops", "bf16_flops", "launch_overhead_s"):
        assert measured[name]["value"] > 0, name
    # A tiny op costs microseconds to dispatch, not milliseconds: the number is per op, not per trial.
    assert measured["launch_overhead_s"]["value"] < 1e-3
    assert "tf32_flops" in doc["skipped"] and "h2d_pinned_bytes_per_s" in doc["skipped"]
    entries = load_store(store)
    assert list(entries) == [doc["key"]] and doc["key"].startswith("cpu:")
    assert lookup(doc["device_name"], "", store) is None

    listing = runner.invoke(app, ["calibrate", "--list", "--store", str(store)])
    assert listing.exit_code == 0 and "CPU: not a GPU roof" in listing.output
    shown = runner.invoke(app, ["calibrate", "--device", "cpu", "--budget", "2", "--no-save",
                                "--store", str(tmp_path / "other.json")])
    assert shown.exit_code == 0, shown.output
    assert "never used as GPU roofs" in shown.output and "Not stored" in shown.output
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "--device must be cuda or cpu"),
    (["--device", "cpu", "--budget", "0"], "--budget must be more than 0"),
    (["--device", "cpu", "--budget", "9999"], "at most 600"),
    (["--gpu", "-1"], "--gpu must be a CUDA device index"),
])
def test_bad_options(args, message, tmp_path):
    result = runner.invoke(app, ["calibrate", *args, "--store", str(tmp_path / "s.json")])
    assert result.exit_code == 2 and message in result.output


# --- the busy-GPU check, through the NVML seam ------------------------------------------------------------------

def test_refuses_a_gpu_another_process_uses():
    fake = Fake([FakeGpu(processes=[FakeProcess(pid=4242, used_bytes=40 * 2**30)], util_gpu=0)])
    with nvml_seam.use(fake):
        with pytest.raises(SourceUnavailable, match=r"busy with pid 4242 .*40\.0 GiB.*--force"):
            check_gpu(0)
        forced = check_gpu(0, force=True)
    assert forced.gpu is not None and forced.gpu.name == H100 and forced.gpu.driver == DRIVER
    assert "pid 4242" in forced.forced and forced.busy_with
    assert fake.initialised == 0  # NVML shut down again either way


def test_busy_utilisation_without_a_listed_process_is_refused():
    with nvml_seam.use(Fake([FakeGpu(util_gpu=60)])):
        with pytest.raises(SourceUnavailable, match="60% utilisation from processes NVML does not list"):
            check_gpu(0)


def test_idle_gpu_passes_and_own_process_does_not_count():
    import os

    with nvml_seam.use(Fake([FakeGpu(util_gpu=0, processes=[FakeProcess(pid=os.getpid())])])):
        check = check_gpu(0)
    assert check.forced == "" and check.gpu is not None and check.gpu.name == H100


def test_without_nvml_the_check_is_refused_unless_forced():
    with nvml_seam.use(Fake([], init_error=pynvml.NVML_ERROR_NO_PERMISSION)):
        with pytest.raises(SourceUnavailable, match="cannot check that GPU 0 is idle.*--force"):
            check_gpu(0)
        assert "not checked" in check_gpu(0, force=True).forced


def test_without_a_driver_there_is_nothing_to_force():
    # No NVIDIA driver at all: --force would only lead to a second refusal, so the first sentence says so.
    with nvml_seam.use(Fake([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        for force in (False, True):
            with pytest.raises(SourceUnavailable, match="needs an NVIDIA GPU and there is none here.*--device cpu"):
                check_gpu(0, force=force)


def test_cli_refuses_busy_gpu_before_touching_cuda(tmp_path):
    store = ["--store", str(tmp_path / "s.json")]
    with nvml_seam.use(Fake([FakeGpu(processes=[FakeProcess(pid=4242)], util_gpu=0)])):
        busy = runner.invoke(app, ["calibrate", *store])
        forced = runner.invoke(app, ["calibrate", "--force", *store])
    assert busy.exit_code == 3 and "is busy with pid 4242" in busy.output and "Traceback" not in busy.output
    # Forced past the check, this CPU-only machine then has no CUDA device: one sentence, exit 3.
    assert forced.exit_code == 3 and "needs a CUDA GPU" in forced.output
    assert not (tmp_path / "s.json").exists()


def test_cuda_visible_devices_maps_to_nvml(monkeypatch):
    fake = Fake([FakeGpu(uuid="GPU-aaa"), FakeGpu(uuid="GPU-bbb"), FakeGpu(uuid="GPU-ccc")])
    fake.nvmlInit()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert nvml_handle(fake, 0)[0] == 2 and nvml_handle(fake, 1)[0] == 0
    with pytest.raises(SourceUnavailable, match="not among CUDA_VISIBLE_DEVICES"):
        nvml_handle(fake, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbb")
    assert nvml_handle(fake, 0)[1].index == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_handle(fake, 1)[0] == 1


def test_power_cap_detection():
    with nvml_seam.use(Fake([FakeGpu(limit_mw=400_000)], default_limit_mw=700_000)):
        capped, why = power_capped(0)
    assert capped and "400 W" in why and "700 W" in why
    with nvml_seam.use(Fake([FakeGpu(limit_mw=700_000)], default_limit_mw=700_000)):
        capped, why = power_capped(0)
    assert not capped and "nvidia-smi -pl" in why


def test_driver_version_from_the_kernel_module_banner(tmp_path):
    banner = tmp_path / "version"
    banner.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                      "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert driver_from_proc(str(banner)) == "550.54.15"
    assert driver_from_proc(str(tmp_path / "absent")) == ""


def test_default_store_follows_xdg(monkeypatch, tmp_path):
    from diagnoser.calibration.store import default_store_path

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_store_path() == Path(tmp_path) / "diagnoser" / "calibration.json"


def test_attach_collector_fills_measured_roofs_from_the_default_store(monkeypatch, tmp_path):
    from diagnoser.collectors.nvml import gpu_info

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    fake = Fake([FakeGpu()])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert gpu_info(fake, 0, handle).measured == {}  # nothing calibrated: datasheet roofs
    save_result(h100_result())  # the default store, under XDG_DATA_HOME
    assert gpu_info(fake, 0, handle).measured == lookup(H100, DRIVER)
    fake.driver = "560.28.03"  # after a driver update the old calibration no longer applies
    assert gpu_info(fake, 0, handle).measured == {}
