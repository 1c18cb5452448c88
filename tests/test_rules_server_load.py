"""Load rules from the server's own signals and the host (BAT005, IDLE002, SRV009, HOST004), the KV fix naming the
knob in force, the prefix-cache bound from tokens, and the label matchers the engine tables use. Each case is one a
real vLLM (CPU build) got wrong: see tests/test_real_vllm.py for the same situations on the real engine."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from diagnoser.capture import ServerInfo, ServingConfig
from diagnoser.collectors.server_maps import parse_spec
from diagnoser.collectors.server_metrics import _select
from diagnoser.diagnosis import Benefit, FixKind, GainKind
from diagnoser.rules import diagnose
from diagnoser.units import fmt_bucket
from tests.factories import make_capture


def capture(signals: dict[str, Any], *, serving: dict | None = None, gpu: bool = False, cpu_only: bool = True) -> Any:
    cap = make_capture(signals, gpu="NVIDIA H100 80GB HBM3" if gpu else None)
    cap.server = ServerInfo(kind="vllm")
    typed = {k: v for k, v in (serving or {}).items() if k in ServingConfig.__struct_fields__}
    extra = {k: str(v) for k, v in (serving or {}).items() if k not in typed}
    cap.serving = msgspec.structs.replace(cap.serving, engine="vllm", **typed, extra=extra)
    cap.cpu_only = cpu_only
    return cap


# --- BAT005: the batch pinned at --max-num-seqs while requests queue --------------------------------------------

def test_batch_pinned_at_the_limit_is_batching_limited_with_a_throughput_bound():
    """--max-num-seqs 2, 12 clients: 2 running in every sample, about 10 waiting, KV 10 % used. The tool said
    'capacity, not speed, gain not predictable' and ranked it behind SRV004; re-measured x2.36 at 16."""
    d = diagnose(capture({"server.running": 2.0, "server.waiting": 10.0, "server.kv_usage": 0.1},
                         serving={"max_num_seqs": 2}))
    assert d.verdict == "batching" and "limit of 2" in d.headline
    fix = d.fixes[0]
    assert fix.kind is FixKind.BATCH_MORE and fix.benefit is Benefit.SPEED
    assert "--max-num-seqs 12" in fix.action
    # No roofs to price the step: the batch ratio is in the basis, not promised (a real vLLM gave x4.1 and x8.7).
    assert fix.gain is None and "x6.0 at an unchanged step time" in fix.basis


def test_batch_pinned_bound_is_cut_by_the_kv_room():
    d = diagnose(capture({"server.running": 4.0, "server.waiting": 20.0, "server.kv_usage": 0.45},
                         serving={"max_num_seqs": 4}))
    fix = d.fixes[0]
    assert fix.kind is FixKind.BATCH_MORE and "--max-num-seqs 8" in fix.action  # 4 x 0.9 / 0.45 = 8 fit
    assert "x2.0 at an unchanged step time" in fix.basis and "KV cache has room" in fix.basis


@pytest.mark.parametrize("signals, seqs", [
    ({"server.running": 2.0, "server.waiting": 10.0, "server.kv_usage": 0.1}, None),  # limit not known
    ({"server.running": 5.0, "server.waiting": 10.0, "server.kv_usage": 0.1}, 16),  # below the limit
    ({"server.running": 2.0, "server.waiting": 0.0, "server.kv_usage": 0.1}, 2),  # nothing waits
    ({"server.running": 2.0, "server.waiting": 10.0, "server.kv_usage": 0.97}, 2),  # the KV cache holds the queue
])
def test_batch_pinned_must_not_fire(signals, seqs):
    d = diagnose(capture(signals, serving={"max_num_seqs": seqs} if seqs else None))
    assert "BAT005" not in [f.code for f in d.findings]


# --- IDLE002: under-loaded, from the server's signals alone -------------------------------------------------------

def test_one_client_in_sequence_is_under_loaded_not_batching():
    d = diagnose(capture({"server.running": [1.0, 1.0, 0.0, 1.0] * 5, "server.waiting": 0.0},
                         serving={"max_num_seqs": 16}))
    assert d.verdict == "idle" and "of a limit of 16" in d.headline
    assert d.fixes[0].kind is FixKind.RIGHT_SIZE and d.fixes[0].gain is None
    assert d.fixes[0].benefit is Benefit.CAPACITY


def test_moderate_load_is_not_under_loaded():
    d = diagnose(capture({"server.running": 4.0, "server.waiting": 0.0}, serving={"max_num_seqs": 16}))
    assert "IDLE002" not in [f.code for f in d.findings]


@pytest.mark.parametrize(("rejected", "idle"), [(8.0, False), (5.0, False), (1.0, True), (0.0, True)])
def test_a_light_server_is_under_loaded_unless_most_answers_were_refusals(rejected: float, idle: bool) -> None:
    """Few requests in flight and none waiting reads as light load, but where most of the API's answers were 4xx
    refusals (prompts over the context) the clients offer load the server turns away: SRV010's fix comes first, not
    right-sizing. A server that refused a few of many requests is still light, and right-sizing still stands."""
    d = diagnose(capture({"server.running": [1.0, 0.0] * 10, "server.waiting": 0.0,
                          "server.http_requests_per_s": 10.0, "server.http_rejected_per_s": rejected},
                         serving={"max_num_seqs": 16}))
    codes = [f.code for f in d.findings]
    assert ("IDLE002" in codes) is idle, codes
    if rejected:
        assert "SRV010" in codes, codes
    if not idle:
        assert d.fixes[0].kind is FixKind.CONTEXT_LENGTH, [(f.kind, f.action) for f in d.fixes]


# --- SRV009: clients giving up --------------------------------------------------------------------------------

def test_aborts_counted_by_the_engine_are_said():
    d = diagnose(capture({"server.running": 2.0, "server.waiting": 10.0, "server.kv_usage": 0.1,
                          "server.aborts_per_s": 3.0, "server.requests_per_s": 1.0}, serving={"max_num_seqs": 2}))
    assert d.verdict == "batching"  # SRV009 qualifies the verdict, never names it
    (f,) = [f for f in d.findings if f.code == "SRV009"]
    assert "75% of the requests that ended were abandoned" in f.message


def test_requests_answered_by_http_but_never_finished_by_the_engine_are_abandoned():
    """vLLM 0.32 cancels a request whose client left in its front end: no finished_reason counts it, the HTTP
    counter does."""
    d = diagnose(capture({"server.running": 2.0, "server.waiting": 10.0, "server.kv_usage": 0.1,
                          "server.aborts_per_s": 0.0, "server.http_requests_per_s": 4.0,
                          "server.requests_per_s": 1.0}, serving={"max_num_seqs": 2}))
    (f,) = [f for f in d.findings if f.code == "SRV009"]
    assert "75%" in f.message and "3.00/s against 1.00/s served" in f.message
    quiet = diagnose(capture({"server.running": 2.0, "server.waiting": 10.0, "server.http_requests_per_s": 1.02,
                              "server.requests_per_s": 1.0}, serving={"max_num_seqs": 2}))
    assert "SRV009" not in [f.code for f in quiet.findings]


# --- HOST004: other processes take the host's CPU ----------------------------------------------------------------

def test_host_taken_by_other_processes_is_host_limited():
    """Numbers from the real vLLM (CPU build) in CI: 8 spinning processes took 0.6 of 2 cores, its busiest thread
    waited 46 % of the time for a CPU, tokens/s fell 4.3x against the same load alone (others 0.1, wait 22 %)."""
    busy = {"host.cpu_frac": 1.0, "host.others_cpu": 0.6, "host.cores": 2.0, "host.target_cpu": 1.32,
            "host.target_cpu_wait": 0.46, "server.running": 4.0, "server.waiting": 0.0}
    d = diagnose(capture(busy, serving={"max_num_seqs": 16}))
    assert d.verdict == "host_launch"
    fix = d.fixes[0]
    # The share of CPU taken (x1.45) did not bound the 4.3x loss: no gain is promised.
    assert fix.kind is FixKind.HOST_CPU and fix.gain is None and "no bound" in fix.basis
    alone = {**busy, "host.others_cpu": 0.1, "host.target_cpu": 1.81, "host.target_cpu_wait": 0.22}
    assert "HOST004" not in [f.code for f in diagnose(capture(alone)).findings]
    unseen = {k: v for k, v in busy.items() if k != "host.target_cpu_wait"}  # no schedstat: others alone decide
    assert "HOST004" not in [f.code for f in diagnose(capture(unseen)).findings]
    assert "HOST004" in [f.code for f in diagnose(capture({**unseen, "host.others_cpu": 0.9})).findings]


# --- the KV fix names the knob that caps this server -------------------------------------------------------------

KV_FULL = {"server.kv_usage": 0.98, "server.waiting": 9.0, "server.running": 2.0, "server.preemptions_per_s": 0.5}


def test_kv_fix_names_the_block_override_in_force():
    d = diagnose(capture(KV_FULL, serving={"num_gpu_blocks_override": 24, "block_size": 16}))
    assert d.verdict == "vram"
    fix = next(f for f in d.fixes if f.kind is FixKind.KV_MEMORY)
    assert "--num-gpu-blocks-override" in fix.action and "24 blocks of 16 tokens" in fix.action
    assert "--gpu-memory-utilization" not in fix.action


def test_kv_fix_on_the_cpu_build_names_its_kv_space():
    fix = next(f for f in diagnose(capture(KV_FULL)).fixes if f.kind is FixKind.KV_MEMORY)
    assert "VLLM_CPU_KVCACHE_SPACE" in fix.action
    gpu = next(f for f in diagnose(capture(KV_FULL, gpu=True, cpu_only=False)).fixes if f.kind is FixKind.KV_MEMORY)
    assert "--gpu-memory-utilization" in gpu.action


# --- SRV001: the prefix cache's bound from the tokens processed ---------------------------------------------------

def test_prefix_cache_bound_from_tokens_holds_the_realised_gain():
    """Prompt tokens 67x the generated ones, 97 % of each prompt shared: the old basis said 'up to +14 %' from
    request times and an assumed 50 % shared; the real engine gave x5.09 with the cache on."""
    d = diagnose(capture({"server.prompt_len_mean": [1000.0], "server.prompt_tokens_per_s": 670.0,
                          "server.gen_tokens_per_s": 10.0, "server.prefill_time_mean_s": [0.1],
                          "server.decode_time_mean_s": [0.6]}, serving={"prefix_caching": False}))
    fix = next(f for f in d.fixes if f.kind is FixKind.PREFIX_CACHING)
    assert fix.gain_kind is GainKind.UPPER_BOUND and fix.gain >= 5.09
    assert "prompt tokens are 99% of the tokens processed" in fix.basis


# --- formatting and label matchers ------------------------------------------------------------------------------

def test_bucketed_quantiles_are_shown_as_their_bucket():
    assert fmt_bucket(0.509, "tokens", (0.0, 1.0)) == "<= 1 tokens (the histogram's first bucket)"
    assert fmt_bucket(39.5, "s", (20.0, 40.0)) == "20.00 s to 40.00 s (histogram bucket)"
    assert fmt_bucket(12.0, "s", (10.0, float("inf"))).startswith("> 10.00 s")
    assert fmt_bucket(0.25, "s", None) == "250.0 ms"


def test_label_matchers_select_as_promql_does():
    samples = {"vllm:request_success_total": [({"finished_reason": r}, v) for r, v in
                                              (("stop", 1.0), ("length", 5.0), ("abort", 7.0), ("error", 2.0))]}
    assert sum(_select(samples, 'vllm:request_success_total{finished_reason!~"abort|error"}') or []) == 6.0
    assert _select(samples, 'vllm:request_success_total{finished_reason="abort"}') == [7.0]
    assert sum(_select(samples, 'vllm:request_success_total{finished_reason!="abort"}') or []) == 8.0
    old = {"vllm:request_success_total": [({}, 9.0)]}  # a page without the label: the spec is not there
    assert _select(old, 'vllm:request_success_total{finished_reason!~"abort|error"}') is None
    assert parse_spec('x{a=~"b.*"}')[1] is not None


def test_a_trace_without_gpu_work_does_not_lower_a_server_verdict():
    """`attach --trace` on a CPU vLLM: the trace holds CPU ops only; the KV verdict from the server's signals stands
    (it read INCONCLUSIVE: 'the trace holds only 0 GPU kernels ... x0.40')."""
    from diagnoser.capture import TraceSummary
    cap = capture(KV_FULL, serving={"num_gpu_blocks_override": 24, "block_size": 16})
    plain = diagnose(cap)
    cap.trace = TraceSummary(kernel_count=0, window_s=5.0)
    traced = diagnose(cap)
    assert traced.verdict == plain.verdict == "vram"
    assert traced.confidence == pytest.approx(plain.confidence)
    assert not any("GPU kernel" in r for r in traced.confidence_reasons)


def test_the_engines_own_flop_and_byte_estimates_place_the_work_against_the_roofs():
    """vLLM's estimated_{flops,read_bytes,write_bytes}_per_gpu_total give achieved FLOP/s and bytes/s where GPM and
    DCGM's profiling fields are absent: they set how close the work runs to each roof."""
    from diagnoser.evidence_build import build_evidence
    from diagnoser.physics import match_gpu, peak_flops

    cap = capture({"server.est_read_bytes_per_s": 2.2e12, "server.est_write_bytes_per_s": 0.2e12,
                   "server.est_flops_per_s": 1.0e14, "server.running": 8.0, "server.waiting": 0.0},
                  gpu=True, cpu_only=False)
    ev = build_evidence(cap)
    spec = match_gpu("NVIDIA H100 80GB HBM3", None)
    assert spec is not None
    hbm, flops = ev.get("theory.hbm_roof_frac"), ev.get("theory.compute_roof_frac")
    assert hbm is not None and hbm.value == pytest.approx(2.4e12 / spec.hbm_bytes_per_s)
    assert flops is not None and flops.value == pytest.approx(1.0e14 / peak_flops(spec, "bf16"))


