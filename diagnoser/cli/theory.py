"""`diagnoser theory`: what the hardware allows for a model, from first principles, before measuring anything."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from diagnoser.capture import ModelInfo
from diagnoser.cli.common import handles_errors, print_json
from diagnoser.errors import InputError
from diagnoser.physics import (
    BUNDLED_SOURCES,
    DEFAULT_MEM_FRACTION,
    GpuSpec,
    Interconnect,
    WhatIf,
    attainable_shares,
    bundled_models,
    check_layout,
    compute_dtype,
    cost_per_million_tokens,
    decode_bound,
    decode_ceiling_tokens_per_s,
    decode_comm_s,
    decode_compute_s,
    decode_floor_s,
    decode_step_bytes,
    dp_attention_gains,
    dp_attention_sequences,
    fits,
    generation_what_if,
    has_kv_shape,
    interconnect,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_cache_dtype,
    load_bundled_model,
    max_concurrent_sequences,
    model_from_params,
    parse_param_count,
    peak_flops,
    pipeline_decode,
    prefill_time_s,
    resolve_model,
    ridge_batch,
    ridge_point,
    tokens_per_joule,
    weight_breakdown,
    weight_bytes,
    weight_dtype,
    what_if,
)
from diagnoser.physics.attention import describe as describe_attention
from diagnoser.physics.attention import mla_dims, sliding
from diagnoser.physics.gpus import load_gpu_spec, looks_like_spec_file, resolve_gpu
from diagnoser.physics.precision import normalise_dtype, weight_only
from diagnoser.physics.quant import weight_format, with_weight_format
from diagnoser.physics.realised import decode_efficiency, decode_workload, generation_workload
from diagnoser.physics.whatif import REALISED_PREFIX, ratio_text
from diagnoser.textsafe import printable

WIDTH = 80


@dataclass(frozen=True)
class Setup:
    """What the user asked about, resolved and validated."""

    model: ModelInfo
    gpu: GpuSpec
    dtype: str
    kv_dtype: str
    batch: int
    context: int
    tp: int
    link: Interconnect
    interconnect_kind: str | None = None  # the user's --interconnect, applied to what-ifs too
    pp: int = 1
    microbatches: int | None = None
    efficiency: float | None = None  # measured tokens/s over the decode ceiling, when given
    efficiency_source: str = ""
    mem_fraction: float = DEFAULT_MEM_FRACTION  # --mem-fraction: a server setting, not physics
    assumptions: tuple[str, ...] = ()  # what was taken for the user (the part a family name means, 16-bit weights)
    gen_tokens: int = 128  # tokens each request generates, for batch what-ifs (each request also prefills --context)


def build_model(
    model: str | None,
    params: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
) -> ModelInfo:
    """The model from --model, or from --params and the optional shape flags."""
    if model and params:
        raise InputError("give --model or --params, not both.")
    if model:
        if layers or kv_heads or head_dim:
            raise InputError("--layers, --kv-heads and --head-dim go with --params; --model has its own shape.")
        return resolve_model(model)
    if params:
        return model_from_params(parse_param_count(params), layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    raise InputError("give --model (a config.json or a bundled name such as llama-2-7b) or --params.")


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded quantity becomes null."""
    return value if math.isfinite(value) else None


def choose_gpu(text: str, *, spec_file: bool = False) -> tuple[GpuSpec, str]:
    """A GPU from the table (resolve_gpu, with its note on the part a family name was taken as), or from a file
    of the user's figures (--gpu-spec, or a --gpu / --vs-gpu value that names a .toml or .json file)."""
    if spec_file or looks_like_spec_file(text):
        return load_gpu_spec(text), ""
    return resolve_gpu(text)


def serving_dtype(model: ModelInfo, gpu: GpuSpec, dtype: str | None) -> tuple[str | None, str]:
    """The weight precision to size, and a note when it is not the config's: a float32 checkpoint is served in 16
    bits (vLLM's --dtype auto downcasts float32 configs to bf16, or fp16 where the GPU has no bf16 rate), so that
    is the default; an explicit --dtype wins."""
    if dtype or model.dtype != "fp32":
        return dtype, ""
    served = "bf16" if "bf16" in gpu.flops else "fp16"
    return served, (f"The config's weights are float32, but servers load them in 16 bits (vLLM's --dtype auto "
                    f"gives {served} on this GPU): sized at {served}; pass --dtype fp32 for 32-bit weights.")


