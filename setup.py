"""The compiled parts, both optional: without a C compiler the install still succeeds and the Python they stand in
for runs instead (the same answers, slower). diagnoser/traces/_scan.c reads plain trace chunks (else the typed decode,
2-3x slower); diagnoser/traces/_gaps.c runs the GPU analysis' loops over every op: the sweep, each idle gap's cause,
the compute/communication unions and the kernel statistics' sums (else the Python in timeline.py and kernels.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"diagnoser.traces.{name}", [f"diagnoser/traces/{name}.c"], optional=True,
                             extra_compile_args=["-O2"]) for name in ("_scan", "_gaps")])
