"""Issue 44, item 2: a batch what-if counts the part of the step's time beyond the roofline that grows with the
sequences (physics.realised: the arithmetic the roofline hides under the weight reads, the activations, the
engine's host work per sequence), not only the part fixed per step.

The published rows (tests/fixtures/published/results.json): Llama 3.1 405B FP8 on 8 MI300X under vLLM V0, batch 1
to 256 at 128 in / 128 out (Oracle). Held fixed per step, batch 1 -> 64 was over-predicted by 54 %, -> 128 by 90 %,
-> 256 by 137 %. With the growth counted, -> 64 lies within the corpus's 25 %; -> 128 and -> 256 do not yet (+28 %,
+41 %): those bounds are stated here, and the issue stays open for them (docs/physics.md, "Known misses").
"""

from __future__ import annotations

import pytest

from diagnoser.physics import (
    PER_SEQUENCE_HOST_S,
    generation_what_if,
    get_gpu,
    load_bundled_model,
    realised_range,
    realised_speedup,
)
from tests.test_physics_published import ROWS, SOURCES, gpu_of, predict, workload

BASE = "oci-405b-mi300x-b1"


def test_the_405b_mi300x_batch_64_jump_lies_within_the_tolerance() -> None:
    pair = predict(BASE, "oci-405b-mi300x-b64")
    assert pair.measured == pytest.approx(32.9, abs=0.05)
    assert abs(pair.error) <= 0.25, pair  # +54 % with the time beyond the roofline held fixed per step


@pytest.mark.parametrize(("row", "bound"), [("oci-405b-mi300x-b128", 0.30), ("oci-405b-mi300x-b256", 0.45)])
def test_the_405b_mi300x_jumps_of_128x_and_more_reach_the_stated_bound(row: str, bound: float) -> None:
    """Not yet within 25 % (issue 44 item 2 stays open for them): +28 % and +41 %, against +90 % and +137 % with the
    time beyond the roofline fixed per step. Still over-promised: the growth counted is about half the source's."""
    pair = predict(BASE, row)
    assert 0.25 < pair.error <= bound, pair


def test_the_405b_mi300x_batch_jumps_all_improve_on_the_fixed_overhead() -> None:
    for k in (2, 4, 8, 16, 32, 64, 128, 256):
        new = predict(BASE, f"oci-405b-mi300x-b{k}")
        old = predict(BASE, f"oci-405b-mi300x-b{k}", per_sequence=False)
        assert abs(new.error) <= abs(old.error) + 1e-9, (k, new.error, old.error)
        assert new.low is not None and new.high is not None
        assert new.low <= new.predicted <= new.high and new.high == pytest.approx(old.predicted)


def test_small_batch_jumps_on_a_short_context_stay_right() -> None:
    """Where the per-step model was right (a few sequences, 128-token prompts) it stays right: the growth of a
    handful of sequences is small beside a step's fixed time."""
    for k, was in ((2, 0.01), (4, 0.04), (8, 0.09)):
        pair = predict(BASE, f"oci-405b-mi300x-b{k}")
        assert abs(pair.error) <= was + 0.005, (k, pair.error)
    # TensorRT-LLM's GPT-J, batch 1 -> 64 at 128 + 128 tokens (no published host cost a sequence: none counted)
    for base, row in (("h100vsa100-a100-b1", "h100vsa100-a100-b64"), ("h100vsa100-h100-b1", "h100vsa100-h100-b64")):
        assert abs(predict(base, row).error) <= 0.25


def test_the_engine_names_its_host_work_and_an_unknown_one_counts_none() -> None:
    assert SOURCES["oci-mi300x-405b"]["engine"] == "vllm-v0"
    assert {"vllm-v0": pytest.approx(1e-4)} == PER_SEQUENCE_HOST_S
    base, row = ROWS[BASE], ROWS["oci-405b-mi300x-b64"]
    works = workload(base, gpu_of(base, measured=True)), workload(row, gpu_of(row, measured=True))
    efficiency = 0.42
    known = realised_range(works[0], works[1], efficiency, engine="vLLM-V0")
    unknown = realised_range(works[0], works[1], efficiency)
    assert known.value < unknown.value  # host work a sequence slows the large batch
    assert known.value == pytest.approx(realised_speedup(works[0], works[1], efficiency, host_per_sequence_s=1e-4))
    assert unknown.value == pytest.approx(realised_speedup(works[0], works[1], efficiency))
    # one range whatever the engine: from the time beyond the roofline fixed per step to vLLM V0's host work added
    assert (known.low, known.high) == pytest.approx((unknown.low, unknown.high))
    assert unknown.high == pytest.approx(realised_speedup(works[0], works[1], efficiency, per_sequence=False))
    assert "vllm-v0's host work" in known.basis.lower() and "no host work per sequence" in unknown.basis


def test_the_growth_never_exceeds_what_the_baseline_shows() -> None:
    """A step measured near its attainable roofline has little time beyond it: the part that grows with the batch
    is capped at that time (the fixed part is never negative), so however large the host work a sequence assumed,
    the baseline's time beyond the roofline, all of it per sequence, is the most the large batch pays."""
    base, row = ROWS[BASE], ROWS["oci-405b-mi300x-b256"]
    works = workload(base, gpu_of(base, measured=True)), workload(row, gpu_of(row, measured=True))
    tight = works[0].ceiling_s / (works[0].attained_s * 1.001)  # 0.1 % beyond the attained roofline
    capped = [realised_speedup(works[0], works[1], tight, host_per_sequence_s=h) for h in (1e-3, 1e-1)]
    assert capped[0] == pytest.approx(capped[1], rel=2e-3)
    overhead = (works[0].ceiling_s / tight - works[0].attained_s) / works[0].steps
    after_s = works[1].attained_s + works[1].steps * overhead * 256
    # (the growth is about linear in the batch: its hidden arithmetic and activations are, the host work is)
    assert capped[0] == pytest.approx((works[1].tokens / after_s) / (works[0].tokens * tight / works[0].ceiling_s),
                                      rel=2e-3)
    assert capped[0] < realised_speedup(works[0], works[1], tight, per_sequence=False)


def test_a_batch_what_if_prints_its_range() -> None:
    llama = load_bundled_model("llama-3.1-8b")
    h100 = get_gpu("h100-sxm")
    result = generation_what_if(llama, h100, "bf16", 1, 128, 128, 64, efficiency=0.4, engine="vllm-v0")
    assert result.realised_speedup is not None and result.realised_low is not None
    assert result.realised_high is not None
    assert result.realised_low <= result.realised_speedup < result.realised_high  # V0's host work: the low end
    assert " to x" in result.explanation and "grows with the batch" in result.explanation
    assert any(note.startswith("realised range x") and "vLLM V0" in note for note in result.assumptions)
    plain = generation_what_if(llama, h100, "bf16", 1, 128, 128, 64, efficiency=0.4)
    assert plain.realised_speedup is not None and plain.realised_speedup > result.realised_speedup
