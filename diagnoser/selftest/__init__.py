"""`diagnoser selftest`: real torch workloads with known limiters (scenarios.py, model.py, workload.py), attached to
and diagnosed like any server (harness.py), with real-GPU runs recordable as test fixtures (record.py).

torch is imported only by the workload process and model.py; the harness needs it only to ask whether CUDA exists.
"""
