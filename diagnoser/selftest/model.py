"""A Llama-shaped decoder with random weights, a static KV cache and a decode step that CUDA graphs can capture.

Random weights are enough: the self-test checks what limits the hardware, and bytes moved and FLOPs done depend on
the shapes, not on what the model says. The shape is Llama's (RMSNorm, grouped-query attention, a gated SiLU MLP,
untied embeddings) without rotary embeddings, which change neither bytes nor FLOPs measurably.

The KV cache is a pool of slots, one per sequence, each `max_ctx` tokens long, allocated up front (static shapes are
what let a decode step be captured once and replayed); decode runs over the first `batch` slots. A decode step attends
over the whole slot with a mask, so it reads `max_ctx` tokens of K and V per sequence: the physics checks use that
context.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from diagnoser.selftest.scenarios import Shape

FP8 = torch.float8_e4m3fn


class Fp8Linear(nn.Module):
    """A bias-free linear layer with FP8 (e4m3) weights and activations and one scale per tensor, run by
    torch._scaled_mm on FP8 tensor cores: each step reads one byte per weight, as vLLM's --quantization fp8 does.

    The weight is stored as w / scale with scale = 1 / sqrt(in_features), so the stored values are about N(0, 1),
    well inside e4m3's range. The input must already be FP8 (see `Layer.act`): a layer's q, k and v projections share
    one cast of their input, as they would share a fused norm-and-quantise kernel. Activations are cast with a static
    scale of 1 (vLLM's static activation scheme); the inputs here are normalised or small, far below e4m3's 448."""

    scale: torch.Tensor  # buffers, registered in __init__
    one: torch.Tensor

    def __init__(self, in_features: int, out_features: int, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("scale", torch.tensor(1.0 / math.sqrt(in_features), dtype=torch.float32))
        self.register_buffer("one", torch.tensor(1.0, dtype=torch.float32))
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        # _scaled_mm wants the second operand column-major: the [out, in] weight transposed is exactly that.
        y = torch._scaled_mm(x.reshape(-1, x.shape[-1]), self.weight.t(), scale_a=self.one, scale_b=self.scale,
                             out_dtype=self.out_dtype)
        return y.reshape(*lead, y.shape[-1])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


class Layer(nn.Module):
    def __init__(self, s: Shape, dtype: torch.dtype, fp8: bool = False) -> None:
        super().__init__()
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.fp8 = fp8

        def linear(n_in: int, n_out: int) -> nn.Module:
            return Fp8Linear(n_in, n_out, dtype) if fp8 else nn.Linear(n_in, n_out, bias=False, dtype=dtype)

        self.norm1 = nn.Parameter(torch.ones(s.hidden, dtype=dtype))
        self.wq, self.wk, self.wv, self.wo = linear(s.hidden, q), linear(s.hidden, kv), linear(s.hidden, kv), \
            linear(q, s.hidden)
        self.norm2 = nn.Parameter(torch.ones(s.hidden, dtype=dtype))
        self.gate, self.up = linear(s.hidden, s.intermediate), linear(s.hidden, s.intermediate)
        self.down = linear(s.intermediate, s.hidden)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """A linear layer's input in the weights' precision: one cast, shared by the layers that read it."""
        return x.to(FP8) if self.fp8 else x

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(_rms_norm(x, self.norm2))
        return x + self.down(self.act(F.silu(self.gate(h)) * self.up(h)))


class KvCache:
    """K and V for `slots` sequences of up to `max_ctx` tokens: [layers, slots, kv_heads, max_ctx, head_dim] each."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.slots, self.max_ctx = k.shape[1], k.shape[3]

    @classmethod
    def allocate(cls, s: Shape, slots: int, max_ctx: int, device: Any, dtype: torch.dtype) -> KvCache:
        shape = (s.layers, slots, s.kv_heads, max_ctx, s.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def first(self, n: int) -> KvCache:
        """The first `n` slots, as a view: decode runs over the running sequences, the pool may hold more."""
        return KvCache(self.k[:, :n], self.v[:, :n])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class Decoder(nn.Module):
    """`dtype` is the precision of activations, norms, embeddings, the head and the KV cache; `fp8` stores the
    attention and MLP weights in FP8 (the head stays in `dtype`, as FP8 checkpoints keep lm_head)."""

    def __init__(self, s: Shape, device: Any = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 fp8: bool = False) -> None:
        super().__init__()
        self.s = s
        # Build on the meta device and materialise on the target in its dtype, so a 3B model never passes through
        # host memory or FP32.
        with torch.device("meta"):
            self.embed = nn.Embedding(s.vocab, s.hidden, dtype=dtype)
            self.layers = nn.ModuleList(Layer(s, dtype, fp8) for _ in range(s.layers))
            self.norm = nn.Parameter(torch.ones(s.hidden, dtype=dtype))
            self.head = nn.Linear(s.hidden, s.vocab, bias=False, dtype=dtype)
        self.device = torch.device(device)
        for p in self.parameters():
            p.requires_grad_(False)
        if self.device.type != "meta":  # a meta model only describes the shape (parameter counts)
            self.to_empty(device=device)
            gen = torch.Generator(device=device).manual_seed(seed)
            with torch.no_grad():
                for p in self.parameters():
                    if p.dim() == 1:
                        p.fill_(1.0)  # norm weights
                    elif p.dtype == FP8:  # stored over its scale 1/sqrt(in): N(0, 1) (see Fp8Linear)
                        p.copy_(torch.empty(p.shape, device=device, dtype=dtype).normal_(generator=gen).to(FP8))
                    else:
                        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
                for m in self.modules():  # buffers were left empty by to_empty
                    if isinstance(m, Fp8Linear):
                        m.scale.fill_(1.0 / math.sqrt(m.weight.shape[1]))
                        m.one.fill_(1.0)
        self.eval()
        self.dtype = dtype

    def blocks(self) -> list[Layer]:
        return [cast(Layer, m) for m in self.layers]

    # --- prefill: many tokens per sequence, eager ------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: KvCache | None = None,
                slots: list[int] | None = None) -> torch.Tensor:
        """Run prompts [batch, length] through the model (causal attention within each prompt), writing their K/V
        into `cache` at `slots` when given; returns the greedy next token of each prompt, on the device."""
        s, (b, n) = self.s, tokens.shape
        group = s.heads // s.kv_heads
        index = torch.tensor(slots, device=self.device) if cache is not None and slots is not None else None
        x = self.embed(tokens)
        for i, layer in enumerate(self.blocks()):
            h = layer.act(_rms_norm(x, layer.norm1))
            q = layer.wq(h).view(b, n, s.heads, s.head_dim).transpose(1, 2)
            k = layer.wk(h).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            v = layer.wv(h).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            if cache is not None and index is not None:
                cache.k[i, index, :, :n] = k
                cache.v[i, index, :, :n] = v
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer.wo(layer.act(a.transpose(1, 2).reshape(b, n, s.heads * s.head_dim)))
            x = layer.mlp(x)
        return self.head(_rms_norm(x[:, -1], self.norm)).argmax(-1)

    # --- decode: one token per sequence, static shapes -------------------------------------------------------

    def decode_step(self, cache: KvCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of the cache's slots: token b sits at positions[b] of slot b. No host sync and no
        shape that depends on values, so the whole step can be captured in a CUDA graph."""
        s, b = self.s, tokens.shape[0]
        group = s.heads // s.kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        where = positions.view(b, 1, 1, 1).expand(b, s.kv_heads, 1, s.head_dim)
        visible = torch.arange(cache.max_ctx, device=self.device)[None, :] <= positions[:, None]
        hidden_mask = ~visible.view(b, 1, 1, cache.max_ctx)
        x = self.embed(tokens)[:, None, :]
        for i, layer in enumerate(self.blocks()):
            h = layer.act(_rms_norm(x, layer.norm1))
            q = layer.wq(h).view(b, s.kv_heads, group, s.head_dim)
            cache.k[i].scatter_(2, where, layer.wk(h).view(b, s.kv_heads, 1, s.head_dim))
            cache.v[i].scatter_(2, where, layer.wv(h).view(b, s.kv_heads, 1, s.head_dim))
            # Grouped-query attention without copying K/V per head: [b, kv, group, d] @ [b, kv, d, ctx].
            scores = torch.matmul(q, cache.k[i].transpose(-1, -2)) * scale
            probs = torch.softmax(scores.float().masked_fill(hidden_mask, -math.inf), dim=-1).to(x.dtype)
            a = torch.matmul(probs, cache.v[i])
            x = x + layer.wo(layer.act(a.reshape(b, 1, s.heads * s.head_dim)))
            x = layer.mlp(x)
        return self.head(_rms_norm(x[:, 0], self.norm)).argmax(-1)


class DecodeRunner:
    """Replays decode steps over a cache: captured once in a CUDA graph when `graph` (the way vLLM and SGLang run
    decode), else eager. `tokens` and `positions` are static device tensors the step advances in place. `compiled`
    runs the step through torch.compile first (norms, casts and softmax fused: a decode closer to its floor)."""

    def __init__(self, model: Decoder, cache: KvCache, *, graph: bool, compiled: bool = False) -> None:
        self.model, self.cache = model, cache
        self.decode_step = torch.compile(model.decode_step, dynamic=False) if compiled else model.decode_step
        dev = model.device
        self.tokens = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.positions = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.graph: Any = None
        if graph:
            self._capture()

    def _body(self) -> None:
        nxt = self.decode_step(self.cache, self.tokens, self.positions)
        self.tokens.copy_(nxt)
        self.positions.add_(1)

    @torch.inference_mode()
    def _capture(self) -> None:
        saved = self.positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: cuBLAS picks its kernels, the allocator its pools
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        self.positions.copy_(saved)

    @torch.inference_mode()
    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    @torch.inference_mode()
    def start(self, slots: list[int], prompts: torch.Tensor, max_tokens_per_pass: int = 16384) -> None:
        """Begin new sequences in `slots` (prompts [len(slots), length]): prefill the prompts into the cache, a few
        at a time so activations stay small beside a full cache, and point the step at each prompt's end."""
        length = prompts.shape[1]
        per_pass = max(1, max_tokens_per_pass // length)
        for at in range(0, len(slots), per_pass):
            chunk = slots[at:at + per_pass]
            first = self.model.prefill(prompts[at:at + per_pass], self.cache, chunk)
            index = torch.tensor(chunk, device=self.tokens.device)
            self.tokens[index] = first
            self.positions[index] = length
