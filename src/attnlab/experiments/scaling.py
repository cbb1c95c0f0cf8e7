"""attnlab experiment scaling: train small models with score scale 1/sqrt(d_k), 1 and 1/d_k at d_k 16, 64, 256.

The tutorial claims that without the 1/sqrt(d_k) scale the softmax saturates, gradients vanish and
training becomes unstable ("remove scaling and observe training instability"), and that 1/d_k makes
attention too uniform to focus. Each (task, d_k, scale, seed) is trained from the same init seed;
loss curves, gradient norms of W_Q/W_K and attention entropy are logged (reports/scaling/ from the CLI).
"""
from __future__ import annotations

from dataclasses import dataclass

from .training import TrainingConfig, TrainingResult, run_training

__all__ = ["ScalingConfig", "run", "ARMS", "INTRO"]

ARMS = [("1/sqrt(d_k)", {"scale": "sqrt"}), ("1 (no scaling)", {"scale": "none"}), ("1/d_k", {"scale": "dk"})]
INTRO = ["Claim under test (tutorial): without the 1/√d_k scale the softmax saturates, gradients vanish and "
         "training is unstable; with 1/d_k attention is too uniform to focus. Arms: score scale 1/√d_k "
         "(baseline), 1 and 1/d_k, everything else identical (same init seed per seed, same batches)."]


@dataclass
class ScalingConfig(TrainingConfig):
    """``TrainingConfig`` of the scaling experiment; d_k None means 16, 64, 256 (quick: 16, 64)."""


def run(config: ScalingConfig, *, progress=None) -> TrainingResult:
    """Train every (task, d_k, arm, seed) with score scale 1/√d_k (the baseline), 1 and 1/d_k, all else
    identical; the result holds loss curves, W_Q/W_K gradient norms and attention entropy per run, and
    a verdict per arm (``TrainingResult.write`` makes the report). ``progress``: a rich Progress (or
    ``attnlab.harness.NoProgress``). Raises ValueError for settings that cannot run."""
    d_ks = [16, 64] if config.quick else [16, 64, 256]
    return run_training(config, "scaling", ARMS, d_ks, INTRO, baseline="1/sqrt(d_k)", progress=progress)
