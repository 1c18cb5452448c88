"""The fleet's arithmetic without a Prometheus: prices, what is at stake per verdict (from real engine diagnoses),
grouping, rows built from step values and from window statistics, and what fleet publishes."""

from __future__ import annotations

import math
from array import array

import pytest

from diagnoser.collectors.dcgm import GpuIdentity
from diagnoser.collectors.prometheus_source import Window, WindowData
from diagnoser.errors import InputError
from diagnoser.fleet.model import FleetReport
from diagnoser.fleet.run import (
    build_rows,
    diagnosis_dict,
    dumps_json,
    gpu_price,
    group_rows,
    report_dict,
    stake_fraction,
)
from diagnoser.rules import diagnose
from tests.factories import make_capture

H100 = "NVIDIA H100 80GB HBM3"


def test_prices_from_the_table_mig_slices_and_overrides() -> None:
    assert gpu_price(H100) == pytest.approx(6.9)
    assert gpu_price(H100, "3g.40gb") == pytest.approx(6.9 * 3 / 7)
    assert gpu_price("NVIDIA A100-SXM4-80GB") == pytest.approx(4.1)
    assert gpu_price("Tesla T4") == pytest.approx(0.53)
    assert gpu_price(H100, "1g.10gb", override=2.0) == pytest.approx(2 / 7)
    assert gpu_price("NVIDIA RTX 2000 Ada Generation") is None
    assert gpu_price("NVIDIA A30", "1g.6gb") is None  # not in the physics table: unknown, never a guess
    assert gpu_price("NVIDIA A30", "1g.6gb", override=1.0) == pytest.approx(0.25)  # A30 has 4 slices


def test_stake_follows_the_verdict() -> None:
    idle = diagnose(make_capture({"gpu.busy": 0.03}))
    assert idle.verdict == "idle" and stake_fraction(idle, 0.03) == 1.0
    batching = diagnose(make_capture({"gpu.busy": 0.3}))
    assert batching.verdict == "batching" and stake_fraction(batching, 0.3) == pytest.approx(0.7)
    compute = diagnose(make_capture({"gpu.busy": 0.97, "gpu.tensor_active": 0.8, "gpu.dram_active": 0.3}))
    assert compute.verdict == "compute"
    # FP8 over BF16 peak on an H100 is 2x, for the 80 % of cycles the tensor pipes work: 1 / (0.2 + 0.8 / 2)
    gain = next(f.gain for f in compute.fixes if f.gain is not None)
    assert stake_fraction(compute, 0.97) == pytest.approx(1 - 1 / gain) and gain == pytest.approx(1 / 0.6, rel=1e-3)
    errors = diagnose(make_capture({"gpu.busy": 0.6, "gpu.xid_errors": 1.0}))
    assert errors.verdict == "errors" and stake_fraction(errors, 0.6) == 1.0
    nothing = diagnose(make_capture({}))
    assert nothing.verdict == "inconclusive" and stake_fraction(nothing, None) == 0.0


def _window_data(n_gpus: int) -> WindowData:
    """Step values as Prometheus would return them: GPU i idle if i is even, else memory-bound; plus one MIG GPU."""
    w = Window(1_700_000_000.0, 1_700_003_600.0)
    data = WindowData(w, 120.0, 120.0, w.start + 120, 30)
    data.fields_present = {"gr_engine_active", "tensor_active", "dram_active", "fb_used", "fb_free", "power"}

    def put(field: str, key: tuple[str, str], value: float) -> None:
        steps = array("d", [value + 0.01 * math.sin(i) for i in range(30)])
        data.values.setdefault(field, {})[key] = steps

    for i in range(n_gpus):
        key = (f"GPU-{i:04d}", "")
        data.gpus[key] = GpuIdentity(key=key, index=i % 8, model=H100, node=f"node-{i // 8}",
                                     pods=[(f"ns-{i % 2}", f"pod-{i}")])
        put("gr_engine_active", key, 0.03 if i % 2 == 0 else 0.95)
        put("dram_active", key, 0.02 if i % 2 == 0 else 0.75)
        put("tensor_active", key, 0.0 if i % 2 == 0 else 0.2)
        put("fb_used", key, 20000)
        put("fb_free", key, 61559)
    parent, instance = ("GPU-mig", ""), ("GPU-mig", "1")
    data.gpus[parent] = GpuIdentity(key=parent, index=0, model=H100, node="node-mig")
    data.gpus[instance] = GpuIdentity(key=instance, index=0, model=H100, node="node-mig", mig_id="1",
                                      mig_profile="3g.40gb", pods=[("ns-0", "mig-pod")])
    put("gr_engine_active", instance, 0.02)
    put("power", parent, 300.0)  # a board field: the instance inherits it
    return data


