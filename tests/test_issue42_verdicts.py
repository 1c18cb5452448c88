"""Verdicts against the target's own use (issue 42, items 6, 7 and 9): an idle verdict contradicted by the server's
own CPU or GPU does not stand; neighbours' load does not decide an idle server's verdict; vLLM V1's
iteration-tokens histogram is not read as work per step."""

from __future__ import annotations

from diagnoser.rules import diagnose
from tests.test_rules_server_load import capture

# 4 closed-loop clients on vLLM's CPU build: the engine used 1.87 of 2 cores while its running gauge read 0 in 8 of
# 10 scrapes (it updates in bursts), so the gauge's mean was 0.4 and nothing waited.
BUSY_GAUGE_ZERO = {"server.running": [0, 0, 0, 2, 0, 0, 0, 2, 0, 0], "server.waiting": 0.0,
                   "host.target_cpu": 1.87, "host.cores": 2.0, "host.cpu_frac": 0.95, "host.others_cpu": 0.02}


def test_an_idle_verdict_the_servers_own_cpu_contradicts_does_not_stand() -> None:
    d = diagnose(capture(BUSY_GAUGE_ZERO, serving={"max_num_seqs": 16}))
    assert "IDLE002" in [f.code for f in d.findings]  # the gauges still read idle, and the finding says so
    assert d.verdict != "idle", d.headline
    assert d.verdict == "inconclusive" and "1.87 of the host's 2 cores" in d.headline
    assert any("does not stand" in n for n in d.notes)
    # the same gauges with the engine at rest: idle stands
    quiet = diagnose(capture({**BUSY_GAUGE_ZERO, "host.target_cpu": 0.03}, serving={"max_num_seqs": 16}))
    assert quiet.verdict == "idle"


def test_an_idle_verdict_the_gpu_contradicts_does_not_stand() -> None:
    signals = {"server.running": 0.4, "server.waiting": 0.0, "gpu.busy": 0.95}
    d = diagnose(capture(signals, serving={"max_num_seqs": 16}, gpu=True, cpu_only=False))
    assert d.verdict != "idle" and "GPU was busy 95%" in d.headline


def test_neighbours_load_does_not_decide_an_idle_servers_verdict() -> None:
    """No request in the window, the target at 0.02 cores, other tenants at 2 of 2 cores: HOST004 said "the server
    waits for CPU" and outranked IDLE; on a quiet host the same server read idle."""
    idle = {"server.running": 0.0, "server.waiting": 0.0, "host.target_cpu": 0.02, "host.cores": 2.0,
            "host.cpu_frac": 1.0, "host.others_cpu": 1.95}
    d = diagnose(capture(idle, serving={"max_num_seqs": 16}))
    assert "HOST004" not in [f.code for f in d.findings]
    assert d.verdict == "idle"
    # a server that does want the CPU, its threads seen waiting for it, is still starved by them
    starved = {**idle, "host.target_cpu": 0.5, "host.target_cpu_wait": 0.45, "server.running": 4.0}
    assert "HOST004" in [f.code for f in diagnose(capture(starved, serving={"max_num_seqs": 16})).findings]


def test_vllm_v1_iteration_tokens_are_not_read_as_work_per_step() -> None:
    """A real vLLM (CPU build, V1) with --max-num-batched-tokens 128: no step can hold more than 128 tokens, yet its
    iteration_tokens_total reads 997 at p99 (a prompt counted whole when its first token comes out). SRV004 may not
    read it as tokens per step: it cannot decide, and says why."""
    from pathlib import Path

    from diagnoser import signals as S
    from diagnoser.capture import load
    from diagnoser.pipeline import diagnose_capture

    vllm = Path(__file__).resolve().parent / "fixtures" / "vllm"
    o = diagnose_capture(load(vllm / "budget-capped.dgc"))
    assert o.capture.serving.max_num_batched_tokens == 128
    p99 = o.evidence.value(S.SERVER_ITERATION_TOKENS_P99)
    assert p99 is not None and p99 > 128  # what a per-step reading cannot be
    for name in ("kv-capped", "batch-capped", "budget-loose"):
        d = diagnose_capture(load(vllm / f"{name}.dgc")).diagnosis
        assert "SRV004" not in [f.code for f in d.findings]
        (why,) = [s.reason for s in d.skipped if s.code == "SRV004"]
        assert "vLLM 0.32.0 records iteration_tokens_total when a request's first token comes out" in why
        assert not any(c.signal.startswith("server.iteration_tokens") for f in d.findings for c in f.citations)
