"""The one compiled part: the fast reader of plain trace chunks (diagnoser/traces/_scan.c). It is optional: without
a C compiler the install still succeeds and every chunk is read by the typed decode (same answers, 2-3x slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"diagnoser.traces.{name}", [f"diagnoser/traces/{name}.c"], optional=True,
                             extra_compile_args=["-O2"]) for name in ("_scan", "_gaps")])
