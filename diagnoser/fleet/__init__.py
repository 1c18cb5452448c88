"""The fleet: one diagnosis per GPU (or MIG instance) of a whole cluster over a window, from Prometheus.

`run.py` runs it (`run_fleet`: statistics, triage, points for the GPUs at stake, prices, the report's JSON),
`triage.py` diagnoses each GPU from its window statistics, `pack.py` carries a worker's rows back with their diagnoses
packed, `model.py` holds the report (`FleetReport`, `FleetRow`) the renderers show, and `promrules.py` writes the
Prometheus rule group that keeps the same statistics and classification recorded.

Nothing is imported here: a renderer that needs only the report's model does not pay for the rule engine.
"""
