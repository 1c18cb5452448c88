from array import array
from collections.abc import Callable, Sequence

CAUSES: tuple[str, ...]
CONSTANTS: dict[str, float]

def gap_causes(gaps: list[tuple[float, float, int | None, int | None]], sync_start: Sequence[float],
               sync_end_max: Sequence[float], gpu_sync_start: Sequence[float], gpu_sync_end_max: Sequence[float],
               of_gpu: list[int | None], g_name: array, r_ts: array, r_dur: array, pageable_htod: bytes,
               to_host: bytes, host_events: Callable[[], tuple[Sequence[float], Sequence[float]]], /
               ) -> tuple[list[str], tuple[float, ...], tuple[int, ...], float]: ...
def idle_inside(gap_starts: array, gap_ends: array, op_names: array, op_starts: array, op_ends: array, n_names: int,
                /) -> list[tuple[int, float]]: ...
def sorted_times(times: array, /) -> bytes: ...
