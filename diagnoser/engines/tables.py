"""The knob tables by engine, and what a capture's circumstances say a knob is in force at."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diagnoser.capture import GpuInfo, ServingConfig
from diagnoser.engines import vllm
from diagnoser.engines.knobs import Knob, Platform, Setting, is_cpu_build, parse_version, setting

TABLES: Mapping[str, Mapping[str, Knob]] = {"vllm": vllm.BY_NAME}


def knobs_of(engine: str) -> Mapping[str, Knob]:
    """The engine's knobs by name; empty for an engine with no table."""
    return TABLES.get(engine, {})


def platform_of(version: str, cpu_only: bool, gpus: Sequence[GpuInfo], serving: ServingConfig) -> Platform | None:
    """What the engine's defaults depend on: a CPU build (its version says +cpu, or the capture had no GPU and said
    so), else the first GPU's memory and name; None when neither is known."""
    world = (serving.tensor_parallel_size or 1) * (serving.pipeline_parallel_size or 1)
    if is_cpu_build(version) or (cpu_only and not gpus):
        return Platform(cpu=True, world_size=world)
    if not gpus:
        return None
    g = gpus[0]
    memory = g.memory_total_bytes / (1 << 30) if g.memory_total_bytes else None
    return Platform(gpu_memory_gib=memory, gpu_name=g.name, world_size=world)


def in_force(engine: str, name: str, serving: ServingConfig, version: str, platform: Platform | None) -> \
        Setting | None:
    """The knob `name` of `engine` as it is in force, or None where the engine has no table or no such knob."""
    knob = knobs_of(engine).get(name)
    if knob is None:
        return None
    return setting(knob, serving, parse_version(version), platform)
