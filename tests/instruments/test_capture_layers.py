"""attnlab.capture beyond attention: residual-stream and MLP points of attnlab blocks (checked against a
hand-run of the layers), and patch_sweep over layers × heads (× positions) against patch_heads cell by cell,
drawn by viz.plot_patch_sweep as valid PNG and SVG."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import assert_close

from attnlab import capture as C
from attnlab import viz
from attnlab.nn import Encoder

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")

B, T, E, H = 2, 5, 12, 3


@pytest.fixture(params=[True, False], ids=["pre-norm", "post-norm"])
def enc(request):
    torch.manual_seed(0)
    return Encoder(E, H, 2, d_ff=17, norm_first=request.param).eval()


def _x(seed=1):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


def test_layer_points_are_the_residual_stream_and_the_mlp_output(enc):
    x = _x()
    out, cache = C.run_with_cache(enc, x)
    h = x
    for i, layer in enumerate(enc.layers):  # the oracle: the layers run by hand
        # layer 0 sees x itself; later layers agree to float32 rounding of the hand-run (kernels differ)
        assert_close(cache[f"layers.{i}.resid_pre"], h, atol=0 if i == 0 else 1e-6, what=f"resid_pre {i}")
        n = layer.norm1(h) if layer.norm_first else h
        a = layer.self_attn(n, n, n, need_weights=False)[0]
        mid = h + a if layer.norm_first else layer.norm1(h + a)
        f = layer.ffn(layer.norm2(mid) if layer.norm_first else mid)
        assert_close(cache[f"layers.{i}.mlp_out"], f, atol=1e-6, what=f"mlp_out {i}")
        h = mid + f if layer.norm_first else layer.norm2(mid + f)
        assert_close(cache[f"layers.{i}.resid_post"], h, atol=1e-6, what=f"resid_post {i}")
    assert_close(out, enc.norm(h) if enc.norm is not None else h, atol=1e-6, what="output")
    assert "blocks.1.attn.z" in cache  # attention points are cached alongside


def test_layer_points_can_be_replaced(enc):
    x = _x()
    base = enc(x)
    # zeroing layer 1's MLP output equals the model run with that FFN's last linear zeroed
    zeroed = C.run_with_hooks(enc, x, fwd_hooks=[("layers.1.mlp_out", lambda t, ctx: torch.zeros_like(t))])
    import copy

    m2 = copy.deepcopy(enc)
    torch.nn.init.zeros_(m2.layers[1].ffn.linear2.weight)
    torch.nn.init.zeros_(m2.layers[1].ffn.linear2.bias)
    assert_close(zeroed, m2(x), atol=1e-6, what="zeroed mlp")
    assert float((zeroed - base).abs().max()) > 1e-3
    # patching layer 1's resid_pre with another input's: layer 0 no longer matters
    _, other = C.run_with_cache(enc, _x(2), names=["layers.1.resid_pre"])
    patched = C.run_with_hooks(enc, x, fwd_hooks=[("layers.1.resid_pre", lambda t, ctx: other["layers.1.resid_pre"])])
    assert_close(patched, enc(_x(2)), atol=1e-6, what="patched residual stream")
    # resid_post of the last block replaced by its own value is the identity
    same = C.run_with_hooks(enc, x, fwd_hooks=[("layers.1.resid_post", lambda t, ctx: t.clone())])
    assert_close(same, base, atol=0, what="identity")
    with pytest.raises(ValueError, match="same shape"):
        C.run_with_hooks(enc, x, fwd_hooks=[("layers.0.mlp_out", lambda t, ctx: t[:, :1])])
    with pytest.raises(ValueError, match=r"2 blocks \(layers.0 .. layers.1\)"):
        C.run_with_cache(enc, x, names=["layers.2.resid_pre"])
    with pytest.raises(ValueError, match="kind in resid_pre, mlp_out, resid_post"):
        C.run_with_cache(enc, x, names=["layers.0.mlp"])
    with pytest.raises(KeyError, match="was not cached"):
        C.run_with_cache(enc, x, names=["layers.0.mlp_out"])[1]["layers.0.resid_pre"]


def test_patch_sweep_matches_patch_heads_per_cell(enc, tmp_path):
    clean, corrupt = _x(1), _x(3)
    _, src = C.run_with_cache(enc, clean, names=[f"blocks.{i}.attn.z" for i in range(2)])
    metric = lambda out: out[:, -1].sum()  # noqa: E731
    sweep = C.patch_sweep(enc, corrupt, src, metric)
    assert sweep.shape == (2, H) and sweep.dtype == torch.float64
    for li in range(2):
        for h in range(H):
            with C.patch_heads(enc, li, [h], src):
                assert sweep[li, h] == pytest.approx(float(metric(enc(corrupt))), abs=1e-6)
    pos = C.patch_sweep(enc, corrupt, src, metric, layers=[1], heads=[0, 2], positions=True)
    assert pos.shape == (1, 2, T)
    # patching one position at a time: position t of head h changes only outputs it reaches; with every
    # position patched (one at a time) the cell at the last position moves the last-token metric most
    base = float(metric(enc(corrupt)))
    assert (pos[0, :, :-1] - base).abs().max() < (pos[0, :, -1] - base).abs().max() + 1e-9
    with pytest.raises(ValueError, match="head 5 out of range"):
        C.patch_sweep(enc, corrupt, src, metric, heads=[5])
    for suffix in ("png", "svg"):
        p = viz.plot_patch_sweep(sweep, tmp_path / f"s.{suffix}", baseline=base, metric="last-token sum")
        data = p.read_bytes()
        if suffix == "png":
            import matplotlib.image as mpimg

            assert data[:8] == b"\x89PNG\r\n\x1a\n" and mpimg.imread(p).ndim == 3
        else:
            assert ET.fromstring(data).tag.endswith("svg")
    viz.plot_patch_sweep(pos, tmp_path / "pos.png", tokens=[f"t{i}" for i in range(T)], layers=[1], heads=[0, 2])