def test_rows_from_step_values() -> None:
    data = _window_data(40)
    serial = build_rows(data)
    assert len(serial) == 41  # 40 GPUs and the MIG instance; the MIG board is no row
    verdicts = {r.uuid: r.diagnosis.verdict for r in serial}
    assert verdicts["GPU-0000"] == "idle" and verdicts["GPU-0001"] == "memory_bandwidth"
    mig = next(r for r in serial if r.mig_profile)
    assert mig.gpu == "0/1" and mig.diagnosis.verdict == "idle" and mig.pod == "mig-pod"
    assert mig.usd_per_gpu_hour == pytest.approx(6.9 * 3 / 7)
    assert serial[0].frac_at_stake == 1.0 and not any(r.partial for r in serial)


def test_gaps_mark_rows_partial() -> None:
    data = _window_data(2)
    steps = data.values["gr_engine_active"][("GPU-0000", "")]
    for i in range(20, 30):
        steps[i] = math.nan  # the exporter went away two thirds in
    for field in ("dram_active", "tensor_active", "fb_used", "fb_free"):
        for i in range(20, 30):
            data.values[field][("GPU-0000", "")][i] = math.nan
    rows = {r.uuid: r for r in build_rows(data)}
    gone = rows["GPU-0000"]
    assert gone.partial and "no data after" in gone.notes[0] and gone.diagnosis.verdict == "idle"
    assert not rows["GPU-0001"].partial


def test_groups() -> None:
    rows = build_rows(_window_data(16))
    by_node = group_rows(rows, "node")
    assert [g.name for g in by_node][:2] in (["node-0", "node-1"], ["node-1", "node-0"])
    assert sum(len(g.rows) for g in by_node) == len(rows)
    by_ns = {g.name: g for g in group_rows(rows, "namespace")}
    assert by_ns["ns-0"].verdicts["idle"] == 9  # eight even GPUs and the MIG instance
    assert by_ns["ns-0"].to_dict()["gpus"] == 9
    with pytest.raises(InputError, match="--group-by must be one of"):
        group_rows(rows, "rack")


def test_fast_json_is_the_models_own_dict() -> None:
    rows = build_rows(_window_data(6))
    extra = diagnose(make_capture({"gpu.busy": 0.97, "gpu.tensor_active": 0.8, "gpu.dram_active": 0.3}))
    for d in [r.diagnosis for r in rows] + [extra, diagnose(make_capture({}))]:
        assert diagnosis_dict(d) == d.to_dict()
    report = FleetReport(source="http://p:9090", window_start=1.0, window_end=2.0, rows=rows, errors=["e"])
    assert report_dict(report) == report.to_dict()
    assert report_dict(report, limit=2)["rows"] == report.to_dict()["rows"][:2]
    import json

    assert json.loads(dumps_json(report_dict(report))) == json.loads(json.dumps(report.to_dict()))


