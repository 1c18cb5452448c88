import gzip
import json

import pytest

from diagnoser import capture as cap_mod
from diagnoser.capture import CaptureError, ModelInfo, TraceSummary, Unavailable, load, save
from tests.factories import make_capture


def _full_capture():
    cap = make_capture({"gpu.busy": [0.1, 0.5, 0.9], "server.waiting": [0, 2, 4]}, n=3,
                       model=ModelInfo(name="m", params=7e9, layers=32, kv_heads=8, head_dim=128, dtype="bf16"),
                       trace=TraceSummary(path="t.json", window_s=1.5, gpu_busy_frac=0.4,
                                          idle_frac_by_cause={"host": 0.3}, kernel_share={"gemm": 0.7}))
    cap.unavailable.append(Unavailable(source="gpm", what="gpu.dram_active", reason="not supported", hint="Hopper+"))
    cap.notes.append("a note")
    return cap


def test_round_trip_keeps_everything(tmp_path):
    cap = _full_capture()
    path = save(cap, tmp_path / "c.dgc")
    back = load(path)
    assert back == cap
    assert back.series[0].values == [0.1, 0.5, 0.9]
    assert back.trace.idle_frac_by_cause == {"host": 0.3}


def test_file_is_gzip_json_with_format_and_version(tmp_path):
    path = save(_full_capture(), tmp_path / "c.dgc")
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert doc["format"] == "diagnoser-capture"
    assert doc["version"] == cap_mod.FORMAT_VERSION
    assert doc["capture"]["target"] == "test target"


def test_plain_json_is_also_read(tmp_path):
    raw = gzip.decompress(cap_mod.dumps(_full_capture()))
    (tmp_path / "c.json").write_bytes(raw)
    assert load(tmp_path / "c.json").target == "test target"


def test_newer_version_is_rejected_with_one_sentence(tmp_path):
    doc = json.loads(gzip.decompress(cap_mod.dumps(_full_capture())))
    doc["version"] = cap_mod.FORMAT_VERSION + 1
    (tmp_path / "new.dgc").write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(CaptureError, match="newer than this diagnoser reads"):
        load(tmp_path / "new.dgc")


def test_older_version_is_migrated(tmp_path, monkeypatch):
    # A version-0 file whose "target" was called "subject": the migration renames it.
    doc = json.loads(gzip.decompress(cap_mod.dumps(_full_capture())))
    doc["version"] = 0
    doc["capture"]["subject"] = doc["capture"].pop("target")
    (tmp_path / "old.dgc").write_bytes(gzip.compress(json.dumps(doc).encode()))

    def v0_to_v1(raw):
        raw["target"] = raw.pop("subject")
        return raw

    monkeypatch.setitem(cap_mod._MIGRATIONS, 0, v0_to_v1)
    assert load(tmp_path / "old.dgc").target == "test target"


@pytest.mark.parametrize("content,match", [
    (b"\x1f\x8b\x08\x00garbage", "gzip stream is damaged"),
    (b"{not json", "not a diagnoser capture"),
    (json.dumps({"format": "other", "version": 1, "capture": {}}).encode(), "not a diagnoser capture"),
    (json.dumps({"format": "diagnoser-capture", "version": 1, "capture": {"target": 3}}).encode(), "damaged capture"),
])
def test_corrupt_files_are_rejected(tmp_path, content, match):
    (tmp_path / "bad.dgc").write_bytes(content)
    with pytest.raises(CaptureError, match=match):
        load(tmp_path / "bad.dgc")


