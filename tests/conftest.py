import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(1) if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
