"""Builds a tiny random-weight Llama and a word-level tokenizer in a folder, for a real vLLM to serve in tests.

Run with the engine's own interpreter (it has transformers and tokenizers; the project's venv does not):
    .engines/vllm/bin/python tests/engines/tiny_llama.py OUT_DIR
Nothing is downloaded: the tokenizer's vocabulary is made-up words ("w0" ... "wN"), the weights are random. The shape
is a small Llama (GQA, SwiGLU, RoPE) so that the engine's real code paths run: paged KV cache, continuous batching,
prefix caching, chunked prefill. Deterministic: the same folder for the same arguments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 2048
SPECIAL = ["<unk>", "<s>", "</s>"]
SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 4096}


def words(n: int = VOCAB - len(SPECIAL)) -> list[str]:
    return [f"w{i}" for i in range(n)]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=SHAPE["max_position_embeddings"])
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="bfloat16", **SHAPE)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "BUILT").write_text(json.dumps({"params": sum(p.numel() for p in model.parameters()), **SHAPE}))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if not (target / "BUILT").exists():
        build(target)
    print((target / "BUILT").read_text())
