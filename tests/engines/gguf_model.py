"""Writes a tiny random-weight Llama as a GGUF file for a real llama.cpp server to serve in tests.

Written with the `gguf` package directly (no converter: llama.cpp's converter refuses a tokenizer whose
pre-tokenizer hash it does not know). The tokenizer is a SentencePiece-kind ("llama") vocabulary declared in full:
the specials, the 256 byte tokens (llama.cpp's fallback for any character not in the vocabulary), the pieces "▁",
"w", the ten digits, and "▁w0" ... "▁w1999": every prefix of a word "w<n>" (n < 2000) is itself a piece, so the
SPM merges make each made-up word of tests/engines/load.py one token. The weights are random (seeded: the same
file for the same arguments), in F16 (llama.cpp's CPU matmuls for it are the common path).

The shape is sized for two CPU cores: a decode step of a few milliseconds per sequence, so that eight clients
against two slots keep requests deferred while a situation still runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = 2000
SPECIAL = ["<unk>", "<s>", "</s>"]
SHAPE = {"hidden": 768, "ffn": 2048, "layers": 8, "heads": 12, "kv_heads": 4, "context": 4096}
NAME = "tiny-llama.gguf"


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (gguf.TokenType values) of the tiny SPM vocabulary."""
    import gguf

    tokens = list(SPECIAL)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁", "w", *[str(d) for d in range(10)], "▁w", *[f"▁w{i}" for i in range(WORDS)]]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher (merged first); specials and bytes score lowest.
    scores = [0.0] * (len(SPECIAL) + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def build(folder: Path, seed: int = 0, name: str = NAME, **shape: int) -> Path:
    """The GGUF file `name` in `folder` (written once; an existing one is kept), of SHAPE with `shape`'s entries in
    place of its own. Another seed and a smaller shape make a draft model for this one: the same vocabulary and
    tokenizer (llama.cpp checks they match), unrelated weights, so its drafts are rarely what the target would
    pick. The defaults write the same bytes as before these arguments."""
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if path.exists():
        return path
    unknown = set(shape) - set(SHAPE)
    if unknown:
        raise TypeError(f"no such shape entries: {sorted(unknown)}")
    sh = {**SHAPE, **shape}
    tokens, scores, types = vocabulary()
    n_vocab, d, f = len(tokens), sh["hidden"], sh["ffn"]
    heads, kv_heads, layers = sh["heads"], sh["kv_heads"], sh["layers"]
    head_dim = d // heads
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        # numpy order (rows = output features); gguf stores it with the dimensions reversed, as llama.cpp reads it.
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    writer = gguf.GGUFWriter(str(path.with_suffix(".part")), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(sh["context"])
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    writer.add_tensor("token_embd.weight", w(n_vocab, d))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(d, d))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(kv_heads * head_dim, d))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(kv_heads * head_dim, d))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(d, d))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(f, d))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(f, d))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(d, f))
    writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".part").rename(path)
    return path


def describe() -> dict[str, int]:
    n_vocab = len(vocabulary()[0])
    d, f, layers = SHAPE["hidden"], SHAPE["ffn"], SHAPE["layers"]
    kv = d * SHAPE["kv_heads"] // SHAPE["heads"]
    params = 2 * n_vocab * d + layers * (2 * d * d + 2 * kv * d + 3 * d * f + 2 * d) + d
    return {"params": params, "vocab": n_vocab, **SHAPE}


if __name__ == "__main__":  # python -m tests.engines.gguf_model OUT_DIR
    import sys

    print(build(Path(sys.argv[1])), json.dumps(describe()))
