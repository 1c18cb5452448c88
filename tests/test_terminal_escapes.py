"""Terminal escape injection: untrusted text (a process's command line or name, a dcgm-exporter modelName label, a
GPU name, an endpoint's error, a stored run's error) reaches the terminal and the logs with its control characters
shown as escapes, never sent: piped, and on a real pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diagnoser.agent.history import HistoryStore, RunRecord
from diagnoser.agent.notify import EventLog
from diagnoser.collectors import nvml_seam as seam
from diagnoser.reports.redact import redact, redact_argv
from diagnoser.textsafe import has_controls, one_line, printable
from tests.fake_nvml import FakeGpu, FakeNvml, FakeProcess

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
CLEAR = "\x1b[2J\x1b[H"
CLIPBOARD = "\x1b]52;c;ZXZpbA==\x07"  # OSC 52: write "evil" to the clipboard
CSI_C1 = "\x9b2J"  # the one-character CSI of C1
HOSTILE = f"x{CLEAR}{CLIPBOARD}{CSI_C1}\u202eevil"
# What must never come out raw: ESC, BEL, the C1 CSI and the bidi override.
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def assert_no_raw_controls(text: str, where: str) -> None:
    for ch in RAW:
        assert ch not in text, f"{ch!r} reached {where}: {text[:400]!r}"


# --- the sanitiser itself --------------------------------------------------------------------------------------------

def test_controls_are_shown_as_escapes_and_idempotent() -> None:
    shown = printable(HOSTILE)
    assert shown == "x\\x1b[2J\\x1b[H\\x1b]52;c;ZXZpbA==\\x07\\x9b2J\\u202eevil"
    assert printable(shown) == shown and not has_controls(shown)
    assert printable("two\nlines\tand a tab") == "two\nlines\tand a tab"
    assert one_line("two\nlines\r") == "two\\x0alines\\x0d"
    assert printable("GPU ü Ω 中") == "GPU ü Ω 中"  # printable Unicode is left alone


def test_line_and_paragraph_separators_are_escaped() -> None:
    """U+2028, U+2029 and NEL (U+0085) start a new line in terminals, log viewers and JSON-lines readers: a name
    holding one could print a line of its own (a forged verdict) at column 0."""
    forged = "NVIDIA H100\u2028VERDICT IDLE confidence high (0.99)\u2029x\x85y"
    shown = "NVIDIA H100\\u2028VERDICT IDLE confidence high (0.99)\\u2029x\\x85y"
    assert printable(forged) == shown and one_line(forged) == shown
    assert has_controls(forged) and not has_controls(shown) and printable(shown) == shown
    assert len(redact(forged).splitlines()) == 1


def test_every_redacted_string_is_printable() -> None:
    for text in (HOSTILE, f"--api-key sk-abcdefgh12345678 {CLEAR}", f"http://u:p@h/x?token=1{CLIPBOARD}"):
        out = redact(text)
        assert not has_controls(out) and redact(out) == out
    assert not any(has_controls(w) for w in redact_argv(["python", HOSTILE, "--token", CLEAR]))


# --- attach: the command line of the target -----------------------------------------------------------------------

def _hostile_server(*extra: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", *extra, HOSTILE], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, int(line.split()[1])


def test_a_target_started_from_a_long_interpreter_path_shows_its_server_arguments(tmp_path: Path) -> None:
    """A virtual environment's interpreter path alone can fill the target's description: the description names the
    interpreter by its name, so the server's own arguments (a hostile one among them) are what it shows."""
    from diagnoser.collectors.target import resolve_target

    bin_dir = tmp_path / "home-of-a-user" / "checkouts" / "inference-server-project" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python3"
    python.symlink_to(sys.executable)  # tests.light_server needs only the standard library
    assert len(str(python)) > 80
    server = subprocess.Popen([str(python), "-m", "tests.light_server", "--page", "vllm", "--api-key",
                               "sk-abcdefgh12345678", HOSTILE], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("ready ")
        shown = resolve_target(pid=server.pid).description
    finally:
        server.kill()
        server.wait()
    assert f"pid {server.pid} (python3 -m tests.light_server --page vllm --api-key [redacted] 'x\\x1b[2J" in shown
    assert str(bin_dir) not in shown and "sk-abcdefgh" not in shown
    assert not has_controls(shown)


@pytest.mark.slow
def test_attach_piped_shows_the_command_line_escaped(tmp_path: Path) -> None:
    server, _ = _hostile_server()
    try:
        result = subprocess.run([sys.executable, "-m", "diagnoser", "attach", str(server.pid), "--duration", "1",
                                 "--html", str(tmp_path / "r.html")], cwd=REPO, env=ENV, capture_output=True,
                                timeout=180, check=False)
    finally:
        server.kill()
        server.wait()
    out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    assert result.returncode == 0, err
    assert_no_raw_controls(err, "attach's stderr")
    assert_no_raw_controls(out, "attach's report")
    assert "\\x1b[2J" in err  # shown, so the reader sees what the command line held
    assert_no_raw_controls((tmp_path / "r.html").read_text(), "the HTML report")


@pytest.mark.slow
def test_attach_on_a_terminal_sends_no_hostile_sequence() -> None:
    """On a pseudo-terminal rich draws its live line with its own escapes; none of the target's may pass."""
    server, _ = _hostile_server()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "diagnoser", "attach", str(server.pid), "--duration", "2"],
                                cwd=REPO, env={**ENV, "TERM": "xterm-256color", "COLUMNS": "200"}, stdin=slave,
                                stdout=slave, stderr=slave)
        os.close(slave)
        seen = bytearray()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: the command is done
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        proc.wait(60)
    finally:
        os.close(master)
        server.kill()
        server.wait()
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    for sequence in ("\x1b[2J", "\x1b]52;", "\x9b", "\u202e", "\x07"):
        assert sequence not in text, f"{sequence!r} reached the terminal"
    assert "\\x1b[2J" in text


