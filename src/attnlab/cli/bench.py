"""attnlab bench SUITE: benchmarks measured side by side with PyTorch in one run (JSON + plots)."""
from __future__ import annotations

from ._suites import add_suites, run_suite

SUITES = {
    "core": ("attnlab.cli.bench_core", "tiled / sparse / auto vs torch SDPA vs naive: time and peak memory"),
    "all": ("attnlab.cli.bench_all", "every mechanism and pattern x sequence length, fitted exponents"),
    "minilm": ("attnlab.cli.bench_minilm", "MiniLM encode throughput: attnlab vs transformers"),
    "generate": ("attnlab.cli.bench_generate", "TransformerLM generation with vs without KV cache"),
    "decode": ("attnlab.cli.bench_decode", "decode vs SDPA enable_gqa against the measured read bandwidth (targets for a quiet machine)"),
    "ring": ("attnlab.cli.bench_ring", "ring attention: per-rank memory and time vs one process"),
    "layers": ("attnlab.cli.bench_layers", "self-attention vs recurrence vs convolution (Vaswani et al. Table 1)"),
    "kernels": ("attnlab.cli.bench_kernels", "attnlab's kernels vs SDPA and compiled FlexAttention, against their targets"),
    "planner": ("attnlab.cli.bench_planner", "method=auto against the fastest kernel over 66 configurations"),
}


def build_parser(parser):
    """One sub-command per suite of ``SUITES``, each with the options of its ``cli/bench_*.py`` face."""
    add_suites(parser, SUITES, "suite")


def run(args):
    """Run the chosen suite's CLI face; returns the suite's result (its ``exit_code`` is the exit status)."""
    return run_suite(args)
