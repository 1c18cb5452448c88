"""The command line: thin typer commands over the library. Each command lives in its own module."""