def _notes(s: Setup, kv_known: bool, max_seqs: int | None) -> list[str]:
    notes = list(s.assumptions)
    if not fits(s.model, s.gpu, s.dtype, s.tp * s.pp, mem_fraction=s.mem_fraction):
        notes.append(f"The weights do not fit in {s.mem_fraction:.0%} of one {s.gpu.name} at tp {s.tp}"
                     + (f" x pp {s.pp}" if s.pp > 1 else "") + "; the speeds assume they did (try --tp or a "
                     "smaller --dtype).")
    if not kv_known:
        notes.append("KV cache not counted: pass --layers, --kv-heads and --head-dim to size it.")
    elif max_seqs is not None and s.batch > max_seqs > 0:
        notes.append(f"Only {max_seqs} sequences of {s.context} tokens fit in {s.mem_fraction:.0%} of each GPU's "
                     f"memory (the share assumed for the server, --mem-fraction): batch {s.batch} does not run at "
                     "that share (the figures beside 'if it did' assume it did; try a smaller --batch, a larger "
                     "--mem-fraction, --kv-dtype fp8 or --tp).")
    if s.model.max_context and s.context > s.model.max_context:
        notes.append(f"Context {s.context} exceeds the model's {s.model.max_context} positions.")
    math_dtype = compute_dtype(s.gpu, s.dtype)
    if math_dtype != s.dtype and s.dtype != "fp32" and not weight_only(s.dtype):  # weight-only: expected
        notes.append(f"The {s.gpu.name} has no {s.dtype} tensor cores; math runs at its {math_dtype} rate.")
    if s.model.active_params and s.model.params and s.model.active_params < s.model.params:
        notes.append("MoE: a step reads only the experts its tokens route to (uniform routing assumed).")
    if s.pp > 1:
        notes.append(f"Decode (ceiling) is one tp group holding every layer; the Pipeline section spreads them over "
                     f"{s.pp} stages of {s.tp} GPU{'s' if s.tp > 1 else ''}.")
    if s.tp > 1 and not (s.model.layers and s.model.hidden):
        notes.append("Tensor-parallel collectives not counted: the model's layers and hidden size are unknown.")
    return notes


def _weights(s: Setup) -> dict[str, Any]:
    parts = weight_breakdown(s.model, s.dtype)
    scheme = parts.scheme
    return {"bytes": parts.total, "bytes_per_gpu": parts.total / (s.tp * s.pp), "linear_bytes": parts.linear,
            "lm_head_bytes": parts.lm_head, "embedding_bytes": parts.embedding, "norm_bytes": parts.norms,
            "sixteen_bit_bytes": parts.sixteen_bit,
            "scheme": {"method": scheme.method, "group_size": scheme.group_size, "scale_bytes": scheme.scale_bytes,
                       "lm_head_quantised": scheme.lm_head, "from_config": scheme.from_config,
                       "described": scheme.describe()} if scheme.quantised else None}


def _pipeline(s: Setup, context: int) -> dict[str, Any] | None:
    """Per-stage share and bubble of a --pp pipeline (each stage a --tp group)."""
    if s.pp == 1:
        return None
    micro = s.microbatches or min(s.pp, s.batch)
    if micro > s.batch:
        raise InputError(f"--microbatches {micro} needs at least as many sequences as --batch {s.batch}.")
    per_micro = s.batch / micro
    # One stage holds 1/pp of the layers: its bytes and FLOPs are 1/pp of a whole step at the micro-batch.
    stage_bytes = decode_step_bytes(s.model, per_micro, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp) / s.pp
    stage_flops_s = decode_compute_s(s.model, s.gpu, per_micro, dtype=s.dtype, tp=s.tp, context=context) / s.pp
    comm = decode_comm_s(s.model, s.gpu, per_micro, tp=s.tp, link=s.link) / s.pp
    stage_weights = weight_bytes(s.model, s.dtype) / (s.tp * s.pp)
    hop = interconnect(s.gpu, 2, s.interconnect_kind)
    p = pipeline_decode(stage_bytes / s.gpu.hbm_bytes_per_s + comm, stage_flops_s, s.batch, s.pp, micro,
                        stage_weight_bytes=stage_weights, hidden=s.model.hidden, link=hop)
    return {"stages": p.stages, "microbatches": p.microbatches, "gpus": s.pp * s.tp,
            "stage_weight_bytes": p.stage_weight_bytes, "stage_s": p.stage_s, "handoff_s": p.handoff_s,
            "bubble": p.bubble, "tokens_per_s": p.tokens_per_s}


