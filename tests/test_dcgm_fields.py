"""The DCGM field table and labels: both field-name sets, both hostname spellings, MIG, Kubernetes labels, target
selection (pod, UUID, node + index, a real process's CUDA_VISIBLE_DEVICES), the counters CSV, window parsing."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import pytest

from diagnoser.collectors.dcgm import (
    COUNTERS_CSV,
    FIELD_OF_NAME,
    FIELDS,
    FIELDS_BY_KEY,
    WANTED_SIGNALS,
    GpuSelector,
    drop_mig_parents,
    identity_from_labels,
    parse_exporter_text,
    select_gpus,
    selector_for_pid,
)
from diagnoser.collectors.prometheus_source import parse_duration, parse_time, resolve_window
from diagnoser.errors import InputError, SourceUnavailable
from tests.prom_harness import SimFleet

T = 1_700_000_100.0


def test_every_field_has_a_unique_legacy_name_and_known_signal() -> None:
    from diagnoser.signals import SPECS

    names = [n for f in FIELDS if not f.bits for n in f.names]
    assert len(names) == len(set(names))
    # The clock event reasons are one metric read as three groups of bits.
    assert {f.names for f in FIELDS if f.bits} == {("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                                                    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")}
    for f in FIELDS:
        assert f.names and f.names[0].startswith("DCGM_FI_")
        assert f.signal is None or f.signal in SPECS, f.signal
        assert f.reduce in ("avg", "rate", "increase", "max", "last")


def test_legacy_and_dcgm46_names_parse_to_the_same_values() -> None:
    legacy = SimFleet(n_gpus=4, names="legacy", start=T - 50)
    renamed = SimFleet(n_gpus=4, names="dcgm46", start=T - 50)
    text_old, text_new = legacy.render(legacy.gpus, T), renamed.render(renamed.gpus, T)
    assert "DCGM_FI_PROF_SM_ACTIVE{" in text_old and "DCGM_FI_PROF_SM_UTIL_RATIO{" in text_new
    assert "DCGM_FI_PROF_SM_ACTIVE{" not in text_new and "DCGM_FI_DEV_BOARD_POWER_WATTS{" in text_new
    old, new = parse_exporter_text(text_old, T), parse_exporter_text(text_new, T)
    assert old.values == new.values
    assert {"gr_engine_active", "sm_active", "tensor_active", "dram_active", "power", "temp", "xid",
            "power_violation"} <= old.fields_seen


def test_both_hostname_spellings_name_the_node() -> None:
    for spelling in ("Hostname", "hostname"):
        fleet = SimFleet(n_gpus=2, host_label=spelling, start=T)
        s = parse_exporter_text(fleet.render(fleet.gpus, T), T)
        assert {g.node for g in s.gpus.values()} == {"node-0000"}
        assert f'{spelling}="node-0000"' in fleet.render(fleet.gpus, T)


def test_units_percent_counters_and_mebibytes() -> None:
    fleet = SimFleet(n_gpus=1, profiles=("throttled",), start=T - 100)
    s = parse_exporter_text(fleet.render(fleet.gpus, T), T)
    (values,) = s.values.values()
    assert values["gpu_util"] * FIELDS_BY_KEY["gpu_util"].scale == pytest.approx(values["gr_engine_active"], abs=0.01)
    assert values["fb_used"] * FIELDS_BY_KEY["fb_used"].scale == values["fb_used"] * 2**20
    # 100 s at 85 % power-capped: 85e9 ns; the collector turns its rate into a fraction with scale 1e-9.
    assert values["power_violation"] == pytest.approx(85e9)
    assert FIELDS_BY_KEY["power_violation"].scale == 1e-9


def test_mig_instances_keep_device_fields_on_the_parent() -> None:
    fleet = SimFleet(n_gpus=3, gpus_per_node=2, mig_nodes=(0,), start=T)
    s = parse_exporter_text(fleet.render(fleet.gpus, T), T)
    keys = set(s.gpus)
    uuid = fleet.gpus[0].uuid
    assert {(uuid, "1"), (uuid, "2"), (uuid, "")} <= keys
    assert "gpu_util" not in s.values[(uuid, "1")] and "power" not in s.values[(uuid, "1")]
    assert "power" in s.values[(uuid, "")]
    targets = drop_mig_parents(s.gpus.values())
    assert (uuid, "") not in {g.key for g in targets} and len(targets) == 3


def test_exported_pod_labels_win_when_prometheus_renamed_them() -> None:
    labels = {"gpu": "0", "UUID": "GPU-1", "Hostname": "n1", "pod": "dcgm-exporter-abc", "namespace": "gpu-operator",
              "exported_pod": "vllm-0", "exported_namespace": "serving"}
    ident = identity_from_labels(labels, exported_pods=True)
    assert ident is not None and ident.pods == [("serving", "vllm-0")]
    assert identity_from_labels({"nvlink": "0", "gpu": "0", "gpu_uuid": "GPU-1"}) is None


def test_node_label_from_service_discovery_beats_the_exporter_hostname() -> None:
    ident = identity_from_labels({"gpu": "1", "UUID": "GPU-2", "hostname": "dcgm-exporter-x7", "node": "gpu-node-3"})
    assert ident is not None and ident.node == "gpu-node-3"
    ident = identity_from_labels({"gpu": "1", "uuid": "GPU-3", "instance": "10.0.0.7:9400"})
    assert ident is not None and ident.node == "10.0.0.7" and ident.uuid_label == "uuid"


@pytest.fixture(scope="module")
def two_nodes():  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=8, gpus_per_node=4, mig_nodes=(1,), start=T)
    return fleet, parse_exporter_text(fleet.render(fleet.gpus, T), T)


def test_select_by_pod_uuid_and_node_index(two_nodes) -> None:  # type: ignore[no-untyped-def]
    fleet, s = two_nodes
    gpus = drop_mig_parents(s.gpus.values())
    g = fleet.gpus[2]
    (by_pod,) = select_gpus(gpus, GpuSelector(pod=g.pod))
    assert by_pod.uuid == g.uuid
    (by_ns_pod,) = select_gpus(gpus, GpuSelector(pod=f"{g.namespace}/{g.pod}"))
    assert by_ns_pod.key == by_pod.key
    with pytest.raises(InputError, match="no GPU matches"):
        select_gpus(gpus, GpuSelector(pod=f"other-ns/{g.pod}"))
    (by_uuid,) = select_gpus(gpus, GpuSelector(uuid=g.uuid.upper().removeprefix("GPU-")))
    assert by_uuid.key == by_pod.key
    (by_node,) = select_gpus(gpus, GpuSelector(node="node-0000", gpu=g.index))
    assert by_node.key == by_pod.key


def test_ambiguous_and_empty_selections_list_the_candidates(two_nodes) -> None:  # type: ignore[no-untyped-def]
    fleet, s = two_nodes
    gpus = drop_mig_parents(s.gpus.values())
    with pytest.raises(InputError, match="pick one with --gpu"):
        select_gpus(gpus, GpuSelector())
    with pytest.raises(InputError, match="2 GPUs match gpu 1"):
        select_gpus(gpus, GpuSelector(gpu=1))
    with pytest.raises(InputError, match="MIG instances"):
        select_gpus(gpus, GpuSelector(node="node-0001", gpu=0))
    (one,) = select_gpus(gpus, GpuSelector(node="node-0001", gpu=0, mig_instance="2"))
    assert one.mig_id == "2"
    with pytest.raises(InputError, match="matches .* pods"):
        select_gpus(gpus, GpuSelector(pod="ba"))  # bandwidth-server and batching-server share the prefix


def _sleeper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **env})


def test_pid_selects_its_gpus_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    by_index = _sleeper({"CUDA_VISIBLE_DEVICES": "1"})
    by_uuid = _sleeper({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-1,GPU-bbbb-2"})
    nothing = _sleeper({"CUDA_VISIBLE_DEVICES": ""})
    try:
        monkeypatch.delenv("NODE_NAME", raising=False)
        sel = selector_for_pid(by_index.pid)
        assert sel.indices == (1,) and sel.pid == by_index.pid and sel.node == os.uname().nodename
        # In a Kubernetes pod the host name is the pod's: the node's name comes from the downward API.
        monkeypatch.setenv("NODE_NAME", "gpu-node-7")
        assert selector_for_pid(by_index.pid).node == "gpu-node-7"
        # UUIDs name a GPU on any node: no node to match (a pod's host name would match none).
        by_uuids = selector_for_pid(by_uuid.pid)
        assert by_uuids.uuids == ("GPU-aaaa-1", "GPU-bbbb-2") and by_uuids.node is None
        with pytest.raises(SourceUnavailable, match="cannot tell which GPU"):
            selector_for_pid(nothing.pid)
    finally:
        for p in (by_index, by_uuid, nothing):
            p.kill()
            p.wait()
    with pytest.raises(SourceUnavailable, match="no process with pid"):
        selector_for_pid(by_index.pid)


def test_pid_selector_picks_its_gpu_among_the_exporters(two_nodes) -> None:  # type: ignore[no-untyped-def]
    fleet, s = two_nodes
    sel = GpuSelector(pid=1, indices=(3,), node="node-0000")
    (picked,) = select_gpus(drop_mig_parents(s.gpus.values()), sel)
    assert picked.index == 3 and picked.node == "node-0000"


def _csv_fields() -> list[list[str]]:
    rows = []
    with open(COUNTERS_CSV, newline="") as f:
        for row in csv.reader(f):
            if row and not row[0].lstrip().startswith("#") and row[0].strip():
                rows.append([c.strip() for c in row])
    return rows


def test_counters_csv_enables_every_field_the_rules_need() -> None:
    rows = _csv_fields()
    enabled = {r[0] for r in rows}
    for r in rows:
        assert len(r) >= 3 and r[1] in ("gauge", "counter", "label"), r
    for signal, keys in WANTED_SIGNALS.items():
        legacy = {FIELDS_BY_KEY[k].names[0] for k in keys}
        if signal in ("gpu.sm_clock_frac", "gpu.mem_used_frac"):
            assert legacy <= enabled, signal  # needs the clock and its maximum
        else:
            assert legacy & enabled, signal
    # Everything the default CSV leaves out but the rules read is in ours.
    needed = {FIELDS_BY_KEY[k].name for keys in WANTED_SIGNALS.values() for k in keys
              if not FIELDS_BY_KEY[k].in_default_csv and not k.endswith("_total")}
    assert needed <= enabled
    # Counters are declared as counters, as dcgm-exporter expects.
    types = {r[0]: r[1] for r in rows}
    for name in ("DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"):
        assert types[name] == "counter"
    assert all(name in FIELD_OF_NAME or name.startswith(("DCGM_FI_DEV_", "DCGM_FI_DRIVER")) for name in enabled)


def test_durations_times_and_windows() -> None:
    assert parse_duration("90s") == 90 and parse_duration("1h30m") == 5400 and parse_duration("2d") == 172800
    assert parse_duration("45") == 45
    for bad in ("soon", "10x", "-5m", "0"):
        with pytest.raises(InputError):
            parse_duration(bad)
    now = 1_800_000_000.0
    assert parse_time("now-2h", now=now) == now - 7200 and parse_time("30m ago", now=now) == now - 1800
    assert parse_time("2026-11-21T03:00Z") == parse_time("2026-11-21T03:00") == parse_time("2026-11-21T04:00+01:00")
    assert parse_time("1700000000") == 1_700_000_000
    with pytest.raises(InputError, match="not a time"):
        parse_time("last tuesday")
    w = resolve_window(since="30m", at="now-1h", now=now)
    assert (w.start, w.end) == (now - 5400, now - 3600)
    w = resolve_window(start="now-10m", now=now)
    assert (w.start, w.end) == (now - 600, now)
    assert resolve_window(now=now, default_s=3600).length_s == 3600
    for kwargs in ({"since": "1h", "start": "now-2h"}, {"end": "now"}, {"start": "now", "end": "now-1h"},
                   {"since": "1h", "at": "now+1h"}):
        with pytest.raises(InputError):
            resolve_window(now=now, **kwargs)  # type: ignore[arg-type]


def test_time_helpers_use_the_real_clock_by_default() -> None:
    before = time.time()
    assert before - 1 <= parse_time("now") <= time.time() + 1
