"""The real-vLLM situations: each a server set-up and a load, with the verdict and first fix an expert expects,
written from the set-up before the tool was run on it (as tests/expectations does for recordings).

`record_all` starts each server once and runs every situation that shares its flags, attaching `diagnoser attach
--port` to it for a window while the load runs; a fix is then applied (the server restarted with the fixed flags,
the same load) and re-measured, and `diagnoser compare` checks the realised gain against the predicted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.engines.load import Load
from tests.engines.vllm_server import MODEL_NAME, VllmServer

REPO = Path(__file__).resolve().parents[2]
WINDOW_S = float(os.environ.get("VLLM_WINDOW_S", "12"))
WARM_S = 8.0  # load runs this long before the window: the batch and queue reach their steady state
# Server set-ups, by name: the flags that differ from vLLM's defaults (prefix caching on, chunked prefill on).
SERVERS: dict[str, tuple[str, ...]] = {
    # 12 blocks of 32 tokens (one is vLLM's null block; the CPU build's attention needs multiples of 32): under three
    # sequences of 64 + 64 tokens at a time
    "kv12": ("--max-num-seqs", "16", "--num-gpu-blocks-override", "12", "--block-size", "32", "--max-model-len",
             "256"),
    "default": ("--max-num-seqs", "16"),
    "seqs2": ("--max-num-seqs", "2"),
    "noprefix": ("--max-num-seqs", "16", "--no-enable-prefix-caching"),
    # a per-step token budget far below the prompts (the CPU build's default is 2048)
    "budget128": ("--max-num-seqs", "16", "--max-num-batched-tokens", "128"),
}


@dataclass(frozen=True)
class Situation:
    name: str
    server: str  # a key of SERVERS
    load: dict[str, Any]  # Load's fields
    why: str  # the expert's reading of the set-up, before running the tool
    verdicts: tuple[str, ...]  # verdicts that count as right
    first_fix: tuple[str, ...] = ()  # FixKind values, one of which must rank first ("" = none offered)
    fix_text: str = ""  # words the first fix's action must hold (the knob that caps this server)
    forbidden: tuple[str, ...] = ()  # rule codes that must not be among the findings
    must_find: tuple[str, ...] = ()  # rule codes that must be among the findings
    applied: str = ""  # the server set-up with the first fix applied; "" = no fix to re-measure
    busy_host: bool = False  # other tenants keep every core busy during the window
    forbidden_fixes: tuple[str, ...] = ()  # FixKind values that must not be offered at all (a knob already loose)
    side_load: dict[str, Any] = field(default_factory=dict)  # a second load beside the first (Load's fields)


SITUATIONS: tuple[Situation, ...] = (
    Situation(
        "one-client", "default", {"clients": 1, "prompt_words": 64, "max_tokens": 64},
        "One client in sequence: one request in flight at any time, nothing waits, 15 of 16 batch slots empty. The "
        "offered load limits throughput; no prefill can share a step with another request's decode (SRV004 "
        "impossible). Expected: under-loaded (idle), no speed fix.",
        verdicts=("idle",), forbidden=("SRV004",), first_fix=("right_size", "")),
    Situation(
        "moderate", "default", {"clients": 4, "prompt_words": 64, "max_tokens": 64},
        "Four closed-loop clients on a 16-sequence server: 4 running, nothing waits, KV nearly empty. Healthy: no "
        "limiter the server could remove (the load is what it is): neither the sequence limit nor the KV pool may "
        "be advised raised.",
        verdicts=("inconclusive", "idle"), first_fix=("right_size", "split_prefill", "cap_prefill", ""),
        forbidden_fixes=("batch_more", "kv_memory")),
    Situation(
        "batch-capped", "seqs2", {"clients": 12, "prompt_words": 64, "max_tokens": 64},
        "--max-num-seqs 2 with 12 clients: the batch is pinned at 2, about 10 wait, the KV cache has room. The "
        "scheduler's cap is the limiter (batching); raising it is a throughput fix until the device saturates "
        "(12 / 2 = 6x at an unchanged step time; with no device roofs on a CPU build, nothing bounds it).",
        verdicts=("batching",), first_fix=("batch_more",), fix_text="--max-num-seqs", applied="default"),
    Situation(
        "clients-time-out", "seqs2", {"clients": 12, "prompt_words": 64, "max_tokens": 64, "timeout_s": 3.0},
        "The same capped server, clients giving up after 3 s: most requests are aborted while queued. The server is "
        "batching-limited and most clients leave: both must be said.",
        verdicts=("batching",), must_find=("SRV009",)),
    Situation(
        "kv-capped", "kv12", {"clients": 12, "prompt_words": 64, "max_tokens": 64},
        "--num-gpu-blocks-override 12 (352 usable tokens of KV) with 12 clients of 128 tokens each: the KV cache is full, "
        "requests wait and are preempted. VRAM-limited; the fix names the flag that caps it (not "
        "--gpu-memory-utilization).",
        verdicts=("vram",), first_fix=("kv_memory",), fix_text="--num-gpu-blocks-override", applied="default"),
    Situation(
        "prefix-off", "noprefix", {"clients": 8, "prompt_words": 1536, "shared_prefix": 1504, "max_tokens": 4},
        "Prompts of 1536 words, 1504 of them the same for every request, 4 generated tokens, prefix caching off: "
        "prefill is nearly all the work and 98 % of it is recomputed. The prefix cache is the fix, bounded by the "
        "prompt tokens it would save.",
        verdicts=("compute", "inconclusive"), first_fix=("prefix_caching",), must_find=("SRV001",),
        applied="default"),
    Situation(
        "host-busy", "default", {"clients": 4, "prompt_words": 64, "max_tokens": 64},
        "Four clients while other tenants (each a session of its own, as other services and containers are) keep "
        "every core busy: the engine gets a fraction of the CPU it would have. On a CPU build that is the limit: "
        "host-limited must be said, and no gain promised for the cores given back.",
        verdicts=("host_launch",), first_fix=("host_cpu",), must_find=("HOST004",), busy_host=True),
    Situation(
        "budget-capped", "budget128", {"clients": 4, "prompt_words": 512, "max_tokens": 16},
        "--max-num-batched-tokens 128 with 512-token unique prompts from 4 clients on a 16-sequence server: a prompt "
        "needs 4+ steps of the whole budget, so one request prefills at a time and the others wait with 15 slots "
        "and the KV cache free. The token budget binds (batching); its fix raises --max-num-batched-tokens (the "
        "CPU default, 2048, fits several prompts a step), never --max-num-seqs, which is far from binding. Not "
        "priced on a CPU build: the fix must still help when applied.",
        verdicts=("batching",), first_fix=("token_budget",), fix_text="--max-num-batched-tokens",
        must_find=("BAT006",), forbidden_fixes=("batch_more",), applied="default"),
    Situation(
        "budget-loose", "default", {"clients": 4, "prompt_words": 512, "max_tokens": 16},
        "The same load on the default server (2048 tokens a step, larger than a prompt beside the decodes; prefix "
        "caching on, every prompt unique): 4 of 16 running, nothing holds a request back. The budget must not be "
        "advised raised, nor the sequence limit; a 0 % prefix-cache hit rate is the workload (unique prompts) with "
        "the cache on and room in the pool, not a miss (no SRV001).",
        verdicts=("inconclusive", "idle", "compute"), forbidden=("SRV001", "BAT006", "BAT005"),
        forbidden_fixes=("token_budget", "batch_more", "prefix_caching", "context_length")),
    Situation(
        "over-length", "kv12", {"clients": 2, "prompt_words": 300, "max_tokens": 16, "pause_s": 0.25},
        "Two clients sending 300-token prompts to a server with --max-model-len 256, each retrying after a quarter "
        "second: vLLM refuses each with HTTP 400 before it is queued; beside them one client's valid 64-token "
        "requests. Most answers are refusals (SRV010), "
        "not clients giving up (no SRV009); the valid load is one request at a time: under-loaded.",
        verdicts=("idle", "inconclusive"), must_find=("SRV010",), forbidden=("SRV009",),
        first_fix=("right_size", "context_length", ""),
        side_load={"clients": 1, "prompt_words": 64, "max_tokens": 64}),
)


# The knob matrix: for each knob of vLLM's table (diagnoser/engines/vllm.py), the situation above in which it binds and
# one in which it is loose (the load needs no more than it gives: its fix must not be offered), or why this tier does
# not exercise it yet. tests/test_engine_knobs.py holds it to the table and to the situations' expectations.
MATRIX: dict[str, tuple[str, str] | str] = {
    "max_num_seqs": ("batch-capped", "moderate"),
    "max_num_batched_tokens": ("budget-capped", "budget-loose"),
    "max_model_len": ("over-length", "budget-loose"),
    "num_gpu_blocks_override": ("kv-capped", "moderate"),
    "prefix_caching": ("prefix-off", "budget-loose"),
    "gpu_memory_utilization": "the CPU build sizes its KV pool from VLLM_CPU_KVCACHE_SPACE, not from a share of a "
    "GPU's memory",
    "kv_cache_memory_bytes": "not yet: binding it needs a pool of a few hundred tokens, which VLLM_CPU_KVCACHE_SPACE "
    "(whole GiB) cannot give; the tier pins the pool with --num-gpu-blocks-override instead",
    "chunked_prefill": "on for every generative model in V1; turning it off is unsupported, so it has no loose side",
    "long_prefill_token_threshold": "not yet: its binding side is SRV004's long prompts beside short decodes, which "
    "two loads of different prompts in one window would give",
    "kv_cache_dtype": "not yet: an FP8 KV cache on the CPU build is untried",
    "block_size": "not yet: no rule reads the block's tail waste",
    "speculative_config": "not yet: ngram speculation on the CPU build is untried",
    "tensor_parallel_size": "one CPU socket: no second device to split over",
    "data_parallel_size": "one CPU socket: no second engine replica",
    "scheduling_policy": "it reorders the queue and relieves no constraint (no direction to advise)",
    "max_num_queued_reqs": "not yet: binding needs open-loop arrivals above capacity (SRV011), a load the tier's "
    "closed-loop clients do not make",
}


@dataclass
class Recording:
    situation: Situation
    capture: Path
    diagnosis: dict[str, Any]
    stderr: str
    client: dict[str, float]  # what the load generator saw in the window
    load_avg: float
    # CPU (cores) that processes other than the engine, this test and its `attach` used in the window, measured
    # here with psutil apart from diagnoser: other work on a shared machine (or the situation's own tenants)
    others_cores: float = 0.0
    applied: Recording | None = None  # the same load on the fixed server
    compare: dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceRun:
    """`diagnoser trace PID` through the default server's profiler endpoints while four clients run."""

    returncode: int
    stdout: str
    stderr: str
    folder: Path | None  # where the trace landed
    analysis: dict[str, Any]  # `diagnoser analyze FOLDER --json`'s context.trace.summary
    generated: float  # the server's own generation_tokens_total across the trace request (start to stop)
    load_avg: float


