import pytest

from diagnoser import signals as S
from diagnoser.capture import ProcessInfo, TraceSummary
from diagnoser.diagnosis import Benefit, Finding, Fix, FixKind, GainKind, Limiter
from diagnoser.errors import InputError
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import Check, Page, RuleSet, Threshold, default_rules, diagnose, load_thresholds, rule
from diagnoser.rules.base import MEAN
from diagnoser.rules.judge import judge_fixes
from tests.factories import make_capture

BW_CASE = {"gpu.busy": 0.97, "gpu.dram_active": 0.65, "gpu.tensor_active": 0.12}


def test_rule_with_missing_required_signal_is_skipped_with_the_reason():
    cap = make_capture({"gpu.busy": 0.9})
    cap.mark_unavailable("gpm", "gpu.dram_active", "GPM needs a Hopper or newer GPU")
    d = diagnose(cap)
    bw = next(s for s in d.skipped if s.code == "BW001")
    assert "gpu.dram_active" in bw.reason and "Hopper" in bw.reason
    codes = {r.code for r in default_rules()}
    assert {s.code for s in d.skipped} | set(d.passed) | {f.code for f in d.findings} == codes


def test_every_rule_has_a_page_thresholds_and_a_limiter():
    for r in default_rules():
        assert r.code[:-3].isalpha() and r.code[-3:].isdigit()
        page = r.page_for()
        assert page.detects and page.why and page.fixes and page.sources
        assert "{" not in page.detects + page.why + page.fixes, r.code  # every placeholder filled
        assert r.thresholds, r.code
        assert r.requires, r.code


def test_thresholds_can_be_overridden_from_toml(tmp_path):
    assert diagnose(make_capture(BW_CASE)).verdict == "memory_bandwidth"
    cfg = tmp_path / "rules.toml"
    cfg.write_text("[thresholds.BW001]\ndram_active_mean = 0.7\n")
    overrides = load_thresholds(cfg)
    assert overrides == {"BW001": {"dram_active_mean": 0.7}}
    d = diagnose(make_capture(BW_CASE), default_rules().with_overrides(overrides))
    assert "BW001" in d.passed


def test_a_page_shows_the_threshold_in_force_not_the_default():
    r = default_rules().get("BW001")
    assert r is not None
    assert "at or above 60 %" in r.page_for().detects
    rules = default_rules().with_overrides({"BW001": {"dram_active_mean": 0.45}})
    assert "at or above 45 %" in r.page_for(rules.thresholds("BW001")).detects
    assert "60 %" not in r.page_for(rules.thresholds("BW001")).detects


@pytest.mark.parametrize("text,match", [
    ("[thresholds.XX999]\na = 1\n", "unknown rule"),
    ("[thresholds.BW001]\nnope = 1\n", "has no threshold 'nope'"),
    ("[thresholds.BW001]\ndram_active_mean = 'high'\n", "must be a number"),
    ("[thresholds.BW001\n", "cannot read rules config"),
])
def test_bad_threshold_files(tmp_path, text, match):
    cfg = tmp_path / "rules.toml"
    cfg.write_text(text)
    with pytest.raises(InputError, match=match):
        load_thresholds(cfg)


def test_cpu_only_and_exited_process_are_said():
    cap = make_capture({"gpu.busy": 0.9}, gpu=None)
    cap.cpu_only = True
    cap.process = ProcessInfo(pid=123, exited_at_s=4.2)
    d = diagnose(cap)
    assert d.notes[0].startswith("CPU run: not a GPU verdict")
    assert any("exited 4.2 s into the window" in n for n in d.notes)


def test_to_dict_is_json_ready():
    import json

    d = diagnose(make_capture(BW_CASE))
    doc = json.loads(json.dumps(d.to_dict()))
    assert doc["verdict"] == "memory_bandwidth"
    assert doc["findings"][0]["citations"][0]["signal"] == "gpu.dram_active"
    assert doc["schema_version"] == 1
    assert doc["fixes"][0]["kind"] in {k.value for k in FixKind}


# --- the rule API -------------------------------------------------------------------------------------------------

_PAGE = Page("detects {x}", "why", "fixes", "sources")


def test_a_rule_naming_an_unknown_signal_is_refused_at_registration():
    with pytest.raises(ValueError, match="unknown signal 'gpu.bussy'"):
        rule(code="TST001", name="t", limiter=Limiter.IDLE, summary="s", requires=("gpu.bussy",),  # type: ignore[arg-type]
             thresholds={"x": Threshold(1.0, "m")}, page=_PAGE)


def test_a_page_naming_a_threshold_the_rule_lacks_is_refused():
    with pytest.raises(ValueError, match="thresholds it does not have: y"):
        rule(code="TST001", name="t", limiter=Limiter.IDLE, summary="s", requires=(S.GPU_BUSY,),
             thresholds={"x": Threshold(1.0, "m")}, page=Page("{y}", "", "", ""))


