"""attnlab experiment failure-modes: the tutorial's failure modes, trained side by side.

Arms: standard scaled dot-product softmax attention; no scaling; no softmax (weights = scaled scores,
unbounded and possibly negative); cosine similarity instead of the dot product (softmax over cosines,
temperature 1). Same model, data, seeds and budget (reports/failure-modes/ from the CLI).
"""
from __future__ import annotations

from dataclasses import dataclass

from .training import TrainingConfig, TrainingResult, run_training

__all__ = ["FailureModesConfig", "run", "ARMS", "INTRO"]

ARMS = [("standard", {"score": "softmax", "scale": "sqrt"}), ("no scaling", {"score": "softmax", "scale": "none"}),
        ("no softmax", {"score": "none", "scale": "sqrt"}), ("cosine", {"score": "cosine", "scale": "sqrt"})]
INTRO = ["Claims under test (tutorial): without softmax the weights are unbounded and possibly negative, which "
         "destabilises training; cosine similarity loses the magnitude information learned projections rely on; "
         "without scaling the softmax saturates. 'no softmax' uses the scaled scores (q·k/√d_k) directly as "
         "weights; 'cosine' is softmax over cos(q, k) (temperature 1, so logits lie in [-1, 1])."]


@dataclass
class FailureModesConfig(TrainingConfig):
    """``TrainingConfig`` of the failure-modes experiment; d_k None means 64 (quick: 16)."""


def run(config: FailureModesConfig, *, progress=None) -> TrainingResult:
    """Train every (task, d_k, arm, seed) of ARMS (standard, no scaling, no softmax, cosine) with the same
    model, data, seeds and budget; the result holds every run and a verdict per arm against "standard"
    (``TrainingResult.write`` makes the report). Raises ValueError for settings that cannot run."""
    return run_training(config, "failure-modes", ARMS, [16] if config.quick else [64], INTRO, baseline="standard",
                        progress=progress)
