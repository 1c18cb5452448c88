"""The form of an engine's knob table and its one reader.

A knob is one setting of the engine's scheduler: how it is spelled (command line, config page labels, environment),
its default per version and platform, the per-step constraint it sets, the signal that shows that constraint binds,
the direction that relieves it, what the change trades and what bounds its gain, and the fix each direction applies.
`setting(...)` answers what a knob is in force at in a capture: the value the command line or the engine's page
gave, else the engine's default for its version and platform, else unknown (and why).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from diagnoser.capture import ServingConfig
from diagnoser.diagnosis import FixKind


class Direction(str, Enum):
    RAISE = "raise"
    LOWER = "lower"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True)
class Platform:
    """What an engine's defaults depend on: a CPU build or a GPU (its memory and name), and the ranks one engine
    spans (tensor x pipeline parallel)."""

    cpu: bool = False
    gpu_memory_gib: float | None = None
    gpu_name: str = ""
    world_size: int = 1


@dataclass(frozen=True)
class ByPlatform:
    """A default that differs by platform (vLLM's get_batch_defaults for the OpenAI API server): on a CPU build, on
    a GPU under 70 GiB (or an A100), 70-160 GiB, and 160 GiB or more; `per_rank` multiplies the CPU build's value by
    the world size (vLLM does so on CPU only)."""

    cpu: Any
    gpu: Any
    gpu_70g: Any
    gpu_160g: Any
    per_rank: bool = False

    def value(self, p: Platform) -> Any:
        if p.cpu:
            v = self.cpu
        elif p.gpu_memory_gib is None:
            return None
        elif p.gpu_memory_gib >= 160:
            v = self.gpu_160g
        elif p.gpu_memory_gib >= 70 and "a100" not in p.gpu_name.lower():
            v = self.gpu_70g
        else:
            v = self.gpu
        return v * p.world_size if self.per_rank and p.cpu and isinstance(v, int) else v


@dataclass(frozen=True)
class Default:
    """The default from version `since` on (up to the next entry's), as read from that version's source."""

    since: tuple[int, ...]
    value: Any  # a plain value, a ByPlatform, or None (no default: the engine decides at run time)
    source: str = ""


@dataclass(frozen=True)
class Knob:
    name: str  # the key in ServingConfig (a typed field or an `extra` key)
    title: str  # what a person calls it
    flags: tuple[str, ...]  # command-line spellings, the first the one advice names
    constrains: str  # what it limits per step
    binds: str  # the signal that shows the limit binds
    relieves: Direction | None  # the direction that relieves the constraint (None: a choice, no relief direction)
    trades: str  # what moving it costs
    bounds: str  # what bounds the gain of moving it
    fixes: Mapping[Direction, FixKind] = field(default_factory=dict)  # the fix a change in each direction applies
    page: tuple[str, ...] = ()  # labels of the engine's info gauges that carry it
    env: tuple[str, ...] = ()  # environment variables that set it
    defaults: tuple[Default, ...] = ()
    kind: type = int
    zero_is_unlimited: bool = False  # 0 means no limit (vLLM's long-prefill cap): 0 -> 512 lowers the limit
    env_scale: float = 1.0  # the environment variable's unit in the knob's (GiB -> bytes)

    @property
    def flag(self) -> str:
        return self.flags[0]

    def default(self, version: tuple[int, ...] | None, platform: Platform | None) -> tuple[Any, str]:
        """(value, why): the default in force for this version and platform, or (None, why it is unknown)."""
        if not self.defaults:
            return None, f"{self.flag} has no fixed default"
        if version is None:
            return None, f"{self.flag} is not on the command line or the server's page, and the engine's version is " \
                "unknown, so its default is too"
        chosen = None
        for d in self.defaults:
            if version >= d.since:
                chosen = d
        if chosen is None:
            return None, f"{self.flag}'s default before version {_dotted(self.defaults[0].since)} is not in the table"
        value = chosen.value
        if isinstance(value, ByPlatform):
            if platform is None:
                return None, f"{self.flag}'s default depends on the device, which is unknown"
            value = value.value(platform)
            if value is None:
                return None, f"{self.flag}'s default depends on the GPU's memory, which is unknown"
        return value, chosen.source


def direction_of(knob: Knob, before: Any, after: Any) -> Direction | None:
    """Which way a change moved the knob; None when it did not move or one side is unknown and the kind says
    nothing (a number from an unknown default)."""
    if before == after:
        return None
    if knob.kind is bool:
        return None if after is None else Direction.ON if after else Direction.OFF
    if knob.kind is str:
        if before in (None, "") and after not in (None, ""):
            return Direction.ON
        return Direction.OFF if after in (None, "") and before not in (None, "") else None
    if before is None or after is None:
        return None
    x, y = float(before), float(after)
    if knob.zero_is_unlimited:
        x, y = (x or float("inf")), (y or float("inf"))
    return Direction.RAISE if y > x else Direction.LOWER if y < x else None


@dataclass(frozen=True)
class Setting:
    """A knob as it is in force: its value and where the value comes from."""

    knob: Knob
    value: Any
    source: str  # "configured" (command line or the engine's page) or the default's source
    why_unknown: str = ""

    @property
    def known(self) -> bool:
        return self.value is not None

    @property
    def is_default(self) -> bool:
        return self.known and self.source != CONFIGURED


CONFIGURED = "configured"


def parse_version(text: str) -> tuple[int, ...] | None:
    """'0.32.0+cpu' -> (0, 32, 0); llama.cpp's build numbers, 'b11434-1a2b3c4' (its /props build_info) or
    'version: 11434 (1a2b3c4)' (`llama-server --version` of older builds), -> (11434,); None when the text holds no
    version. A llama.cpp built outside its git tree says build 0 ('b0-unknown'): no version, not the first build."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if m is None:
        build = re.match(r"\s*(?:b|version:\s*)(\d+)(?:[-\s(]|$)", text or "")
        return (int(build.group(1)),) if build is not None and int(build.group(1)) > 0 else None
    return tuple(int(g) for g in m.groups() if g is not None)


def is_cpu_build(version_text: str) -> bool:
    return "+cpu" in (version_text or "").lower()


def configured(serving: ServingConfig, knob: Knob) -> Any:
    """The value the capture's serving configuration holds for `knob` (command line or page), typed; None if none."""
    if knob.name in ServingConfig.__struct_fields__:
        return getattr(serving, knob.name)
    text = serving.extra.get(knob.name)
    scale = 1.0
    if text is None:  # set through the engine's environment instead (kept under the variable's name)
        text = next((serving.extra[v] for v in knob.env if v in serving.extra), None)
        scale = knob.env_scale
    if text is None:
        return None
    if knob.kind is bool:
        return text.strip().lower() in ("1", "true", "yes", "on", "")
    if knob.kind in (int, float):
        try:
            return knob.kind(float(text) * scale)
        except ValueError:
            return None
    return text


def setting(knob: Knob, serving: ServingConfig, version: tuple[int, ...] | None,
            platform: Platform | None) -> Setting:
    value = configured(serving, knob)
    if value is not None:
        return Setting(knob, value, CONFIGURED)
    value, why = knob.default(version, platform)
    return Setting(knob, value, why, "" if value is not None else why)


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)