def report(s: Setup, *, power_w: float | None, usd_per_hour: float | None, what_ifs: list[WhatIf]) -> dict[str, Any]:
    """Every number the command shows, as plain data (the --json output)."""
    m, gpu = s.model, s.gpu
    mla = mla_dims(m) is not None
    kv_known = has_kv_shape(m)
    context = s.context if kv_known else 0  # without the shape, decode is computed without KV reads
    kv_per_token = kv_bytes_per_token(m, s.kv_dtype) if kv_known else None
    max_seqs = max_concurrent_sequences(m, gpu, s.context, s.mem_fraction, tp=s.tp, dtype=s.dtype,
                                        kv_dtype=s.kv_dtype, pp=s.pp) if kv_known and s.context > 0 else None
    ceiling = decode_ceiling_tokens_per_s(m, gpu, s.batch, context, s.dtype, s.tp, kv_dtype=s.kv_dtype, link=s.link)
    power = (power_w or gpu.tdp_w) * s.tp
    weights = _weights(s)
    shares = attainable_shares(gpu, s.dtype)
    return {
        "model": {"name": m.name, "params": m.params, "active_params": m.active_params, "layers": m.layers,
                  # MLA keeps a latent, not KV heads: its layout is under "attention"
                  "kv_heads": None if mla else m.kv_heads, "head_dim": None if mla else m.head_dim,
                  "max_context": m.max_context, "attention": _attention(m)},
        "gpu": {"key": gpu.key, "name": gpu.name, "memory_bytes": gpu.memory_bytes,
                "hbm_bytes_per_s": gpu.hbm_bytes_per_s, "peak_flops": peak_flops(gpu, s.dtype),
                "compute_dtype": compute_dtype(gpu, s.dtype), "source": gpu.source},
        "settings": {"dtype": s.dtype, "kv_dtype": s.kv_dtype, "batch": s.batch, "context": s.context,
                     "gen_tokens": s.gen_tokens, "tp": s.tp,
                     "pp": s.pp, "mem_fraction": s.mem_fraction,
                     "interconnect": {"name": s.link.name, "bytes_per_s": s.link.bytes_per_s,
                                      "latency_s": s.link.latency_s} if s.tp > 1 or s.pp > 1 else None},
        "weight_bytes": weights["bytes"],
        "weight_bytes_per_gpu": weights["bytes_per_gpu"],
        "weights": weights,
        "usable_bytes_per_gpu": gpu.memory_bytes * s.mem_fraction,
        "fits": fits(m, gpu, s.dtype, s.tp * s.pp, mem_fraction=s.mem_fraction),
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_token_per_gpu": kv_bytes_per_token(m, s.kv_dtype, tp=s.tp) if kv_known else None,
        # a sliding layer holds at most its window of the context
        "kv_bytes_per_sequence": kv_bytes_per_sequence(m, s.context, s.kv_dtype) if kv_known else None,
        "max_concurrent_sequences": max_seqs,
        # the same memory with attention data-parallel over the tp GPUs (SGLang's --enable-dp-attention): each GPU
        # keeps only its own sequences' KV; None where tensor parallelism keeps no duplicate KV to save
        "max_concurrent_sequences_dp_attention": dp_attention_sequences(
            m, gpu, s.context, s.mem_fraction, s.tp, dtype=s.dtype, kv_dtype=s.kv_dtype)
        if kv_known and s.context > 0 and s.pp == 1 and dp_attention_gains(m, s.tp) else None,
        "decode": {
            "floor_s": decode_floor_s(m, gpu, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp),
            "compute_s": decode_compute_s(m, gpu, s.batch, dtype=s.dtype, tp=s.tp, context=context),
            "comm_s": decode_comm_s(m, gpu, s.batch, tp=s.tp, link=s.link),
            "bound": decode_bound(m, gpu, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp),
            "ceiling_tokens_per_s": ceiling,
            "per_sequence_tokens_per_s": ceiling / s.batch,
        },
        "measured": {"efficiency": s.efficiency, "tokens_per_s": s.efficiency * ceiling, "from": s.efficiency_source,
                     "attainable_bandwidth_share": shares[0], "attainable_compute_share": shares[1]}
        if s.efficiency is not None else None,
        "pipeline": _pipeline(s, context),
        "ridge": {
            "flop_per_byte": ridge_point(gpu, s.dtype),
            "batch": ridge_batch(m, gpu, s.dtype, tp=s.tp),
            "batch_at_context": _finite(ridge_batch(m, gpu, s.dtype, context=context, kv_dtype=s.kv_dtype, tp=s.tp))
            if context else None,
        },
        "prefill": {"tokens": s.context, "time_s": prefill_time_s(m, gpu, s.context, s.dtype, s.tp,
                                                                  kv_dtype=s.kv_dtype, link=s.link)
                    if s.context > 0 else None},
        "energy": {"power_w": power, "power_source": "user" if power_w else "tdp",
                   "tokens_per_joule": tokens_per_joule(ceiling, power)},
        "cost": {"usd_per_gpu_hour": usd_per_hour,
                 "usd_per_million_tokens": cost_per_million_tokens(ceiling, usd_per_hour, s.tp)}
        if usd_per_hour is not None else None,
        "what_ifs": [{"change": w.change, "before_tokens_per_s": w.before_tokens_per_s,
                      "after_tokens_per_s": w.after_tokens_per_s, "speedup": w.speedup,
                      "ceiling_speedup": w.speedup, "realised_speedup": w.realised_speedup,
                      "efficiency": w.efficiency, "before_batch": w.before_batch, "after_batch": w.after_batch,
                      "explanation": w.explanation, "assumptions": list(w.assumptions)} for w in what_ifs],
        "notes": _notes(s, kv_known, max_seqs),
    }


