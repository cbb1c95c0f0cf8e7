"""Experiments that put the tutorials' claims to the test, as a library.

Each experiment module exposes ``run(config, *, progress=None) -> result``: a config dataclass in, a
result dataclass out, whose ``write(out)`` makes the report (results.json, report.md, report.html,
plots) through ``attnlab.harness``. Nothing here parses arguments or prints; ``attnlab experiment NAME``
(``attnlab.cli.experiment``) does that.

- ``variance``: Var(q·k) against d_k for the scales 1, 1/√d_k, 1/d_k (random and MiniLM's q, k).
- ``scaling``, ``failure_modes``: small models trained with and without the scale, softmax, dot product.
- ``long_range``: every attention mechanism on ListOps, associative recall and selective copy.
- ``approximation``: each approximation's error against exact attention, its speed, the frontier.

Shared parts: ``model`` (``attnlab.nn``'s encoder layers with the experiments' switches), ``attention``
(a name -> what ``MultiHeadAttention`` takes), ``tasks`` (the training data), ``training`` (runs,
checkpoints, summaries).
"""