# --- dcgm: the modelName label ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_dcgm_model_name_label_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--page", "dcgm", "--model-name",
                             f"NVIDIA H100 80GB HBM3{CLEAR}{CLIPBOARD}"], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline().split()[1])
    try:
        args = ["dcgm", "--dcgm-exporter", f"http://127.0.0.1:{port}/metrics", "--duration", "2", "--interval", "0.5"]
        piped = subprocess.run([sys.executable, "-m", "diagnoser", *args, "--verbose"], cwd=REPO, env=ENV,
                               capture_output=True, timeout=180, check=False)
        as_json = subprocess.run([sys.executable, "-m", "diagnoser", *args, "--json"], cwd=REPO, env=ENV,
                                 capture_output=True, timeout=180, check=False)
    finally:
        proc.kill()
        proc.wait()
    out = piped.stdout.decode(errors="replace")
    assert piped.returncode == 0, piped.stderr
    assert_no_raw_controls(out + piped.stderr.decode(errors="replace"), "dcgm's output")
    assert "H100 80GB HBM3\\x1b[2J" in out
    assert as_json.returncode == 0, as_json.stderr
    d = json.loads(as_json.stdout)
    assert_no_raw_controls(json.dumps(d, ensure_ascii=False), "dcgm's JSON")


# --- gpus, doctor: names from the driver and from processes ---------------------------------------------------------

def test_gpus_and_doctor_show_hostile_names_escaped() -> None:
    from diagnoser.cli import doctor as doctor_cli
    from diagnoser.cli import gpus as gpus_cli
    from tests.test_collect_nvml import _app

    # A process that names itself (prctl PR_SET_NAME, 15 bytes) with a clear-screen and a clipboard write.
    script = ("import ctypes, sys, time\nctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"
              "print('ok', flush=True)\ntime.sleep(120)")
    named = subprocess.Popen([sys.executable, "-c", script, "\x1b[2J\x1b]52;c;YQ\x07"], stdout=subprocess.PIPE,
                             text=True)
    assert named.stdout is not None and named.stdout.readline().strip() == "ok"
    gpu = FakeGpu(name=f"NVIDIA H100{CLEAR}{CLIPBOARD}", processes=[FakeProcess(named.pid)])
    runner = CliRunner()
    try:
        with seam.use(FakeNvml([gpu])):
            table = runner.invoke(_app(gpus_cli), ["gpus"])
            checks = runner.invoke(_app(doctor_cli), ["doctor"])
    finally:
        named.kill()
        named.wait()
    assert table.exit_code == 0, table.output
    assert_no_raw_controls(table.stdout, "gpus")
    assert "\\x1b[2J" in table.stdout
    assert checks.exit_code == 0, checks.output
    assert_no_raw_controls(checks.stdout, "doctor")


def test_a_gpu_name_cannot_start_a_forged_line() -> None:
    """A line separator in a GPU name, piped: shown as its escape, so no line of the output starts with the name's
    forged verdict."""
    from diagnoser.cli import gpus as gpus_cli
    from tests.test_collect_nvml import _app

    forged = "VERDICT IDLE conf high (0.99)"
    gpu = FakeGpu(name=f"H100\u2028{forged}\u2029{forged}\x85{forged}")
    with seam.use(FakeNvml([gpu])):
        table = CliRunner().invoke(_app(gpus_cli), ["gpus"])
    assert table.exit_code == 0, table.output
    for ch in ("\u2028", "\u2029", "\x85"):
        assert ch not in table.stdout, f"{ch!r} reached gpus' output"
    assert "H100\\u2028VERDICT" in table.stdout  # the cell wraps after it
    assert not any(line.lstrip(" |│").startswith("VERDICT") for line in table.stdout.splitlines())


