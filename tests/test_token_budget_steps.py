"""The per-step token budget as a constraint on the step (BAT006), read from the tokens each step held: where the
engine counts them per step (llama.cpp's tokens over its llama_decode() calls, vLLM's V0 iteration histogram) and the
steps are full at the budget while requests wait, the budget binds whatever the sequence limit, and raising the
sequence limit (BAT005) is not the first fix: more sequences add no token to a full step. Each case beside its
neighbour: the same slots with steps far from full, and vLLM V1's histogram, which is no count per step."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from diagnoser import signals as S
from diagnoser.capture import ServerInfo, ServingConfig
from diagnoser.diagnosis import FixKind
from diagnoser.rules import diagnose
from tests.factories import make_capture
from tests.serving_pages import values
from tests.test_llamacpp_map import FIRST, SECOND, llama_capture, page, read, served  # noqa: F401 (served: a fixture)

# 2 slots both busy, 2 requests deferred all window: the slot limit is reached too.
SLOTS_FULL = {"server.running": 2.0, "server.waiting": [2.0] * 10, "server.gen_tokens_per_s": 3.0}


def codes(d: Any) -> list[str]:
    return [f.code for f in d.findings]


def test_the_tokens_per_decode_call_over_the_window_from_llama_cpps_counters(served: Any) -> None:
    """(2000 prompt + 800 generated tokens) over 400 llama_decode() calls: 7 tokens a step."""
    cap = read(served([page(FIRST), page(SECOND)]).url)
    assert values(cap, S.SERVER_ITERATION_TOKENS_MEAN) == [pytest.approx(2800 / 400)]


def test_steps_full_at_llama_cpps_batch_size_name_it_before_the_slots() -> None:
    """-np 2 -b 32 -ub 32 with 600-token prompts: each step holds about 30 of its 32 tokens, two slots busy, two
    requests deferred. The logical batch caps the step: raise --batch-size (and --ubatch-size, the physical batch
    the step is computed in), not --parallel."""
    d = diagnose(llama_capture({**SLOTS_FULL, "server.iteration_tokens_mean": 30.0},
                               serving={"max_num_seqs": 2, "max_num_batched_tokens": 32, "ubatch_size": 32}))
    assert "BAT006" in codes(d) and "BAT005" not in codes(d), codes(d)
    first = d.fixes[0]
    assert first.kind is FixKind.TOKEN_BUDGET, [(f.kind, f.action) for f in d.fixes]
    assert "llama.cpp --batch-size from 32 to about 128" in first.action, first.action
    assert "--ubatch-size from 32" in first.action, first.action
    assert not any(f.kind is FixKind.BATCH_MORE for f in d.fixes), [(f.kind, f.action) for f in d.fixes]


def test_with_the_prompt_length_known_the_budget_is_sized_for_two_prompts() -> None:
    d = diagnose(llama_capture({**SLOTS_FULL, "server.iteration_tokens_mean": 31.0, "server.prompt_len_mean": 601.0},
                               serving={"max_num_seqs": 2, "max_num_batched_tokens": 32, "ubatch_size": 512}))
    first = d.fixes[0]
    assert first.kind is FixKind.TOKEN_BUDGET and "to about 1280" in first.action, first.action
    assert "--ubatch-size" not in first.action.split("to about 1280")[0][-20:]
    assert "prefills in 19 steps" in first.action, first.action


@pytest.mark.parametrize("tokens", [7.0, 12.0])
def test_steps_far_from_full_leave_the_slot_limit_first(tokens: float) -> None:
    """The neighbour: the same two busy slots and deferred requests, but each step holds 7 (or 12) of 32 tokens:
    the steps have room, so the slots bind (BAT005, --parallel) and the budget is not named."""
    d = diagnose(llama_capture({**SLOTS_FULL, "server.iteration_tokens_mean": tokens},
                               serving={"max_num_seqs": 2, "max_num_batched_tokens": 32}))
    assert "BAT005" in codes(d) and "BAT006" not in codes(d), codes(d)
    assert d.fixes[0].kind is FixKind.BATCH_MORE and "--parallel" in d.fixes[0].action


def test_full_steps_with_nothing_waiting_are_not_a_binding_budget() -> None:
    """Steps full but no request waits: the budget holds nothing back."""
    d = diagnose(llama_capture({**SLOTS_FULL, "server.waiting": 0.0, "server.iteration_tokens_mean": 31.0},
                               serving={"max_num_seqs": 2, "max_num_batched_tokens": 32}))
    assert "BAT006" not in codes(d), codes(d)


def _vllm(version: str, signals: dict[str, Any], serving: dict[str, Any]) -> Any:
    cap = make_capture(signals, gpu=None)
    cap.server = ServerInfo(kind="vllm", version=version)
    typed = {k: v for k, v in serving.items() if k in ServingConfig.__struct_fields__}
    cap.serving = msgspec.structs.replace(cap.serving, engine="vllm", **typed)
    cap.cpu_only = True
    return cap


def test_vllm_v1s_iteration_histogram_is_not_read_as_full_steps() -> None:
    """vLLM V1 records a prompt's tokens when its first token comes out: a mean near the budget there says nothing
    of the step, so the sequence limit pinned with a queue stays BAT005."""
    signals = {"server.running": 2.0, "server.waiting": [6.0] * 10, "server.iteration_tokens_mean": 120.0}
    d = diagnose(_vllm("0.32.0+cpu", signals, {"max_num_seqs": 2, "max_num_batched_tokens": 128}))
    assert "BAT005" in codes(d) and d.fixes[0].kind is FixKind.BATCH_MORE, codes(d)
    # vLLM V0 counted per step: there the same steps are full at the budget
    d = diagnose(_vllm("0.6.3", signals, {"max_num_seqs": 2, "max_num_batched_tokens": 128}))
    assert "BAT006" in codes(d) and "BAT005" not in codes(d), codes(d)
    assert d.fixes[0].kind is FixKind.TOKEN_BUDGET and "--max-num-batched-tokens from 128" in d.fixes[0].action
