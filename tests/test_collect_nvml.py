"""The NVML and GPM collectors against the fake pynvml seam (tests/fake_nvml.py), with real target processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest
import typer
from typer.testing import CliRunner

from diagnoser.capture import Capture, new_capture
from diagnoser.cli import doctor as doctor_cli
from diagnoser.cli import gpus as gpus_cli
from diagnoser.collectors import nvml_seam as seam
from diagnoser.collectors.gpm import GpmCollector
from diagnoser.collectors.nvml import NvmlCollector
from diagnoser.collectors.pidmap import PidMapper, read_nspid
from diagnoser.collectors.process import ProcessTree
from diagnoser.collectors.session import Sampler, run_sampler
from diagnoser.evidence_build import build_evidence
from tests.fake_nvml import GIB, FakeGpu, FakeMig, FakeNvml, FakeProcess, hopper_gpm

MIB = 1 << 20


@pytest.fixture
def target():
    """A real process to attach to (it does nothing; NVML's view of it comes from the fake)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def window(fake: FakeNvml, pid: int | None = None, *, duration: float = 1.0, interval: float = 0.1,
           mapper: PidMapper | None = None) -> tuple[Capture, FakeNvml]:
    capture = new_capture("test")
    tree = ProcessTree(pid) if pid is not None else None
    if tree is not None:
        capture.process = tree.info()
    nvml = NvmlCollector(tree, pid_mapper=mapper or PidMapper(host_proc=None))
    sampler = Sampler(capture, [nvml, GpmCollector(nvml)], duration_s=duration, interval_s=interval, tree=tree)
    with seam.use(fake):
        run_sampler(sampler)
    assert fake.initialised == 0, "NVML must be shut down at the end of the window"
    return capture, fake


def values(capture: Capture, name: str, gpu: str = "0") -> list[float]:
    found = [s for s in capture.series if s.name == name and s.labels.get("gpu") == gpu]
    assert len(found) <= 1
    return found[0].values if found else []


def unavailable(capture: Capture, what: str) -> list:
    return [u for u in capture.unavailable if u.what == what]


def test_h100_window_maps_every_reading_to_signals_in_their_units(target):
    gpu = FakeGpu(processes=[FakeProcess(target.pid, 2 * GIB), FakeProcess(999_999_0, 7 * GIB)],
                  process_util={target.pid: 37}, reasons=0x4 | 0x1, gpm=hopper_gpm())
    capture, fake = window(FakeNvml([gpu]), target.pid)

    info = capture.gpus[0]
    assert (info.name, info.memory_total_bytes, info.driver) == ("NVIDIA H100 80GB HBM3", 80 * GIB, "550.54.15")
    assert (info.max_sm_clock_mhz, info.power_limit_w, info.cuda_capability) == (1980, 700, "9.0")
    assert capture.process is not None and capture.process.gpu_indices == [0]
    assert not capture.cpu_only
    n = len(values(capture, "gpu.busy"))
    assert n >= 5
    assert set(values(capture, "gpu.busy")) == {0.5}
    assert set(values(capture, "gpu.mem_busy")) == {0.3}
    assert set(values(capture, "gpu.mem_used_bytes")) == {40 * GIB}
    assert values(capture, "gpu.sm_clock_frac")[0] == pytest.approx(1755 / 1980)
    assert set(values(capture, "gpu.power_w")) == {450.0}
    assert set(values(capture, "gpu.power_limit_w")) == {700.0}
    assert set(values(capture, "gpu.power_default_limit_w")) == {700.0}  # NVML's, not the spec table's
    assert set(values(capture, "gpu.temp_c")) == {60.0}
    assert set(values(capture, "gpu.throttle.power")) == {1.0}
    assert set(values(capture, "gpu.throttle.thermal")) == {0.0}
    assert set(values(capture, "gpu.throttle.other")) == {0.0}  # GpuIdle is not a throttle
    assert any("SwPowerCap 100%" in note and "GpuIdle" in note for note in capture.notes)
    # the target's memory only, not the other process's
    assert set(values(capture, "proc.gpu_mem_bytes")) == {2 * GIB}
    assert set(values(capture, "proc.gpu_busy")) == {0.37}
    # GPM: percents become ratios, MiB/s become B/s; GPM's PCIe replaces NVML's blocking PCIe query
    assert set(values(capture, "gpu.dram_active")) == {0.85}
    assert set(values(capture, "gpu.tensor_active")) == {0.20}
    assert set(values(capture, "gpu.sm_active")) == {0.90}
    assert set(values(capture, "gpu.pcie_tx_bps")) == {100 * MIB}
    assert set(values(capture, "gpu.nvlink_rx_bps")) == {1000 * MIB}
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    assert {s.source for s in capture.series if s.name == "gpu.dram_active"} == {"gpm"}
    assert capture.unavailable == []
    ev = build_evidence(capture)
    assert ev["gpu.dram_active"].mean == pytest.approx(0.85)
    assert ev["gpu.mem_used_frac"].mean == pytest.approx(0.5)


