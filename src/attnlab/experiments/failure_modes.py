"""attnlab experiment failure-modes: the tutorial's failure modes, trained side by side.

Arms: standard scaled dot-product softmax attention; no scaling; no softmax (weights = scaled scores,
unbounded and possibly negative); cosine similarity instead of the dot product (softmax over cosines,
temperature 1). Same model, data, seeds and budget. Writes reports/failure-modes/.
"""
from __future__ import annotations

from . import _common as C

__all__ = ["build_parser", "run", "ARMS"]

ARMS = [("standard", {"score": "softmax", "scale": "sqrt"}), ("no scaling", {"score": "softmax", "scale": "none"}),
        ("no softmax", {"score": "none", "scale": "sqrt"}), ("cosine", {"score": "cosine", "scale": "sqrt"})]


def build_parser(p):
    """Add the training experiments' options and --d-k (comma-separated head dims) to the argparse
    parser ``p``."""
    C.add_training_args(p)
    p.add_argument("--d-k", default=None, help="comma-separated head dims (default 64; quick 16)")


def run(args):
    """Train every (task, d_k, arm, seed) of ARMS (standard, no scaling, no softmax, cosine) with the same
    model, data, seeds and budget, and return the experiment's result dict; writes report.md,
    results.json and the curves to --out (default reports/failure-modes). See
    ``experiments._common.training_experiment``."""
    d_ks = C.ints_of(args.d_k, "--d-k") if args.d_k else ([16] if args.quick else [64])
    intro = ["Claims under test (tutorial): without softmax the weights are unbounded and possibly negative, which "
             "destabilises training; cosine similarity loses the magnitude information learned projections rely on; "
             "without scaling the softmax saturates. 'no softmax' uses the scaled scores (q·k/√d_k) directly as "
             "weights; 'cosine' is softmax over cos(q, k) (temperature 1, so logits lie in [-1, 1])."]
    return C.training_experiment(args, "failure-modes", ARMS, d_ks, intro, baseline="standard")