def test_a_rule_gets_its_required_signals_present_and_cannot_read_undeclared_ones():
    seen = []

    @rule(code="TST001", name="t", limiter=Limiter.IDLE, summary="s", requires=(S.GPU_BUSY,),
          uses=(S.SERVER_WAITING,), reads={S.GPU_BUSY: (MEAN,)}, thresholds={"x": Threshold(1.0, "m")}, page=_PAGE)
    def probe(c: Check) -> Finding | None:
        seen.append(c.req(S.GPU_BUSY).mean)
        assert c.opt(S.SERVER_WAITING) is None
        with pytest.raises(KeyError, match="neither requires nor uses"):
            c.opt(S.GPU_DRAM_ACTIVE)
        return None

    rules = RuleSet([probe])
    res = rules.run(build_evidence(make_capture({"gpu.busy": 0.5})))
    assert seen == [0.5] and res.passed == ["TST001"]
    res = rules.run(build_evidence(make_capture({"gpu.sm_active": 0.5})))
    assert seen == [0.5] and res.skipped[0].code == "TST001"  # not run without its signal


def test_equally_strong_findings_are_ordered_by_the_rule_set_not_by_import_order():
    def make(code: str):
        @rule(code=code, name=code.lower(), limiter=Limiter.IDLE, summary="s", requires=(S.GPU_BUSY,),
              thresholds={"x": Threshold(1.0, "m")}, page=_PAGE)
        def same(c: Check) -> Finding | None:
            return c.finding(0.5, "same strength")
        return same

    a, b = make("AAA001"), make("ZZZ001")
    ev = build_evidence(make_capture({"gpu.busy": 0.5}))
    assert [f.code for f in RuleSet([b, a]).run(ev).findings] == ["ZZZ001", "AAA001"]
    assert [f.code for f in RuleSet([a, b]).run(ev).findings] == ["AAA001", "ZZZ001"]
    with pytest.raises(ValueError, match="duplicate"):
        RuleSet([a, a])


# --- the judge: fixes checked against the evidence --------------------------------------------------------------

def _fix(kind: FixKind, gain: float | None, **kw) -> Fix:
    return Fix(kind.value, "do it", gain, "basis", kw.pop("rule", "T001"), kind=kind, **kw)


def test_a_fix_already_in_place_is_withheld_with_the_evidence():
    trace = TraceSummary(kernel_count=1000, cuda_graph_launches=40, graph_kernel_count_frac=0.95)
    ev = build_evidence(make_capture({"gpu.busy": 0.5}, trace=trace))
    f = Finding("T001", "t", Limiter.HOST_LAUNCH, 0.8, "m", fixes=(_fix(FixKind.CUDA_GRAPHS, 1.5),
                                                                    _fix(FixKind.OFFLOAD_HOST_WORK, 1.4)))
    fixes, withheld = judge_fixes([f], ev)
    assert [x.kind for x in fixes] == [FixKind.OFFLOAD_HOST_WORK]
    assert withheld[0].kind is FixKind.CUDA_GRAPHS and "95% of the traced kernels" in withheld[0].why


@pytest.mark.parametrize(("cause", "sized"), [("host", False), ("sync", False), ("", False), ("queue_dry", True)])
def test_a_host_fix_is_not_sized_from_a_window_that_is_one_pause_of_the_hosts(cause: str, sized: bool):
    """One gap of 78 % of the window, the host's (a first call's warm-up): the host fix's idle share is that pause's,
    so it gets no gain. A pause with no work queued (a server between requests) is not what a host fix removes: the
    gain sized from the host's own gaps stands."""
    trace = TraceSummary(kernel_count=1000, longest_gap_frac=0.78, longest_gap_cause=cause)
    ev = build_evidence(make_capture({"gpu.busy": 0.2}, trace=trace))
    f = Finding("T001", "t", Limiter.HOST_LAUNCH, 0.8, "m", fixes=(_fix(FixKind.CUDA_GRAPHS, 1.15),
                                                                    _fix(FixKind.BATCH_MORE, 1.5)))
    fixes, _ = judge_fixes([f], ev)
    gains = {x.kind: x for x in fixes}
    assert gains[FixKind.BATCH_MORE].gain == 1.5  # not a host-side fix
    graphs = gains[FixKind.CUDA_GRAPHS]
    if sized:
        assert graphs.gain == pytest.approx(1.15)
    else:
        assert graphs.gain is None and "one pause holds 78% of its window" in graphs.basis
        assert "1.1x from this window" in graphs.basis


def test_fp8_weights_are_not_offered_to_fp8_weights():
    from tests.factories import llama_7b

    model = llama_7b()
    model.dtype = "fp8"
    d = diagnose(make_capture(BW_CASE | {"server.running": 1.0, "server.waiting": 0.0}, model=model))
    kinds = {f.kind for f in d.fixes}
    assert FixKind.FP8_WEIGHTS not in kinds and FixKind.INT4_WEIGHTS in kinds