def test_field_answers_decode_straight_into_keys_and_floats() -> None:
    """The typed decode of a field query keeps only the key labels, turns value strings into floats, and falls
    back to the generic decode for what it refuses ("+Inf", an error body), with the same result."""
    from diagnoser.collectors.prom_client import KeyedSeries, _decode_json
    from diagnoser.collectors.prometheus_source import _values_by_step

    body = (b'{"status":"success","data":{"resultType":"matrix","result":['
            b'{"metric":{"Hostname":"n1","UUID":"GPU-a","pod":"p1","modelName":"H100"},'
            b'"values":[[100,"0.5"],[160,"0.7"],[220,"NaN"]]},'
            b'{"metric":{"hostname":"n1","uuid":"GPU-a","pod":"p2"},"values":[[160,"0.9"]]},'
            b'{"metric":{"UUID":"GPU-b","GPU_I_ID":"3"},"values":[[100,"1"],[160,"2"],[220,"3"]]},'
            b'{"metric":{"Hostname":"n2"},"values":[[100,"1"]]}]}}')
    answer = _decode_json(body, keyed=True)
    assert isinstance(answer, dict)
    series = answer["data"]["result"]
    assert all(isinstance(s, KeyedSeries) for s in series)
    assert series[0].metric.UUID == "GPU-a" and series[0].values[1] == (160.0, 0.7)
    steps = _values_by_step(series, 100.0, 60.0, 3)
    assert set(steps) == {("GPU-a", ""), ("GPU-b", "3")}  # the series without a UUID is dropped
    a = steps[("GPU-a", "")]
    assert a[0] == 0.5 and a[1] == pytest.approx(0.8) and math.isnan(a[2])  # two pods of one GPU averaged
    assert list(steps[("GPU-b", "3")]) == [1.0, 2.0, 3.0]

    inf = body.replace(b'"0.9"', b'"+Inf"')
    generic = _decode_json(inf, keyed=True)
    assert isinstance(generic, dict) and isinstance(generic["data"]["result"][0], dict)
    fallback = [KeyedSeries.from_dict(s) for s in generic["data"]["result"]]
    assert fallback[1].values == [(160.0, math.inf)]
    # An infinity is no reading: the step keeps the other pod's value alone.
    assert _values_by_step(fallback, 100.0, 60.0, 3)[("GPU-a", "")][1] == pytest.approx(0.7)
    error = b'{"status":"error","errorType":"bad_data","error":"parse error"}'
    assert _decode_json(error, keyed=True) == {"status": "error", "errorType": "bad_data", "error": "parse error"}
    instant = _decode_json(b'{"status":"success","data":{"resultType":"vector","result":['
                           b'{"metric":{"UUID":"GPU-a"},"value":[220,"7"]}]}}', keyed=True)
    assert isinstance(instant, dict) and instant["data"]["result"][0].points == [(220.0, 7.0)]


def test_gc_is_paused_for_the_run_and_restored() -> None:
    import gc

    from diagnoser.fleet.run import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one restores what it found: paused
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed query")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


# --- the triage from window statistics -----------------------------------------------------------------------------


def test_signals_from_statistics_answer_what_was_computed_and_nothing_else() -> None:
    """A signal made from window statistics answers the statistics the engine computed, exactly, and raises for any
    other: a quantile or a share interpolated between them would be a number nobody measured, read by a path that
    bypassed the rules' declarations."""
    from diagnoser.evidence import NoSuchStatistic, Signal

    samples = Signal("gpu.dram_active", "ratio", ("dcgm",), tuple(i / 100 for i in range(101)))
    stats = Signal.from_stats("gpu.dram_active", "ratio", ("dcgm",), mean=samples.mean, p50=samples.p50,
                              p90=samples.p90, max=samples.max, min=samples.min, n=101)
    assert stats.n == 101 and stats.mean == pytest.approx(0.5) and stats.values == (stats.mean,)
    for name in ("p50", "p90", "max", "min", "value"):
        assert stats.stat(name) == pytest.approx(samples.stat(name))
    for ask in (lambda: stats.quantile(0.7), lambda: stats.frac_above(0.25), lambda: stats.p99):
        with pytest.raises(NoSuchStatistic, match="gpu.dram_active hold no"):
            ask()
    # A 0/1 signal: its mean is the share above 0.5, given exactly.
    throttle = Signal.from_stats("gpu.throttle.power", "ratio", ("dcgm",), mean=0.85, n=120, frac_above={0.5: 0.85})
    assert throttle.frac_above(0.5) == 0.85 and throttle.stat("frac_above:0.5") == 0.85
    assert throttle.frac_below(0.5) == pytest.approx(0.15)
    bare = Signal.from_stats("gpu.busy", "ratio", ("dcgm",), mean=0.4)
    assert bare.mean == bare.value == 0.4
    for ask in (lambda: bare.p90, lambda: bare.max, lambda: bare.min, lambda: bare.frac_above(0.3)):
        with pytest.raises(NoSuchStatistic):
            ask()