# vLLM's profiler with the light settings (docs/traces.md): no Python stacks, no key-averages table; the frontend
# traced too (ignore_frontend=false) so that its file lands beside the worker's.
def profiler_flags(folder: Path) -> tuple[str, ...]:
    return ("--profiler-config.profiler=torch", f"--profiler-config.torch_profiler_dir={folder}",
            "--profiler-config.torch_profiler_with_stack=false",
            "--profiler-config.torch_profiler_dump_cuda_time_total=false",
            "--profiler-config.ignore_frontend=false")


def _generated(server: VllmServer) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def trace_window(server: VllmServer, out: Path, seconds: float = 2.0) -> TraceRun:
    """Four clients, then `diagnoser trace PID` (no --url: the endpoints come from the server's command line), then
    `diagnoser analyze` of what it saved."""
    load = Load(port=server.port, model=MODEL_NAME, clients=4, prompt_words=64, max_tokens=64, seconds=WARM_S + 400)
    with load:
        time.sleep(WARM_S)
        before = _generated(server)
        assert server.proc is not None
        proc = subprocess.run([sys.executable, "-m", "diagnoser", "trace", str(server.proc.pid), "--seconds",
                               str(seconds), "-o", str(out), "--no-analyze"], capture_output=True, text=True,
                              timeout=400, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        generated = _generated(server) - before
        load_avg = os.getloadavg()[0]
    folders = sorted(p for p in out.glob("*") if p.is_dir()) if out.exists() else []
    analysis: dict[str, Any] = {}
    if proc.returncode == 0 and folders:
        done = subprocess.run([sys.executable, "-m", "diagnoser", "analyze", str(folders[-1]), "--json"],
                              capture_output=True, text=True, timeout=400, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode == 0:
            analysis = json.loads(done.stdout)["context"]["trace"]["summary"]
    return TraceRun(proc.returncode, proc.stdout, proc.stderr, folders[-1] if folders else None, analysis,
                    generated, load_avg)


def attach(port: int, out: Path, seconds: float = WINDOW_S) -> tuple[dict[str, Any], str]:
    """`diagnoser attach --port` for a window, capture saved; the JSON diagnosis and stderr."""
    proc = subprocess.run([sys.executable, "-m", "diagnoser", "attach", "--port", str(port), "--duration",
                           str(seconds), "--json", "--save", str(out)], capture_output=True, text=True,
                          timeout=seconds + 240, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"attach exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), proc.stderr


@contextmanager
def busy_cores() -> Iterator[None]:
    """Other tenants, for the window only: four spinning processes per core, each in a session of its own. Spinners
    sharing the test's session shared one scheduler group (Linux autogroup) and took 0.3-0.6 of 2 cores against the
    engine's own spinning threads, a different amount each run; tenants of their own take what other services
    would."""
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 300\nwhile time.time() < end: "
                              "pass"], start_new_session=True) for _ in range(4 * (os.cpu_count() or 2))]
    try:
        time.sleep(1.0)  # every tenant running before the window opens
        yield
    finally:
        for p in spin:
            p.kill()
            p.wait()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_window(server: VllmServer, situation: Situation, out: Path) -> Recording:
    load = Load(port=server.port, model=MODEL_NAME, seconds=WARM_S + WINDOW_S + 200, **situation.load)
    side = Load(port=server.port, model=MODEL_NAME, seconds=WARM_S + WINDOW_S + 200, seed=7, **situation.side_load) \
        if situation.side_load else None
    with load, side if side is not None else _nothing():
        time.sleep(WARM_S)
        with busy_cores() if situation.busy_host else _nothing():
            before = (load.done, load.tokens, load.gave_up, time.monotonic())
            cpu_before = _cpu_split(server)
            diagnosis, stderr = attach(server.port, out)
            cpu_after = _cpu_split(server)
            after = (load.done, load.tokens, load.gave_up, time.monotonic())
            load_avg = os.getloadavg()[0]
    dt = after[3] - before[3]
    client = {"done": after[0] - before[0], "tokens_per_s": (after[1] - before[1]) / dt,
              "gave_up": after[2] - before[2], "errors": len(load.errors)}
    host, engine, ours = (b - a for a, b in zip(cpu_before, cpu_after, strict=True))
    return Recording(situation, out, diagnosis, stderr, client, load_avg, max(0.0, host - engine - ours) / dt)


