"""diagnoser: what limits this inference server, and what to change."""

__version__ = "0.1.0"
