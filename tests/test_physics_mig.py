"""Issue 46, item 5: a MIG slice's roofs are its parent GPU's scaled by the slice's share of the SMs and of the
memory slices, as NVIDIA's Multi-Instance GPU User Guide tabulates them ("Supported MIG Profiles": A30 1g.6gb 1/4
of the SMs and 1/4 of the memory; H100 1g.10gb 1/7 and 1/8, 3g.40gb 3/7 and 4/8); the A30 has a row of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from diagnoser.cli import theory
from diagnoser.collectors.dcgm import drop_mig_parents, gpu_info, parse_exporter_text
from diagnoser.physics import GPUS, get_gpu, match_gpu

GIB = 1024**3


@pytest.mark.parametrize(
    ("name", "parent", "compute", "memory"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100-sxm", 1 / 7, 1 / 8),
        ("NVIDIA H100 80GB HBM3 MIG 1g.20gb", "h100-sxm", 1 / 7, 2 / 8),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "h100-sxm", 3 / 7, 4 / 8),
        ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", "h100-sxm", 1.0, 1.0),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "a100-40gb-sxm", 1 / 7, 1 / 8),
        ("NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb", "a100-80gb-sxm", 1 / 7, 4 / 8),  # a compute instance in a 3g
        ("NVIDIA H200 MIG 1g.18gb", "h200", 1 / 7, 1 / 8),
        ("NVIDIA H100 NVL MIG 3g.47gb", "h100-nvl", 3 / 7, 4 / 8),
        ("NVIDIA A30 MIG 1g.6gb", "a30", 1 / 4, 1 / 4),
        ("NVIDIA A30 MIG 2g.12gb+me", "a30", 2 / 4, 2 / 4),
    ],
)
def test_a_slice_has_its_share_of_the_roofs(name: str, parent: str, compute: float, memory: float) -> None:
    whole = GPUS[parent]
    spec = match_gpu(name, 10 * GIB)
    assert spec is not None and spec.key.startswith(f"{parent}-mig-")
    assert spec.flops["bf16"] == pytest.approx(whole.flops["bf16"] * compute)
    assert spec.hbm_bytes_per_s == pytest.approx(whole.hbm_bytes_per_s * memory)
    assert spec.memory_bytes == pytest.approx(whole.memory_bytes * memory, rel=1e-9)
    assert spec.nvlink_bytes_per_s is None  # no peer-to-peer between MIG instances
    assert "Multi-Instance GPU User Guide" in spec.source


def test_the_h100_smallest_slice_is_no_longer_the_whole_gpu() -> None:
    # Before: the 1g.10gb slice carried the H100's 3.35 TB/s and 989 TFLOP/s, 8x and 7x what it has.
    spec = match_gpu("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert spec is not None
    assert spec.hbm_bytes_per_s == pytest.approx(3.35e12 / 8) and spec.flops["bf16"] == pytest.approx(989.4e12 / 7)
    assert spec.memory_bytes == 10 * GIB


def test_a30_is_in_the_table_and_refuses_profiles_it_has_not() -> None:
    a30 = match_gpu("NVIDIA A30")
    assert a30 is not None and a30.key == "a30"
    assert (a30.memory_bytes, a30.hbm_bytes_per_s, a30.flops["fp16"]) == (24 * GIB, 933e9, 165e12)
    assert match_gpu("NVIDIA A30 MIG 7g.80gb") is None  # an H100's profile: no such slice on an A30
    assert match_gpu("NVIDIA L40S MIG 1g.12gb") is None  # no MIG on an L40S
    assert get_gpu("a30").key == "a30"


@pytest.mark.parametrize(
    ("page", "key"),
    [("h100_mig_1g10gb_k8s_excerpt.prom", "h100-sxm-mig-1g.10gb"),
     ("rtx2000ada_a30mig_lowercase_hostname_excerpt.prom", "a30-mig-1g.6gb")],
)
def test_real_exporter_pages_of_slices(page: str, key: str) -> None:
    # The names the collector makes of real dcgm-exporter pages: before, the H100 slice had the whole H100's roofs
    # and the A30 slice was "not in the physics table".
    scrape = parse_exporter_text((Path(__file__).parent / "fixtures" / "dcgm" / page).read_text(), at=1.7e9)
    names = [gpu_info(g).name for g in drop_mig_parents(scrape.gpus.values()) if g.mig_profile]
    specs = [match_gpu(name) for name in names]
    assert specs and all(spec is not None and spec.key == key for spec in specs), names


def test_theory_on_a_slice_prints_the_slice() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    result = CliRunner().invoke(app, ["theory", "--model", "llama-3.1-8b", "--gpu", "H100 MIG 1g.10gb", "--dtype",
                                      "fp8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu"]["key"] == "h100-sxm-mig-1g.10gb"
    assert data["gpu"]["hbm_bytes_per_s"] == pytest.approx(3.35e12 / 8)
    # 9.1 GB of fp8 weights at 419 GB/s: about 20 ms a step, where the whole H100 promised 2.5 ms
    assert data["decode"]["ceiling_tokens_per_s"] < 60


def test_a_slice_keeps_the_boards_power() -> None:
    # NVML reads a MIG instance's power and power limit as the whole board's: THR001 compares them with this TDP.
    spec = match_gpu("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert spec is not None and spec.tdp_w == GPUS["h100-sxm"].tdp_w
