"""attnlab experiment scaling: train small models with score scale 1/sqrt(d_k), 1 and 1/d_k at d_k 16, 64, 256.

The tutorial claims that without the 1/sqrt(d_k) scale the softmax saturates, gradients vanish and
training becomes unstable ("remove scaling and observe training instability"), and that 1/d_k makes
attention too uniform to focus. Each (task, d_k, scale, seed) is trained from the same init seed;
loss curves, gradient norms of W_Q/W_K and attention entropy are logged. Writes reports/scaling/.
"""
from __future__ import annotations

from . import _common as C

__all__ = ["build_parser", "run", "ARMS"]

ARMS = [("1/sqrt(d_k)", {"scale": "sqrt"}), ("1 (no scaling)", {"scale": "none"}), ("1/d_k", {"scale": "dk"})]


def build_parser(p):
    """Add the training experiments' options and --d-k (comma-separated head dims) to the argparse
    parser ``p``."""
    C.add_training_args(p)
    p.add_argument("--d-k", default=None, help="comma-separated head dims (default 16,64,256; quick 16,64)")


def run(args):
    """Train every (task, d_k, arm, seed) with score scale 1/√d_k (the baseline), 1 and 1/d_k, all else
    identical, and return the experiment's result dict (loss curves, W_Q/W_K gradient norms, attention
    entropy); writes report.md, results.json and the curves to --out (default reports/scaling). See
    ``experiments._common.training_experiment``."""
    d_ks = C.ints_of(args.d_k, "--d-k") if args.d_k else ([16, 64] if args.quick else [16, 64, 256])
    intro = ["Claim under test (tutorial): without the 1/√d_k scale the softmax saturates, gradients vanish and "
             "training is unstable; with 1/d_k attention is too uniform to focus. Arms: score scale 1/√d_k "
             "(baseline), 1 and 1/d_k, everything else identical (same init seed per seed, same batches)."]
    return C.training_experiment(args, "scaling", ARMS, d_ks, intro, baseline="1/sqrt(d_k)")