def _attention(m: ModelInfo) -> dict[str, Any]:
    """The attention layout behind the KV figures: grouped-query (gqa), MLA or sliding windows."""
    mla, window = mla_dims(m), sliding(m)
    out: dict[str, Any] = {"layout": "mla" if mla else "sliding" if window else "gqa",
                           "description": describe_attention(m)}
    if mla:
        out.update(kv_lora_rank=mla[0], qk_rope_head_dim=mla[1])
    if window:
        out.update(sliding_window=window[0], sliding_layers=window[1])
    return out


# --- terminal ----------------------------------------------------------------------------------------------

def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def _weight_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    st, w = r["settings"], r["weights"]
    gpus = st["tp"] * st["pp"]
    rows = [("weights", f"{_gb(w['bytes'])} at {st['dtype']}"
             + (f" ({_gb(w['bytes_per_gpu'])} per GPU)" if gpus > 1 else ""))]
    if w["scheme"]:
        rows.append(("stored as", w["scheme"]["described"]
                     + ("" if w["scheme"]["from_config"] else ", by default")))
        rows.append(("kept 16-bit", f"{_gb(w['sixteen_bit_bytes'])} (embedding, norms"
                     + ("" if w["scheme"]["lm_head_quantised"] else ", lm_head") + ")"))
    return rows