def test_no_fewer_weight_bits_are_offered_to_3_bit_weights():
    """3-bit GPTQ weights read fewer bytes than FP8 or INT4 would: neither fix may be offered (the config was refused
    before 3- and 2-bit weights were sized); batching is, its gain from the 3-bit bytes (less than at INT4: each
    step's weight read is already cheaper)."""
    from tests.factories import llama_7b

    gains = {}
    for dtype in ("int4", "int3"):
        model = llama_7b()
        model.dtype = dtype
        d = diagnose(make_capture(BW_CASE | {"server.running": 1.0, "server.waiting": 0.0}, model=model))
        kinds = {f.kind: f.gain for f in d.fixes}
        assert not kinds.keys() & {FixKind.FP8_WEIGHTS, FixKind.INT4_WEIGHTS}
        gains[dtype] = kinds[FixKind.BATCH_MORE]
    assert gains["int3"] is not None and gains["int4"] is not None and 1 < gains["int3"] < gains["int4"]
    from diagnoser.characterise import characterise  # the in-place record names the precision

    model = llama_7b()
    model.dtype = "int2"
    ev = build_evidence(make_capture(BW_CASE, model=model))
    characterise(ev)
    assert ev.in_place[FixKind.INT4_WEIGHTS] == "the weights are already int2"


def test_a_host_fix_is_bounded_by_a_gpu_busy_all_the_time_and_says_so():
    ev = build_evidence(make_capture({"gpu.busy": 0.5}))
    f = Finding("T001", "t", Limiter.HOST_LAUNCH, 0.8, "m", fixes=(_fix(FixKind.REMOVE_SYNCS, 5.0),))
    (fix,), _ = judge_fixes([f], ev)
    assert fix.gain == pytest.approx(2.0)  # 1 / 0.5 busy
    assert fix.gain_kind is GainKind.UPPER_BOUND and "1 / 50% busy" in fix.capped


def test_a_gain_beyond_twenty_is_capped_and_labelled():
    ev = build_evidence(make_capture({"server.waiting": 3.0}, gpu=None))
    f = Finding("T001", "t", Limiter.BATCHING, 0.8, "m", fixes=(_fix(FixKind.BATCH_MORE, 46.5),))
    (fix,), _ = judge_fixes([f], ev)
    assert fix.gain == 20.0 and fix.is_upper_bound and "capped at 20x (from 46.5x)" in fix.capped


def test_a_fix_appears_once_and_names_every_rule_that_proposed_it():
    ev = build_evidence(make_capture({"gpu.busy": 0.9}))
    a = Finding("A001", "a", Limiter.HOST_LAUNCH, 0.9, "m", fixes=(_fix(FixKind.CUDA_GRAPHS, 1.1, rule="A001"),))
    b = Finding("B001", "b", Limiter.HOST_LAUNCH, 0.5, "m", fixes=(_fix(FixKind.CUDA_GRAPHS, 1.3, rule="B001"),))
    fixes, _ = judge_fixes([a, b], ev)
    assert len(fixes) == 1 and fixes[0].rules == ("A001", "B001") and fixes[0].gain == 1.1


def test_the_first_fix_addresses_the_verdict_and_capacity_comes_last():
    ev = build_evidence(make_capture({"gpu.busy": 0.2}))
    vram = Finding("V001", "v", Limiter.VRAM, 0.9, "m", fixes=(_fix(FixKind.FP8_KV, 1.2),))
    host = Finding("H001", "h", Limiter.HOST_LAUNCH, 0.95, "m", fixes=(_fix(FixKind.OFFLOAD_HOST_WORK, 3.0),))
    lat = Finding("L001", "l", Limiter.LATENCY, 0.7, "m",
                  fixes=(_fix(FixKind.BATCH_MORE, 9.0, benefit=Benefit.CAPACITY), _fix(FixKind.FUSE_KERNELS, 1.3)))
    fixes, _ = judge_fixes([vram, host, lat], ev)
    assert [f.kind for f in fixes] == [FixKind.FP8_KV, FixKind.OFFLOAD_HOST_WORK, FixKind.FUSE_KERNELS,
                                       FixKind.BATCH_MORE]


def test_serving_advice_is_withheld_from_a_training_job():
    trace = TraceSummary(kernel_count=5000, gpu_busy_frac=0.4, idle_frac_by_cause={"host": 0.5})
    cap = make_capture({}, trace=trace)
    ev = build_evidence(cap)
    ev.workload = "training"
    f = Finding("T001", "t", Limiter.BATCHING, 0.8, "m", fixes=(_fix(FixKind.BATCH_MORE, 2.0),
                                                                 _fix(FixKind.LARGER_BATCH, 1.5)))
    fixes, withheld = judge_fixes([f], ev)
    assert [x.kind for x in fixes] == [FixKind.LARGER_BATCH]
    assert "training job" in withheld[0].why


def test_every_page_that_states_a_threshold_states_the_one_in_force():
    import string

    for r in default_rules():
        named = {f for text in r.page.fields().values() for _, f, _, _ in string.Formatter().parse(text) if f}
        assert named, f"{r.code}'s page states none of its thresholds"
        odd = {name: t.value * 1.37 + 0.011 for name, t in r.thresholds.items()}
        assert r.page_for(odd) != r.page_for(), r.code
