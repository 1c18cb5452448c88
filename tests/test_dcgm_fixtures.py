"""Real dcgm-exporter scrapes (tests/fixtures/dcgm, see SOURCES.md there) parsed into GPUs, MIG instances, pods and
signals, and diagnosed through the normal engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnoser.capture import new_capture
from diagnoser.collectors.dcgm import (
    GpuSelector,
    GpuWindow,
    add_gpu_window,
    drop_mig_parents,
    gpu_info,
    mark_missing,
    parse_exporter_text,
    select_gpus,
)
from diagnoser.errors import InputError
from diagnoser.physics import match_gpu
from diagnoser.rules import diagnose

DCGM = Path(__file__).resolve().parent / "fixtures" / "dcgm"


def scrape(name: str):  # type: ignore[no-untyped-def]
    return parse_exporter_text((DCGM / name).read_text(), at=1_700_000_000.0)


def window_of(s, key) -> GpuWindow:  # type: ignore[no-untyped-def]
    """The scrape as a one-sample window of one GPU."""
    gw = GpuWindow(s.gpus[key])
    for field_key, value in s.values[key].items():
        from diagnoser.collectors.dcgm import FIELDS_BY_KEY

        gw.add(field_key, 0.0, value * FIELDS_BY_KEY[field_key].scale)
    return gw


def test_t4_gke_scrape_gives_two_gpus_with_pod_labels_and_prof_signals() -> None:
    s = scrape("t4x2_gke_k8s_prof.prom")
    assert len(s.gpus) == 2
    by_index = {g.index: g for g in s.gpus.values()}
    gpu0, gpu1 = by_index[0], by_index[1]
    assert gpu0.uuid == "GPU-84412445-5790-0b3f-f714-da8aa3b2c0b0"
    assert gpu0.model == "Tesla T4"
    assert gpu0.node == "gke-test-dcgm-default-pool-fed1e979-tt7p"  # from the old `Hostname` label
    assert gpu0.pods == [("default", "triton-84d57987c9-kks4k")]
    assert gpu0.containers == ["triton-server"]
    assert gpu1.pods == []  # empty pod="" labels mean no pod
    assert s.values[gpu0.key] == {"sm_active": 0.0, "sm_occupancy": 0.0, "tensor_active": 0.0}
    assert match_gpu(gpu_info(gpu0).name).key == "t4"


def test_t4_scrape_selected_by_pod_is_diagnosed_idle_and_names_what_is_missing() -> None:
    s = scrape("t4x2_gke_k8s_prof.prom")
    (target,) = select_gpus(s.gpus.values(), GpuSelector(pod="default/triton-84d57987c9-kks4k"))
    assert target.index == 0
    cap = new_capture(target.describe(), started_at=1_700_000_000.0, duration_s=1.0)
    produced = add_gpu_window(cap, window_of(s, target.key))
    mark_missing(cap, set(produced), fields_in_source=s.fields_seen)
    assert {"gpu.sm_active", "gpu.sm_occupancy", "gpu.tensor_active"} <= set(produced)
    d = diagnose(cap)
    # SM activity 0 with nothing queued: the engine says idle, from one sample so with reduced confidence.
    assert d.verdict == "idle"
    missing = {u.what: u for u in d.unavailable}
    assert "gpu.dram_active" in missing and "gpu.busy" in missing
    assert "dcgm-counters.csv" in missing["gpu.dram_active"].hint
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" in missing["gpu.busy"].reason


def test_h100_mig_scrape_gives_three_instances_of_one_gpu() -> None:
    s = scrape("h100_mig_1g10gb_k8s_excerpt.prom")
    gpus = drop_mig_parents(s.gpus.values())
    assert sorted(g.mig_id for g in gpus) == ["7", "8", "9"]
    assert {g.uuid for g in gpus} == {"GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77"}
    assert all(g.mig_profile == "1g.10gb" and g.label == f"0/{g.mig_id}" for g in gpus)
    info = gpu_info(next(g for g in gpus if g.mig_id == "7"))
    assert info.mig_mode and info.mig_instance == "7" and info.name.endswith("MIG 1g.10gb")
    assert match_gpu(info.name).key == "h100-sxm-mig-1g.10gb"  # the parent's roofs scaled to the slice
    # A pod picks its own instance; the GPU's UUID alone is ambiguous between instances.
    (tts,) = select_gpus(gpus, GpuSelector(pod="tts-predictor-00011-deployment-5554f75554-8j8pl"))
    assert tts.mig_id == "9" and tts.namespaces == ["model-playground-stg"]
    with pytest.raises(InputError, match="MIG instances"):
        select_gpus(gpus, GpuSelector(uuid="GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77"))
    (eight,) = select_gpus(gpus, GpuSelector(uuid="58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77", mig_instance="8"))
    assert eight.pods == []
    assert s.values[tts.key] == {"gr_engine_active": 0.0}


def test_h100_mig_instance_busy_comes_from_gr_engine_active() -> None:
    s = scrape("h100_mig_1g10gb_k8s_excerpt.prom")
    key = ("GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77", "9")
    cap = new_capture("mig", started_at=1_700_000_000.0)
    produced = add_gpu_window(cap, window_of(s, key))
    assert produced == ["gpu.busy"]
    (busy,) = cap.series_named("gpu.busy")
    assert busy.values == [0.0] and busy.source == "dcgm" and busy.labels["gpu"] == "0/9"


def test_lowercase_hostname_scrape_with_a30_mig_and_new_help_texts() -> None:
    s = scrape("rtx2000ada_a30mig_lowercase_hostname_excerpt.prom")
    gpus = {g.index: g for g in s.gpus.values()}
    ada, a30 = gpus[1], gpus[2]
    assert ada.node == a30.node == "dcgm-exporter-wwwjh"  # the new lowercase `hostname` label
    assert ada.model == "NVIDIA RTX 2000 Ada Generation" and ada.mig_id == ""
    assert a30.mig_id == "3" and a30.mig_profile == "1g.6gb"
    assert a30.pods == [("default", "triton-server-f7cb5d77-95xcf")] and a30.containers == ["triton-server"]
    # Fields diagnoser does not use are seen but not mapped; FB_FREE is, in MiB.
    assert {"DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_FB_FREE"} <= s.metric_names
    assert s.values[ada.key] == {"fb_free": 11275.0}
    assert s.values[a30.key] == {"fb_free": 2207.0}
    (picked,) = select_gpus(s.gpus.values(), GpuSelector(pod="triton-server"))  # a unique pod-name prefix
    assert picked.key == a30.key
    (by_node,) = select_gpus(s.gpus.values(), GpuSelector(node="dcgm-exporter-wwwjh", gpu=1))
    assert by_node.key == ada.key


def test_t4_page_without_the_sm_clock_blames_the_counters_file_not_the_gpu() -> None:
    """The T4 page holds three profiling fields only: the SM clock, which the default counters file exports and a T4
    reports, is missing because this exporter's counters file leaves it out, not because of the GPU."""
    s = scrape("t4x2_gke_k8s_prof.prom")
    gpu = next(g for g in s.gpus.values() if g.index == 0)
    cap = new_capture(gpu.describe(), started_at=1_700_000_000.0, duration_s=1.0)
    mark_missing(cap, set(add_gpu_window(cap, window_of(s, gpu.key))), fields_in_source=s.fields_seen)
    clock = next(u for u in cap.unavailable if u.what == "gpu.sm_clock_frac")
    assert "counters file" in clock.reason and "for this GPU" not in clock.reason, clock.reason
    assert "DCGM_FI_DEV_SM_CLOCK" in clock.hint, clock.hint
