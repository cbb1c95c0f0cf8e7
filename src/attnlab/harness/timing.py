"""One timer for every instrument (``attnlab.timing``: it lives at the bottom of the package, so the
library's calibration, ``attnlab.functional.calibration``, times with it too)."""
from ..timing import Timing, interleaved, median_rate, paired_ratio, time_call

__all__ = ["Timing", "interleaved", "median_rate", "paired_ratio", "time_call"]
