"""attnlab calibrate's grid, for the instruments: it lives in the library (``attnlab.functional.calibration``,
which the background calibration runs too); Note [Calibrated rates] in ``attnlab.kernels.rates``."""
from ..functional.calibration import MARGIN, CalibrationConfig, calibrate

__all__ = ["CalibrationConfig", "calibrate", "MARGIN"]
