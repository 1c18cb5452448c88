"""A fleet diagnosis: one Diagnosis per GPU over a window, with what is at stake. Produced by `diagnoser fleet`,
rendered by the terminal, JSON and HTML renderers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diagnoser.diagnosis import Diagnosis


@dataclass
class FleetRow:
    node: str
    gpu: str  # index or MIG instance, as the exporter labels it
    uuid: str
    model_name: str  # GPU model name
    diagnosis: Diagnosis
    pod: str = ""
    namespace: str = ""
    container: str = ""
    mig_profile: str = ""
    # What is at stake, for sorting: idle or underused GPU-hours priced at usd_per_gpu_hour over the window,
    # or the throughput the top fix predicts.
    usd_per_hour_at_stake: float = 0.0
    top_fix_gain: float | None = None
    # Share of this GPU's price at stake (1.0 idle, 1 - busy underused, 1 - 1/gain with a predicted fix) and the
    # price used (from --usd-per-gpu-hour or the rough table in diagnoser/fleet/run.py; None: unknown).
    frac_at_stake: float = 0.0
    usd_per_gpu_hour: float | None = None
    busy: float | None = None  # mean GPU busy fraction over the window, when measured
    partial: bool = False  # some series had gaps or were missing
    notes: list[str] = field(default_factory=list)
    # What the diagnosis was made from: "statistics" (the engine's window statistics), "recorded statistics" (the
    # rule group's), or "points" (the GPU's series over the window, for the top of the list); "not diagnosed" when
    # the GPU reports no field a rule reads (notes[0] says what it reports; its diagnosis is inconclusive).
    basis: str = "points"


@dataclass
class FleetReport:
    source: str  # Prometheus URL or exporter list
    window_start: float
    window_end: float
    rows: list[FleetRow] = field(default_factory=list)
    usd_per_gpu_hour: float | None = None
    errors: list[str] = field(default_factory=list)  # partial data, timeouts: shown, never fatal
    query_seconds: float | None = None
    # The account of the GPUs: every GPU or MIG instance any DCGM series names in the window (the rows), those
    # diagnosed (the others report no field a rule reads: rows with basis "not diagnosed"), and how many GPUs each
    # DCGM field the fleet reads shows (metric name -> GPUs).
    gpus_seen: int | None = None
    gpus_diagnosed: int | None = None
    gpus_per_field: dict[str, int] = field(default_factory=dict)
    # DCGM fields whose statistic query failed, asked twice: every row is then partial, and `fleet` exits 4
    lost: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "window_start": self.window_start, "window_end": self.window_end,
            "usd_per_gpu_hour": self.usd_per_gpu_hour, "errors": self.errors, "query_seconds": self.query_seconds,
            "gpus_seen": self.gpus_seen, "gpus_diagnosed": self.gpus_diagnosed, "gpus_per_field": self.gpus_per_field,
            "lost": self.lost,
            "rows": [{**{k: v for k, v in r.__dict__.items() if k != "diagnosis"},
                      "diagnosis": r.diagnosis.to_dict()} for r in self.rows],
        }