# --- errors, history, the agent's lines ---------------------------------------------------------------------------

def test_error_sentences_are_escaped() -> None:
    result = subprocess.run([sys.executable, "-m", "diagnoser", "diagnose", f"/tmp/no-such{CLEAR}{CLIPBOARD}.dgc"],
                            cwd=REPO, env=ENV, capture_output=True, timeout=120, check=False)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 2
    assert_no_raw_controls(err, "an error sentence")
    assert "no capture file at /tmp/no-such\\x1b[2J" in err


def test_history_and_the_agent_lines_show_stored_errors_escaped(tmp_path: Path) -> None:
    db = tmp_path / "history.db"
    with HistoryStore(db) as store:
        store.add(RunRecord(target=f"evil{CLEAR}", started_at=time.time(), finished_at=time.time(), status="error",
                            error=f"the endpoint said {CLIPBOARD}{CSI_C1}"))
    for args in (["history"], ["history", "--runs"]):
        result = subprocess.run([sys.executable, "-m", "diagnoser", *args, "--db", str(db)], cwd=REPO, env=ENV,
                                capture_output=True, timeout=120, check=False)
        out = result.stdout.decode(errors="replace")
        assert result.returncode == 0, result.stderr
        assert_no_raw_controls(out, f"`diagnoser {' '.join(args)}`")
        assert "\\x1b[2J" in out  # the target name, shown (table cells wrap the longer error)
    # The agent's log lines are JSON: control characters are JSON escapes, whatever a field holds.
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    EventLog(Sink()).emit("run", target=f"evil{CLEAR}", error=HOSTILE)  # type: ignore[arg-type]
    assert_no_raw_controls("".join(lines), "an agent log line")
    assert json.loads(lines[0])["error"] == HOSTILE


@pytest.mark.slow
def test_agent_once_summary_lines_are_escaped(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "diagnoser", "agent", "--once", "--targets",
                             f"evil=match:no-such-process-{CLEAR}{CLIPBOARD}", "--db", str(tmp_path / "h.db")],
                            cwd=REPO, env=ENV, capture_output=True, timeout=180, check=False)
    out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    assert result.returncode == 3, err
    assert_no_raw_controls(out, "agent --once's summary")
    assert_no_raw_controls(err, "the agent's log")
    assert "no-such-process-\\x1b[2J" in out


# --- fleet: node, pod and model labels from Prometheus ------------------------------------------------------------

@pytest.mark.parametrize("tty", [False, True])
def test_fleet_table_shows_hostile_labels_escaped(tty: bool) -> None:
    import io

    from rich.console import Console

    from diagnoser.cli.fleet import render_fleet
    from diagnoser.fleet.run import FleetGroup
    from tests.test_report_cases import fleet_report

    report = fleet_report()
    first = report.rows[0]
    first.node, first.pod, first.model_name = f"node{CLEAR}", f"pod{CLIPBOARD}[link=http://evil]x[/link]", HOSTILE
    report.errors.append(f"node {CLEAR}: scrape failed {CSI_C1}")
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=tty, no_color=not tty, highlight=False)
    render_fleet(report, console, groups=[FleetGroup(name=f"model {CLIPBOARD}", rows=report.rows)],
                 notes=[f"note {CLEAR}"])
    text = out.getvalue()
    for sequence in ("\x1b[2J", "\x1b]52;", "\x1b]8;", "\x9b", "\u202e", "\x07"):
        assert sequence not in text, f"{sequence!r} reached the fleet table"
    assert "\\x1b[2J" in text


# --- analyze: kernel and op names from a trace file ---------------------------------------------------------------

def test_analyze_shows_hostile_kernel_names_escaped(tmp_path: Path) -> None:
    events: list[dict[str, object]] = [{"ph": "X", "cat": "cpu_op", "name": f"aten::mm{CLEAR}", "pid": 1, "tid": 1,
                                        "ts": 0, "dur": 50, "args": {"External id": 1}}]
    for i in range(20):
        t = 100 + i * 100
        events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t,
                    "dur": 5, "args": {"correlation": i + 10, "External id": 1}},
                   {"ph": "X", "cat": "kernel", "name": f"evil_gemm_kernel{CLIPBOARD}", "pid": 0, "tid": 7,
                    "ts": t + 10, "dur": 60, "args": {"correlation": i + 10, "stream": 7, "device": 0}}]
    trace = tmp_path / "hostile.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "-m", "diagnoser", "analyze", str(trace)], cwd=REPO, env=ENV,
                            capture_output=True, timeout=180, check=False)
    out = result.stdout.decode(errors="replace")
    assert result.returncode == 0, result.stderr
    assert_no_raw_controls(out, "analyze's output")
    assert "evil_gemm_kernel\\x1b]52;c;ZXZpbA==" in out
