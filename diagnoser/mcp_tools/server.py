"""The MCP server over stdio: tools/list from tools.TOOLS, tools/call through runner.run_cli. The only module that
imports the `mcp` SDK; `diagnoser mcp` imports it when it runs.

Every failure of a call is a tool error holding one sentence (`isError`: the assistant reads it and can try
again), never a protocol error with a traceback: bad arguments, a refusal by the config, the command's own error,
a time or size limit, and a bug of ours alike.
"""

from __future__ import annotations

from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from diagnoser import __version__
from diagnoser.errors import DiagnoserError
from diagnoser.mcp_tools.config import Config
from diagnoser.mcp_tools.runner import ToolFailed, end_with_the_server, run_cli
from diagnoser.mcp_tools.tools import TOOLS, command_line
from diagnoser.textsafe import one_line

INSTRUCTIONS = ("diagnoser says what limits a GPU inference server and what to change. Each tool returns the JSON "
                "document the diagnoser CLI prints with --json; an error is one sentence saying what to fix.")


def _error(sentence: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=sentence)], is_error=True)


async def call(config: Config, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
    """One tool call: its document, or its one sentence as a tool error."""
    try:
        tool, argv, timeout_s = command_line(name, arguments, config)
        text = await run_cli(argv, timeout_s=timeout_s, max_output_bytes=config.max_output_bytes,
                             ok_codes=tool.ok_codes)
    except (DiagnoserError, ToolFailed) as exc:
        return _error(one_line(str(exc)))
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # a bug of ours: said in one sentence, the server goes on
        return _error(one_line(f"internal error in the {name} tool ({type(exc).__name__}: {exc}); this is a bug in "
                               "diagnoser: please report it."))
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=False)


def make_server(config: Config) -> Server[Any]:
    tools = [types.Tool(name=t.name, description=t.description, input_schema=t.input_schema()) for t in TOOLS]

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await call(config, params.name, params.arguments)

    return Server("diagnoser", version=__version__, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                  on_call_tool=call_tool)


async def _serve(config: Config) -> None:
    server = make_server(config)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def serve(config: Config) -> None:
    """Serve over stdin/stdout until the client closes them."""
    end_with_the_server()  # a client stopping the server stops the calls it runs too
    anyio.run(_serve, config)
