"""Hugging Face `generate()` on a Llama-shaped decoder with random weights, in a loop, as a process to attach to.

    python3 scripts/gpu/hf_generate.py --size 2.4b --batch 1 --ready-file r.json --progress-file p.jsonl

A workload nobody on the diagnoser project wrote: the decode is transformers' own (`LlamaForCausalLM.generate`,
greedy, eager by default, or `--static`: `cache_implementation="static"`, which transformers compiles itself with
torch.compile, mode "reduce-overhead", on a CUDA device). The model is built from a `LlamaConfig` on the device
directly, in its dtype, with random weights: no download, no CPU initialisation of billions of parameters.

What this script adds around `generate` is bookkeeping only, none of it on the GPU:
- a LogitsProcessor that counts the tokens of each step in Python (it returns the scores untouched and launches
  nothing), for the rate this process measures itself: --progress-file gets one JSON line about every 0.5 s
  (unix time, steps, tokens, generate calls), --stats-file the totals at exit;
- unless --no-metrics, a Prometheus /metrics page on 127.0.0.1 under vLLM's names (the self-test workloads' table,
  diagnoser.selftest.workload.Metrics: requests running = the batch, waiting = 0, prompt and generation token
  counters, tokens per step, inter-token latency), so that `diagnoser attach` reads tokens/s and the batch and
  `diagnoser compare` can measure a realised gain. No KV-cache gauge: transformers' caches have no pool to fill;
- the folder --config-dir gets the model's config.json (for `diagnoser attach --model`).

Once warm (one generate call, plus --ready-steps steps of the next) it writes --ready-file: pid, metrics URL,
config path, shape, batch, and the rate so far. It runs until SIGTERM/SIGINT or --seconds after ready.
`--size toy --device cpu` runs the same code in seconds on a CPU (for testing the recording script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

# Shapes (diagnoser/selftest/scenarios.py's 2.4b and 1.1b, written out so this file stands alone).
SHAPES = {
    "toy": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=256),
    "1.1b": dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
                 intermediate_size=5632, vocab_size=32000),
    "2.4b": dict(num_hidden_layers=32, hidden_size=2560, num_attention_heads=20, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6912, vocab_size=32000),
}
EOS, PAD = 2, 0


class Stop(Exception):
    pass


def _stop(*_args: Any) -> None:
    raise Stop()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # the recorder polls for the file: never let it read half


class Tally:
    """Counts tokens per decode step from inside generate (called once per step, before token selection)."""

    def __init__(self, batch: int, metrics: Any, progress: Path | None) -> None:
        self.batch, self.metrics, self.progress = batch, metrics, progress
        self.steps = self.tokens = self.calls = 0
        self.last_step = self.last_write = time.perf_counter()
        self.t0 = time.time()
        self.call_log: list[dict[str, Any]] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:  # the LogitsProcessor interface
        now = time.perf_counter()
        self.steps += 1
        self.tokens += self.batch
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(self.batch)
            self.metrics.iteration_tokens.observe(self.batch)
            self.metrics.itl.observe(now - self.last_step)
        self.last_step = now
        if self.progress is not None and now - self.last_write >= 0.5:
            self.last_write = now
            self.write_progress()
        return scores

    def write_progress(self) -> None:
        assert self.progress is not None
        with self.progress.open("a") as f:
            f.write(json.dumps({"t": time.time(), "steps": self.steps, "tokens": self.tokens,
                                "calls": self.calls}) + "\n")


def build(args: argparse.Namespace, torch: Any, device: str) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    named = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = named.get(args.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
    config = LlamaConfig(**SHAPES[args.size], max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)  # allocated and initialised on the device
    model.eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return config, model


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="2.4b")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                    help="weights and activations (auto: bf16 on a GPU, fp32 on a CPU); fp32 matmuls stay FP32, "
                    "not TF32 (PyTorch's default)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=512, help="max_new_tokens (= min_new_tokens) per call")
    ap.add_argument("--static", action="store_true", help='cache_implementation="static" (auto-compiled on CUDA)')
    ap.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of the warm-up call (--static: the "
                    "same as --new-tokens, so that the compiled graphs and the static cache are the ones reused)")
    ap.add_argument("--ready-steps", type=int, default=24, help="decode steps after the warm-up call before ready")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop this long after ready at the latest")
    ap.add_argument("--config-dir", type=Path, help="write the model's config.json here")
    ap.add_argument("--ready-file", type=Path)
    ap.add_argument("--progress-file", type=Path)
    ap.add_argument("--stats-file", type=Path)
    ap.add_argument("--no-metrics", action="store_true", help="serve no /metrics page")
    ap.add_argument("--hook", action="store_true", help="import diagnoser.hook (lets `attach --trace` profile us)")
    ap.add_argument("--compile-on-cpu", action="store_true", help="--static on a CPU: compile there too (transformers "
                    "compiles only on accelerators unless told; for testing this script)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    return ap


def _import_hook() -> bool:
    try:
        import diagnoser.hook  # noqa: F401  (installs the signal-triggered profiler)
    except ImportError as exc:
        print(f"hf_generate: no diagnoser.hook ({exc})", file=sys.stderr)
        return False
    return True


def _serve_metrics(name: str, batch: int) -> tuple[Any, int, Any]:
    """vLLM-named /metrics on 127.0.0.1 (an ephemeral port): the metrics, the port and the server to shut down."""
    from prometheus_client import start_http_server

    from diagnoser.selftest.workload import Metrics

    metrics = Metrics(name, kv_cache=False)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    metrics.running.set(batch)
    metrics.waiting.set(0)
    return metrics, server.server_port, server


class Workload:
    """The model in a loop of generate calls: a warm-up call, then calls of --new-tokens until stopped or
    --seconds after ready; the ready file once --ready-steps of the first main call have run."""

    def __init__(self, args: argparse.Namespace, torch: Any, transformers: Any, device: str, t_start: float) -> None:
        self.args, self.torch, self.transformers, self.device, self.t_start = args, torch, transformers, device, t_start
        if device == "cpu":
            torch.set_num_threads(max(1, args.threads))
        self.hooked = _import_hook() if args.hook else False
        self.config, self.model = build(args, torch, device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.name = f"hf-random-llama-{args.size}"
        self.config_path = None
        if args.config_dir is not None:
            args.config_dir.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(args.config_dir)
            self.config_path = args.config_dir / "config.json"
        if device == "cuda":
            torch.cuda.synchronize()
        self.t_built = time.time()
        print(f"hf_generate: {self.name} ({self.params / 1e9:.3f} B params) on {device} in "
              f"{self.t_built - t_start:.1f} s; transformers {transformers.__version__}, torch {torch.__version__}",
              flush=True)
        self.metrics: Any = None
        self.port: int | None = None
        self.server: Any = None
        if not args.no_metrics:
            self.metrics, self.port, self.server = _serve_metrics(self.name, args.batch)
        if args.progress_file is not None:
            args.progress_file.unlink(missing_ok=True)
        self.tally = Tally(args.batch, self.metrics, args.progress_file)
        g = torch.Generator(device="cpu").manual_seed(1)
        self.input_ids = torch.randint(3, self.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
        self.kw = self._generate_kwargs()
        self.warm = args.new_tokens if args.static else min(args.warmup_tokens, args.new_tokens)
        self.warm_s = 0.0
        self.ready_at: float | None = None
        self.deadline: float | None = None
        self.steps_warm: int | None = None
        self.tokens_warm: int | None = None

    def _generate_kwargs(self) -> dict[str, Any]:
        """generate()'s arguments: a fixed random prompt, greedy, the tally as a logits processor."""
        from transformers import LogitsProcessorList

        args, torch = self.args, self.torch
        kw: dict[str, Any] = dict(attention_mask=torch.ones_like(self.input_ids), do_sample=False,
                                  logits_processor=LogitsProcessorList([self.tally]))
        if args.static:
            kw["cache_implementation"] = "static"
            if args.compile_on_cpu and self.device == "cpu":
                from transformers import CompileConfig

                cc = CompileConfig()  # transformers' defaults (mode "reduce-overhead"), on every device
                cc._compile_all_devices = True
                kw["compile_config"] = cc
        return kw

    def generate(self, new_tokens: int) -> float:
        args, tally = self.args, self.tally
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(self.input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **self.kw)
        made = out.shape[1] - args.prompt
        dt = time.perf_counter() - t0
        tally.calls += 1
        rate = made * args.batch / dt
        tally.call_log.append({"new_tokens": made, "batch": args.batch, "seconds": round(dt, 4),
                               "tokens_per_s": round(rate, 2), "t_end": time.time()})
        if self.metrics is not None:
            self.metrics.success.inc(args.batch)
            self.metrics.prompt_tokens.inc(args.batch * args.prompt)
        print(f"hf_generate: call {tally.calls}: {made} x {args.batch} tokens in {dt:.2f} s = {rate:.1f} tokens/s "
              f"(prefill included)", flush=True)
        return dt

    def mark_ready(self) -> None:
        args, torch, port = self.args, self.torch, self.port
        self.ready_at = ready_at = time.time()
        self.deadline = time.monotonic() + args.seconds
        if args.ready_file is not None:
            _write_json(args.ready_file, {
                "pid": os.getpid(), "port": port, "metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
                "config": str(self.config_path) if self.config_path else None, "model": self.name,
                "params": self.params, "size": args.size, "device": self.device,
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "gpu_name": torch.cuda.get_device_name() if self.device == "cuda" else "",
                "torch": str(torch.__version__), "transformers": self.transformers.__version__, "batch": args.batch,
                "prompt": args.prompt, "new_tokens": args.new_tokens, "static": args.static,
                "trace_hook": self.hooked, "attn_implementation": getattr(self.model.config, "_attn_implementation",
                                                                          None),
                "startup_s": round(self.t_built - self.t_start, 2), "warmup_s": round(self.warm_s, 2),
                "ready_at": ready_at, "steps_at_ready": self.tally.steps, "tokens_at_ready": self.tally.tokens})
        print(f"hf_generate: ready ({ready_at - self.t_start:.1f} s after start)", flush=True)

    def _processors(self) -> Any:
        """The tally; on the first main call also the check that marks ready once --ready-steps of it have run."""
        from transformers import LogitsProcessorList

        if self.ready_at is not None:
            return LogitsProcessorList([self.tally])
        target = self.tally.steps + self.args.ready_steps

        def ready_check(input_ids: Any, scores: Any) -> Any:
            if self.ready_at is None and self.tally.steps >= target:
                self.mark_ready()
            return scores

        return LogitsProcessorList([self.tally, ready_check])

    def run(self) -> None:
        """The warm-up call, then main calls until SIGTERM/SIGINT or the deadline; the stats file on every way out."""
        try:
            self.warm_s = self.generate(self.warm)
            self.steps_warm, self.tokens_warm = self.tally.steps, self.tally.tokens
            print(f"hf_generate: warm-up call ({self.warm} new tokens) took {self.warm_s:.1f} s", flush=True)
            while True:
                self.kw["logits_processor"] = self._processors()
                self.generate(self.args.new_tokens)
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    break
        except Stop:
            pass
        finally:
            self._finish()

    def _finish(self) -> None:
        args, tally = self.args, self.tally
        if args.progress_file is not None:
            tally.write_progress()
        full = [c for c in tally.call_log[1:] if c["new_tokens"] == args.new_tokens]
        stats = {"steps": tally.steps, "tokens": tally.tokens, "calls": tally.calls, "warmup_steps": self.steps_warm,
                 "warmup_tokens": self.tokens_warm, "ready_at": self.ready_at, "ended_at": time.time(),
                 "call_log": tally.call_log,
                 "full_calls_tokens_per_s": (sum(c["new_tokens"] * c["batch"] for c in full) /
                                             sum(c["seconds"] for c in full)) if full else None}
        if args.stats_file is not None:
            _write_json(args.stats_file, stats)
        if self.server is not None:
            self.server.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

    t_start = time.time()
    import torch
    import transformers

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    Workload(args, torch, transformers, device, t_start).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
