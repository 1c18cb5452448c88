"""`diagnoser theory` through typer's test runner, on a fresh app holding only this command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from diagnoser.cli import theory
from diagnoser.physics.whatif import ratio_text


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Keeps `theory` a subcommand, as in the real app."""

    theory.register(app)
    return app


def run(app: typer.Typer, *args: str) -> Result:
    return CliRunner().invoke(app, ["theory", *args])


def run_json(app: typer.Typer, *args: str) -> dict:
    result = run(app, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_one_sentence_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diagnoser: ") and lines[0].endswith("."), result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_bundled_model_report_in_80_columns(app: typer.Typer) -> None:
    result = run(app, "--model", "llama-2-7b", "--vs-dtype", "fp8", "--vs-gpu", "h200", "--vs-batch", "32",
                 "--vs-tp", "2", "--usd-per-hour", "2.5")
    assert result.exit_code == 0, result.output
    out = result.output
    assert all(len(line.rstrip()) <= 80 for line in out.splitlines())
    # A step reads the linear layers, lm_head and norms (13,214,687,232 bytes at fp16), one embedding row (8,192)
    # and 2048 x 524,288 bytes of KV cache: 14,288,437,248 / 3.35 TB/s = 4.265 ms, 234 tokens/s. FP8 weights halve
    # the linear layers only (lm_head, norms and the KV cache stay 16-bit): x1.83. TP 2 halves the bytes and adds
    # 2 x 32 all-reduces and a logits gather (0.326 ms): 4.265 / (2.133 + 0.326) = x1.73.
    for text in ("meta-llama/Llama-2-7b-hf on H100 SXM5 80GB", "6.74 B", "13.5 GB at fp16", "512 KiB",
                 "fits", "yes", "<= 59 of 2,048 tokens", "all sequences together", "memory-bound", "<= 234 at batch 1", "295 FLOP/byte",
                 "never at 2,048 tokens", "2,048 tokens", "$ per million tokens", "fp16 -> fp8", "(x1.8)",
                 "H100 SXM5 80GB -> H200 SXM 141GB", "batch 1 -> 32", "tp 1 -> 2", "(x1.7)", "0.326 ms a step",
                 "NVLink 4", "stored as fp8 per-tensor"):
        assert text in out, text


def test_json_report_numbers(app: typer.Typer) -> None:
    r = run_json(app, "--model", "llama-2-70b", "--gpu", "h100", "--tp", "2", "--batch", "4", "--context", "1024",
                 "--vs-dtype", "fp8")
    assert r["model"]["params"] == 68_976_648_192
    assert r["kv_bytes_per_token"] == 327_680
    assert r["kv_bytes_per_token_per_gpu"] == 327_680 // 2  # 8 KV heads over 2 GPUs
    assert r["fits"] is True and r["settings"]["tp"] == 2
    assert r["gpu"]["key"] == "h100-sxm" and r["settings"]["dtype"] == "fp16"
    d = r["decode"]
    # Llama-2-70b: embedding and lm_head 32000 x 8192 each, norms 8192 x 161; the step reads all but the embedding
    # table (4 of its rows), half of it per GPU, and half of 4 x 1024 tokens of KV cache.
    table, norms = 32_000 * 8192, 8192 * 161
    read = (68_976_648_192 - table) * 2 + 4 * 8192 * 2
    floor = (read / 2 + 4 * 1024 * 327_680 / 2) / 3.35e12
    # TP 2 over NVLink 4 (450 GB/s each way, 5 us each): 2 x 80 all-reduces of 4 x 8192 x 2 bytes, a logits gather
    comm = 160 * (5e-6 + 4 * 8192 * 2 / 450e9) + 5e-6 + 4 * 32_000 * 2 / 2 / 450e9
    assert norms == 1_318_912 and d["floor_s"] == pytest.approx(floor)
    assert d["comm_s"] == pytest.approx(comm)
    assert d["ceiling_tokens_per_s"] == pytest.approx(4 / (floor + comm))
    assert d["bound"] == "memory"
    assert r["ridge"]["flop_per_byte"] == pytest.approx(989.4 / 3.35)
    (w,) = r["what_ifs"]
    assert w["change"] == "fp16 -> fp8" and 1.5 < w["speedup"] < 2.0


def test_params_with_shape_flags(app: typer.Typer) -> None:
    r = run_json(app, "--params", "7B", "--layers", "32", "--kv-heads", "32", "--head-dim", "128",
                 "--dtype", "float16", "--gpu", "A100-80GB", "--context", "0")
    assert r["kv_bytes_per_token"] == 524_288
    assert r["weight_bytes"] == 14e9
    assert r["decode"]["ceiling_tokens_per_s"] == pytest.approx(2.039e12 / 14e9)
    assert r["prefill"]["time_s"] is None


def test_params_without_shape_skips_the_kv_cache(app: typer.Typer) -> None:
    r = run_json(app, "--params", "70e9")
    assert r["kv_bytes_per_token"] is None and r["max_concurrent_sequences"] is None
    assert r["decode"]["floor_s"] == pytest.approx(140e9 / 3.35e12)
    assert any("--kv-heads" in note for note in r["notes"])


def test_a_batch_that_does_not_fit_has_one_baseline(app: typer.Typer) -> None:
    """64 sequences of 8,192 tokens need 68.7 GB of bf16 KV for Llama-3.1-8B: 57 fit. The decode section said
    "<= 2,561 tokens/s at batch 64" while the KV what-if started from 0 ("fits now")."""
    out = run(app, "--model", "llama-3.1-8b", "--batch", "64", "--context", "8192", "--vs-kv-dtype", "fp8").stdout
    assert "none: batch 64 does not fit" in out and "ceiling 0 -> " in out


def test_not_fitting_is_reported_not_an_error(app: typer.Typer) -> None:
    r = run_json(app, "--params", "405B", "--gpu", "h200", "--dtype", "fp16")
    assert r["fits"] is False
    assert any("do not fit" in note for note in r["notes"])


def test_energy_and_cost(app: typer.Typer) -> None:
    r = run_json(app, "--model", "llama-2-7b", "--gpu", "l4", "--power-w", "50", "--usd-per-hour", "0.8")
    tps = r["decode"]["ceiling_tokens_per_s"]
    assert r["energy"] == {"power_w": 50, "power_source": "user", "tokens_per_joule": pytest.approx(tps / 50)}
    assert r["cost"]["usd_per_million_tokens"] == pytest.approx(0.8 / (tps * 3600) * 1e6)
    assert run_json(app, "--model", "llama-2-7b")["energy"]["power_w"] == 700  # H100 TDP by default


def test_config_path(app: typer.Typer, tmp_path: Path) -> None:
    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_json(app, "--model", str(tmp_path / "config.json"))
    assert r["model"]["params"] == 7_241_732_096 and r["settings"]["dtype"] == "bf16"
    assert run_json(app, "--model", str(tmp_path))["model"]["params"] == 7_241_732_096  # the folder works too


def test_list_models(app: typer.Typer) -> None:
    result = run(app, "--list-models")
    assert result.exit_code == 0
    for name in ("llama-2-7b", "llama-2-70b", "llama-3.1-8b", "mistral-7b-v0.1", "mixtral-8x7b-v0.1"):
        assert name in result.output
    rows = json.loads(run(app, "--list-models", "--json").stdout)
    mixtral = next(row for row in rows if row["name"] == "mixtral-8x7b-v0.1")
    assert mixtral["active_params"] == 12_879_925_248


def test_unknown_gpu(app: typer.Typer) -> None:
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--gpu", "P100"), "unknown GPU", "h100-sxm")
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--vs-gpu", "X9"), "unknown GPU")


def test_missing_config_file(app: typer.Typer, tmp_path: Path) -> None:
    assert_one_sentence_error(run(app, "--model", str(tmp_path / "nope" / "config.json")), "no config file")


def test_malformed_json(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,')
    assert_one_sentence_error(run(app, "--model", str(path)), "not valid JSON")


def test_config_that_is_not_a_model(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"name": "tokenizer"}')
    assert_one_sentence_error(run(app, "--model", str(path)), "hidden_size")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((), "--params"),
        (("--model", "llama-2-7b", "--params", "7e9"), "not both"),
        (("--model", "no-such-model"), "bundled"),
        (("--params", "seven"), "parameter count"),
        (("--model", "llama-2-7b", "--dtype", "fp5"), "unknown precision"),
        (("--model", "llama-2-7b", "--vs-dtype", "fp5"), "unknown precision"),
        (("--model", "llama-2-7b", "--layers", "32"), "--params"),
    ],
)
def test_bad_input(app: typer.Typer, args: tuple[str, ...], fragment: str) -> None:
    assert_one_sentence_error(run(app, *args), fragment)


