"""Issue 44, item 10: each interconnect's collectives are timed at its own latency: Infinity Fabric on AMD's
Instinct parts (8 µs, the engines' custom all-reduce over an 8-GPU xGMI mesh: 5 µs for a fused kernel on MI300X,
6.3-6.7 µs for vLLM's on MI355X), NVLink's 5 µs only on NVLink, PCIe's 10 µs where there is no NVLink."""

from __future__ import annotations

import dataclasses

import pytest

from diagnoser.physics import decode_comm_s, get_gpu, interconnect, load_bundled_model
from diagnoser.physics.parallel import INFINITY_FABRIC_LATENCY_S, NVLINK_LATENCY_S, PCIE_LATENCY_S


@pytest.mark.parametrize(
    ("gpu", "name", "latency"),
    [
        ("mi300x", "Infinity Fabric", INFINITY_FABRIC_LATENCY_S),
        ("mi250x", "Infinity Fabric", INFINITY_FABRIC_LATENCY_S),
        ("h100-sxm", "NVLink 4", NVLINK_LATENCY_S),
        ("a100-80gb-sxm", "NVLink 3", NVLINK_LATENCY_S),
        ("l40s", "PCIe Gen4", PCIE_LATENCY_S),
        ("rtx-4090", "PCIe Gen4", PCIE_LATENCY_S),
    ],
)
def test_each_link_has_its_own_latency(gpu: str, name: str, latency: float) -> None:
    link = interconnect(get_gpu(gpu), 8)
    assert link.name == name and link.latency_s == latency


def test_mi300x_collectives_are_not_timed_at_nvlink_latency() -> None:
    # Llama-3.1-70B at tp 8, batch 1: 2 x 80 all-reduces and one logits gather a step, each 3 µs longer than
    # NVLink's, so 0.48 ms more a step than timed before.
    model, mi300x = load_bundled_model("llama-3.1-70b"), get_gpu("mi300x")
    link = interconnect(mi300x, 8)
    as_nvlink = dataclasses.replace(link, latency_s=NVLINK_LATENCY_S)
    now = decode_comm_s(model, mi300x, 1, tp=8)
    before = decode_comm_s(model, mi300x, 1, tp=8, link=as_nvlink)
    assert now - before == pytest.approx(161 * (INFINITY_FABRIC_LATENCY_S - NVLINK_LATENCY_S))
    assert interconnect(mi300x, 8, "pcie").latency_s == PCIE_LATENCY_S  # --interconnect pcie: PCIe's own figure
