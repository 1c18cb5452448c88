"""The unattended agent: diagnoses a node's inference servers on a schedule, keeps a history, exports metrics.

`config` (TOML + flags), `loop` (the scheduler), `worker` (one run in its own process), `history` (SQLite store),
`metrics` (Prometheus endpoint and textfile), `notify` (log lines and webhook), `reports` (run folders). See
docs/agent.md.
"""
