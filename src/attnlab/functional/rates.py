"""The planner's rates (``attnlab.kernels.rates``: the built-in table or this CPU's calibration) and the
background calibration (``attnlab.functional.calibration``), under their old name: a re-export."""
from ..kernels.rates import (FORMAT, ISA_ENV_VARS, RATE_NAMES, Rates, builtin, cache_dir, cache_path,
                             as_json, calibration_enabled, current, machine_key, make_current, on_change, reload, save)
from .calibration import ASSUMED_FLOPS, LONG_CALL_S, background, note_call, seconds_for, state

__all__ = ["Rates", "RATE_NAMES", "FORMAT", "current", "reload", "make_current", "on_change", "machine_key",
           "cache_dir", "cache_path", "save", "builtin", "calibration_enabled", "ISA_ENV_VARS", "state",
           "note_call", "seconds_for", "background", "LONG_CALL_S", "ASSUMED_FLOPS", "as_json"]
