"""Deprecated alias of ``attnlab.cli.options`` (argparse types) and ``attnlab.resources`` (memory budget,
output folders), kept so that ``from attnlab.options import positive_int`` goes on working."""
from .cli.options import *  # noqa: F401,F403
from .cli.options import __all__  # noqa: F401