def test_truncated_capture_is_rejected(tmp_path):
    data = cap_mod.dumps(_full_capture())
    (tmp_path / "cut.dgc").write_bytes(data[: len(data) // 2])
    with pytest.raises(CaptureError):
        load(tmp_path / "cut.dgc")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CaptureError, match="no capture file"):
        load(tmp_path / "absent.dgc")
    with pytest.raises(CaptureError, match="is a directory"):
        load(tmp_path)


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    save(_full_capture(), tmp_path / "c.dgc")
    save(_full_capture(), tmp_path / "c.dgc")
    assert [p.name for p in tmp_path.iterdir()] == ["c.dgc"]


def test_mark_unavailable_deduplicates():
    cap = make_capture({})
    cap.mark_unavailable("nvml", "gpu.*", "no GPU")
    cap.mark_unavailable("nvml", "gpu.*", "no GPU")
    assert len(cap.unavailable) == 1


def test_non_finite_readings_are_no_reading_and_files_stay_readable(tmp_path):
    # GPM's first DRAM interval on an H100 read NaN; JSON has no NaN, so it once made the capture unreadable.
    c = make_capture({"gpu.busy": 0.9})
    series = cap_mod.Series(name="gpu.dram_active", unit="ratio", source="gpm")
    for t, v in ((0.0, float("nan")), (0.2, 0.24), (0.4, float("inf")), (0.6, 0.26)):
        series.add(t, v)
    assert series.times == [0.2, 0.6] and series.values == [0.24, 0.26]
    built = cap_mod.Series(name="gpu.sm_active", unit="ratio", source="dcgm", times=[0.0, 1.0],
                           values=[float("nan"), 0.5])  # built directly, bypassing add()
    c.series += [series, built]
    path = save(c, tmp_path / "nan.dgc")
    back = {s.name: s for s in load(path).series}
    assert back["gpu.dram_active"].values == [0.24, 0.26]
    assert back["gpu.sm_active"].times == [1.0] and back["gpu.sm_active"].values == [0.5]


def test_null_points_written_by_0_1_0_are_dropped_on_load(tmp_path):
    c = make_capture({"gpu.busy": 0.9, "gpu.dram_active": 0.3}, n=3)
    raw = json.loads(gzip.decompress(cap_mod.dumps(c)))
    dram = next(s for s in raw["capture"]["series"] if s["name"] == "gpu.dram_active")
    dram["values"][0] = None
    path = tmp_path / "old.dgc"
    path.write_bytes(gzip.compress(json.dumps(raw).encode()))
    back = next(s for s in load(path).series if s.name == "gpu.dram_active")
    assert back.values == [0.3, 0.3] and len(back.times) == 2


# Version 2 kept these trace results as free keys of `trace.extra` (diagnoser wrote counts as floats).
V2_EXTRA = {"comm_exposed_frac": 0.0, "graph_kernel_frac": 0.8, "costed_gpu_frac": 0.95, "costed_ops": 12.0,
            "ridge_flop_per_byte": 295.0, "time_frac_below_ridge": 0.9, "context_first": 128.0,
            "context_last": 512.0, "attention_frac_first": 0.1, "attention_frac_last": 0.3, "ranks": 2.0,
            "comm_share_max_rank": 0.05, "a_key_nothing_read": 1.0}


def _version_2(tmp_path, extra, *, null_point=False):
    doc = json.loads(gzip.decompress(cap_mod.dumps(_full_capture())))
    doc["version"] = 2
    doc["capture"]["trace"]["extra"] = extra
    if null_point:  # takes the generic path that repairs what earlier writers got wrong, and migrates as a dict
        doc["capture"]["series"][0]["values"][0] = None
    path = tmp_path / "v2.dgc"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


@pytest.mark.parametrize("null_point", [False, True], ids=["typed", "generic"])
def test_a_version_2_trace_extra_becomes_typed_fields(tmp_path, null_point):
    t = load(_version_2(tmp_path, V2_EXTRA, null_point=null_point)).trace
    assert t is not None
    assert (t.comm_exposed_frac, t.graph_kernel_count_frac, t.costed_gemm_attention_frac) == (0.0, 0.8, 0.95)
    assert (t.ridge_flop_per_byte, t.time_frac_below_ridge, t.comm_share_max_rank) == (295.0, 0.9, 0.05)
    assert (t.attention_frac_first, t.attention_frac_last) == (0.1, 0.3)
    counts = (t.costed_op_count, t.context_tokens_first, t.context_tokens_last, t.rank_count)
    assert counts == (12, 128, 512, 2) and all(type(c) is int for c in counts)
    assert t.graph_kernel_frac is None  # the share by time stays unknown: the old key was the share by count
    assert t.gpu_busy_frac == 0.4


def test_a_version_2_trace_without_extra_leaves_the_fields_unknown(tmp_path):
    t = load(_version_2(tmp_path, {})).trace
    assert t is not None and t.costed_op_count is None and t.rank_count is None and t.comm_exposed_frac is None


@pytest.mark.parametrize("extra,where", [({"ranks": 2.5}, "rank_count"), ({"costed_ops": "many"}, "extra")])
def test_a_version_2_trace_extra_of_the_wrong_type_is_refused_in_one_sentence(tmp_path, extra, where):
    with pytest.raises(CaptureError, match=f"damaged capture \\(version 2\\).*{where}"):
        load(_version_2(tmp_path, extra))


def test_a_saved_trace_has_typed_results_and_no_extra(tmp_path):
    cap = _full_capture()
    assert cap.trace is not None
    cap.trace.costed_op_count, cap.trace.graph_kernel_count_frac = 7, 0.5
    doc = json.loads(gzip.decompress(cap_mod.dumps(cap)))
    assert doc["version"] == 3 and "extra" not in doc["capture"]["trace"]
    assert doc["capture"]["trace"]["costed_op_count"] == 7
    back = load(save(cap, tmp_path / "c.dgc")).trace
    assert back is not None and back.costed_op_count == 7 and back.graph_kernel_count_frac == 0.5


def test_one_unavailable_type_from_the_capture_to_the_diagnosis():
    from diagnoser.evidence_build import build_evidence
    from diagnoser.rules.engine import diagnose_evidence

    cap = _full_capture()
    ev = build_evidence(cap)
    d = diagnose_evidence(ev)
    assert ev.meta.unavailable == tuple(cap.unavailable) and d.unavailable == cap.unavailable
    assert all(type(u) is Unavailable for u in d.unavailable)
    assert d.to_dict()["unavailable"] == [{"source": "gpm", "what": "gpu.dram_active", "reason": "not supported",
                                           "hint": "Hopper+"}]