def _cpu_split(server: VllmServer) -> tuple[float, float, float]:
    """CPU seconds so far: the whole host's busy time, the engine's process tree's, and this process's with the
    children it has waited for (the finished `attach`; not the busy-host tenants, which are still running)."""
    times = psutil.cpu_times()
    host = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    host -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    engine = 0.0
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    for p in (root, *root.children(recursive=True)):
        try:
            t = p.cpu_times()
            engine += t.user + t.system
        except psutil.Error:
            continue
    me = psutil.Process().cpu_times()
    return host, engine, me.user + me.system + me.children_user + me.children_system


def compare(before: Path, after: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "diagnoser", "compare", str(before), str(after), "--json"],
                          capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"compare exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def record_all(model_dir: Path, out: Path, names: tuple[str, ...] = (),
               traced: list[TraceRun] | None = None) -> dict[str, Recording]:
    """Every situation (or those named), each server started once; fixes applied on the default server, which runs
    with its profiler endpoints enabled (light settings) and, when `traced` is given, is traced once at the end."""
    chosen = [s for s in SITUATIONS if not names or s.name in names]
    recordings: dict[str, Recording] = {}
    order = [k for k in SERVERS if k != "default"] + ["default"]  # the fixed runs share the default server
    for key in order:
        on_it = [s for s in chosen if s.server == key]
        fixed = [s for s in chosen if s.applied == key] if key == "default" else []
        if not on_it and not fixed and not (key == "default" and traced is not None):
            continue
        flags = SERVERS[key] + (profiler_flags(out / "profiles") if key == "default" else ())
        with VllmServer(model_dir, flags, log=out / f"vllm-{key}.log") as server:
            for s in on_it:
                recordings[s.name] = run_window(server, s, out / f"{s.name}.dgc")
            for s in fixed:
                rec = recordings[s.name]
                rec.applied = run_window(server, s, out / f"{s.name}-fixed.dgc")
                rec.compare = compare(rec.capture, rec.applied.capture)
            if key == "default" and traced is not None:
                traced.append(trace_window(server, out / "traced"))
    return recordings
