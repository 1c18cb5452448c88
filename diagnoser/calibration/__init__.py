"""`diagnoser calibrate`: measure the roofs this GPU reaches, store them per GPU model and driver, and hand them to
the physics module in place of the datasheet's (see docs/calibrate.md).

torch is imported lazily, only by bench.calibrate; the store is plain JSON and is what the collectors consult.
"""

from diagnoser.calibration.store import CalibrationResult, Measurement, default_store_path, lookup

__all__ = ["CalibrationResult", "Measurement", "default_store_path", "lookup"]
