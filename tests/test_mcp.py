"""`diagnoser mcp` through the MCP SDK's own client: the server runs as a real subprocess over stdio
(`python -m diagnoser mcp`), and each tool is called on the fixtures. A tool's document is the CLI's --json output for
the same input; every refusal and failure is a tool error of one sentence; attach is off unless the config allows it;
fleet asks only the configured Prometheus."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

mcp = pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install -e '.[test]' installs it)")

import anyio  # noqa: E402  (after the skip: the SDK brings it)
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

from tests.prom_harness import (  # noqa: E402, F401  (dcgm_stack is a fixture)
    NO_PROMETHEUS,
    PROFILE_VERDICT,
    dcgm_stack,
    find_prometheus,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
CAPTURE = FIXTURES / "gpu" / "nvidia-h100-80gb-hbm3-decode-b1.dgc"
CAPTURE_AFTER = FIXTURES / "gpu" / "nvidia-h100-80gb-hbm3-decode-b16.dgc"
TRACE = FIXTURES / "traces" / "a100_torch_compile_triton.json.gz"
TOOLS = {"diagnose", "analyze", "compare", "theory", "rules", "fleet", "attach"}
CALL_TIMEOUT_S = 300  # a loaded 2-core machine: generous, and no timing is asserted


def cli_json(*args: str) -> Any:
    r = subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=CALL_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mcp.toml"
    path.write_text(text)
    return path


def session(config: Path, scenario: Callable[[ClientSession], Awaitable[None]]) -> None:
    """Start `python -m diagnoser mcp --config CONFIG` as the client does, initialize, and run the scenario."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "diagnoser", "mcp", "--config", str(config)],
                                   cwd=str(REPO), env={"PYTHONWARNINGS": "ignore"})

    async def run() -> None:
        with open(os.devnull, "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as s:
                    init = await s.initialize()
                    assert init.server_info.name == "diagnoser"
                    assert init.capabilities.tools is not None
                    await scenario(s)

    anyio.run(run)


async def document(s: ClientSession, name: str, arguments: dict[str, Any]) -> Any:
    result = await s.call_tool(name, arguments, read_timeout_seconds=CALL_TIMEOUT_S)
    text = result.content[0].text  # type: ignore[union-attr]
    assert not result.is_error, text
    return json.loads(text)


async def refusal(s: ClientSession, name: str, arguments: dict[str, Any]) -> str:
    """The tool error's text, checked to be one sentence: one line, no traceback."""
    result = await s.call_tool(name, arguments, read_timeout_seconds=CALL_TIMEOUT_S)
    assert result.is_error, result.content
    assert len(result.content) == 1
    text = result.content[0].text  # type: ignore[union-attr]
    assert "\n" not in text and "Traceback" not in text and text.rstrip().endswith((".", ")")), text
    return text


@pytest.fixture
def no_config(tmp_path: Path) -> Path:
    return write_config(tmp_path, "")


def test_lists_every_tool_and_each_answers_what_the_cli_prints(no_config: Path) -> None:
    expected = {
        "diagnose": cli_json("diagnose", str(CAPTURE), "--json"),
        "analyze": cli_json("analyze", str(TRACE), "--json", "--max-trace-size", "2G"),
        "compare": cli_json("compare", str(CAPTURE), str(CAPTURE_AFTER), "--json"),
        "theory": cli_json("theory", "--json", "--model", "llama-2-7b", "--batch", "8", "--vs-dtype", "fp8"),
        "rules": cli_json("rules", "BW001", "--json"),
    }

    async def scenario(s: ClientSession) -> None:
        listed = (await s.list_tools()).tools
        assert {t.name for t in listed} == TOOLS
        for t in listed:
            assert t.description and t.input_schema["type"] == "object", t.name
            assert t.input_schema["additionalProperties"] is False
            for name, prop in t.input_schema["properties"].items():
                assert prop.get("type") and prop.get("description"), (t.name, name)
        assert (await document(s, "diagnose", {"capture": str(CAPTURE)})) == expected["diagnose"]
        assert (await document(s, "analyze", {"trace": str(TRACE)})) == expected["analyze"]
        assert (await document(s, "compare", {"before": str(CAPTURE), "after": str(CAPTURE_AFTER)})) == \
            expected["compare"]
        theory = await document(s, "theory", {"model": "llama-2-7b", "batch": 8, "vs_dtype": ["fp8"]})
        assert theory == expected["theory"] and theory["what_ifs"][0]["change"]
        assert (await document(s, "rules", {"code": "BW001"})) == expected["rules"]
        every = await document(s, "rules", {})
        assert "BW001" in {r["code"] for r in every} and len(every) > 10
        models = await document(s, "theory", {"list_models": True})
        assert "llama-2-7b" in {m["name"] for m in models}
        # No Prometheus and no allow-list in the config: both refuse, saying where to allow them.
        assert "[fleet] prometheus" in await refusal(s, "fleet", {})
        said = await refusal(s, "attach", {"port": 8000, "duration": 1})
        assert said.startswith("live attach is off") and str(no_config) in said

    session(no_config, scenario)


def test_a_relative_path_is_the_servers_working_directory(no_config: Path) -> None:
    async def scenario(s: ClientSession) -> None:
        doc = await document(s, "diagnose", {"capture": str(CAPTURE.relative_to(REPO))})
        assert doc == cli_json("diagnose", str(CAPTURE), "--json")

    session(no_config, scenario)


def test_bad_arguments_are_refused_in_one_sentence(no_config: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.dgc"
    bad.write_bytes(b"\x1f\x8b not a capture")
    folder = tmp_path / "folder"
    folder.mkdir()

    async def scenario(s: ClientSession) -> None:
        said = await refusal(s, "diagnose", {"capture": str(tmp_path / "missing.dgc")})
        assert "no such file" in said and "missing.dgc" in said
        assert "is a folder" in await refusal(s, "diagnose", {"capture": str(folder)})
        assert "needs the argument 'capture'" in await refusal(s, "diagnose", {})
        assert "'capture' must be a string, not a number" in await refusal(s, "diagnose", {"capture": 7})
        assert "has no argument 'path'" in await refusal(s, "diagnose", {"capture": str(CAPTURE), "path": "x"})
        # The CLI's own sentence comes back: the file exists but is no capture.
        said = await refusal(s, "diagnose", {"capture": str(bad)})
        assert "bad.dgc" in said and not said.startswith("diagnoser:")
        assert "'batch' must be a whole number, not a string" in await refusal(s, "theory", {"model": "llama-2-7b",
                                                                                            "batch": "8"})
        assert "'batch' must be from 1 to 1000000, not 0" in await refusal(s, "theory", {"model": "llama-2-7b",
                                                                                         "batch": 0})
        assert "'window' must be one of" in await refusal(s, "analyze", {"trace": str(TRACE), "window": "all"})
        assert "unknown-model" in await refusal(s, "theory", {"model": "unknown-model"})
        assert "no rule with the code or name" in await refusal(s, "rules", {"code": "NOPE999"})
        assert "must not start with '-'" in await refusal(s, "rules", {"code": "--prometheus-rules"})
        assert "no tool named 'shell'" in await refusal(s, "shell", {"command": "ls"})
        assert "compare two captures or two traces" in await refusal(s, "compare", {"before": str(CAPTURE),
                                                                                    "after": str(TRACE)})

    session(no_config, scenario)


def test_a_result_over_the_output_limit_is_refused_not_cut(tmp_path: Path) -> None:
    config = write_config(tmp_path, "[limits]\nmax_output_bytes = 2000\n")

    async def scenario(s: ClientSession) -> None:
        said = await refusal(s, "rules", {})
        assert "over 2,000 bytes" in said and "max_output_bytes" in said
        assert (await document(s, "theory", {"list_models": True}))  # a small one still comes back whole

    session(config, scenario)


def test_a_call_past_its_time_is_stopped_and_said_so(tmp_path: Path) -> None:
    config = write_config(tmp_path, "[limits]\ntimeout_s = 0.001\n")  # no command starts that fast

    async def scenario(s: ClientSession) -> None:
        said = await refusal(s, "analyze", {"trace": str(TRACE)})
        assert said == "analyze did not finish within 0.001 s ([limits] timeout_s) and was stopped."
        assert "did not finish" in await refusal(s, "rules", {})  # and the server goes on serving

    session(config, scenario)


@pytest.fixture
def light_server() -> Any:
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--page", "vllm"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        found = re.match(r"ready (\d+)", line)
        assert found, f"the light server did not start: {line!r}"
        yield proc, int(found.group(1))
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_attach_runs_only_where_the_allow_list_says_and_within_its_window(tmp_path: Path, light_server: Any) -> None:
    proc, port = light_server
    config = write_config(tmp_path, f"[attach]\nports = [{port}]\nmax_duration_s = 3\n")

    async def scenario(s: ClientSession) -> None:
        doc = await document(s, "attach", {"port": port, "duration": 1})
        assert doc["verdict"] and doc["context"]
        assert "not in the attach allow-list" in await refusal(s, "attach", {"port": port + 1 if port < 65535
                                                                             else port - 1})
        assert "not in the attach allow-list" in await refusal(s, "attach", {"pid": proc.pid})
        said = await refusal(s, "attach", {"port": port, "duration": 30})
        assert "at most 3 s" in said and "max_duration_s" in said
        assert "'duration' must be from 0.1 to 600, not 5000" in await refusal(s, "attach", {"port": port,
                                                                                              "duration": 5000})
        assert "one of 'pid' or 'port'" in await refusal(s, "attach", {})

    session(config, scenario)


def _call_processes(port: int) -> list[Any]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        words = proc.info["cmdline"] or []
        if "diagnoser" in words and "attach" in words and str(port) in words:
            found.append(proc)
    return found


@pytest.mark.slow
def test_a_call_in_flight_ends_with_its_client(tmp_path: Path, light_server: Any) -> None:
    """The client goes away mid-call (stdin closed, then the server terminated): the command it was running is
    stopped too, not left to run out its window."""
    import psutil

    _, port = light_server
    config = write_config(tmp_path, f"[attach]\nports = [{port}]\nmax_duration_s = 600\n")
    seen: list[Any] = []

    async def scenario(s: ClientSession) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.call_tool, "attach", {"port": port, "duration": 500})
            with anyio.fail_after(120):
                while not seen:
                    seen.extend(_call_processes(port))
                    await anyio.sleep(0.2)
            tg.cancel_scope.cancel()  # the client leaves while the window runs

    session(config, scenario)
    [child] = seen
    gone = psutil.wait_procs([child], timeout=120)[0]
    assert gone == [child] or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.prometheus
@pytest.mark.skipif(find_prometheus() is None, reason=NO_PROMETHEUS)
def test_fleet_asks_the_configured_prometheus(tmp_path: Path, dcgm_stack: Any) -> None:
    config = write_config(tmp_path, f'[fleet]\nprometheus = "{dcgm_stack.prom.url}"\nmax_window = "1h"\n')

    async def scenario(s: ClientSession) -> None:
        doc = await document(s, "fleet", {"since": "12s"})
        rows = {(row["uuid"], row["gpu"]): row for row in doc["rows"]}
        for g in dcgm_stack.gpus:
            key = (g.uuid, f"{g.index}/{g.mig_id}" if g.mig_id else str(g.index))
            assert rows[key]["diagnosis"]["verdict"] == PROFILE_VERDICT[g.profile], key
        narrowed = await document(s, "fleet", {"since": "12s", "limit": 2})
        assert len(narrowed["rows"]) == 2
        said = await refusal(s, "fleet", {"since": "2d"})
        assert "at most 3600 s" in said and "max_window" in said
        # The Prometheus is never an argument.
        assert "has no argument 'prometheus'" in await refusal(s, "fleet", {"prometheus": "http://evil:9090"})

    session(config, scenario)


def run_mcp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diagnoser", "mcp", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def test_without_the_sdk_it_says_how_to_install_it(tmp_path: Path) -> None:
    hidden = tmp_path / "no-sdk"  # the core install: neither the SDK nor its dependencies
    for name in ("mcp", "mcp_types", "anyio"):
        (hidden / name).mkdir(parents=True)
        message = f"No module named {name!r}"
        (hidden / name / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    r = run_mcp("--config", str(write_config(tmp_path, "")),
                env={"PYTHONPATH": os.pathsep.join([str(hidden), str(REPO)])})
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip().splitlines() == ["diagnoser: diagnoser mcp needs the MCP SDK: pip install "
                                             "'diagnoser[mcp]'."]
    assert r.stdout == ""


@pytest.mark.parametrize("text, said", [
    ("[attach]\nports = ['8000']\n", "[attach] ports must be a list of whole numbers"),
    ("[fleet]\nprometheus = \"file:///etc/passwd\"\n", "must be an http:// or https:// URL"),
    ("[limits]\ntimeout_s = 99999\n", "timeout_s must be a number above 0 and at most 3600"),
    ("[limits]\nmax_trace_size = \"lots\"\n", "a trace size limit must be a size"),
    ("[attach]\nport = [8000]\n", "unknown key(s) port"),
    ("[attach\n", "is not valid TOML"),
])
def test_a_bad_config_fails_before_serving_in_one_sentence(tmp_path: Path, text: str, said: str) -> None:
    r = run_mcp("--config", str(write_config(tmp_path, text)))
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("diagnoser: ") and said in line, line


def test_a_missing_config_named_explicitly_is_an_error(tmp_path: Path) -> None:
    r = run_mcp("--config", str(tmp_path / "none.toml"))
    assert r.returncode == 2 and "no MCP config at" in r.stderr


def test_the_declarations_follow_the_commands_they_run() -> None:
    from diagnoser.fleet.run import GROUPINGS
    from diagnoser.mcp_tools import tools

    assert tools.FLEET_GROUPINGS == GROUPINGS
    assert {t.name for t in tools.TOOLS} == TOOLS
    from diagnoser.cli.app import COMMANDS

    assert set(COMMANDS) >= TOOLS


def test_the_sdk_loads_only_when_the_command_runs_and_torch_never() -> None:
    code = ("import sys, diagnoser.cli.app, diagnoser.cli.mcp, diagnoser.mcp_tools.tools, diagnoser.mcp_tools.config; "
            "print(sorted(m for m in ('mcp', 'mcp_types', 'torch') if m in sys.modules)); "
            "import diagnoser.mcp_tools.server; print('torch' in sys.modules, 'mcp' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "False True"]
