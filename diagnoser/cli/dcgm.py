"""`diagnoser dcgm`: diagnose one GPU, MIG instance, pod or process from DCGM counters, read from a dcgm-exporter
endpoint (live, for --duration seconds) or from Prometheus (any past window)."""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.capture import new_capture
from diagnoser.cli.common import handles_errors
from diagnoser.cli.output import FAIL_ON_HELP, parse_fail_on, show
from diagnoser.collectors.dcgm import GpuSelector, describe_target, selector_for_pid
from diagnoser.collectors.dcgm_collect import collect_dcgm_into
from diagnoser.collectors.prom_client import parse_headers
from diagnoser.collectors.prometheus_source import resolve_window
from diagnoser.errors import InputError
from diagnoser.interrupts import arm, ends_window_on_signals
from diagnoser.rules import load_thresholds


def build_selector(*, gpu: int | None, uuid: str | None, pod: str | None, node: str | None,
                   mig_instance: str | None, pid: int | None, live: bool) -> GpuSelector:
    """The target from the options; a PID becomes the GPUs it runs on (for a live exporter, which is one node's,
    the node is implied by the URL)."""
    if pid is not None:
        if any(v is not None for v in (gpu, uuid, pod)):
            raise InputError("--pid picks the GPUs itself; do not combine it with --gpu, --uuid or --pod.")
        found = selector_for_pid(pid)
        return GpuSelector(pid=pid, uuids=found.uuids, indices=found.indices, mig_instance=mig_instance,
                           node=node if node else (None if live else found.node))
    return GpuSelector(gpu=gpu, uuid=uuid, pod=pod, node=node, mig_instance=mig_instance)


def register(app: typer.Typer) -> None:
    @app.command("dcgm")
    @handles_errors
    @ends_window_on_signals
    def dcgm_cmd(
        exporter: str = typer.Option(None, "--dcgm-exporter", help="A dcgm-exporter endpoint to sample live, e.g. "
                                     "http://node:9400/metrics."),
        prometheus: str = typer.Option(None, "--prometheus", help="A Prometheus that scrapes dcgm-exporter: read "
                                       "a past window."),
        gpu: int = typer.Option(None, "--gpu", help="GPU index (with --node when reading Prometheus)."),
        uuid: str = typer.Option(None, "--uuid", help="GPU UUID (GPU-...; the prefix may be left out)."),
        pod: str = typer.Option(None, "--pod", help="Kubernetes pod, or namespace/pod (a unique prefix works)."),
        node: str = typer.Option(None, "--node", help="Node (the exporter's hostname label or Prometheus instance)."),
        mig_instance: str = typer.Option(None, "--mig-instance", help="MIG GPU instance id (GPU_I_ID)."),
        pid: int = typer.Option(None, "--pid", help="A process on this node: diagnose the GPUs it uses."),
        duration: float = typer.Option(10.0, "--duration", min=1.0, help="Seconds to sample the exporter."),
        interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between exporter readings."),
        since: str = typer.Option(None, "--since", help="Prometheus: window length ending now or at --at "
                                  "(default 30m)."),
        start: str = typer.Option(None, "--start", help="Prometheus: window start (ISO 8601, unix seconds, now-2h)."),
        end: str = typer.Option(None, "--end", help="Prometheus: window end, with --start (default now)."),
        at: str = typer.Option(None, "--at", help="Prometheus: end of the --since window (default now)."),
        timeout: float = typer.Option(10.0, "--timeout", min=1.0, help="Seconds each request may take, whole."),
        headers: list[str] = typer.Option([], "--header", help="Prometheus: an HTTP header for every request, "
                                          "'Name: value' (Mimir's X-Scope-OrgID, a bearer token); repeatable."),
        save_to: Path = typer.Option(None, "--save", help="Also save the capture (.dgc) for diagnose/report."),
        html: Path = typer.Option(None, "--html", help="Also write the HTML report to this file."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
        fail_on: str = typer.Option("", "--fail-on", help=FAIL_ON_HELP),
        rules_config: Path = typer.Option(None, "--rules-config", help="TOML file overriding rule thresholds."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every fix, its basis and skipped rules."),
    ) -> None:
        """Diagnose a GPU, MIG instance, pod or process from DCGM counters (dcgm-exporter or Prometheus)."""
        if (exporter is None) == (prometheus is None):
            raise InputError("give one DCGM source: --dcgm-exporter URL (live) or --prometheus URL (a past window).")
        if exporter is not None and any(v is not None for v in (since, start, end, at)):
            raise InputError("--since/--start/--end/--at read a past window from --prometheus; a live exporter is "
                             "sampled for --duration seconds.")
        wanted = parse_fail_on(fail_on)
        overrides = load_thresholds(rules_config) if rules_config else None
        selector = build_selector(gpu=gpu, uuid=uuid, pod=pod, node=node, mig_instance=mig_instance, pid=pid,
                                  live=exporter is not None)
        from diagnoser.pipeline import Pipeline

        pipeline = Pipeline(overrides=overrides, save_to=save_to, html=html)  # checks the outputs before the window
        if exporter is not None:
            # The window's length is the time it was read for (set when it ends), not the one planned.
            capture = new_capture(f"dcgm-exporter {exporter}")
            stop = arm()  # SIGINT/SIGTERM end the window; what was read is still saved and diagnosed
            targets = collect_dcgm_into(capture, exporter_url=exporter, selector=selector, duration_s=duration,
                                        interval_s=interval, timeout_s=timeout, stop=stop.event)
            capture.target = f"{describe_target(targets)} (dcgm-exporter {exporter})"
            stop.check_captured(bool(capture.series))
            if stop.stopped:
                capture.notes.append(f"Interrupted {stop.event.how} after {capture.duration_s:.1f} s of the planned "
                                     f"{duration:g} s; the diagnosis covers what was read.")
        else:
            window = resolve_window(since=since, start=start, end=end, at=at, default_s=1800.0)
            capture = new_capture(f"prometheus {prometheus}", started_at=window.start, duration_s=window.length_s)
            targets = collect_dcgm_into(capture, prometheus_url=prometheus, selector=selector, start=window.start,
                                        end=window.end, timeout_s=timeout, headers=parse_headers(headers))
            capture.target = f"{describe_target(targets)} (Prometheus {prometheus})"
            capture.host = targets[0].node or capture.host
        pipeline.checkpoint(capture)
        if save_to is not None:
            typer.echo(f"diagnoser: saved the capture to {save_to}", err=True)
        show(pipeline.write(pipeline.diagnose(capture)), as_json=as_json, fail_on=wanted, verbose=verbose)
