"""Cut a short window out of a large Kineto trace, to keep or share: a 2 s trace of a CUDA-graph decode on an H100
is ~470 MB, and 30 ms of it (a few decode steps) is ~150 kB gzipped.

The window starts at a quantile of the GPU events' start times (the middle, by default), so it holds steady-state
work rather than the profiler's warm-up. Events that end inside it are kept, and so are the host events of the few
milliseconds before it, since a GPU kernel's launch precedes it; metadata events (process and thread names) and
the top-level keys (deviceProperties, distributedInfo, ...) are kept whole. Events are copied byte for byte.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec

from diagnoser.traces.decode import TraceError, read_json_bytes

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Launches run ahead of the GPU: keep the host events of this long before the window (a CUDA-graph decode that
# runs two steps ahead launched ~10 ms early on an H100; what falls before this is analysed as unattributed).
LEAD_US = 2_000.0


def _windowed(w: _When) -> bool:
    """Events kept only from the window's start: GPU work and profiler steps (a step that began in the lead would
    stretch the analysed window over GPU work that was cut away)."""
    return w.cat in GPU_CATS or w.name.startswith("ProfilerStep#")


class _When(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float | None = None
    dur: float = 0.0


def trim_trace(src: Path, dst: Path, *, window_ms: float = 30.0, at: float = 0.5, step: str | None = None,
               lead_ms: float = LEAD_US / 1e3) -> int:
    """Write the `window_ms` window of `src` that starts at the `at` quantile of GPU event starts to `dst` (gzip
    JSON); with `step` ("ProfilerStep#16"), the window is that step's span instead. Host events of `lead_ms` before
    the window are kept too (a GPU far behind its host needs more than the default). Returns the number of events
    kept. Raises TraceError for a file that is not a trace with GPU events (or without that step)."""
    if window_ms <= 0 or not 0.0 <= at < 1.0:
        raise TraceError("the window must be positive and start at a quantile in [0, 1).")
    data = read_json_bytes(src)
    try:
        top = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
        raw_events = msgspec.json.decode(top["traceEvents"], type=list[msgspec.Raw])
    except (msgspec.DecodeError, UnicodeDecodeError, msgspec.ValidationError, KeyError) as exc:
        raise TraceError(f"{src} is not a Kineto trace ({exc}).") from None
    except RecursionError:
        raise TraceError(f"{src} nests arrays or objects more than about 1,000 levels deep; not a Kineto trace "
                         "diagnoser can cut.") from None
    decode = msgspec.json.Decoder(_When)
    when = [decode.decode(raw) for raw in raw_events]
    starts = sorted(w.ts for w in when if w.ph == "X" and w.cat in GPU_CATS and w.ts is not None)
    if not starts:
        raise TraceError(f"{src} has no GPU events to place a window on.")
    if step is not None:
        spans = [(w.ts, w.dur) for w in when if w.name == step and w.cat == "user_annotation" and w.ts is not None]
        if not spans:
            raise TraceError(f"{src} has no annotation named {step}.")
        t0, dur = max(spans, key=lambda s: s[1])
        t1 = t0 + dur
    else:
        t0 = starts[int(len(starts) * at)]
        t1 = t0 + window_ms * 1e3
    lead = lead_ms * 1e3
    kept = [raw for raw, w in zip(raw_events, when, strict=True)
            if w.ph == "M" or (w.ts is not None and w.ts + w.dur <= t1 and w.ts >= (t0 if _windowed(w) else t0 - lead))]
    top["traceEvents"] = msgspec.Raw(msgspec.json.encode(kept))
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wb", compresslevel=9) as out:
        out.write(msgspec.json.encode(top))
    return len(kept)
