"""A tiny decoder-only LLM run on the CPU under torch.profiler: the real traces the trace tests analyse.

Prefill processes `batch` prompts of `prompt` tokens at once (causal attention), then each decode step feeds one
token per sequence through the same layers with a growing KV cache, exactly the shape of LLM serving. The FLOPs
of every op follow from the sizes below, so tests can check the analysis exactly (`expected_flops`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

D_MODEL = 64
HEADS = 4
LAYERS = 2
VOCAB = 128


def _model():  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
            self.o = nn.Linear(D_MODEL, D_MODEL)
            self.up = nn.Linear(D_MODEL, 4 * D_MODEL)
            self.down = nn.Linear(4 * D_MODEL, D_MODEL)
            self.n1 = nn.LayerNorm(D_MODEL)
            self.n2 = nn.LayerNorm(D_MODEL)

        def forward(self, x, cache):  # type: ignore[no-untyped-def]
            b, n, d = x.shape
            q, k, v = self.qkv(self.n1(x)).split(d, -1)
            q, k, v = (t.view(b, n, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
            if cache is not None:
                k = torch.cat([cache[0], k], 2)
                v = torch.cat([cache[1], v], 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
            return x + self.down(F.gelu(self.up(self.n2(x)))), (k, v)

    class TinyDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

        def forward(self, tokens, caches):  # type: ignore[no-untyped-def]
            x = self.emb(tokens)
            new = []
            for block, cache in zip(self.blocks, caches, strict=True):
                x, kv = block(x, cache)
                new.append(kv)
            return self.head(x[:, -1]).argmax(-1), new

    torch.manual_seed(0)
    return TinyDecoder().eval()


def generate(model, batch: int, prompt: int, decode_steps: int, step=None) -> None:  # type: ignore[no-untyped-def]
    """Prefill then greedy decode; `step()` is called after every forward pass (the profiler's step)."""
    import torch

    with torch.no_grad():
        tokens = torch.randint(0, VOCAB, (batch, prompt))
        nxt, caches = model(tokens, [None] * LAYERS)
        if step:
            step()
        for _ in range(decode_steps):
            nxt, caches = model(nxt[:, None], caches)
            if step:
                step()


def profile_generation(path: Path, *, batch: int = 2, prompt: int = 16, decode_steps: int = 6,
                       record_shapes: bool = True, profiler_steps: bool = True) -> Path:
    """Write a Kineto trace of one generation to `path` (CPU activity only: there is no GPU here)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    model = _model()
    generate(model, batch, prompt, 1)  # warm-up outside the trace
    if profiler_steps:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "won't be using warmup": the warm-up ran above, unprofiled
            sched = schedule(wait=0, warmup=0, active=decode_steps + 1, repeat=1)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes, schedule=sched,
                     on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
            generate(model, batch, prompt, decode_steps, prof.step)
    else:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
            generate(model, batch, prompt, decode_steps)
        prof.export_chrome_trace(str(path))
    return path


def expected_flops(batch: int, prompt: int, decode_steps: int) -> float:
    """FLOPs of the generation, 2 per multiply-add; causal prefill attention counts half its score matrix."""
    d, e, h = D_MODEL, D_MODEL // HEADS, HEADS
    total = 0.0
    for step in range(decode_steps + 1):
        tokens = batch * prompt if step == 0 else batch
        q_len = prompt if step == 0 else 1
        kv_len = prompt + step
        linear = 2 * tokens * d * (3 * d) + 2 * tokens * d * d + 2 * tokens * d * (4 * d) + 2 * tokens * (4 * d) * d
        attention = 4.0 * batch * h * q_len * kv_len * e
        if step == 0:
            attention /= 2
        total += LAYERS * (linear + attention) + 2 * batch * d * VOCAB
    return total
