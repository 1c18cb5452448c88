"""`diagnoser demo`: start a small real inference server and a load, attach, diagnose, write the report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer

from diagnoser.cli.attach import LiveView
from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.errors import EXIT_FAIL_ON, InputError

CPU_CAN = ("What this CPU run shows for real: the server's own signals (queue, running batch, KV-cache use, "
           "preemptions, token rates, TTFT and inter-token latency) and the host's (the engine thread's CPU), "
           "measured from outside on a live serving loop.")
CPU_CANNOT = ("What it cannot show: GPU busy time, SM, DRAM and tensor-pipe activity, clocks and power. So it "
              "cannot tell compute-bound from bandwidth-bound, and the rules that need GPU counters were skipped. "
              "Run `diagnoser demo` on a machine with an NVIDIA GPU to see them.")
GPU_NOTE = ("The demo model is tiny for a GPU: expect it to look launch-bound or idle there, which is what such a "
            "small model really is.")


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @handles_errors
    def demo_cmd(
        out: Path = typer.Option(Path("diagnoser-demo"), "--out", "-o", help="Folder for the capture and reports.",
                                 file_okay=False),
        duration: float = typer.Option(8.0, "--duration", "-d", help="Seconds to observe the server."),
        device: str = typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda."),
        concurrency: int = typer.Option(24, "--concurrency", help="Closed-loop clients of the load generator."),
        max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Most sequences the server batches."),
        kv_tokens: int = typer.Option(1024, "--kv-tokens", help="The server's KV-cache budget in tokens."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix and skipped rule."),
    ) -> None:
        """Run the demo: a real (tiny) inference server under load, attached to and diagnosed."""
        from diagnoser.demo.run import DemoConfig, run_demo

        wanted = parse_fail_on(fail_on)
        if device not in ("auto", "cpu", "cuda"):
            raise InputError(f"--device must be auto, cpu or cuda, not {device!r}.")
        if not duration > 0 or concurrency < 1 or max_num_seqs < 1 or kv_tokens < 16:
            raise InputError("--duration must be positive, --concurrency and --max-num-seqs at least 1, "
                             "--kv-tokens at least 16.")
        if importlib.util.find_spec("torch") is None:
            raise InputError("the demo server needs torch: pip install 'diagnoser[torch]'.")
        cfg = DemoConfig(duration_s=duration, concurrency=concurrency, max_num_seqs=max_num_seqs,
                         kv_tokens=kv_tokens, device=device)
        with LiveView(f"demo: observing the server for {duration:g} s") as view:
            run = run_demo(cfg, out, on_sample=view, on_status=lambda msg: view.say(f"diagnoser demo: {msg}"))
        for problem in run.problems:
            view.say(f"diagnoser demo: {problem}")
        if not as_json:
            view.say("")
        show(run.outcome, as_json=as_json, fail_on=set(), verbose=verbose)
        view.say("")
        if run.device == "cpu":
            view.say(CPU_CAN)
            view.say(CPU_CANNOT)
        else:
            view.say(GPU_NOTE)
        load = run.load
        if load:
            view.say(f"Load: {load.get('requests', 0)} requests, {load.get('completion_tokens_per_s', 0):.0f} "
                     f"generated tokens/s over {load.get('elapsed_s', 0):.0f} s, {load.get('errors', 0)} errors.")
        view.say("Files: " + ", ".join(f"{name} {path}" for name, path in run.files.items()))
        view.say(f"Re-diagnose later with: diagnoser diagnose {run.files['capture']}")
        verdict = run.diagnosis.verdict
        if verdict in wanted or ("any" in wanted and run.diagnosis.limiter is not None):
            raise typer.Exit(EXIT_FAIL_ON)
