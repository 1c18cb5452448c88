"""`diagnoser mcp`: the commands as Model Context Protocol tools for an AI assistant (docs/mcp.md).

`config.py` (what the user allows: limits, the Prometheus, the attach allow-list) and `tools.py` (each tool's
arguments declared once, checked, and turned into the CLI's own arguments) import no SDK; `runner.py` runs one call as
the CLI; `server.py` is the only module that imports the `mcp` SDK (the `mcp` extra).
"""