def _stats(profiles: list[dict[str, float]], *, mig: bool = False):  # type: ignore[no-untyped-def]
    """WindowStats as the engine would answer them: one number per GPU and statistic."""
    from diagnoser.collectors.prom_stats import WindowStats

    w = Window(1_700_000_000.0, 1_700_003_600.0)
    data = WindowStats(w)
    for i, _ in enumerate(profiles):
        key = (f"GPU-{i:04d}", "")
        data.gpus[key] = GpuIdentity(key=key, index=i, model=H100, node="node-0", pods=[("ns", f"pod-{i}")])
    if mig:
        data.gpus[("GPU-0000", "1")] = GpuIdentity(key=("GPU-0000", "1"), index=0, model=H100, node="node-0",
                                                   mig_id="1", mig_profile="3g.40gb")
    data.keys = list(data.gpus)
    data.index = {k: i for i, k in enumerate(data.keys)}
    data.samples = array("d", [120.0] * len(data.keys))
    for i, p in enumerate(profiles):
        for stat, value in p.items():
            data.values.setdefault(stat, array("d", [math.nan] * len(data.keys)))[i] = value
            data.fields_present.add(stat.split(".")[0])
    return data


PLANTED = {  # statistics of each planted class, and the verdict the engine must give from them
    "idle": ({"gr_engine_active.avg": 0.02, "sm_active.avg": 0.01, "dram_active.avg": 0.01}, "idle"),
    "bandwidth": ({"gr_engine_active.avg": 0.95, "sm_active.avg": 0.85, "tensor_active.avg": 0.22,
                   "dram_active.avg": 0.72}, "memory_bandwidth"),
    "compute": ({"gr_engine_active.avg": 0.97, "tensor_active.avg": 0.78, "dram_active.avg": 0.35}, "compute"),
    "vram": ({"gr_engine_active.avg": 0.8, "sm_active.avg": 0.85, "dram_active.avg": 0.42, "tensor_active.avg": 0.35,
              "fb_used.avg": 81000, "fb_used.p90": 81200, "fb_total.last": 81559}, "vram"),
    "batching": ({"gr_engine_active.avg": 0.3, "sm_active.avg": 0.22, "dram_active.avg": 0.12}, "batching"),
    # Clock-event bits (HW power brake) and no maximum clock: the spec table's 1980 MHz stands in.
    "throttled": ({"gr_engine_active.avg": 0.92, "tensor_active.avg": 0.45, "dram_active.avg": 0.4,
                   "sm_clock.avg": 1188.0, "reasons_power.min": 0x84, "reasons_power.max": 0x84, "reasons_power.avg": 0x84}, "throttling"),
    "errors": ({"gr_engine_active.avg": 0.6, "xid.max": 79.0}, "errors"),
    # Busy, SMs and DRAM well under their roofs, the tensor pipes nearly idle: kernel-bound in the memory regime.
    "latency": ({"gr_engine_active.avg": 0.93, "sm_active.avg": 0.34, "tensor_active.avg": 0.05,
                 "dram_active.avg": 0.28}, "latency"),
}


