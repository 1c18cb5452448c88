"""GGUF types and EXL2 bits named as a model's storage: bits per weight with their block scales, and the decode
floor they give. Expected bytes are worked by hand from ggml's block sizes and llama.cpp's published file sizes."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from diagnoser.cli import theory
from diagnoser.errors import InputError
from diagnoser.physics import decode_floor_s, get_gpu, load_bundled_model, weight_bytes
from diagnoser.physics.quant import ggml_type_bits, gguf_bits, quant_scheme, weight_format, with_weight_format


@pytest.mark.parametrize(("name", "bits"), [
    ("Q6_K", 210 * 8 / 256),
    ("Q8_0", 34 * 8 / 32),
    ("Q4_0", 18 * 8 / 32),
    ("Q4_1", 20 * 8 / 32),
    ("Q5_0", 22 * 8 / 32),
    ("Q5_1", 24 * 8 / 32),
    ("IQ1_S", 50 * 8 / 256),
    ("IQ1_M", 56 * 8 / 256),
    ("IQ2_XXS", 66 * 8 / 256),
    ("IQ2_XS", 74 * 8 / 256),
    ("IQ2_S", 82 * 8 / 256),
    ("IQ3_XXS", 98 * 8 / 256),
    ("IQ3_S", 110 * 8 / 256),
    ("IQ4_NL", 18 * 8 / 32),
    ("IQ4_XS", 136 * 8 / 256),
    # mixes: llama-quantize's Llama-3-8B file sizes (GiB) over its 8,030,261,248 weights, or its stated bpw
    ("Q2_K", 2.96 * 2**33 / 8_030_261_248),
    ("Q3_K_S", 3.41 * 2**33 / 8_030_261_248),
    ("Q3_K_M", 3.74 * 2**33 / 8_030_261_248),
    ("Q3_K_L", 4.03 * 2**33 / 8_030_261_248),
    ("Q4_K_S", 4.37 * 2**33 / 8_030_261_248),
    ("Q4_K_M", 4.58 * 2**33 / 8_030_261_248),
    ("Q5_K_S", 5.21 * 2**33 / 8_030_261_248),
    ("Q5_K_M", 5.33 * 2**33 / 8_030_261_248),
    ("IQ2_M", 2.7),
    ("IQ3_XS", 3.3),
    ("IQ3_M", 3.66),
    ("Q4_K", 4.58 * 2**33 / 8_030_261_248),  # llama-quantize: Q4_K is an alias for Q4_K_M
])
def test_gguf_bits_per_weight(name: str, bits: float) -> None:
    fmt = weight_format(name)
    assert fmt is not None and fmt.bits == pytest.approx(bits, rel=1e-9)
    assert weight_format(f"gguf:{name.lower()}") == fmt


@pytest.mark.parametrize(("name", "bits"), [("q2_k", 2.625), ("q3_k", 3.4375), ("q4_k", 4.5), ("q5_k", 5.5),
                                            ("q6_k", 6.5625)])
def test_ggml_block_types(name: str, bits: float) -> None:
    assert ggml_type_bits(name) == bits


def test_named_figures() -> None:
    assert gguf_bits("Q4_K_M") == pytest.approx(4.90, abs=0.01)
    assert gguf_bits("Q6_K") == 6.5625 and gguf_bits("Q8_0") == 8.5 and gguf_bits("Q4_0") == 4.5
    assert gguf_bits("bf16") is None and weight_format("int4") is None


def test_exl2_bits() -> None:
    fmt = weight_format("exl2:4.65")
    assert fmt is not None and fmt.bits == 4.65 and fmt.dtype == "int4"
    assert weight_format("EXL2-3.0bpw") == weight_format("exl2 3") and weight_format("exl2 3.0") is not None
    with pytest.raises(InputError, match="2 to 8"):
        weight_format("exl2:9.5")


def test_llama_8b_q4_k_m_decode_floor_by_hand() -> None:
    """Llama-3.1-8B in Q4_K_M: every matrix (embedding and lm_head too) at 4.58 GiB x 8 / 8,030,261,248 bits a
    weight, the norms (hidden x (2 x layers + 1)) in FP32; a batch-1 step at no context reads all of it but the
    embedding, of which it reads one row."""
    base = load_bundled_model("llama-3.1-8b")
    model = with_weight_format(base, weight_format("Q4_K_M"))  # type: ignore[arg-type]
    assert quant_scheme(model).describe().startswith("GGUF Q4_K_M (4.9 bits a weight")
    bpw = 4.58 * 2**33 / 8_030_261_248
    norms = 4096 * (2 * 32 + 1)
    table = 128256 * 4096
    assert base.params == 8_030_261_248
    assert weight_bytes(model) == pytest.approx((8_030_261_248 - norms) * bpw / 8 + norms * 4, rel=1e-12)
    read = (8_030_261_248 - norms - table) * bpw / 8 + norms * 4 + 4096 * bpw / 8
    gpu = get_gpu("h100-sxm")
    assert decode_floor_s(model, gpu, 1, 0) == pytest.approx(read / gpu.hbm_bytes_per_s, rel=1e-9)
    # about 4.9 GB a step: 3.3x fewer bytes than bf16
    assert decode_floor_s(load_bundled_model("llama-3.1-8b"), gpu, 1, 0) / decode_floor_s(model, gpu, 1, 0) == \
        pytest.approx(16 / bpw, rel=0.02)


def test_theory_takes_a_gguf_type() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand."""

    theory.register(app)
    result = CliRunner().invoke(app, ["theory", "--model", "llama-3.1-8b", "--dtype", "Q4_K_M", "--gpu", "h100-sxm",
                                      "--context", "0", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    bpw = 4.58 * 2**33 / 8_030_261_248
    assert data["weight_bytes"] == pytest.approx((8_030_261_248 - 4096 * 65) * bpw / 8 + 4096 * 65 * 4, rel=1e-9)
    assert "GGUF Q4_K_M" in json.dumps(data["weights"])