def test_an_estimate_counter_that_never_moved_is_not_a_measurement_of_zero():
    """On vLLM's CPU build the estimate counters stay at 0: no server.est_* signal, rather than '0 B/s'."""
    from diagnoser.capture import new_capture
    from diagnoser.collectors.server_metrics import ServerMetricsCollector
    from tests.test_server_metrics import Endpoint

    ep = Endpoint()
    try:
        base = ('vllm:num_requests_running{{engine="0"}} 2\nvllm:estimated_flops_per_gpu_total{{engine="0"}} {f}\n'
                'vllm:generation_tokens_total{{engine="0"}} {g}\n')
        for flops, expect in ((0.0, False), (None, True)):
            cap = new_capture("t")
            collector = ServerMetricsCollector(ep.url, None)
            collector.start(cap)
            for i, t in enumerate((0.0, 1.0, 2.0)):
                ep.body = base.format(f=flops if flops is not None else 1e12 * i, g=10 * i)
                collector.sample(t)
            collector.stop(2.0)
            found = cap.series_named("server.est_flops_per_s")
            assert bool(found and found[0].values) is expect
            if expect:
                assert found[0].values == [pytest.approx(1e12)] * 2
    finally:
        ep.close()


def test_the_kv_fix_is_not_capped_by_the_recompute_saved():
    """A real vLLM with its KV pool forced small (12 clients, room for 3): VRAM001 sizes more KV memory by the
    waiting requests running too (up to x4.34 there, x3.96 realised); SRV006's 'stop evicting' bound counts only the
    recompute saved (+1 %). Merged as one fix, the tighter bound made the KV fix '+1 %' and ranked it last, behind
    three unsized fixes; they are two levers, each with its own number."""
    churn = {**KV_FULL, "server.requests_per_s": 1.0, "server.prompt_len_mean": [64.0], "server.gen_len_mean": [64.0],
             "server.prefill_time_mean_s": [0.01], "server.decode_time_mean_s": [0.5]}
    d = diagnose(capture(churn, serving={"num_gpu_blocks_override": 12, "block_size": 32}))
    assert d.verdict == "vram"
    assert d.fixes[0].kind is FixKind.KV_MEMORY and d.fixes[0].gain is not None and d.fixes[0].gain >= 2.0
    stop = next(f for f in d.fixes if f.kind is FixKind.STOP_PREEMPTION)
    assert stop.gain is not None and stop.gain < 1.2 and stop.rules == ("SRV006",)
