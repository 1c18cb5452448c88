"""Live collectors that fill a Capture: NVML and GPM (GPU), psutil (host), the server's /metrics, DCGM.

`diagnoser.collectors.session.collect(target, ...)` runs them together; see docs/attach.md.
"""
