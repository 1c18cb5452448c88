"""`diagnoser agent`: diagnose this node's inference servers on a schedule (or once, for cron and CronJobs)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.errors import EXIT_INTERRUPTED, EXIT_UNAVAILABLE
from diagnoser.interrupts import catch
from diagnoser.textsafe import one_line


def _flags(**given: Any) -> dict[str, Any]:
    return {k: v for k, v in given.items() if v is not None}


def register(app: typer.Typer) -> None:
    @app.command("agent")
    @handles_errors
    def agent_cmd(
        once: bool = typer.Option(False, "--once", help="Run one cycle and exit (cron, systemd timers, CronJobs)."),
        every: str = typer.Option(None, "--every", help="Interval between cycles, e.g. 15m (default 15m)."),
        jitter: str = typer.Option(None, "--jitter", help="Random spread of the interval, e.g. 10% (default 10%)."),
        config: Path = typer.Option(None, "--config", "-c", help="TOML config file (docs/agent.md)."),
        targets: list[str] = typer.Option(
            None, "--targets", "-t",
            help="What to diagnose (repeat or comma-separate): PORT, HOST:PORT, pid:PID, match:REGEX, url:URL, "
                 "NAME=... to name it. Default: the processes NVML sees on the GPUs."),
        discover: bool = typer.Option(None, "--discover/--no-discover",
                                      help="Also diagnose the GPU processes NVML finds (default: only without "
                                           "--targets)."),
        window: str = typer.Option(None, "--window", help="Observation window per target, e.g. 10s (default 10s)."),
        sample_interval: str = typer.Option(None, "--sample-interval", help="Sampling period (default 0.5s)."),
        grace: str = typer.Option(None, "--grace",
                                  help="Time a target may take beyond its window before it is abandoned "
                                       "(default 60s)."),
        max_parallel: int = typer.Option(None, "--max-parallel", help="Targets diagnosed at once (default 4)."),
        db: Path = typer.Option(None, "--db", help="History store (default $STATE_DIRECTORY or "
                                                   "~/.local/state/diagnoser/history.db)."),
        retention: str = typer.Option(None, "--retention", help="Keep history this long, e.g. 30d (default 30d)."),
        max_db_mb: int = typer.Option(None, "--max-db-mb", help="Keep the history under this size (default 256)."),
        reports_dir: Path = typer.Option(None, "--reports-dir", help="Where run reports go (default: beside the "
                                                                      "history, reports/; reports-NAME/ for a history "
                                                                      "not named history.db)."),
        keep_reports: int = typer.Option(None, "--keep-reports",
                                         help="Run reports kept per target (default 20; 0 keeps none)."),
        no_html: bool = typer.Option(False, "--no-html", help="Keep the capture and diagnosis.json, not HTML."),
        metrics_port: int = typer.Option(None, "--metrics-port",
                                         help="Serve Prometheus metrics on this port (default 9464; 0 turns it "
                                              "off)."),
        metrics_addr: str = typer.Option(None, "--metrics-addr", help="Address to serve metrics on "
                                                                      "(default 127.0.0.1)."),
        textfile: Path = typer.Option(None, "--textfile",
                                      help="Write metrics for node_exporter's textfile collector here (*.prom), "
                                           "instead of serving them unless --metrics-port is given too."),
        webhook: str = typer.Option(None, "--webhook", help="POST verdict changes as JSON to this URL."),
        rules_config: Path = typer.Option(None, "--rules-config", help="TOML file overriding rule thresholds."),
        dcgm_exporter: str = typer.Option(None, "--dcgm-exporter", help="dcgm-exporter /metrics URL to read DCGM "
                                                                        "counters from."),
        prometheus: str = typer.Option(None, "--prometheus", help="Prometheus URL holding dcgm-exporter's series."),
    ) -> None:
        """Diagnose this node's inference servers on a schedule; keep a history; export metrics."""
        from diagnoser.agent.config import build_config, validate
        from diagnoser.agent.loop import Agent

        target_list = [t for item in (targets or []) for t in item.split(",") if t.strip()]
        flags = _flags(**{
            "agent.every": every, "agent.jitter": jitter, "agent.window": window,
            "agent.sample_interval": sample_interval, "agent.grace": grace, "agent.max_parallel": max_parallel,
            "agent.discover": discover, "agent.rules_config": str(rules_config) if rules_config else None,
            "history.db": str(db) if db else None, "history.retention": retention, "history.max_db_mb": max_db_mb,
            "reports.dir": str(reports_dir) if reports_dir else None, "reports.keep": keep_reports,
            "reports.html": False if no_html else None, "metrics.port": metrics_port, "metrics.addr": metrics_addr,
            "metrics.textfile": str(textfile) if textfile else None, "notify.webhook": webhook,
            "sources.dcgm_exporter": dcgm_exporter, "sources.prometheus": prometheus,
        })
        if target_list:
            flags["targets"] = target_list
        cfg = build_config(config, flags)
        validate(cfg)
        if once:
            cfg.metrics_port = None  # nothing would be there to scrape once the run ends; use --textfile
        agent = Agent(cfg, progress=once)  # --once: each target's stages on stderr as it goes
        previous = catch((signal.SIGTERM, signal.SIGINT), lambda *_: agent.stop())  # an ignored SIGINT stays so
        try:
            if once:
                report = agent.run_cycle()
            else:
                agent.serve_metrics()
                agent.run_forever()
                return
        finally:
            agent.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for run in report.runs:
            what = f"{run.verdict} ({run.confidence:.2f})" if run.status == "ok" else f"{run.status}: {run.error}"
            sys.stdout.write(one_line(f"{run.target}: {what}") + "\n")  # errors quote targets' answers
        if not report.runs and report.skipped:
            typer.echo("diagnoser: interrupted before any target was diagnosed.", err=True)
            raise typer.Exit(EXIT_INTERRUPTED)
        if not report.runs:
            why = (report.discovery_error or "no target was given").rstrip(".")
            typer.echo(one_line(f"diagnoser: nothing to diagnose: {why}."), err=True)
            raise typer.Exit(EXIT_UNAVAILABLE)
        if report.failed:
            raise typer.Exit(EXIT_UNAVAILABLE)
