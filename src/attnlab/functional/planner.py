"""``attnlab.kernels.planner`` under its old name: this name is the same module object (a plan, a rule or a
constant read or patched here is the planner's own), kept so ``attnlab.functional.planner`` still imports."""
import sys

from ..kernels import planner

sys.modules[__name__] = planner
