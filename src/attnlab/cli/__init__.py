"""The attnlab command line: a thin client over the library.

``main.py`` is the entry and the error boundary; each subcommand module has ``build_parser(parser)``
and ``run(args)``, which turns the options into the library's config, calls it (``run_trace``,
``run_viz``, ``run_heads``, ``run_retrieve``, ``run_tour``, ...) and renders the result. What the
modules share (the usage error, parser classes, showing or writing output) is in ``common.py``,
argparse types in ``options.py``; no module here imports ``main``.
"""
