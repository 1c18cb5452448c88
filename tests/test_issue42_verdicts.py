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
