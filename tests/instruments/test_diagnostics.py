"""attnlab.diagnostics and attnlab.capture against independent computations (autograd Jacobians,
torch.distributions, dense float64 weights)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close

import attnlab
from attnlab import diagnostics as dg
from attnlab import patterns as P
from attnlab.capture import capture


def test_entropy_max_weight_match_categorical():
    w = torch.softmax(torch.randn(3, 7, 11, dtype=torch.float64), -1)
    assert_close(dg.entropy(w), torch.distributions.Categorical(probs=w).entropy(), 1e-12, what="entropy")
    assert_close(dg.max_weight(w), w.max(-1).values, 0, what="max weight")
    assert float(dg.entropy(torch.full((5,), 0.2))) == pytest.approx(math.log(5))
    assert float(dg.entropy(torch.tensor([0.0, 1.0, 0.0]))) == 0.0
    assert dg.saturated_fraction(torch.tensor([[0.995, 0.005], [0.5, 0.5]])) == 0.5


def test_jacobian_norm_closed_form_equals_autograd():
    x = torch.randn(4, 9, dtype=torch.float64)
    p = torch.softmax(x, -1)
    for r in range(4):
        J = torch.autograd.functional.jacobian(lambda z: torch.softmax(z, -1), x[r])
        assert_close(dg.softmax_jacobian(p)[r], J, 1e-12, what="Jacobian")
        assert float(dg.jacobian_norm(p)[r]) == pytest.approx(float(J.norm()), abs=1e-12)


def test_score_grad_norm_equals_jacobian_times_upstream():
    s = torch.randn(2, 5, 6, dtype=torch.float64)
    v = torch.randn(2, 6, 3, dtype=torch.float64)
    g = torch.randn(2, 5, 3, dtype=torch.float64)
    p = torch.softmax(s, -1)
    # ∂L/∂s_row = J_rowᵀ (V g_row), J symmetric
    manual = torch.einsum("blij,blj->bli", dg.softmax_jacobian(p), torch.einsum("bsd,bld->bls", v, g)).norm(dim=-1)
    assert_close(dg.score_grad_norm(s, v, g), manual, 1e-12, what="grad norm")
    with pytest.raises(ValueError, match="disagree on S"):
        dg.score_grad_norm(s, v[:, :4])


def test_score_variance_grows_with_dk_and_sqrt_restores_one():
    for d_k in (4, 64, 512):
        r = dg.score_variance(d_k, n=8192, seed=1)
        assert 0.85 * d_k < r["unscaled"] < 1.15 * d_k
        assert 0.85 < r["sqrt"] < 1.15
        assert r["dk"] == pytest.approx(r["unscaled"] / d_k**2)
    with pytest.raises(ValueError, match="scale must be one of"):
        dg.scale_value("half", 4)


def test_scale_sweep_shows_saturation_and_vanishing_gradient():
    rows = dg.scale_sweep(d_ks=(4, 512), seq_len=32)
    by = {(r.d_k, r.scale): r for r in rows}
    assert by[(512, "none")].mean_max_weight > 0.8 > by[(512, "sqrt")].mean_max_weight
    assert by[(512, "none")].mean_grad_norm < by[(512, "sqrt")].mean_grad_norm
    assert by[(512, "dk")].mean_entropy > by[(512, "sqrt")].mean_entropy  # too flat
    assert by[(512, "dk")].mean_entropy <= by[(512, "dk")].max_entropy + 1e-12


@pytest.fixture
def one_thread():
    """Many small block matmuls: on a shared 2-core machine extra intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_streaming_summary_at_32k_tokens_matches_dense_rows(one_thread):
    L, E, w = 32768, 8, 32
    q = torch.randn(1, L, E)
    k = torch.randn(1, L, E)
    pat = P.sliding_window(w)
    s = dg.streaming_summary(q, k, pattern=pat, k=3, block_size=128)
    assert s.entropy.shape == (1, L) and s.topk_indices.shape == (1, L, 3)
    rows = torch.tensor([0, 5, 17000, L - 1])
    j = torch.arange(L)
    scores = (q[0, rows].double() @ k[0].double().T) / math.sqrt(E)  # (4, L) only these rows
    keep = (j.unsqueeze(0) - rows.unsqueeze(1)).abs() <= w
    ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    assert_close(s.entropy[0, rows], dg.entropy(ref), 2e-4, what="entropy")
    assert_close(s.max_weight[0, rows], ref.max(-1).values, 2e-5, what="max weight")
    assert_close(s.sink_mass[0, rows], ref[:, 0], 2e-5, what="sink mass")
    assert set(s.topk_indices[0, 17000].tolist()) == set(ref[2].topk(3).indices.tolist())
    ph = s.per_head()[0]
    assert 0 < ph["mean_distance"] <= w


def _mha():
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(0)
    return MultiHeadAttention(16, 4)


def test_capture_weights_equal_forward_weights_and_restore_module():
    mha = _mha()
    x = torch.randn(2, 7, 16)
    model = torch.nn.Sequential(mha)
    with capture(model) as cap:
        out, none = mha(x)  # caller did not ask for weights
    assert none is None
    assert "forward_intermediates" not in mha.__dict__  # hooks removed
    _, w = mha(x, need_weights=True, average_attn_weights=False)
    (got,) = cap.weights()
    assert_close(got, w, 1e-6, what="captured weights")
    # an independent oracle: q, k from the projections, float64 reference
    q = mha.q_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    k = mha.k_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    _, ref = attnlab.reference.attention(q, k, k)
    assert_close(got, ref, 1e-5, what="captured weights vs reference")
    assert cap.names == ["0"]


def test_capture_summary_mode_with_key_padding():
    mha = _mha()
    x = torch.randn(2, 9, 16)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True  # last three keys of sequence 1 are padding
    with capture(mha, mode="summary") as cap:
        mha(x, key_padding_mask=kpm)
    (per_batch,) = cap.summaries()
    _, w = mha(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)  # (2, 4, 9, 9)
    for b in range(2):
        assert_close(per_batch[b].entropy, dg.entropy(w[b]), 2e-5, what=f"entropy batch {b}")
        assert_close(per_batch[b].max_weight, w[b].amax(-1), 2e-6, what=f"max weight batch {b}")
    with pytest.raises(ValueError, match="summary mode"):
        cap.weights()


def test_capture_refuses_bad_targets():
    with pytest.raises(ValueError, match="contains no attention module to capture: neither an attnlab.nn.MultiHeadAttention"):
        with capture(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(TypeError):
        with capture("model"):
            pass
    with pytest.raises(ValueError, match="mode must be"):
        with capture(_mha(), mode="all"):
            pass
