"""The fleet page's per-GPU evidence (issue 29.4): at 100,000 GPUs the top 200 by money at stake were all idle GPUs
(the whole price of a GPU doing nothing outweighs a fix's share), and no VRAM- or compute-limited GPU's evidence was
on the page. Every verdict present gets its most-at-stake GPUs shown, in turn."""

from __future__ import annotations

from diagnoser.diagnosis import Diagnosis
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.model import build_fleet_view


def _row(i: int, verdict: str, usd: float) -> FleetRow:
    d = Diagnosis(verdict=verdict, confidence=0.8, headline=f"{verdict} GPU {i}", target=f"GPU {i}")
    return FleetRow(node=f"n{i // 8}", gpu=str(i % 8), uuid=f"GPU-{i:06d}", model_name="NVIDIA H100 80GB HBM3",
                    diagnosis=d, usd_per_hour_at_stake=usd, usd_per_gpu_hour=3.0)


def test_every_verdict_has_its_most_at_stake_gpus_shown() -> None:
    rows = ([_row(i, "idle", 3.0) for i in range(400)] + [_row(400 + i, "vram", 1.0 + i / 100) for i in range(30)]
            + [_row(430 + i, "compute", 0.5) for i in range(5)])
    view = build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=rows))
    shown = [v["verdict_key"] for v in view.details]
    assert len(shown) == 200
    assert shown.count("vram") == 30 and shown.count("compute") == 5 and shown.count("idle") == 165
    assert view.details[0]["verdict_key"] == "idle"  # still in the table's order: most at stake first
    top_vram = max(rows[400:430], key=lambda r: r.usd_per_hour_at_stake)
    assert any(v["uuid"] == top_vram.uuid for v in view.details)
    html = HtmlRenderer().render_fleet(view)
    # The table links exactly the GPUs whose evidence the page holds.
    assert html.count('href="#gpu-') == 200 and html.count('class="card gpu-detail"') == 200


def test_a_small_fleet_shows_every_gpu() -> None:
    rows = [_row(i, "idle" if i % 2 else "vram", 1.0) for i in range(10)]
    view = build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=rows))
    assert len(view.details) == 10 and all(v["detailed"] for v in view.rows)