def _rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows; a label with an empty value is a section heading."""
    m, st, d, ridge = r["model"], r["settings"], r["decode"], r["ridge"]
    params = _count(m["params"])
    if m["active_params"] and m["active_params"] < m["params"]:
        params += f" ({_count(m['active_params'])} active per token)"
    shape = ", ".join(f"{v} {k}" for k, v in (("layers", m["layers"]), ("KV heads", m["kv_heads"]),
                                              ("head dim", m["head_dim"])) if v)
    rows = [("Model", ""), ("parameters", params)]
    if shape:
        rows.append(("shape", shape))
    if m["attention"]["description"]:
        rows.append(("attention", m["attention"]["description"]))
    rows += _weight_rows(r)
    kv = r["kv_bytes_per_token"]
    rows.append(("KV cache per token", f"{kv / 1024:,.1f} KiB at {st['kv_dtype']}" if kv and kv < 10 * 1024
                 else f"{kv / 1024:,.0f} KiB at {st['kv_dtype']}" if kv else "unknown"))
    if kv and m["attention"]["layout"] == "sliding" and st["context"]:
        rows.append(("KV per sequence", f"{_gb(r['kv_bytes_per_sequence'])} at {st['context']:,} tokens (sliding "
                                        "layers keep their window)"))
    rows += [("Memory", ""), ("fits", ("yes" if r["fits"] else "no") + f": {_gb(r['weight_bytes_per_gpu'])} of "
                                 f"{_gb(r['usable_bytes_per_gpu'])} usable per GPU"),
             ("usable", f"{st['mem_fraction']:.0%} of memory: a server setting (vLLM's default 0.9), not physics; "
                        "--mem-fraction sets it")]
    if r["max_concurrent_sequences"] is not None:
        seqs = f"<= {r['max_concurrent_sequences']:,} of {st['context']:,} tokens at {st['kv_dtype']} KV"
        dp = r["max_concurrent_sequences_dp_attention"]
        if dp is not None:
            copies = "every GPU keeps every sequence's latent" if m["attention"]["layout"] == "mla" else \
                "KV heads are copied to several GPUs"
            seqs += (f" with tensor-parallel attention ({copies}); <= {dp:,} over the {st['tp']} GPUs with "
                     "data-parallel attention (SGLang's --enable-dp-attention: each GPU keeps its own sequences' "
                     "KV and a whole copy of attention's weights)")
        rows.append(("max sequences", seqs))
    step = max(d["floor_s"], d["compute_s"]) + d["comm_s"]
    rows += [("Decode (ceiling)", ""),
             ("time per step", f">= {_time(step)} ({d['bound']}-bound)"),
             ("memory, compute", f"{_time(d['floor_s'])}, {_time(d['compute_s'])}")]
    if st["tp"] > 1:
        link = st["interconnect"]
        comm = (f"{_time(d['comm_s'])} a step over {link['name']} ({link['bytes_per_s'] / 1e9:g} GB/s each way, "
                f"{link['latency_s'] * 1e6:g} µs each)")
        rows.append(("collectives", comm))
    rate = f"<= {_rate(d['ceiling_tokens_per_s'])} at batch {st['batch']} ({_rate(d['per_sequence_tokens_per_s'])} " \
        "per sequence)"
    fit = r["max_concurrent_sequences"]
    if fit is not None and st["batch"] > fit:
        # The what-ifs start from 0 tokens/s for a batch that does not fit: say the same here.
        rate = (f"none: batch {st['batch']} does not fit in {st['mem_fraction']:.0%} of memory "
                f"({_rate(d['ceiling_tokens_per_s'])} if it did)")
    rows += [("tokens/s", rate),
             ("ridge point", f"{ridge['flop_per_byte']:.0f} FLOP/byte at {r['gpu']['compute_dtype']}"),
             ("ridge batch", _ridge_text(ridge, st["context"] if kv else 0))]
    if r["measured"]:
        me = r["measured"]
        measured = f"{_rate(me['tokens_per_s'])}: {me['efficiency']:.0%} of the ceiling ({me['from']})"
        rows += [("Measured", ""), ("tokens/s", measured)]
    if r["pipeline"]:
        p = r["pipeline"]
        stage = f"{_gb(p['stage_weight_bytes'])} of weights per GPU, {_time(p['stage_s'])} per micro-batch"
        plural = "es" if p["microbatches"] > 1 else ""
        rows += [(f"Pipeline ({p['stages']} stages)", ""),
                 ("per stage", stage),
                 ("bubble", f"{p['bubble']:.0%} idle with {p['microbatches']} micro-batch{plural}"),
                 ("tokens/s", f"<= {_rate(p['tokens_per_s'])} over {p['gpus']} GPUs")]
    if r["prefill"]["time_s"] is not None:
        rows += [("Prefill", ""), (f"{st['context']:,} tokens", f">= {_time(r['prefill']['time_s'])}")]
    e = r["energy"]
    rows += [("Energy and cost", ""), ("tokens per joule", f"{e['tokens_per_joule']:.3g} at {e['power_w']:.0f} W"
                                       + (" (TDP)" if e["power_source"] == "tdp" else ""))]
    if r["cost"]:
        rows.append(("$ per million tokens", f"{r['cost']['usd_per_million_tokens']:.3g}"))
    return rows


def _ridge_text(ridge: dict[str, Any], context: int) -> str:
    text = f"{ridge['batch']:,.0f} without KV"
    if context:
        at = ridge["batch_at_context"]
        text += (f"; {at:,.0f}" if at is not None else "; never") + f" at {context:,} tokens"
    return text


def _render_what_if(w: dict[str, Any], console: Console) -> None:
    head = f"{w['change']}: ceiling {_rate(w['before_tokens_per_s'])} -> {_rate(w['after_tokens_per_s'])} tokens/s"
    if not w["after_tokens_per_s"]:
        head += " (does not fit)"
    elif w["speedup"] is None:
        head += " (fits now)"
    else:
        head += f" ({ratio_text(w['speedup'])})"
        if w["realised_speedup"] is not None:
            head += f"; realised {ratio_text(w['realised_speedup'])}"
    nb, na = w.get("before_batch"), w.get("after_batch")
    if nb and na and nb != na and w["after_tokens_per_s"]:
        # A batch change moves the throughput of all sequences together; each sequence's own speed goes the other way.
        head += (f"; all sequences together, each {_rate(w['before_tokens_per_s'] / nb)} -> "
                 f"{_rate(w['after_tokens_per_s'] / na)} tokens/s")
    console.print(Padding(head, (0, 0, 0, 2)))
    why = w["explanation"].removeprefix(f"{w['change']}: ")
    console.print(Padding(why, (0, 0, 0, 4)), style="dim")
    for assumption in w["assumptions"]:
        if not assumption.startswith(REALISED_PREFIX):  # said once, above the what-ifs
            console.print(Padding(f"assumes {assumption}", (0, 0, 0, 4)), style="dim")


def _shown(value: Any) -> Any:
    """Every string of the result as text to show: a model's name and notes come from a config file anyone wrote,
    so control characters are escaped (never obeyed) and brackets never read as rich markup."""
    if isinstance(value, str):
        return escape(printable(value))
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shown(v) for v in value]
    return value


def render(r: dict[str, Any], console: Console) -> None:
    r = _shown(r)
    st = r["settings"]
    console.print(f"[bold]{r['model']['name'] or 'model'}[/] on {r['gpu']['name']}"
                  + (f" x{st['tp']}" if st["tp"] > 1 else "") + (f" x pp {st['pp']}" if st["pp"] > 1 else ""))
    console.print(f"batch {st['batch']}, context {st['context']:,}, {st['dtype']} weights, {st['kv_dtype']} KV; "
                  "ceilings from datasheet peaks", style="dim")
    # Caveats first: they qualify the numbers that follow.
    for note in r["notes"]:
        console.print(Padding(f"Note: {note}", (0, 0, 0, 0)))
    table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
    table.add_column(min_width=22, max_width=24, no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in _rows(r):
        table.add_row(f"[bold]{label}[/]" if not value else f"  {label}", value)
    console.print(table)
    if r["what_ifs"]:
        console.print("[bold]What if[/]")
        realised = next((a for w in r["what_ifs"] for a in w["assumptions"] if a.startswith(REALISED_PREFIX)), "")
        if realised:
            console.print(Padding("x ceiling: the ratio of the ceilings, what a step at its floor would gain. "
                                  "x realised: what this server would gain; " + realised.removeprefix(
                                      REALISED_PREFIX).strip() + ".", (0, 0, 0, 2)), style="dim")
        for w in r["what_ifs"]:
            _render_what_if(w, console)


def _list_models(as_json: bool) -> None:
    models = [(name, load_bundled_model(name)) for name in bundled_models()]
    if as_json:
        print_json([{"name": name, "source": BUNDLED_SOURCES.get(name, ""), "params": m.params,
                     "active_params": m.active_params, "dtype": m.dtype} for name, m in models])
        return
    table = Table("name", "Hugging Face source", "params", "dtype", box=None, pad_edge=False)
    for name, m in models:
        table.add_row(name, BUNDLED_SOURCES.get(name, ""), _count(m.params or 0.0), m.dtype)
    Console(width=WIDTH, highlight=False).print(table)


@dataclass(frozen=True)
class Changes:
    """The --vs-* values: one what-if each."""

    dtype: list[str]
    kv_dtype: list[str]
    gpu: list[GpuSpec]
    batch: list[int]
    tp: list[int]


def _what_ifs(s: Setup, vs: Changes) -> list[WhatIf]:
    """One comparison per --vs-* value, each changing that one thing."""
    context = s.context if has_kv_shape(s.model) else 0

    def compare(**change: Any) -> WhatIf:
        gpu, tp = change.get("new_gpu") or s.gpu, change.get("new_tp") or s.tp
        link = interconnect(gpu, tp, s.interconnect_kind) if tp > 1 else None
        return what_if(s.model, s.gpu, s.dtype, s.batch, context, s.tp, kv_dtype=s.kv_dtype, link=s.link,
                       new_link=link, efficiency=s.efficiency, mem_fraction=s.mem_fraction, **change)

    out = [compare(new_dtype=normalise_dtype(d)) for d in vs.dtype]
    out += [compare(new_kv_dtype=normalise_dtype(d)) for d in vs.kv_dtype]
    out += [compare(new_gpu=g) for g in vs.gpu]
    for b in vs.batch:
        if b < 1:
            raise InputError(f"--vs-batch must be at least 1, not {b}.")
        if s.context < 1:
            out.append(compare(new_batch=b))  # no prompt, nothing to prefill
            continue
        # A larger batch shares the decode's weight reads, not the prefill's FLOPs: count each request's prefill.
        out.append(generation_what_if(s.model, s.gpu, s.dtype, s.batch, s.context, s.gen_tokens, b, s.tp,
                                      context=context, kv_dtype=s.kv_dtype, efficiency=s.efficiency, link=s.link,
                                      mem_fraction=s.mem_fraction))
    for t in vs.tp:
        if t < 1:
            raise InputError(f"--vs-tp must be at least 1, not {t}.")
        out.append(compare(new_tp=t))
    return out


RATE_KINDS = ("decode", "requests")


def _efficiency(info: ModelInfo, gpu: GpuSpec, s: Setup, tokens_per_s: float | None,
                efficiency: float | None, rate_of: str = "decode") -> tuple[float | None, str]:
    """The measured efficiency against this setup's decode ceiling, from --tokens-per-s or --efficiency. With
    --tokens-per-s-of requests the rate counts whole requests (each --context prompt prefilled, then --gen-tokens
    generated; a benchmark's output tokens over its requests' time): it is taken against the requests' ceiling,
    prefill priced, and turned into the decode step's share (physics.decode_efficiency)."""
    if rate_of not in RATE_KINDS:
        raise InputError(f"--tokens-per-s-of is decode or requests, not {rate_of!r:.20}.")
    if tokens_per_s is not None and efficiency is not None:
        raise InputError("give --tokens-per-s or --efficiency, not both.")
    if efficiency is not None:
        if not 0 < efficiency <= 1:
            raise InputError(f"--efficiency is a share of the ceiling in (0, 1], not {efficiency:g}.")
        return efficiency, "--efficiency"
    if tokens_per_s is None:
        return None, ""
    context = s.context if has_kv_shape(info) else 0
    ceiling = decode_ceiling_tokens_per_s(info, gpu, s.batch, context, s.dtype, s.tp, kv_dtype=s.kv_dtype,
                                          link=s.link)
    if rate_of == "requests":
        if s.context < 1:
            raise InputError("--tokens-per-s-of requests needs the prompt's length as --context (at least 1).")
        requests = generation_workload(info, gpu, s.batch, s.context, s.gen_tokens, dtype=s.dtype,
                                       kv_dtype=s.kv_dtype, tp=s.tp, link=s.link)
        if tokens_per_s > requests.ceiling_tokens_per_s:
            raise InputError(f"{tokens_per_s:g} tokens/s is above the ceiling of {requests.ceiling_tokens_per_s:,.0f} "
                             f"for requests of {s.context:,} prompt and {s.gen_tokens:,} generated tokens; check the "
                             "model, precision, GPU, batch, --context and --gen-tokens.")
        share = tokens_per_s / requests.ceiling_tokens_per_s
        step = decode_workload(info, gpu, s.batch, context, dtype=s.dtype, kv_dtype=s.kv_dtype, tp=s.tp, link=s.link)
        return decode_efficiency(requests, share, step), (
            f"--tokens-per-s {tokens_per_s:g} of whole requests: {share:.0%} of their ceiling with each "
            f"{s.context:,}-token prefill priced, so decode steps at this share")
    if tokens_per_s > ceiling:
        raise InputError(f"{tokens_per_s:g} tokens/s is above the ceiling of {ceiling:,.0f} for this setup; check "
                         "the model, precision, GPU, batch and context (a rate over whole requests, prefill "
                         "included, is --tokens-per-s-of requests).")
    return tokens_per_s / ceiling, f"--tokens-per-s {tokens_per_s:g} of decode steps"


