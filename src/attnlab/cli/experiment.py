"""attnlab experiment NAME: experiments that write reports/<name>/ (report.md, results.json, PNGs)."""
from __future__ import annotations

from ._suites import add_suites, run_suite

SUITES = {
    "variance": ("attnlab.experiments.variance", "Var(q·k) vs d_k for scalings 1, 1/sqrt(d_k), 1/d_k"),
    "scaling": ("attnlab.experiments.scaling", "training with and without the sqrt(d_k) scale"),
    "failure-modes": ("attnlab.experiments.failure_modes", "no softmax, cosine similarity, no scaling"),
    "long-range": ("attnlab.experiments.long_range", "ListOps, associative recall, selective copy"),
    "approximation": ("attnlab.experiments.approximation", "approximation error vs budget vs speed"),
}


def build_parser(parser):
    add_suites(parser, SUITES, "name")


def run(args):
    return run_suite(args)
