"""After record_hf.sh's runs: mark each capture, cut its trace, measure the workload's own rate over the window,
re-diagnose, compare the pairs, and write summary.md / summary.json into the work folder.

    python3 scripts/gpu/hf_record_finish.py WORK_DIR

Each run folder WORK_DIR/<name>/ holds what record_hf.sh left: ready.json, progress.jsonl, stats.json,
<name>.raw.dgc (the capture exactly as `diagnoser attach --save` wrote it), attach.json/.err, workload.log and maybe
a trace-*.json. This writes beside them:

- <name>.dgc: the raw capture with what attach cannot know of this workload, as the self-test harness adds it to
  its own captures (diagnoser/selftest/harness.py): serving.engine = "transformers" (the /metrics page is a shim
  under vLLM's names, so attach reads the engine as vLLM and would count vLLM's continuous batching and tuned
  decode as already in place), and serving.mean_context_tokens = the tokens each decode step attends over (prompt +
  half the new tokens with transformers' dynamic cache; the whole static cache with --static). A note says so.
- diagnose.json / diagnose.txt: `diagnoser diagnose` of the marked capture;
- <name>-<N>ms.json.gz: a window of the trace (diagnoser/traces/trim.py), the full trace deleted.

Every step is independent: one that fails is written into the summary and the rest go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PY = os.environ.get("PY", sys.executable)
TRIM_MS = float(os.environ.get("TRIM_MS", "50"))
PAIRS = [("hf-eager-b1", "hf-eager-b16", "batch 1 -> 16 (the larger-batch fix)"),
         ("hf-eager-b1", "hf-static-compile-b1", "eager -> static cache + torch.compile (the CUDA-graphs fix)"),
         ("hf-static-compile-b1-fp32", "hf-static-compile-b1", "fp32 -> bf16, compiled (the precision fix)"),
         ("hf-static-compile-b16-fp32", "hf-static-compile-b16", "fp32 -> bf16, compiled, batch 16")]
OBSERVED = ("gpu.busy", "gpu.sm_active", "gpu.tensor_active", "gpu.dram_active", "gpu.mem_used_frac", "gpu.power_w",
            "gpu.sm_clock_frac", "host.target_busiest_thread", "host.target_cpu", "server.running", "server.waiting",
            "server.gen_tokens_per_s")


def run(cmd: list[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, str(exc.stdout or ""), f"timed out after {timeout:g} s"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def progress(path: Path) -> list[tuple[float, int]]:
    points = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            d = json.loads(line)
            points.append((float(d["t"]), int(d["tokens"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the stop signal
    return sorted(points)


def tokens_at(points: list[tuple[float, int]], t: float) -> float | None:
    """Cumulative tokens at unix time t, interpolated between the workload's progress lines."""
    for (t0, n0), (t1, n1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else float(n0)
    return None


def window_rate(points: list[tuple[float, int]], start: float, end: float) -> float | None:
    a, b = tokens_at(points, start), tokens_at(points, end)
    return (b - a) / (end - start) if a is not None and b is not None and end > start else None


def observed(capture: Any) -> dict[str, float]:
    from diagnoser.evidence_build import build_evidence

    ev = build_evidence(capture)
    return {name: round(ev[name].mean, 4) for name in OBSERVED if name in ev}


def finish_run(d: Path) -> dict[str, Any]:
    from diagnoser.capture import load, save

    name = d.name
    out: dict[str, Any] = {"name": name, "errors": []}
    ready, stats = read_json(d / "ready.json") or {}, read_json(d / "stats.json") or {}
    keys = ("batch", "static", "size", "params", "dtype", "device", "gpu_name", "torch", "transformers",
            "attn_implementation", "startup_s", "warmup_s", "prompt", "new_tokens")
    out["ready"] = {k: ready.get(k) for k in keys}
    out["workload_full_calls_tokens_per_s"] = stats.get("full_calls_tokens_per_s")
    out["workload_calls"] = [{k: c.get(k) for k in ("new_tokens", "batch", "seconds", "tokens_per_s")}
                             for c in stats.get("call_log", [])]
    attach = read_json(d / "attach.json")
    if isinstance(attach, dict):
        out["attach_verdict"] = attach.get("verdict")
        out["attach_headline"] = attach.get("headline")
        out["attach_confidence"] = attach.get("confidence")
    raw = d / f"{name}.raw.dgc"
    if not raw.is_file():
        out["errors"].append("no capture (attach failed?): see attach.err")
        return out
    try:
        cap = load(raw)
        points = progress(d / "progress.jsonl")
        rate = window_rate(points, cap.started_at, cap.started_at + cap.duration_s)
        out["window"] = {"started_at": cap.started_at, "duration_s": cap.duration_s}
        out["workload_window_tokens_per_s"] = round(rate, 2) if rate is not None else None
        out["observed_raw"] = observed(cap)
        batch, prompt, new = int(ready.get("batch") or 1), int(ready.get("prompt") or 0), int(ready.get("new_tokens")
                                                                                              or 0)
        context = prompt + new if ready.get("static") else prompt + (new + 1) // 2
        cap.serving.engine = "transformers"
        if context:
            cap.serving.mean_context_tokens = float(context)
        how = ('cache_implementation="static" (compiled by transformers with torch.compile, mode reduce-overhead)'
               if ready.get("static") else "eager, dynamic cache")
        cap.notes.append(
            f"Recorded by scripts/gpu/record_hf.sh: transformers {ready.get('transformers')} generate() on "
            f"{ready.get('model')} (random {ready.get('dtype')} weights, {ready.get('attn_implementation')} "
            "attention), greedy, "
            f"batch {batch}, {prompt}-token prompts, {new} new tokens per call, {how}. Its /metrics page is the "
            "recorder's shim under vLLM's names (running = batch, generated-token counter); serving.engine was set "
            f"to 'transformers' and mean_context_tokens to {context} after the window (attach read the page's "
            f"names as vLLM). The workload measured {rate or 0:.1f} tokens/s itself over the window.")
        save(cap, d / f"{name}.dgc")
        out["observed"] = observed(cap)
    except Exception as exc:
        out["errors"].append(f"mark: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return out
    for fmt, extra in (("json", ["--json"]), ("txt", ["--verbose"])):
        rc, so, se = run([PY, "-m", "diagnoser", "diagnose", str(d / f"{name}.dgc"), *extra])
        (d / f"diagnose.{fmt}").write_text(so + (f"\n[stderr]\n{se}" if se.strip() else ""))
        if fmt == "json":
            try:
                dj = json.loads(so)
                out["verdict"], out["headline"] = dj.get("verdict"), dj.get("headline")
                out["confidence"], out["regime"] = dj.get("confidence"), dj.get("regime")
                out["fixes"] = [{k: f.get(k) for k in ("kind", "title", "gain", "gain_kind", "benefit", "rule")}
                                for f in dj.get("fixes", [])[:5]]
                out["findings"] = [{k: f.get(k) for k in ("code", "limiter", "strength", "message")}
                                   for f in dj.get("findings", [])[:4]]
            except ValueError:
                out["errors"].append(f"diagnose rc={rc}: {se.strip()[-300:]}")
    traces = sorted(d.glob("trace-*.json*"))
    if traces:
        from diagnoser.traces.trim import trim_trace

        src = traces[0]
        out["trace_bytes"] = src.stat().st_size
        dst = d / f"{name}-{TRIM_MS:g}ms.json.gz"
        try:
            out["trace_events_kept"] = trim_trace(src, dst, window_ms=TRIM_MS)
            out["trace_window"] = dst.name
        except Exception as exc:
            out["errors"].append(f"trim: {type(exc).__name__}: {exc}")
        for t in traces:
            t.unlink()
    return out


def compare(work: Path, a: str, b: str, what: str) -> dict[str, Any]:
    ca, cb = work / a / f"{a}.dgc", work / b / f"{b}.dgc"
    res: dict[str, Any] = {"before": a, "after": b, "what": what}
    if not (ca.is_file() and cb.is_file()):
        res["error"] = "a capture is missing"
        return res
    stem = work / f"compare-{a}-vs-{b}"
    rc, so, se = run([PY, "-m", "diagnoser", "compare", str(ca), str(cb)])
    stem.with_suffix(".txt").write_text(so + (f"\n[stderr]\n{se}" if se.strip() else ""))
    rc, so, se = run([PY, "-m", "diagnoser", "compare", str(ca), str(cb), "--json"])
    stem.with_suffix(".json").write_text(so if so.strip() else se)
    try:
        cj = json.loads(so)
    except ValueError:
        res["error"] = f"compare rc={rc}: {se.strip()[-300:]}"
        return res
    res["rates"] = cj.get("rates")
    res["changes"] = cj.get("changes")
    res["predictions"] = [{k: p.get(k) for k in ("kind", "predicted", "predicted_kind", "for_change", "realised",
                                                 "verdict", "applied", "benefit")}
                          for p in cj.get("predictions", [])]
    res["notes"] = cj.get("notes")
    res["confounders"] = cj.get("confounders")
    return res


def md(summary: dict[str, Any]) -> str:
    lines = [f"# HF generate recordings ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})", ""]
    for k, v in summary.get("env", {}).items():
        lines.append(f"- {k}: {v}")
    lines += ["", "| run | batch | tokens/s (workload, window) | tokens/s (full calls) | GPU busy | SM | DRAM | "
              "busiest thread | verdict as attached | verdict (marked) | top fix |", "|---" * 11 + "|"]
    for r in summary["runs"]:
        o = r.get("observed", r.get("observed_raw", {}))
        fix = (r.get("fixes") or [{}])[0]

        def pct(key: str, o: dict[str, float] = o) -> str:
            return f"{o[key]:.0%}" if key in o else "-"

        full = r.get("workload_full_calls_tokens_per_s")
        lines.append(f"| {r['name']} | {r.get('ready', {}).get('batch')} | {r.get('workload_window_tokens_per_s')} | "
                     f"{round(full, 1) if full else '-'} | {pct('gpu.busy')} | {pct('gpu.sm_active')} | "
                     f"{pct('gpu.dram_active')} | {pct('host.target_busiest_thread')} | {r.get('attach_verdict')} | "
                     f"{r.get('verdict')} | {fix.get('kind')} {fix.get('gain')} |")
    for r in summary["runs"]:
        lines += ["", f"## {r['name']}", "", f"- headline: {r.get('headline')}", f"- as attached: "
                  f"{r.get('attach_headline')}"]
        for f in r.get("fixes", []):
            lines.append(f"- fix {f.get('kind')}: gain {f.get('gain')} ({f.get('gain_kind')}, {f.get('benefit')})")
        if r.get("errors"):
            lines.append(f"- ERRORS: {r['errors']}")
    for c in summary["compares"]:
        lines += ["", f"## compare {c['before']} -> {c['after']}: {c['what']}", ""]
        if c.get("error"):
            lines.append(f"- ERROR: {c['error']}")
        for p in c.get("predictions", []):
            lines.append(f"- {p.get('kind')}: predicted {p.get('predicted')} ({p.get('predicted_kind')}), for the "
                         f"change made {p.get('for_change')}, realised {p.get('realised')}: {p.get('verdict')}")
    return "\n".join(lines) + "\n"


def main() -> int:
    work = Path(sys.argv[1])
    summary: dict[str, Any] = {"env": read_json(work / "env.json") or {}, "runs": [], "compares": []}
    for d in sorted(p for p in work.iterdir() if p.is_dir() and p.name.startswith("hf-")):
        try:
            summary["runs"].append(finish_run(d))
        except Exception as exc:
            summary["runs"].append({"name": d.name, "errors": [f"{type(exc).__name__}: {exc}"]})
            traceback.print_exc()
    for a, b, what in PAIRS:
        try:
            summary["compares"].append(compare(work, a, b, what))
        except Exception as exc:
            summary["compares"].append({"before": a, "after": b, "what": what, "error": f"{type(exc).__name__}: {exc}"})
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (work / "summary.md").write_text(md(summary))
    print(md(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
