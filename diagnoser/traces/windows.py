"""The analysed-window policies (docs/traces.md, "The analysed window"); a module of its own so that a command's
help text can name them without loading the analysis."""

WINDOWS = ("auto", "trace", "gpu", "steps")