def test_unsupported_and_forbidden_readings_are_marked_unavailable_not_zero(target):
    gpu = FakeGpu(processes=[FakeProcess(target.pid)], gpm=hopper_gpm(),
                  fail={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED,
                        "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_NO_PERMISSION})
    capture, fake = window(FakeNvml([gpu]), target.pid)
    assert values(capture, "gpu.power_w") == [] and values(capture, "gpu.temp_c") == []
    (power,) = unavailable(capture, "gpu.power_w")
    assert "does not support" in power.reason and power.source == "nvml"
    (temp,) = unavailable(capture, "gpu.temp_c")
    assert "refused" in temp.reason and "root" in temp.hint
    # a reading that cannot work is asked for once, not every tick
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert fake.calls["nvmlDeviceGetTemperature"] == 1
    assert len(values(capture, "gpu.busy")) >= 5  # the rest of the GPU is still sampled
    assert "gpu.power_w" not in build_evidence(capture)
    assert build_evidence(capture).why_missing("gpu.power_w").startswith("nvml: ")


def test_no_permission_to_list_processes_samples_all_gpus_and_says_why(target):
    gpus = [FakeGpu(fail={"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION}),
            FakeGpu(uuid="GPU-1", fail={"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION})]
    capture, _ = window(FakeNvml(gpus), target.pid)
    (procs,) = unavailable(capture, "proc.gpu_mem_bytes")
    assert "refused" in procs.reason and "root" in procs.hint
    assert [g.index for g in capture.gpus] == [0, 1]
    assert any("would not list the GPU processes" in note for note in capture.notes)
    assert values(capture, "gpu.busy", "1")


def test_mig_instance_reads_memory_and_activity_of_the_targets_instance(target):
    gpu = FakeGpu(mig=[FakeMig(gpu_instance=3, memory_total=10 * GIB, memory_used=6 * GIB),
                       FakeMig(gpu_instance=5, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", memory_total=40 * GIB)],
                  processes=[FakeProcess(target.pid, 4 * GIB, gpu_instance=3)], gpm=hopper_gpm())
    capture, fake = window(FakeNvml([gpu]), target.pid)
    info = capture.gpus[0]
    assert info.mig_mode and info.mig_instance == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    assert info.memory_total_bytes == 10 * GIB
    assert set(values(capture, "gpu.mem_used_bytes")) == {6 * GIB}
    # NVML has no utilisation on MIG: said so explicitly, and GPM's graphics activity stands in
    (busy,) = unavailable(capture, "gpu.busy")
    assert "MIG" in busy.reason and "GPM" in busy.hint
    assert {s.source for s in capture.series if s.name == "gpu.busy"} == {"gpm"}
    assert set(values(capture, "gpu.busy")) == {0.95}
    assert fake.calls["nvmlGpmMigSampleGet"] >= 2 and fake.calls["nvmlGpmSampleGet"] == 0


def test_gpu_lost_mid_window_keeps_earlier_samples_and_says_when(target):
    gpus = [FakeGpu(processes=[FakeProcess(target.pid)], lose_after=3, gpm=hopper_gpm()),
            FakeGpu(uuid="GPU-1", processes=[FakeProcess(target.pid)], gpm=hopper_gpm())]
    capture, _ = window(FakeNvml(gpus), target.pid, duration=1.2)
    assert len(values(capture, "gpu.busy", "0")) == 3
    assert len(values(capture, "gpu.busy", "1")) >= 6
    lost_at = max(t for s in capture.series if s.name == "gpu.busy" and s.labels["gpu"] == "0" for t in s.times)
    later_gpm = [t for s in capture.series if s.source == "gpm" and s.labels.get("gpu") == "0" for t in s.times
                 if t > lost_at + 0.15]
    assert later_gpm == []  # GPM stops with the GPU
    (lost,) = unavailable(capture, "gpu.*")
    assert "GPU 0" in lost.reason and "was lost" in lost.reason and "Xid 79" in lost.hint
    assert any("was lost" in note for note in capture.notes)
    assert capture.duration_s >= 1.2  # the window went on for the other GPU


def test_target_exiting_mid_window_ends_the_window_and_keeps_the_samples():
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    try:
        gpu = FakeGpu(processes=[FakeProcess(short.pid)], gpm=hopper_gpm())
        capture, _ = window(FakeNvml([gpu]), short.pid, duration=30.0)
    finally:
        short.kill()
        short.wait()
    assert capture.process is not None and capture.process.exited_at_s is not None
    assert capture.duration_s < 30.0
    assert capture.process.exited_at_s == pytest.approx(capture.duration_s, abs=0.5)
    assert len(values(capture, "gpu.busy")) >= 3


def _free_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


def test_pid_namespace_mismatch_without_host_proc_is_explicit(target):
    host_pid = _free_pid()  # what NVML reports for our target when we run inside its container
    gpus = [FakeGpu(processes=[FakeProcess(host_pid, 3 * GIB)]), FakeGpu(uuid="GPU-1")]
    capture, _ = window(FakeNvml(gpus), target.pid)
    (procs,) = unavailable(capture, "proc.gpu_mem_bytes")
    assert str(host_pid) in procs.reason and "PID namespace" in procs.reason
    assert "--pid=host" in procs.hint
    assert values(capture, "proc.gpu_mem_bytes") == []
    assert [g.index for g in capture.gpus] == [0, 1]  # cannot tell which GPU: all are sampled, and that is said
    assert any("PID namespaces differ" in note for note in capture.notes)


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


def _start_in_namespace(marker: str) -> subprocess.Popen:
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                             f"import time  # {marker}\ntime.sleep(120)"])


def _inner(unshare: subprocess.Popen, marker: str) -> int:
    """Host PID of the process inside the namespace (the child of `unshare`), once it runs the marker."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "cmdline").read_text() and read_nspid(Path("/proc"), int(entry.name)):
                        chain = read_nspid(Path("/proc"), int(entry.name))
                        if chain and len(chain) == 2:
                            return int(entry.name)
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError("the process in the new PID namespace never started")


@pytest.mark.skipif(not _unshare_available(), reason="needs unshare --pid (root or CAP_SYS_ADMIN)")
def test_pid_namespace_mapping_through_host_proc_uses_nspid_and_namespace_identity():
    """Two real containers-to-be, each with a process that is PID 1 inside its own namespace. Seen from inside the
    first (its /proc is /proc/<pid>/root/proc), NVML's host PIDs map to PID 1 of that namespace only."""
    ours, other = _start_in_namespace("ns-ours"), _start_in_namespace("ns-other")
    try:
        ours_host, other_host = _inner(ours, "ns-ours"), _inner(other, "ns-other")
        inside = Path(f"/proc/{ours_host}/root/proc")  # the procfs mounted inside our namespace
        assert read_nspid(Path("/proc"), ours_host) == [ours_host, 1]
        assert read_nspid(inside, 1) == [1]  # from inside, the target is PID 1 and the host PID is invisible
        mapping = PidMapper(our_proc=inside, host_proc=Path("/proc")).map({1}, {ours_host, other_host})
        assert mapping.nvml_to_target == {ours_host: 1}, "the other namespace's PID 1 is not ours"
        assert mapping.method.startswith("NSpid") and mapping.problem == ""
        blind = PidMapper(our_proc=inside, host_proc=None).map({1}, {ours_host, other_host})
        assert blind.nvml_to_target == {} and "do not exist in this PID namespace" in blind.problem
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_no_driver_marks_the_capture_cpu_only(target):
    capture, _ = window(FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), target.pid, duration=0.3)
    assert capture.cpu_only and capture.gpus == []
    (gpu,) = unavailable(capture, "gpu.*")
    assert "no NVIDIA driver" in gpu.reason
    assert not [s for s in capture.series if s.name.startswith("gpu.")]


def test_pre_hopper_gpu_has_no_gpm_and_reads_pcie_from_nvml(target):
    gpu = FakeGpu(name="NVIDIA A100-SXM4-80GB", capability=(8, 0), gpm_supported=False,
                  processes=[FakeProcess(target.pid)])
    capture, fake = window(FakeNvml([gpu]), target.pid, duration=1.1)
    (dram,) = unavailable(capture, "gpu.dram_active")
    assert "Hopper" in dram.reason and "DCGM_FI_PROF" in dram.hint
    assert set(values(capture, "gpu.pcie_tx_bps")) == {1000 * 1024}
    assert set(values(capture, "gpu.pcie_rx_bps")) == {2000 * 1024}
    assert fake.calls["nvmlDeviceGetPcieThroughput"] >= 2
    assert values(capture, "gpu.sm_active") == []


def test_xid_events_are_counted_and_named(target):
    gpu = FakeGpu(processes=[FakeProcess(target.pid)], xids=[79], gpm=hopper_gpm())
    capture, _ = window(FakeNvml([gpu]), target.pid, duration=1.1)
    assert max(values(capture, "gpu.xid_errors")) == 1
    assert any(note.startswith("XID 79 on GPU 0") for note in capture.notes)


def test_without_a_target_every_gpu_is_sampled():
    capture, _ = window(FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-1", util_gpu=10)]), None, duration=0.5)
    assert set(values(capture, "gpu.busy", "1")) == {0.1}
    assert [g.index for g in capture.gpus] == [0, 1]


def _app(*modules) -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    for module in modules:
        module.register(app)
    return app


def test_gpus_and_doctor_commands_read_the_fake(target):
    gpu = FakeGpu(processes=[FakeProcess(target.pid, 3 * GIB)])
    old = FakeGpu(name="Tesla T4", uuid="GPU-1", gpm_supported=False, memory_total=16 * GIB, memory_used=1 * GIB)
    runner = CliRunner()
    with seam.use(FakeNvml([gpu, old])):
        result = runner.invoke(_app(gpus_cli), ["gpus", "--json"])
        assert result.exit_code == 0, result.output
        listed = json.loads(result.stdout)
        assert [g["name"] for g in listed] == ["NVIDIA H100 80GB HBM3", "Tesla T4"]
        assert listed[0]["processes"][0]["pid"] == target.pid
        assert listed[0]["processes"][0]["used_bytes"] == 3 * GIB
        assert listed[0]["processes"][0]["user"] != "?"
        table = runner.invoke(_app(gpus_cli), ["gpus"])
        assert table.exit_code == 0 and "Tesla T4" in table.stdout
        checks = runner.invoke(_app(doctor_cli), ["doctor", "--json"])
    assert checks.exit_code == 0, checks.output
    by_source = {c["source"]: c for c in json.loads(checks.stdout)}
    assert by_source["NVML"]["status"] == "ok" and "2 GPU(s)" in by_source["NVML"]["detail"]
    assert by_source["GPM"]["status"] == "limited" and "GPU 1" in by_source["GPM"]["detail"]
    assert by_source["GPU processes"]["status"] == "ok"


def test_gpus_command_without_nvml_is_one_sentence_and_exit_3():
    runner = CliRunner()
    with seam.use(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)):
        result = runner.invoke(_app(gpus_cli), ["gpus"])
    assert result.exit_code == 3
    assert result.stderr.strip().count("\n") == 0
    assert "no GPU visible: the NVIDIA driver is not loaded" in result.stderr


def test_seam_is_the_only_importer_of_pynvml_among_the_collectors():
    root = Path(__file__).resolve().parents[1] / "diagnoser" / "collectors"
    importers = [p.name for p in root.glob("*.py")
                 if any(line.strip().startswith(("import pynvml", "from pynvml"))
                        for line in p.read_text().splitlines())]
    assert importers == ["nvml_seam.py"], importers


def test_a_power_cap_at_the_board_default_is_not_a_fix_and_a_lowered_one_is(target):
    """Issue: "Restore full clocks +11 %" was offered where the power cap is the board's default."""
    from diagnoser.diagnosis import FixKind
    from diagnoser.rules import diagnose

    def verdict(limit_mw: int):  # type: ignore[no-untyped-def]
        gpu = FakeGpu(reasons=0x4, sm_clock=1400, util_gpu=95, limit_mw=limit_mw, default_limit_mw=700_000,
                      power_mw=limit_mw - 2000)
        capture, _ = window(FakeNvml([gpu]), target.pid)
        return diagnose(capture)

    default = verdict(700_000)
    thr = next(f for f in default.findings if f.code == "THR001")
    assert "default power cap" in thr.message and FixKind.POWER_COOLING not in {f.kind for f in default.fixes}
    lowered = verdict(450_000)
    fix = next(f for f in lowered.fixes if f.kind is FixKind.POWER_COOLING)
    assert fix.title == "Restore the default power limit" and "450 W" in fix.action and fix.is_upper_bound


def test_the_hw_power_brake_points_at_the_node_not_the_power_limit(target):
    """Clock event bit 0x80 (HwPowerBrakeSlowdown) is asserted by the power supply or the BMC: a GPU braked at 410 W of
    its 700 W default limit is throttled, and the fix is the node's power, not the GPU's limit."""
    from diagnoser.diagnosis import FixKind
    from diagnoser.rules import diagnose

    gpu = FakeGpu(reasons=0x80, sm_clock=1188, util_gpu=95, limit_mw=700_000, default_limit_mw=700_000,
                  power_mw=410_000)
    capture, _ = window(FakeNvml([gpu]), target.pid)
    assert values(capture, "gpu.throttle.power_brake") and set(values(capture, "gpu.throttle.power_brake")) == {1.0}
    d = diagnose(capture)
    assert d.verdict == "throttling" and "HW power brake" in d.headline, d.headline
    fix = next(f for f in d.fixes if f.kind is FixKind.POWER_COOLING)
    assert fix.title == "Check the node's power supply" and "BMC" in fix.action