def test_the_engine_diagnoses_each_planted_class_from_its_statistics() -> None:
    from diagnoser.fleet.run import triage_rows

    names = list(PLANTED)
    stats = _stats([PLANTED[n][0] for n in names])
    rows, triage = triage_rows(stats)
    by_pod = {r.pod: r for r in rows}
    for i, name in enumerate(names):
        row = by_pod[f"pod-{i}"]
        assert row.diagnosis.verdict == PLANTED[name][1], (name, row.diagnosis.headline)
        assert row.basis == "statistics" and not row.partial
    throttled = by_pod[f"pod-{names.index('throttled')}"].diagnosis
    cited = {c.signal: c.value for f in throttled.findings for c in f.citations}
    assert cited["gpu.sm_clock_frac"] == pytest.approx(0.6) and cited["gpu.throttle.power"] == 1.0
    assert cited["gpu.throttle.power_brake"] == 1.0 and "HW power brake" in throttled.headline
    assert triage.spec_clock_models == {H100}
    assert by_pod[f"pod-{names.index('errors')}"].diagnosis.notes[0].startswith("DCGM reports XID 79")


def test_mig_instances_inherit_their_boards_statistics_and_missing_fields_are_named() -> None:
    from diagnoser.fleet.run import triage_rows

    # The board's mask toggled between 0 and 0x84 (power cap + power brake), held 85 % of the window.
    stats = _stats([{"sm_clock.avg": 1188.0, "reasons_power.min": 0.0, "reasons_power.max": 0x84,
                     "reasons_power.avg": 0.85 * 0x84}, {"fb_used.avg": 100.0}], mig=True)
    stats.values["gr_engine_active.avg"] = array("d", [math.nan, math.nan, 0.9])
    stats.values["tensor_active.avg"] = array("d", [math.nan, math.nan, 0.45])
    stats.values["dram_active.avg"] = array("d", [math.nan, math.nan, 0.40])
    rows, _ = triage_rows(stats)
    mig = next(r for r in rows if r.mig_profile)
    assert mig.diagnosis.verdict == "throttling"  # the board's clock and bits, the instance's activity
    cited = {c.signal: c.value for f in mig.diagnosis.findings for c in f.citations}
    assert cited["gpu.throttle.power"] == pytest.approx(0.85) and cited["gpu.throttle.power_brake"] == pytest.approx(0.85)
    blind = next(r for r in rows if r.uuid == "GPU-0001")
    assert blind.partial and blind.notes[0].startswith("no activity counters")
    assert any("none of the activity fields" in n for n in blind.diagnosis.notes)
    assert blind.diagnosis.verdict == "inconclusive"


def test_clock_event_shares_from_the_masks_extremes_and_mean() -> None:
    from diagnoser.collectors.dcgm import CLOCK_EVENT_OTHER, CLOCK_EVENT_POWER, CLOCK_EVENT_THERMAL
    from diagnoser.collectors.prom_stats import bit_shares

    assert bit_shares(0x84, 0x84, 0x84, CLOCK_EVENT_POWER) == 1.0  # held all window
    assert bit_shares(0x1, 0x1, 0x1, CLOCK_EVENT_POWER) == 0.0  # idle: no clock held
    assert bit_shares(0, 0x80, 0x20, CLOCK_EVENT_POWER) == pytest.approx(0.25)  # power brake a quarter of it
    assert bit_shares(0x4, 0x40, 0x13, CLOCK_EVENT_POWER) == pytest.approx(0.75)  # power cap, then HW thermal
    assert bit_shares(0x4, 0x40, 0x13, CLOCK_EVENT_THERMAL) == pytest.approx(0.25)
    assert bit_shares(0x4, 0x84, 0x44, CLOCK_EVENT_POWER) == 1.0 and bit_shares(0, 1, 0.5, CLOCK_EVENT_OTHER) == 0