def register(app: typer.Typer) -> None:
    @app.command("theory")
    @handles_errors
    def theory_cmd(
        model: str = typer.Option(None, "--model", help="A config.json (or its folder), or a bundled model name."),
        params: str = typer.Option(None, "--params", help="Parameter count instead of --model, e.g. 7e9 or 7B."),
        layers: int = typer.Option(None, "--layers", min=1, help="Layers (with --params, to size the KV cache)."),
        kv_heads: int = typer.Option(None, "--kv-heads", min=1, help="KV heads (with --params)."),
        head_dim: int = typer.Option(None, "--head-dim", min=1, help="Head size (with --params)."),
        gpu: str = typer.Option(None, "--gpu", help="GPU, e.g. h100-sxm (the default), h100-pcie, a100-80gb-sxm, "
                                "mi300x, L4, or a spec file (see --gpu-spec)."),
        gpu_spec: str = typer.Option(None, "--gpu-spec",
                                     help="Your GPU's figures: a TOML or JSON file, or key=value pairs (name, "
                                          "memory_gb, hbm_tb_per_s, tdp_w, tflops.bf16, ...; docs/physics.md)."),
        mem_fraction: float = typer.Option(DEFAULT_MEM_FRACTION, "--mem-fraction",
                                           help="Share of each GPU's memory the server may use for weights and KV "
                                                "cache, in (0, 1] (vLLM's --gpu-memory-utilization, default 0.9)."),
        dtype: str = typer.Option(None, "--dtype", help="Weight precision (default: the model's, 16-bit for a float32 "
                                                        "config, else bf16), or a GGUF type (Q4_K_M, Q6_K, IQ3_M ...) "
                                                        "or EXL2 bits (exl2:4.65)."),
        kv_dtype: str = typer.Option(None, "--kv-dtype", help="KV-cache precision (default: 16-bit)."),
        batch: int = typer.Option(1, "--batch", min=1, help="Sequences decoded together."),
        context: int = typer.Option(2048, "--context", min=0, help="Tokens per sequence (and the prompt size)."),
        gen_tokens: int = typer.Option(128, "--gen-tokens", min=1,
                                       help="Tokens each request generates after its --context prompt, for --vs-batch "
                                            "(each request's prefill is counted; default 128, vLLM's benchmark "
                                            "default output length)."),
        tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel GPUs."),
        pp: int = typer.Option(1, "--pp", min=1, help="Pipeline-parallel stages (each a --tp group)."),
        microbatches: int = typer.Option(None, "--microbatches", min=1,
                                         help="Micro-batches in a --pp pipeline (default: --pp, at most --batch)."),
        link: str = typer.Option(None, "--interconnect",
                                 help="nvlink or pcie (default: NVLink where the GPU has it)."),
        tokens_per_s: float = typer.Option(None, "--tokens-per-s",
                                           help="Measured output tokens/s at this setup: what-ifs add the realised "
                                                "gain."),
        rate_of: str = typer.Option("decode", "--tokens-per-s-of",
                                    help="What --tokens-per-s counts: decode (steady decode steps, the default) or "
                                         "requests (whole requests: each --context prompt prefilled, then "
                                         "--gen-tokens generated, as benchmark_latency and most load tests report)."),
        efficiency: float = typer.Option(None, "--efficiency",
                                         help="Measured share of the decode ceiling, in (0, 1], instead."),
        power_w: float = typer.Option(None, "--power-w", help="Power per GPU, W (default: TDP)."),
        usd_per_hour: float = typer.Option(None, "--usd-per-hour", help="Price per GPU hour, USD."),
        vs_dtype: list[str] = typer.Option([], "--vs-dtype", help="What if the weights were this precision?"),
        vs_kv_dtype: list[str] = typer.Option([], "--vs-kv-dtype", help="What if the KV cache were this precision?"),
        vs_gpu: list[str] = typer.Option([], "--vs-gpu", help="What if it ran on this GPU (a name or a spec file)?"),
        vs_batch: list[int] = typer.Option([], "--vs-batch", help="What if the batch were this?"),
        vs_tp: list[int] = typer.Option([], "--vs-tp", help="What if tensor parallel were this?"),
        as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
        list_models: bool = typer.Option(False, "--list-models", help="List the bundled model configs."),
    ) -> None:
        """Ceilings from first principles: memory, decode and prefill speed, ridge batch, and what-ifs."""
        if list_models:
            _list_models(as_json)
            return
        # Checked here rather than by typer's min=, whose message for nan ("greater than or equal to 0.001") misleads.
        for flag, number, zero_ok in (("--tokens-per-s", tokens_per_s, False), ("--power-w", power_w, False),
                                      ("--usd-per-hour", usd_per_hour, True)):
            if number is not None and not (math.isfinite(number) and (number > 0 or zero_ok and number == 0)):
                raise InputError(f"{flag} must be a finite number {'of 0 or more' if zero_ok else 'above 0'}, "
                                 f"not {number:g}.")
        # Plausible per-GPU figures (a TDP from a T4's 70 W to a GB200's 2,700 W; a cloud GPU hour from cents to
        # tens of dollars): a figure in the wrong unit (kW as W, cents as dollars, a node's price as a GPU's) falls out.
        for flag, number, unit, (low, high) in (("--power-w", power_w, "W per GPU", (5, 3000)),
                                                ("--usd-per-hour", usd_per_hour, "USD per GPU hour", (0, 500))):
            if number is not None and not low <= number <= high:
                raise InputError(f"{flag} is {number:g} {unit}, outside the plausible {low:g} to {high:g} {unit}; "
                                 "check its unit.")
        if efficiency is not None and not math.isfinite(efficiency):
            raise InputError(f"--efficiency must be a finite number, not {efficiency:g}.")
        if not (math.isfinite(mem_fraction) and 0 < mem_fraction <= 1):
            raise InputError(f"--mem-fraction is a share of each GPU's memory in (0, 1], not {mem_fraction:g}.")
        if gpu and gpu_spec:
            raise InputError("give --gpu or --gpu-spec, not both.")
        info = build_model(model, params, layers, kv_heads, head_dim)
        fmt = weight_format(dtype) if dtype else None
        if fmt is not None:  # a GGUF type or EXL2 bits: the model stored in that format
            info, dtype = with_weight_format(info, fmt), fmt.dtype
        check_layout(info, tp, pp)
        for t in vs_tp:
            check_layout(info, t, pp, flag="--vs-tp")
        spec, gpu_note = choose_gpu(gpu_spec or gpu or "h100-sxm", spec_file=bool(gpu_spec))
        others = [choose_gpu(g) for g in vs_gpu]
        served, dtype_note = serving_dtype(info, spec, dtype)
        assumed = tuple(note for note in (gpu_note, *(n for _, n in others), dtype_note) if note)
        setup = Setup(info, spec, weight_dtype(info, served), kv_cache_dtype(info, kv_dtype, served), batch, context,
                      tp, interconnect(spec, max(tp, 2), link), link, pp, microbatches, mem_fraction=mem_fraction,
                      assumptions=assumed, gen_tokens=gen_tokens)
        rate, source = _efficiency(info, spec, setup, tokens_per_s, efficiency, rate_of)
        setup = dataclasses.replace(setup, efficiency=rate, efficiency_source=source)
        changes = Changes(vs_dtype, vs_kv_dtype, [g for g, _ in others], vs_batch, vs_tp)
        result = report(setup, power_w=power_w, usd_per_hour=usd_per_hour, what_ifs=_what_ifs(setup, changes))
        if as_json:
            print_json(result)
        else:
            console = Console(highlight=False)
            console.width = min(console.width, WIDTH)
            render(result, console)
