"""Pattern constructors refuse bad arguments at construction, naming the argument, the value and the range;
mask_mods that read h or return something other than a bool tensor are refused by name; dead keys and
sliced_keys against the materialised mask."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from attnlab import patterns as P
from attnlab import viz

BAD = {
    "bigbird seed 2**70": (lambda: P.bigbird(4, seed=2**70), ValueError, r"seed must be <= 18446744073709551615 "
                                                                          r"\(an int in \[0, 18446744073709551615\]"),
    "bigbird seed -1": (lambda: P.bigbird(4, seed=-1), ValueError, r"seed must be >= 0"),
    "longformer 2**62 globals": (lambda: P.longformer(3, 2**62), ValueError, r"global_tokens must be <= 4096.*got 4611686018427387904"),
    "longformer global position 10**30": (lambda: P.longformer(3, [1, 10**30]), ValueError, r"global_tokens\[1\] must be <= 2\*\*62"),
    "key_padding 10**30": (lambda: P.key_padding([10**30]), ValueError, r"lengths\[0\] must be <= 2\*\*62 \(an int in \[0, 2\*\*62\].*1e\+30"),
    "key_padding tensor int64 max": (lambda: P.key_padding(torch.tensor([3, 2**63 - 1])), ValueError, r"lengths\[1\] must be <= 2\*\*62"),
    "key_padding float": (lambda: P.key_padding([2.5]), ValueError, r"lengths\[0\] is 2.5"),
    "key_padding max_len short": (lambda: P.key_padding([3, 9], max_len=5), ValueError, r"max_len=5 is shorter"),
    "dilated 2**62 x 2**62": (lambda: P.dilated(2**62, 2**62), ValueError, r"window \* dilation .* must be <= 2\*\*62"),
    "document causal='yes'": (lambda: P.document([16], causal="yes"), TypeError, r"causal must be a bool.*'yes'"),
    "document lengths overflow": (lambda: P.document([2**62, 2**62]), ValueError, r"lengths must add up to at most 2\*\*62"),
    "sliding_window causal=1": (lambda: P.sliding_window(3, causal=1), TypeError, r"causal must be a bool"),
    "fixed causal='no'": (lambda: P.fixed(4, 1, causal="no"), TypeError, r"causal must be a bool"),
    "strided causal=None": (lambda: P.strided(4, causal=None), TypeError, r"causal must be a bool"),
    "mask_mod None": (lambda: P.from_mask_mod(lambda b, h, q, k: None), TypeError, r"mask_mod <lambda> must return a bool tensor.*NoneType"),
    "mask_mod meta": (lambda: P.from_mask_mod(lambda b, h, q, k: torch.empty(1, 1, dtype=torch.bool, device="meta")),
                      TypeError, r"mask_mod <lambda> returned a meta tensor"),
    "mask_mod reads h": (lambda: P.from_mask_mod(lambda b, h, q, k: (q >= k) & (h == 0)), ValueError,
                         r"mask_mod <lambda> reads h .*per-head bool attn_mask"),
    "viz.show zero heads": (lambda: viz.show(torch.zeros(0, 3, 3), ["a", "b", "c"]), ValueError, r"no heads.*\[0, 3, 3\]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_name_the_argument_value_and_range(name):
    fn, err, match = BAD[name]
    with pytest.raises(err, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_key_padding_longer_than_S_is_refused_at_the_call():
    import attnlab

    pat = P.key_padding([3, 9])
    x = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9 is longer than the attention's key length S=8"):
        attnlab.attention(x, torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8), pattern=pat)
    assert pat.materialize(4, 9).shape == (2, 1, 4, 9)  # S = 9 fits
    assert P.key_padding([2**40]).batch_size == 1  # stored as lengths: no [1, 2**40] mask is built


def test_mask_mod_that_reads_h_only_on_some_rows_is_refused_when_evaluated():
    def fn(b, h, q, k):
        return torch.where(q > 2, q >= k + h, q >= k) if q.numel() > 1 else q >= k

    pat = P.from_mask_mod(fn, name="late_h")  # the 1 x 1 check does not reach h
    with pytest.raises(ValueError, match="mask_mod late_h reads h"):
        pat.materialize(8, 8)


def test_mask_mod_indices_are_int64():
    seen = []
    pat = P.from_mask_mod(lambda b, h, q, k: seen.append((q.dtype, k.dtype)) or q >= k)
    pat.block_layout(40, 40, 8)
    pat.materialize(5, 5)
    assert set(seen) == {(torch.int64, torch.int64)}


from test_patterns_api import sized_pattern  # noqa: E402  (the hypothesis strategy of every pattern kind)


@settings(max_examples=150, deadline=None)
@given(sized_pattern())
def test_dead_keys_equal_the_materialised_mask(prob):
    L, S, pat = prob
    m = pat.materialize(L, S).view(-1, L, S)
    want = ~m.any(-2)  # (B|1, S)
    got = pat.dead_keys(L, S)
    assert got.dtype == torch.bool and got.shape[-1] == S
    assert torch.equal(torch.broadcast_to(got, want.shape), want), (pat, L, S)


@settings(max_examples=80, deadline=None)
@given(sized_pattern())
def test_sliced_keys_is_a_column_slice(prob):
    L, S, pat = prob
    for start, stop in ((0, S), (S // 3, S), (0, S - S // 4), (S // 4, S - S // 3)):
        if stop <= start:
            continue
        sl = P.sliced_keys(pat, start, S)
        want = pat.materialize(L, S)[..., start:stop]
        assert torch.equal(sl.materialize(L, stop - start), want), (pat, start, stop)
        assert torch.equal(sl.dead_keys(L, stop - start), pat.dead_keys(L, S)[:, start:stop])
        for b in (1, 3, 4):
            lay = sl.block_layout(L, stop - start, b)
            dense = torch.nn.functional.pad(want.reshape(-1, L, stop - start), (0, -(stop - start) % b, 0, -L % b))
            blocks = dense.view(dense.shape[0], -(-L // b), b, -1, b)
            any_ = blocks.any(4).any(2).any(0)
            assert not bool(((lay == P.EMPTY) & any_).any()), (pat, start, stop, b)  # EMPTY is truly empty
