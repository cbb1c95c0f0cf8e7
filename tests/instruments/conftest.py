"""Fixtures shared by the instruments' tests."""
import pytest

from attnlab import retrieval as R


@pytest.fixture(scope="module")
def corpus():
    """The generated 48-document retrieval corpus (seed 0) that the hashing and MiniLM retrieval tests share."""
    return R.generate_corpus(48, seed=0)
