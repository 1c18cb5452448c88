"""`diagnoser mcp`: serve the commands to an AI assistant as Model Context Protocol tools over stdio (docs/mcp.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from diagnoser.cli.common import handles_errors
from diagnoser.errors import SourceUnavailable


def register(app: typer.Typer) -> None:
    @app.command("mcp")
    @handles_errors
    def mcp_cmd(
        config: Path | None = typer.Option(None, "--config", help="The TOML file of limits, the Prometheus and the "
                                           "attach allow-list (default: $DIAGNOSER_MCP_CONFIG, else "
                                           "~/.config/diagnoser/mcp.toml; docs/mcp.md)."),
    ) -> None:
        """Serve the commands to an AI assistant as Model Context Protocol tools over stdio."""
        from diagnoser.mcp_tools.config import load

        settings = load(config)  # a bad config fails here, before the assistant connects
        try:  # the SDK (an extra) first: without it, its dependencies (anyio) are missing too
            import mcp  # noqa: F401
        except ImportError:
            raise SourceUnavailable("diagnoser mcp needs the MCP SDK: pip install 'diagnoser[mcp]'.") from None
        from diagnoser.mcp_tools.server import serve

        serve(settings)