def test_out_of_range_option_exits_2(app: typer.Typer) -> None:
    result = run(app, "--model", "llama-2-7b", "--batch", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_registered_in_the_real_app() -> None:
    try:
        from diagnoser.cli.app import app as real_app
    except ImportError as exc:  # another command module is mid-way through being written
        pytest.skip(f"diagnoser.cli.app does not import yet: {exc}")
    result = CliRunner().invoke(real_app, ["theory", "--model", "qwen2.5-0.5b", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["params"] == 494_032_768


def test_measured_rate_gives_realised_gains_beside_the_ceiling_ratio(app: typer.Typer) -> None:
    # Llama-2-7b fp16 on an H100 at batch 1, 2048 tokens: ceiling 234.45 tokens/s (see the 80-column test), so
    # 117.2 tokens/s is half of it.
    r = run_json(app, "--model", "llama-2-7b", "--tokens-per-s", "117.2", "--vs-dtype", "fp8", "--vs-tp", "2")
    assert r["measured"]["efficiency"] == pytest.approx(0.5, abs=1e-3)
    fp8, tp2 = r["what_ifs"]
    assert fp8["ceiling_speedup"] == pytest.approx(1.829, abs=1e-3)
    # Bytes a step reads: linear 6,476,005,376 params, lm_head 131,072,000 and norms 266,240 at 2 bytes (FP8: the
    # linear ones at 1), an 8,192-byte embedding row, and 1,073,741,824 bytes of 16-bit KV cache either way.
    kv = 2048 * 524_288
    floor = ((6_476_005_376 + 131_072_000 + 266_240) * 2 + 8192 + kv) / 3.35e12
    fp8_floor = (6_476_005_376 + (131_072_000 + 266_240) * 2 + 8192 + kv) / 3.35e12
    # measured at half the ceiling: 2 x floor a step, of which floor / 0.9 (streaming reaches 90 % of the datasheet
    # bandwidth) is attained roofline and the rest stays per step
    kept = 2 * floor - floor / 0.9
    assert fp8["realised_speedup"] == pytest.approx(2 * floor / (fp8_floor / 0.9 + kept), rel=2e-3)
    assert 1 < tp2["realised_speedup"] < tp2["ceiling_speedup"] < 2
    assert any(a.startswith("realised gain:") for a in fp8["assumptions"])
    out = run(app, "--model", "llama-2-7b", "--efficiency", "0.5", "--vs-dtype", "fp8").output
    assert "(x1.8); realised x1.3" in out and "x ceiling: the ratio of the ceilings" in out
    assert all(len(line.rstrip()) <= 80 for line in out.splitlines())


def test_kv_dtype_what_if_and_flag_agree(app: typer.Typer) -> None:
    r = run_json(app, "--model", "llama-3.1-8b", "--batch", "16", "--context", "8192", "--vs-kv-dtype", "fp8")
    fp8 = run_json(app, "--model", "llama-3.1-8b", "--batch", "16", "--context", "8192", "--kv-dtype", "fp8")
    (w,) = r["what_ifs"]
    assert w["change"] == "KV bf16 -> fp8"
    assert w["after_tokens_per_s"] == pytest.approx(fp8["decode"]["ceiling_tokens_per_s"])
    assert fp8["max_concurrent_sequences"] in (2 * r["max_concurrent_sequences"], 2 * r["max_concurrent_sequences"] + 1)
    assert fp8["kv_bytes_per_token"] == r["kv_bytes_per_token"] / 2 == 65_536


def test_quantised_weights_show_their_scheme(app: typer.Typer, tmp_path: Path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "float16",
           "quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_json(app, "--model", str(tmp_path))
    linear = 6_738_415_616 - 2 * 131_072_000 - 266_240
    assert r["weight_bytes"] == pytest.approx(linear * (0.5 + 2.5 / 128) + (2 * 131_072_000 + 266_240) * 2)
    assert r["weights"]["scheme"]["group_size"] == 128 and r["weights"]["scheme"]["from_config"]
    assert "stored as" in run(app, "--model", str(tmp_path)).output


def test_interconnect_and_pipeline(app: typer.Typer) -> None:
    nvlink = run_json(app, "--model", "llama-2-70b", "--tp", "4")
    pcie = run_json(app, "--model", "llama-2-70b", "--tp", "4", "--interconnect", "pcie")
    assert nvlink["settings"]["interconnect"]["name"] == "NVLink 4"
    assert pcie["settings"]["interconnect"]["bytes_per_s"] == 64e9
    assert pcie["decode"]["comm_s"] > 2 * nvlink["decode"]["comm_s"]
    one = run_json(app, "--model", "llama-2-70b", "--pp", "4", "--batch", "1")
    assert one["pipeline"]["bubble"] == 0.75 and one["fits"] is True  # 4 stages hold it; 3 of them wait
    full = run_json(app, "--model", "llama-2-70b", "--pp", "4", "--batch", "8")
    assert full["pipeline"]["bubble"] == 0.0 and full["pipeline"]["microbatches"] == 4
    assert full["pipeline"]["stage_weight_bytes"] == pytest.approx(full["weight_bytes"] / 4)
    # each stage holds a quarter of the weights and of each token's KV cache (80 x 8 x 128 x 2 x 2 / 4 bytes)
    free = 0.9 * 80 * 1024**3 - 68_976_648_192 * 2 / 4
    assert full["max_concurrent_sequences"] == int(free / (327_680 / 4) // 2048)


def test_a_compressed_tensors_fp8_kv_cache_scheme_is_read(app: typer.Typer, tmp_path: Path) -> None:
    """llm-compressor's FP8-KV checkpoints say so in quantization_config.kv_cache_scheme: KV bytes per token halve
    (Llama-3.1-8B: 128 -> 64 KiB) without a --kv-dtype flag."""
    cfg = json.loads((Path(theory.__file__).parents[1] / "data" / "models" / "llama-3.1-8b.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = run_json(app, "--model", str(path))
    assert r["settings"]["kv_dtype"] == "fp8" and r["kv_bytes_per_token"] == 64 * 1024


def test_3_bit_weights_are_sized_not_refused(app: typer.Typer) -> None:
    """GPTQ 3-bit: 3/8 byte a weight with an FP16 scale per 128, the embedding, norms and lm_head at 16 bits, and the
    matmuls at the 16-bit rate (weight-only, like INT4: no note that the GPU lacks int3 tensor cores)."""
    r3, r4 = (run_json(app, "--model", "llama-3.1-8b", "--dtype", d) for d in ("int3", "int4"))
    sixteen = r4["weight_bytes"] - 6_979_321_856 * (0.5 + 2 / 128)  # the 16-bit parts, from the INT4 figure
    assert r3["weight_bytes"] == pytest.approx(6_979_321_856 * (0.375 + 2 / 128) + sixteen, rel=1e-6)
    assert not any("int3 tensor cores" in n for n in r3.get("notes", []))


@pytest.mark.parametrize(("quant", "fragment"), [
    ({"quant_method": "awq", "bits": "four", "group_size": 128}, "bits is 'four'"),
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "2-, 3-, 4- and 8-bit"),
    ({"quant_method": "gptq", "bits": True, "group_size": 128}, "bits is True"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -5}, "group_size is -5"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size is 0"),
    ("awq", "must be a JSON object"),
    # A method diagnoser does not size is refused, not read as 16-bit (HQQ 4-bit was 16.1 GB for about 5 GB).
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq'"),
])
def test_an_unreadable_quantization_config_is_refused_not_read_as_16_bit(app: typer.Typer, tmp_path: Path,
                                                                          quant: object, fragment: str) -> None:
    """Read as bf16, an AWQ config with bits "four" was 16 GB of weights instead of about 5.7, with nothing said."""
    cfg = json.loads((Path(theory.__file__).parents[1] / "data" / "models" / "llama-3.1-8b.json").read_text())
    cfg["quantization_config"] = quant
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert_one_sentence_error(run(app, "--model", str(path)), fragment)


@pytest.mark.parametrize(("args", "fragment"), [
    (("--model", "llama-2-7b", "--tokens-per-s", "100", "--efficiency", "0.5"), "not both"),
    (("--model", "llama-2-7b", "--tokens-per-s", "5000"), "above the ceiling"),
    (("--model", "llama-2-7b", "--tokens-per-s", "nan"), "--tokens-per-s must be a finite number above 0"),
    (("--model", "llama-2-7b", "--usd-per-hour", "inf"), "--usd-per-hour must be a finite number"),
    (("--model", "llama-2-7b", "--usd-per-hour", "-0.5"), "of 0 or more"),
    (("--model", "llama-2-7b", "--power-w", "0"), "--power-w must be"),
    (("--params", "1e30"), "no model that size"),
    (("--model", "llama-2-7b", "--efficiency", "1.5"), "(0, 1]"),
    (("--model", "llama-2-7b", "--interconnect", "ib", "--tp", "2"), "unknown interconnect"),
    (("--model", "llama-2-7b", "--pp", "2", "--batch", "1", "--microbatches", "2"), "--microbatches"),
    # Layouts no engine runs: heads split unevenly (vLLM refuses tp 3 for 32 heads), more stages than layers.
    (("--model", "llama-3.1-8b", "--tp", "3"), "does not divide"),
    (("--model", "llama-3.1-8b", "--tp", "64"), "32 attention heads"),
    (("--model", "llama-3.1-8b", "--vs-tp", "3"), "--vs-tp 3"),
    (("--model", "llama-3.1-8b", "--pp", "1000"), "32 layers"),
])
def test_bad_measurements_and_parallel_flags(app: typer.Typer, args: tuple[str, ...], fragment: str) -> None:
    assert_one_sentence_error(run(app, *args), fragment)


def test_a_config_with_escapes_and_markup_in_its_name_is_shown_not_obeyed(app: typer.Typer, tmp_path: Path) -> None:
    config = {"_name_or_path": "\x1b[2J\x1b]52;c;aGk=\x07EVIL[bold]x[/bold]", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = run(app, "--model", str(path), "--gpu", "h100")
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    # The name is there as text: the escapes visible, the brackets literal.
    assert "\\x1b[2J\\x1b]52;c;aGk=\\x07EVIL[bold]x[/bold]" in r.output


# --- attention layouts, GPUs of the user's own, the memory budget and fp32 configs --------------------------------

def _config(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_deepseek_v3_is_sized_by_its_latent(app: typer.Typer, tmp_path: Path) -> None:
    """61 x (512 + 64) x 2 B = 70,272 B a token in bf16, whole on each of 8 GPUs; 25x less than 128 heads of 56."""
    from tests.test_physics_layouts import DEEPSEEK_V3

    r = run_json(app, "--model", _config(tmp_path, DEEPSEEK_V3), "--gpu", "h200", "--tp", "8", "--context", "4096")
    assert r["kv_bytes_per_token"] == r["kv_bytes_per_token_per_gpu"] == 70_272
    assert r["model"]["attention"]["layout"] == "mla" and r["model"]["kv_heads"] is None
    free = 0.9 * 141 * 1024**3 - r["weight_bytes_per_gpu"]
    assert r["max_concurrent_sequences"] == int(free / 70_272 // 4096)
    out = run(app, "--model", _config(tmp_path, DEEPSEEK_V3), "--gpu", "h200", "--tp", "8").output
    assert "MLA: 512 latent + 64 rope" in out and all(len(line.rstrip()) <= 80 for line in out.splitlines())


def test_mistral_sliding_window_at_32k(app: typer.Typer) -> None:
    r = run_json(app, "--model", "mistral-7b-v0.1", "--context", "32768")
    assert r["kv_bytes_per_sequence"] == 32 * 4096 * 4096 and r["max_concurrent_sequences"] == 117
    assert r["model"]["attention"] == {"layout": "sliding", "description": "sliding window of 4,096 tokens on 32 "
                                       "of 32 layers", "sliding_window": 4096, "sliding_layers": 32}
    assert "KV per sequence" in run(app, "--model", "mistral-7b-v0.1", "--context", "32768").output


def test_a_sliding_layout_it_cannot_read_is_refused(app: typer.Typer, tmp_path: Path) -> None:
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "sliding_window": 4096,
           "use_sliding_window": True, "max_window_layers": 21}
    assert_one_sentence_error(run(app, "--model", _config(tmp_path, cfg)), "use_sliding_window", "layer_types")


SPEC_TOML = """
name = "Lab GPU"
memory_gb = 48
hbm_tb_per_s = 1.2
tdp_w = 350
interconnect = "PCIe Gen4"

[tflops]
bf16 = 200
fp8 = 400
"""


def test_gpu_spec_file(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(SPEC_TOML)
    r = run_json(app, "--model", "llama-2-7b", "--gpu-spec", str(path), "--context", "0")
    assert r["gpu"]["name"] == "Lab GPU" and r["gpu"]["memory_bytes"] == 48 * 1024**3
    assert r["gpu"]["hbm_bytes_per_s"] == 1.2e12 and r["gpu"]["peak_flops"] == 200e12
    assert r["decode"]["floor_s"] == pytest.approx((13_214_687_232 + 8192) / 1.2e12)
    assert r["energy"]["power_w"] == 350
    # the same figures inline, and a spec file where --gpu or --vs-gpu takes a GPU
    inline = "name=Lab GPU,memory_gb=48,hbm_tb_per_s=1.2,tdp_w=350,tflops.bf16=200"
    assert run_json(app, "--model", "llama-2-7b", "--gpu-spec", inline, "--context", "0")["decode"] == r["decode"]
    assert run_json(app, "--model", "llama-2-7b", "--gpu", str(path), "--context", "0")["gpu"]["name"] == "Lab GPU"
    (w,) = run_json(app, "--model", "llama-2-7b", "--vs-gpu", str(path))["what_ifs"]
    assert w["change"] == "H100 SXM5 80GB -> Lab GPU"
    json_path = tmp_path / "lab.json"
    json_path.write_text(json.dumps({"name": "J", "memory_bytes": 24 * 1024**3, "hbm_bandwidth": "900 GB/s",
                                     "tdp_w": 300, "flops": {"fp16": "100 TFLOPS"}}))
    assert run_json(app, "--model", "llama-2-7b", "--gpu-spec", str(json_path))["gpu"]["hbm_bytes_per_s"] == 900e9


@pytest.mark.parametrize(("content", "fragment"), [
    ("name = 'X'\nmemory_gb = 48\ntdp_w = 300\n[tflops]\nbf16 = 200\n", "memory bandwidth"),
    ("name = 'X'\nmemory_gb = 48\nhbm_tb_per_s = 1.2\ntdp_w = 300\n", "exactly one of tflops, flops"),
    ("name = 'X'\nmemory_gb = 48\nhbm_tb_per_s = 1200\ntdp_w = 300\n[tflops]\nbf16 = 200\n", "check its unit"),
    ("name = 'X'\nmemory_gb = 48\nhbm_tb_per_s = 1.2\ntdp_w = 300\n[tflops]\nbf17 = 200\n", "not a precision"),
    ("name = 'X'\nmemory_gb = 'lots'\nhbm_tb_per_s = 1.2\ntdp_w = 300\n[tflops]\nbf16 = 200\n", "must be a number"),
    ("name = 'X'\nmemory_gb = 48\nhbm_tb_per_s = 1.2\n[tflops]\nbf16 = 200\n", "tdp_w"),
    ("name = 'X'\nmemroy_gb = 48\n", "unknown key 'memroy_gb'"),
    ("name = 'X'\nmemory_gb = 48\nhbm_tb_per_s = 1.2\ntdp_w = 300\n[tflops]\nfp8 = 400\n", "bf16, fp16 or fp32"),
    ("name = \n", "not valid TOML"),
])
def test_a_bad_gpu_spec_file_is_one_sentence(app: typer.Typer, tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(content)
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--gpu-spec", str(path)), fragment)


def test_gpu_and_gpu_spec_together_or_a_missing_file(app: typer.Typer, tmp_path: Path) -> None:
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--gpu", "h100", "--gpu-spec", "x.toml"), "not both")
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--gpu-spec", str(tmp_path / "no.toml")),
                              "no GPU spec file")


def test_a_laptop_gpu_is_refused_and_a_family_name_is_said(app: typer.Typer) -> None:
    assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--gpu", "RTX 4090 Laptop GPU"), "laptop",
                              "--gpu-spec")
    notes = run_json(app, "--model", "llama-2-7b", "--gpu", "A100", "--vs-gpu", "V100")["notes"]
    assert any("'A100' is taken as the A100 SXM4 80GB" in n and "a100-40gb-sxm" in n for n in notes)
    assert any("'V100' is taken as the Tesla V100 SXM2 32GB" in n for n in notes)
    assert not any("taken as" in n for n in run_json(app, "--model", "llama-2-7b")["notes"])  # the default


def test_mem_fraction_is_a_setting(app: typer.Typer) -> None:
    default = run_json(app, "--model", "llama-2-7b")
    half = run_json(app, "--model", "llama-2-7b", "--mem-fraction", "0.5", "--vs-kv-dtype", "fp8")
    assert default["settings"]["mem_fraction"] == 0.9 and half["settings"]["mem_fraction"] == 0.5
    assert half["usable_bytes_per_gpu"] == 0.5 * 80 * 1024**3
    assert half["max_concurrent_sequences"] == int((0.5 * 80 * 1024**3 - 6_738_415_616 * 2) / 524_288 // 2048)
    # the what-ifs size with the same budget: 27 sequences fit at half the memory, 54 with an FP8 KV cache
    assert half["max_concurrent_sequences"] == 27
    assert "27 -> 54 sequences of 2,048 tokens fit" in " ".join(half["what_ifs"][0]["assumptions"])
    out = run(app, "--model", "llama-2-7b").output
    assert "a server setting" in out and "--mem-fraction" in out
    for bad in ("0", "1.5", "nan"):
        assert_one_sentence_error(run(app, "--model", "llama-2-7b", "--mem-fraction", bad), "--mem-fraction")


def test_fp32_configs_are_served_in_16_bits(app: typer.Typer, tmp_path: Path) -> None:
    """vLLM's --dtype auto downcasts a float32 config to bf16 (fp16 where the GPU has no bf16); --dtype wins."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "float32"}
    path = _config(tmp_path, cfg)
    r = run_json(app, "--model", path)
    assert r["settings"]["dtype"] == "bf16" and r["settings"]["kv_dtype"] == "bf16"
    assert r["weight_bytes"] == 6_738_415_616 * 2
    assert any("float32" in n and "--dtype fp32" in n for n in r["notes"])
    assert run_json(app, "--model", path, "--gpu", "v100-sxm2-32gb")["settings"]["dtype"] == "fp16"
    explicit = run_json(app, "--model", path, "--dtype", "fp32")
    assert explicit["settings"]["dtype"] == "fp32" and explicit["weight_bytes"] == 6_738_415_616 * 4
    assert not any("float32" in n for n in explicit["notes"])


# Each figure a user gives, 1,000x off (or in another unit), is refused in one sentence naming it, its unit and the
# plausible range, exit 2; the same figures at a real GPU's values (an H100 SXM) pass.
_H100_SPEC = {"name": "'X'", "memory_gb": "80", "hbm_tb_per_s": "3.35", "tdp_w": "700", "nvlink_gb_per_s": "900",
              "pcie_gb_per_s": "128", "max_sm_clock_mhz": "1980"}


def _spec_text(**change: str) -> str:
    figures = {**_H100_SPEC, **change}
    rate = figures.pop("bf16", "989.4")
    return "".join(f"{k} = {v}\n" for k, v in figures.items()) + f"[tflops]\nbf16 = {rate}\n"


@pytest.mark.parametrize(("change", "fragments"), [
    ({"hbm_tb_per_s": "3350"}, ("hbm_tb_per_s", "TB/s", "0.02 to 30")),  # GB/s given as TB/s
    ({"hbm_tb_per_s": "900"}, ("hbm_tb_per_s", "TB/s", "0.02 to 30")),  # a V100's 900 GB/s as TB/s
    ({"hbm_tb_per_s": "0.003"}, ("hbm_tb_per_s", "TB/s", "0.02 to 30")),
    ({"bf16": "989400"}, ("tflops.bf16", "FLOP/s", "1e+11 to 5e+16")),  # GFLOP/s given as TFLOP/s
    ({"memory_gb": "80000"}, ("memory_gb", "GB", "1 to 1024")),  # MB as GB
    ({"tdp_w": "700000"}, ("tdp_w", "W", "5 to 3000")),  # mW as W
    ({"tdp_w": "0.7"}, ("tdp_w", "W", "5 to 3000")),  # kW as W
    ({"nvlink_gb_per_s": "900000"}, ("nvlink_gb_per_s", "GB/s", "10 to 1e+04")),
    ({"pcie_gb_per_s": "64000"}, ("pcie_gb_per_s", "GB/s", "4 to 512")),
    ({"max_sm_clock_mhz": "1.98"}, ("max_sm_clock_mhz", "MHz", "300 to 4000")),  # GHz as MHz
])
def test_an_implausible_gpu_figure_is_refused_naming_unit_and_range(
        app: typer.Typer, tmp_path: Path, change: dict[str, str], fragments: tuple[str, ...]) -> None:
    good = tmp_path / "good.toml"
    good.write_text(_spec_text())
    assert run_json(app, "--model", "llama-2-7b", "--gpu-spec", str(good))["gpu"]["name"] == "X"
    path = tmp_path / "bad.toml"
    path.write_text(_spec_text(**change))
    result = run(app, "--model", "llama-2-7b", "--gpu-spec", str(path))
    assert_one_sentence_error(result, "plausible")
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


@pytest.mark.parametrize(("flag", "value", "fragments"), [
    ("--power-w", "700000", ("--power-w", "W per GPU", "5 to 3000")),
    ("--power-w", "1", ("--power-w", "W per GPU", "5 to 3000")),
    ("--usd-per-hour", "9800", ("--usd-per-hour", "USD per GPU hour", "0 to 500")),
])
def test_an_implausible_power_or_price_is_refused(app: typer.Typer, flag: str, value: str,
                                                  fragments: tuple[str, ...]) -> None:
    result = run(app, "--model", "llama-2-7b", flag, value)
    assert_one_sentence_error(result, "plausible")
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


@pytest.mark.parametrize(("share", "shown"), [(None, "90%"), ("0.8", "80%")])
def test_capacity_says_the_memory_share_it_assumed(app: typer.Typer, share: str | None, shown: str) -> None:
    """A batch that does not fit is stated at the share of memory assumed for the server, in the same sentence."""
    args = ["--model", "llama-3.1-8b", "--batch", "64", "--context", "8192"] + (["--mem-fraction", share]
                                                                                 if share else [])
    r = run_json(app, *args)
    (note,) = [n for n in r["notes"] if "does not run" in n]
    assert f"fit in {shown} of each GPU's memory" in note and "--mem-fraction" in note
    assert note.count(". ") == 0 and note.endswith(".")
    out = run(app, *args).stdout
    assert f"none: batch 64 does not fit in {shown} of memory" in out
    grown = ["--model", "llama-3.1-8b", "--batch", "8", "--context", "8192", "--vs-batch", "200"]
    (w,) = run_json(app, *grown, *(["--mem-fraction", share] if share else []))["what_ifs"]
    assert w["after_tokens_per_s"] == 0
    assert f"does not fit beside the weights in {shown} of one" in w["explanation"]


@pytest.mark.parametrize(("value", "shown"), [(121.44, "x120"), (1.834, "x1.8"), (1.73, "x1.7"), (0.998, "x1.0"),
                                             (9.96, "x10"), (33.1, "x33"), (0.0912, "x0.091"), (1507.0, "x1,500")])
def test_ratios_are_shown_to_two_significant_digits(value: float, shown: str) -> None:
    assert ratio_text(value) == shown


def test_a_large_batch_jump_prints_two_digits(app: typer.Typer) -> None:
    """Batch 1 -> 256 on a 70B over 8 GPUs: the ceiling ratio printed to two significant digits, as the JSON's
    full figure rounds."""
    args = ("--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "8", "--context", "1024", "--vs-batch", "256")
    (w,) = run_json(app, *args)["what_ifs"]
    out = run(app, *args).output
    assert f"({ratio_text(w['speedup'])})" in out and f"{w['speedup']:.2f}" not in out
    assert re.search(r"\(x[0-9,]+(\.[0-9])?\)", out)
