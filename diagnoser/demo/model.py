"""A small decoder-only transformer with random weights and a slot-indexed KV cache: the demo server's model.

Random weights are enough: what the demo shows is how a serving engine's scheduling, batching and KV-cache pressure
look from outside, and those depend on shapes and lengths, not on what the model says. The cache holds one slot per
concurrent sequence; decode steps run every running sequence together (a batch), attending only to each sequence's
own prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 4096
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    max_len: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def params(self) -> int:
        """Parameter count (embeddings, blocks, head), for the capture's ModelInfo."""
        d, v = self.d_model, self.vocab
        per_block = 4 * d * d + 4 * d + 8 * d * d + 5 * d + 4 * d
        return v * d + self.max_len * d + self.layers * per_block + 2 * d + d * v


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        shape = (b, n, self.heads, self.head_dim)
        return (q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = attn.shape
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, slots: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=1.0 / math.sqrt(cfg.d_model)) if p.dim() > 1 else nn.init.zeros_(p)
        self.to(device=device, dtype=dtype).eval()
        cache_shape = (cfg.layers, slots, cfg.heads, cfg.max_len, cfg.head_dim)
        self.k_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
        self.device = torch.device(device)

    def _blocks(self) -> Iterable[Block]:
        return cast("Iterable[Block]", self.blocks)  # a ModuleList types its items as Module

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int]) -> int:
        """Run a whole prompt into the slot's cache; returns the next token (greedy)."""
        n = len(tokens)
        ids = torch.tensor([tokens], device=self.device)
        x = self.embed(ids) + self.pos(torch.arange(n, device=self.device))[None]
        for i, block in enumerate(self._blocks()):
            q, k, v = block.split(x)
            self.k_cache[i, slot, :, :n] = k[0]
            self.v_cache[i, slot, :, :n] = v[0]
            x = block.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return int(self.head(self.norm(x[:, -1])).argmax(-1).item())

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], tokens: list[int]) -> list[int]:
        """One step for a batch: token b sits at positions[b] of slot slots[b]; returns each next token."""
        slot_t = torch.tensor(slots, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        span = max(positions) + 1
        x = self.embed(torch.tensor(tokens, device=self.device))[:, None] + self.pos(pos_t)[:, None]
        mask = (torch.arange(span, device=self.device)[None, :] <= pos_t[:, None])[:, None, None, :]
        for i, block in enumerate(self._blocks()):
            q, k, v = block.split(x)
            self.k_cache[i, slot_t, :, pos_t] = k[:, :, 0]
            self.v_cache[i, slot_t, :, pos_t] = v[:, :, 0]
            keys = self.k_cache[i, slot_t, :, :span]
            values = self.v_cache[i, slot_t, :, :span]
            x = block.finish(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
        return self.head(self.norm(x[:, 0])).argmax(-1).tolist()


def pick_device(requested: str = "auto") -> tuple[str, Any]:
    """('cuda' | 'cpu', dtype): CUDA with bf16 when asked for or available, else the CPU in fp32."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return "cuda", torch.bfloat16