def test_published_label_values_are_redacted_exactly_as_the_html_does() -> None:
    from diagnoser.fleet.run import publishable, redact_identities
    from diagnoser.reports.redact import redact

    cache: dict[str, str] = {}
    samples = ["idle-server-00001-7f9c", "node-0007.cluster.local", "NVIDIA H100 80GB HBM3", "team-a", "3g.40gb",
               "pod-sk-proj-AbCdEfGhIjKlMnOpQr", "hf_AbCdEfGhIjKlMn", "x?token=abc", "user:pass@host",
               "a=b", "ghp_0123456789abcdefABCDEF", "eyJhbGciOi.eyJzdWIiOiIx.sig", "AKIA0123456789ABCDEF",
               "job --api-key abc", "", "ASIA0123456789ABCDEF-x", "gpu-operator"]
    samples += [f"{p}-{i}" for i in range(50) for p in ("vllm-decode", "sglang", "triton-7f9c")]
    for value in samples:
        assert publishable(value, cache) == redact(value), value
    g = GpuIdentity(key=("GPU-a", ""), index=0, model=H100, node="n", pods=[("ns", "pod-sk-proj-AbCdEfGhIjKl")])
    redact_identities([g])
    assert g.pods == [("ns", "pod-[redacted]")] and "sk-proj" not in g.describe()


def test_the_streamed_json_is_the_whole_document() -> None:
    import json

    from diagnoser.fleet.run import iter_report_json

    rows = build_rows(_window_data(7))
    report = FleetReport(source="http://p:9090", window_start=1.0, window_end=2.0, rows=rows, errors=["e"])
    extra = {"notes": ["n"], "timings": {"queries": 3}}
    whole = json.loads(dumps_json({**report_dict(report), **extra}))
    for limit, batch in ((None, 3), (None, 1000), (2, 1), (0, 5)):
        streamed = json.loads(b"".join(iter_report_json(report, extra, limit, batch=batch)))
        assert streamed == {**whole, "rows": whole["rows"][:limit] if limit is not None else whole["rows"]}


def test_no_path_of_the_fleet_reads_a_statistic_the_engine_did_not_compute() -> None:
    """Every GPU of a random fleet goes through the whole fleet path (the table's signals, build_evidence, the rules,
    the engine's choice, the judge and its gains): a read of a statistic the engine did not compute, by a path that
    bypasses the rules' declarations, raises (Signal.from_stats), so none happens."""
    import random

    from diagnoser.collectors.dcgm_stats import TABLE
    from diagnoser.fleet.run import triage_rows
    from diagnoser.rules import default_rules

    keys = sorted({s.key for group in TABLE for s in group.inputs} | {"gpu_util.avg"})
    rng = random.Random(27)
    scale = {"fb_used": 81000.0, "fb_total": 81559.0, "sm_clock": 1980.0, "max_sm_clock": 1980.0, "xid": 79.0,
             "reasons_power": 0x84, "pcie_tx": 2e10, "pcie_rx": 2e10, "pcie_tx_total": 2e10, "pcie_rx_total": 2e10,
             "power_violation": 1e9, "thermal_violation": 1e9, "ecc_dbe": 2.0, "gpu_util": 100.0}
    profiles = [{k: rng.random() * scale.get(k.split(".")[0], 1.0) for k in keys if rng.random() < 0.6}
                for _ in range(600)]
    rows, _ = triage_rows(_stats(profiles), processes=1)
    assert len(rows) == 600
    verdicts = {r.diagnosis.verdict for r in rows}
    assert len(verdicts) >= 5, verdicts  # the sample reaches many of the engine's paths
    # A rule may meet a statistic it declares that this GPU lacks (NET002's PCIe p90 where only the byte counter's
    # rate was exported): it is skipped, saying so. A statistic it does not declare is a read that bypassed Check.
    rules = {r.code: r for r in default_rules().rules}
    lacking = [(s.code, s.reason) for r in rows for s in r.diagnosis.skipped if "window statistics do not" in s.reason]
    assert lacking, "the sample has GPUs with a PCIe counter's rate and no gauge"
    for code, reason in lacking:
        signal = reason.split(" of ", 1)[1].split(",", 1)[0]
        assert signal in rules[code].reads, (code, reason)
