"""The engine's own curve, live: the demo server pinned at --max-num-seqs 2 under 8 closed-loop clients has no device
roofs (a CPU), so BAT005 prices raising the limit from the window's step-time curve, with its range; `diagnoser
verify` restarts nothing itself: the test restarts the server with the limit raised, verify measures again and the
realised gain is held against the estimate."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from diagnoser.compare import AGREEMENT
from tests.engines.load import Load
from tests.test_verify_live import ENV, PY, _demo, _free_port, _stop


class PhasedLoad(Load):
    """Closed-loop clients whose prompts alternate, every `phase_s` seconds, between short and long: the steps of
    one second hold few tokens and those of the next many, so the window's tokens per step varies at the scrapes'
    one-second grain (a steady load averages each second to the same mix and the curve is refused). Both windows
    see the same phases, so the traffic is the same on average."""

    phase_s: float = 2.0
    long_words: int = 30  # about 180 bytes: the demo tokenizes bytes, and --max-len 256 holds it with 24 tokens

    def _prompt(self, rng: random.Random) -> str:
        words = self.long_words if int(time.monotonic() / self.phase_s) % 2 else self.prompt_words
        return " ".join(f"w{rng.randrange(2000)}" for _ in range(words))


@pytest.mark.slow
def test_bat005_estimate_from_the_windows_curve_against_the_realised_gain(tmp_path: Path) -> None:
    """Written before the run: with 8 clients and 2 sequences a step, 6 wait; prompts of 2 or 30 words (alternating
    every 2 s) go through some steps beside the two decodes, so tokens per step varies across the window and the
    curve fits. BAT005's fix raises --max-num-seqs to 8 with an estimate (not "gain not predictable") and a range;
    restarted with 8, a realised gain is measured and compare grades the estimate by its own 25 % rule. How far
    the estimate lands from the realised gain is a measurement, not an assertion: benchmarks/REAL_ENGINES.md keeps
    it (a pinned batch prices a generated token at a prompt token's cost, and the demo's decode token costs several
    times more, so the estimate has over-predicted there)."""
    port = _free_port()
    first = _demo(port, 2)
    second: subprocess.Popen[str] | None = None
    # Two groups of 4 clients with answers of different lengths: two requests admitted together do not finish
    # together every time (in lockstep, the running gauge read at a step's end shows both gone half the window).
    loads = [PhasedLoad(port=port, model="diagnoser-demo-tiny", clients=4, prompt_words=2, max_tokens=tokens,
                        seconds=900, seed=seed) for seed, tokens in ((0, 24), (1, 17))]
    verify: subprocess.Popen[str] | None = None
    try:
        for load in loads:
            load.start()
        time.sleep(3.0)  # the batch and queue reach their steady state
        verify = subprocess.Popen([PY, "-m", "diagnoser", "verify", "--port", str(port), "--duration", "12",
                                   "--settle", "3", "--wait", "300", "--save-dir", str(tmp_path), "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        said: list[str] = []
        waiting = threading.Event()

        def read_stderr() -> None:
            assert verify is not None and verify.stderr is not None
            for line in verify.stderr:
                said.append(line)
                if "waiting up to" in line:
                    waiting.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        assert waiting.wait(400), "".join(said)
        _stop(first)
        second = _demo(port, 8)
        out_parts: list[str] = []
        out_reader = threading.Thread(target=lambda: out_parts.append(verify.stdout.read()  # type: ignore[union-attr]
                                                                      ), daemon=True)
        out_reader.start()
        verify.wait(timeout=500)
        out_reader.join(30)
        reader.join(30)
        assert verify.returncode in (0, 1), "".join(said)
        result = json.loads("".join(out_parts))
        (p,) = [p for p in result["predictions"] if p["kind"] == "batch_more"]
        print("batch_more:", {k: p[k] for k in ("predicted", "predicted_kind", "for_change", "low", "high", "realised",
                                                "verdict", "in_range")})
        assert p["applied"] and p["predicted"] is not None and p["predicted_kind"] == "estimate", p
        assert p["realised"] is not None, p
        # The range is the estimate's for the change made (for_change) where compare re-priced it, else the fix's own
        reference = p["for_change"] if p["for_change"] is not None else p["predicted"]
        assert p["low"] is not None and p["high"] is not None and p["low"] <= reference <= p["high"], p
        within = abs(p["realised"] / reference - 1) <= AGREEMENT
        assert (p["verdict"] == "held") == within, p  # compare grades the estimate by the same 25 %
    finally:
        for load in loads:
            load.stop()
        if verify is not None and verify.poll() is None:
            verify.kill()
        _stop(first)
        if second is not None:
            _stop(second)
