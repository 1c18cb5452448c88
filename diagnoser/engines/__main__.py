"""`python -m diagnoser.engines`: every engine's knob table as the Markdown section docs/attach.md holds."""

from __future__ import annotations

from diagnoser.engines.tables import markdown

if __name__ == "__main__":
    print(markdown(), end="")
