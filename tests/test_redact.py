"""Redaction: secrets in command lines, environments and URLs never reach a report; ordinary flags stay readable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diagnoser.reports.redact import MASK, is_secret_name, redact, redact_argv, redact_env, redact_obj

REPO = Path(__file__).resolve().parents[1]
SK = "sk-proj-4f9Qx8TzLw2Rk7Vn3Hb6"
HF = "hf_AbCdEfGhIjKlMnOpQrStUvWx"


@pytest.mark.parametrize("text, secret", [
    (f"vllm serve m --api-key {SK} --port 8000", SK),
    (f"vllm serve m --api-key={SK}", SK),
    (f"HF_TOKEN={HF} python serve.py", HF),
    (f"export HUGGING_FACE_HUB_TOKEN='{HF}'", HF),
    ("OPENAI_API_KEY=\"abc def ghi\" run", "abc def ghi"),
    ("https://user:pass@host:9090/api/v1", "user:pass"),
    ("postgres://svc:Pa55w0rd!@db.internal:5432/x", "Pa55w0rd!"),
    ("https://hub.example/models?token=abc123&rev=main", "abc123"),
    ("https://s3.example/obj?X-Amz-Signature=deadbeefcafe&X-Amz-Expires=60", "deadbeefcafe"),
    ("curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl' x", "eyJhbGciOiJIUzI1NiJ9"),
    ("--password hunter2 --user admin", "hunter2"),
    ("--hf-token " + HF, HF),
    ('{"api_key": "k-123456", "model": "m"}', "k-123456"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI"),
    ("key id AKIAIOSFODNN7EXAMPLE in a log line", "AKIAIOSFODNN7EXAMPLE"),
    (f"a bare {SK} in prose", SK),
    (f"a bare {HF} in prose", HF),
    ("ghp_0123456789abcdefABCDEF0123 leaked", "ghp_0123456789abcdefABCDEF0123"),
])
def test_secret_is_gone(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out
    assert MASK in out
    assert redact(out) == out  # idempotent


@pytest.mark.parametrize("text", [
    "python -m vllm.entrypoints.openai.api_server --max-num-batched-tokens 8192 --tokenizer meta/llama",
    "--max-tokens 512 --kv-cache-dtype fp8 --tensor-parallel-size 2",
    "time per output token: 12 ms; tokens/s 900",
    "http://10.0.0.5:8000/metrics",
    "gpm: not supported on this GPU (needs Hopper)",
    "gpu.dram_active mean = 72 % (>= 50 %) [gpm]",
    "TGI --max-batch-total-tokens; Triton dynamic batching max_queue_delay",
])
def test_ordinary_text_is_untouched(text: str) -> None:
    assert redact(text) == text


def test_name_rules() -> None:
    assert is_secret_name("--api-key") and is_secret_name("OPENAI_API_KEY") and is_secret_name("hf_token")
    assert is_secret_name("X-Api-Key") and is_secret_name("--password") and is_secret_name("AWS_SESSION_TOKEN")
    assert not is_secret_name("--max-num-batched-tokens") and not is_secret_name("--tokenizer")
    # a quantity named after what it counts: vLLM's long-prefill cap is a number of tokens, not a credential
    assert not is_secret_name("--long-prefill-token-threshold") and is_secret_name("--token")
    assert redact("--long-prefill-token-threshold 512 --hf-token hf_x") == \
        f"--long-prefill-token-threshold 512 --hf-token {MASK}"
    assert not is_secret_name("--port") and not is_secret_name("PATH")


def test_argv_masks_the_word_after_a_secret_flag() -> None:
    argv = ["vllm", "serve", "m", "--api-key", SK, "--port", "8000", f"--hf-token={HF}", "--password"]
    out = redact_argv(argv)
    assert out == ["vllm", "serve", "m", "--api-key", MASK, "--port", "8000", f"--hf-token={MASK}", "--password"]
    assert SK not in " ".join(out) and HF not in " ".join(out)


def test_argv_does_not_swallow_the_next_flag() -> None:
    assert redact_argv(["--token", "--port", "1"]) == ["--token", "--port", "1"]


def test_env_and_nested_objects() -> None:
    env = redact_env({"HF_TOKEN": HF, "PATH": "/usr/bin", "PROXY": "http://u:p4ss@proxy:3128"})
    assert env["HF_TOKEN"] == MASK and env["PATH"] == "/usr/bin" and "p4ss" not in env["PROXY"]
    obj = redact_obj({"a": [f"--api-key {SK}", 3, None], "b": {"c": f"https://x:{HF}@h"}})
    assert SK not in str(obj) and HF not in str(obj)
    assert obj["a"][1] == 3 and obj["a"][2] is None  # type: ignore[index]


# --- linear time ----------------------------------------------------------------------------------------------------

_ADVERSARIAL = ["a." * 100_000, "-" * 200_000, "a=" * 100_000, "http://" + "a:" * 100_000, "?a" * 100_000,
                ";a" * 100_000, "x.-" * 66_667, "--a " * 50_000, "-a." * 66_667, "a-" * 100_000,
                "a." * 50_000 + "://" + "a:" * 50_000, "eyJaaaaaaaaa." * 15_385, '"a' * 100_000, "--a '" * 40_000]


def test_redaction_is_linear_on_adversarial_text() -> None:
    """Patterns that scanned a run of name characters from each start inside it took 45 s for 'a.' * 20000 (and
    minutes at 200 KB). Each 200 KB input must be redacted within seconds, measured in a child process with a
    deadline so that a regression fails instead of hanging the suite."""
    assert all(len(s) >= 199_000 for s in _ADVERSARIAL)
    script = textwrap.dedent("""
        import json, sys, time
        from diagnoser.reports.redact import redact
        for i, text in enumerate(json.load(sys.stdin)):
            start = time.perf_counter()
            out = redact(text)
            print(i, len(text), len(out), round(time.perf_counter() - start, 3), flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps(_ADVERSARIAL), capture_output=True,
                            text=True, timeout=10 * len(_ADVERSARIAL), cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert len(rows) == len(_ADVERSARIAL)
    for i, size, out_size, seconds in rows:
        assert int(size) == len(_ADVERSARIAL[int(i)]) and int(out_size) > 0
        assert float(seconds) < 10.0, (i, _ADVERSARIAL[int(i)][:20], seconds)


def test_a_script_named_hf_something_is_not_a_hugging_face_token():
    """The H200 recordings showed their workload as "python3 '[redacted].py'": hf_generate.py matched the token
    shape hf_ + 8 characters. Hugging Face tokens are hf_ and 34 characters."""
    assert redact("/opt/scripts/hf_generate.py --size 2.4b") == "/opt/scripts/hf_generate.py --size 2.4b"
    assert HF not in redact(f"HF_HUB_TOKEN is {HF}")
