"""The compiled parts, both optional: without a C compiler the install still succeeds and the Python they stand in
for runs instead (the same answers, slower). diagnoser/traces/_scan.c reads plain trace chunks (else the typed decode,
2-3x slower); diagnoser/traces/_gaps.c gives each GPU idle gap its cause (else timeline._GapCauses)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"diagnoser.traces.{name}", [f"diagnoser/traces/{name}.c"], optional=True,
                             extra_compile_args=["-O2"]) for name in ("_scan", "_gaps")])
