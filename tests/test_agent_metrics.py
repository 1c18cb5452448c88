"""The agent's Prometheus metrics: values per target, the HTTP endpoint, the node_exporter textfile."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diagnoser.agent.history import ERROR, OK, TIMEOUT, RunRecord
from diagnoser.agent.metrics import VERDICTS, AgentMetrics, MetricsServer, write_textfile
from diagnoser.errors import SourceUnavailable


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _labels(target: str, gpu: str = "0", pod: str = "ns/llama-0", **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"target": target, "gpu": gpu, "pod": pod, **extra}.items()))


def _metrics() -> AgentMetrics:
    m = AgentMetrics()
    m.record_run(RunRecord(target="llama", started_at=100.0, finished_at=112.5, status=OK, verdict="batching",
                           confidence=0.8, efficiency=0.35, top_fix="Raise max_num_seqs", top_fix_rule="BATCH001",
                           top_fix_gain=1.9, gpu="0", pod="ns/llama-0",
                           problems=["dcgm: dcgm-exporter at http://x is unreachable", "server: down"]))
    m.record_run(RunRecord(target="llama", started_at=200.0, finished_at=201.0, status=ERROR,
                           error="no process with PID 7 is running."))
    m.record_run(RunRecord(target="stuck", started_at=300.0, finished_at=370.0, status=TIMEOUT, error="killed"))
    m.record_cycle(400.0, 12.0)
    return m


def test_values_per_target() -> None:
    s = _samples(_metrics().exposition().decode())
    lab = _labels("llama")
    for verdict in VERDICTS:
        assert s[("diagnoser_verdict", _labels("llama", limiter=verdict))] == (1.0 if verdict == "batching" else 0.0)
    assert s[("diagnoser_confidence", lab)] == 0.8
    assert s[("diagnoser_efficiency_ratio", lab)] == 0.35
    assert s[("diagnoser_top_fix_gain_ratio", _labels("llama", rule="BATCH001"))] == 1.9
    # The newest run failed: the verdict stays the last known one, the run is marked not ok.
    assert s[("diagnoser_last_run_ok", lab)] == 0.0
    assert s[("diagnoser_last_run_timestamp_seconds", lab)] == 201.0
    assert s[("diagnoser_last_success_timestamp_seconds", lab)] == 112.5
    assert s[("diagnoser_runs_total", lab)] == 2.0
    assert s[("diagnoser_run_errors_total", _labels("llama", kind="error"))] == 1.0
    stuck = _labels("stuck", gpu="", pod="")
    assert s[("diagnoser_run_errors_total", _labels("stuck", gpu="", pod="", kind="timeout"))] == 1.0
    assert s[("diagnoser_last_run_duration_seconds", stuck)] == 70.0
    assert ("diagnoser_verdict", _labels("stuck", gpu="", pod="", limiter="batching")) not in s  # never had one
    assert s[("diagnoser_agent_cycles_total", ())] == 1.0
    assert s[("diagnoser_agent_last_cycle_duration_seconds", ())] == 12.0
    assert s[("diagnoser_agent_info", (("version", __import__("diagnoser").__version__),))] == 1.0


def test_unavailable_sources_follow_the_newest_run() -> None:
    m = AgentMetrics()
    m.record_run(RunRecord(target="a", started_at=1, finished_at=2, status=OK, verdict="vram", confidence=0.9,
                           problems=["dcgm: unreachable", "dcgm: also", "server: down"]))
    s = _samples(m.exposition().decode())
    assert {dict(k[1])["source"] for k in s if k[0] == "diagnoser_source_unavailable"} == {"dcgm", "server"}
    m.record_run(RunRecord(target="a", started_at=3, finished_at=4, status=OK, verdict="vram", confidence=0.9))
    s = _samples(m.exposition().decode())
    assert not [k for k in s if k[0] == "diagnoser_source_unavailable"]


def test_forget_drops_targets_that_went_away() -> None:
    m = _metrics()
    m.forget({"llama"})
    text = m.exposition().decode()
    assert 'target="llama"' in text and 'target="stuck"' not in text


def test_restore_from_history_does_not_count_runs() -> None:
    m = AgentMetrics()
    ok = RunRecord(target="a", started_at=1, finished_at=2, status=OK, verdict="compute", confidence=0.6)
    failed = RunRecord(target="a", started_at=3, finished_at=4, status=ERROR, error="gone")
    m.restore(failed, ok)
    s = _samples(m.exposition().decode())
    lab = _labels("a", gpu="", pod="")
    assert s[("diagnoser_verdict", _labels("a", gpu="", pod="", limiter="compute"))] == 1.0
    assert s[("diagnoser_runs_total", lab)] == 0.0 and s[("diagnoser_last_run_ok", lab)] == 0.0
    assert s[("diagnoser_last_success_timestamp_seconds", lab)] == 2


def test_served_over_http_on_loopback() -> None:
    m = _metrics()
    server = MetricsServer(m, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert ("diagnoser_confidence", _labels("llama")) in _samples(body)
        # Numbers change between scrapes without re-registering anything.
        m.record_run(RunRecord(target="new", started_at=1, finished_at=2, status=OK, verdict="idle",
                               confidence=0.5))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert 'target="new"' in r.read().decode()
        # A second server on the same port is one sentence, not a traceback.
        with pytest.raises(SourceUnavailable, match=f"cannot serve metrics on 127.0.0.1:{server.port}"):
            MetricsServer(m, "127.0.0.1", server.port)
    finally:
        server.close()
    with socket.socket() as s:  # closed for real: the port can be listened on again (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
        s.listen()


def test_textfile_is_whole_and_parseable(tmp_path: Path) -> None:
    path = tmp_path / "textfile" / "diagnoser.prom"
    m = _metrics()
    write_textfile(m, path)
    first = path.read_text()
    assert ("diagnoser_verdict", _labels("llama", limiter="batching")) in _samples(first)
    m.record_cycle(500.0, 1.0)
    write_textfile(m, path)
    assert _samples(path.read_text())[("diagnoser_agent_cycles_total", ())] == 2.0
    # Nothing but the .prom file is left for node_exporter to trip over.
    assert [p.name for p in path.parent.iterdir()] == ["diagnoser.prom"]


def test_a_diagnosis_reaches_history_and_metrics(tmp_path: Path) -> None:
    """From a capture to the exported numbers: efficiency against the physical ceiling and the top fix's gain."""
    from diagnoser.agent.history import HistoryStore
    from diagnoser.agent.worker import verdict_fields
    from diagnoser.evidence_build import build_evidence
    from diagnoser.rules.engine import diagnose_evidence
    from tests.factories import llama_7b, make_capture

    capture = make_capture({"gpu.busy": 0.9, "server.running": 4, "server.waiting": 20, "server.kv_usage": 0.2,
                            "server.gen_tokens_per_s": 120.0}, model=llama_7b())
    evidence = build_evidence(capture)
    diagnosis = diagnose_evidence(evidence)
    fields = verdict_fields(evidence, diagnosis)
    ceiling = evidence.get("theory.decode_ceiling_tokens_per_s")
    assert ceiling is not None and fields["efficiency"] == pytest.approx(120.0 / ceiling.values[0])
    top = diagnosis.fixes[0]
    assert (fields["top_fix"], fields["top_fix_rule"], fields["top_fix_gain"]) == (top.title, top.rule, top.gain)
    assert top.gain is not None and fields["verdict"] == diagnosis.verdict

    run = RunRecord(target="llama", started_at=1.0, finished_at=2.0, gpu="0",
                    **{k: v for k, v in fields.items() if k != "diagnosis"}, diagnosis=fields["diagnosis"])
    with HistoryStore(tmp_path / "h.db") as store:
        store.add(run)
        (stored,) = store.runs(with_diagnosis=True)
    assert stored.efficiency == fields["efficiency"]
    assert stored.diagnosis == json.loads(json.dumps(fields["diagnosis"]))  # tuples come back as lists
    m = AgentMetrics()
    m.record_run(stored)
    s = _samples(m.exposition().decode())
    lab = _labels("llama", pod="")
    assert s[("diagnoser_efficiency_ratio", lab)] == pytest.approx(fields["efficiency"])
    assert s[("diagnoser_top_fix_gain_ratio", _labels("llama", pod="", rule=top.rule))] == pytest.approx(top.gain)
    assert s[("diagnoser_verdict", _labels("llama", pod="", limiter=diagnosis.verdict))] == 1.0
