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
    shown = [v.row.verdict_key for v in view.details]
    assert len(shown) == 200
    assert shown.count("vram") == 30 and shown.count("compute") == 5 and shown.count("idle") == 165
    assert view.details[0].row.verdict_key == "idle"  # still in the table's order: most at stake first
    top_vram = max(rows[400:430], key=lambda r: r.usd_per_hour_at_stake)
    assert any(v.row.uuid == top_vram.uuid for v in view.details)
    html = HtmlRenderer().render_fleet(view)
    # The table links exactly the GPUs whose evidence the page holds.
    assert html.count('href="#gpu-') == 200 and html.count('class="card gpu-detail"') == 200


def test_a_small_fleet_shows_every_gpu() -> None:
    rows = [_row(i, "idle" if i % 2 else "vram", 1.0) for i in range(10)]
    view = build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=rows))
    assert len(view.details) == 10 and all(v.detailed for v in view.rows)


def _fleet(n: int) -> list[FleetRow]:
    """n GPUs: most idle, a band of VRAM-limited ones on another model, a few compute-limited; money falls with i."""
    rows = []
    for i in range(n):
        verdict = "vram" if i % 10 == 3 else "compute" if i % 97 == 5 else "idle"
        row = _row(i, verdict, 3.0 - i / n)
        if verdict == "vram":
            row.model_name = "NVIDIA A100-SXM4-80GB"
        row.partial = i % 50 == 0
        rows.append(row)
    return rows


def test_a_large_fleet_lists_the_most_at_stake_and_counts_every_gpu() -> None:
    """At 100,000 GPUs a table row each made an 76 MB page: the table lists the GPUs most at stake (and every GPU
    whose evidence is shown), and a table of verdict and model counts every GPU with its money at stake."""
    rows = _fleet(5000)
    view = build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=rows))
    assert len(view.rows) == 2000 and view.summary.listed == 2000 and view.summary.gpus == 5000
    listed = {v.uuid for v in view.rows}
    assert {v.row.uuid for v in view.details} <= listed
    most = sorted(rows, key=lambda r: -r.usd_per_hour_at_stake)[:1500]
    assert {r.uuid for r in most} <= listed  # the cut keeps the most at stake
    assert sum(g.gpus for g in view.groups) == 5000
    assert sum(g.partial for g in view.groups) == sum(r.partial for r in rows)
    assert abs(sum(g.usd_h for g in view.groups) - sum(r.usd_per_hour_at_stake for r in rows)) < 1e-6
    vram = next(g for g in view.groups if g.verdict_key == "vram")
    assert vram.model == "NVIDIA A100-SXM4-80GB" and vram.gpus == 500
    html = HtmlRenderer().render_fleet(view)
    table = html[html.index('id="fleet-table"'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == 2001  # the header and the listed GPUs
    assert 'id="group-table"' in html and "The 2,000 GPUs most at stake of 5,000" in html


def test_gpus_the_page_does_not_list_stay_packed() -> None:
    """The page unpacks only the diagnoses it shows: unpacking 100,000 took the run to 2 GB."""
    from diagnoser.fleet.pack import RowPacker, unpack_rows

    packer = RowPacker()
    for r in _fleet(3000):
        packer.add(r)
    rows, _ = unpack_rows(packer.finish())
    build_fleet_view(FleetReport("p", 1e9, 1e9 + 3600, rows=rows))
    unpacked = sum(1 for r in rows if r.diagnosis._full is not None)  # type: ignore[union-attr]
    assert 0 < unpacked <= 2000
