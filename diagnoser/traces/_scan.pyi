from collections.abc import Callable
from typing import Any

def scan(data: bytes | memoryview, runtime_kinds: dict[str, int], interest: Callable[[str], int],
         sync_kinds: dict[str, int], long_us: float, bare: bool = False, /) -> tuple[Any, ...] | None: ...
