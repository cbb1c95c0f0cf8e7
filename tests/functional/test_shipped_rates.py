"""Note [Shipped rate tables] and Note [Plan the pass that runs]: a fresh install plans with its CPU class's shipped
table (or the nearest recorded class's, said so), a calibration refines it, and a call whose inputs require grad
is planned by the forward + backward threshold. Plans differ only in the kernel chosen: results agree within the
kernels' rounding (the float64 reference's budget)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import cpu, reference
from attnlab.functional import calibration, plancache
from attnlab.kernels import compiled, rates
from helpers import FUSED_ERROR_FACTOR, max_err

needs_ext = pytest.mark.skipif(not compiled.available(), reason=f"compiled kernel: {compiled.unavailable_reason()}")


def _table(where, cls: dict, fwd_pairs, train_pairs) -> None:
    """A shipped table for class ``cls``: the built-in rates, with measured fp32 forward / training thresholds."""
    r = rates.builtin()
    r = rates.Rates(r.sparse_block_speed, r.compiled_block_speed, (), r.sparse_over_compiled, "test",
                    compiled_dense_min_pairs={(torch.float32, c): fwd_pairs for c in (False, True)},
                    compiled_train_min_pairs={(torch.float32, c): train_pairs for c in (False, True)})
    doc = {"format": rates.FORMAT, "class": cls, "threads": 2, "created": "2026-12-04", "rates": rates.as_json(r)}
    (where / f"{cls['key']}.json").write_text(json.dumps(doc))


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    tables = tmp_path / "tables"
    tables.mkdir()
    monkeypatch.setenv("ATTNLAB_CALIBRATION", "on")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rates, "TABLES", tables)
    monkeypatch.setattr(calibration, "_BACKGROUND", None)
    monkeypatch.setattr(calibration, "_calibrate_in_background", lambda: rates.builtin())
    rates.reload()
    yield tables
    monkeypatch.undo()
    rates.reload()


def _cls(key_flags, vendor="V", family=1, model=2):
    c = {"vendor": vendor, "family": family, "model": model, "flags": list(key_flags)}
    c["key"] = cpu.class_key(c)
    return c


def test_nearest_class_takes_the_same_build_and_the_most_shared_flags():
    mine = _cls(["avx512_bf16", "avx512f", "avx2"])
    amx = _cls(["amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"], model=3)
    plain512 = _cls(["avx512f", "avx2"], model=4)
    avx2 = _cls(["avx2"], model=5)
    tables = {c["key"]: {"class": c} for c in (amx, plain512, avx2)}
    assert rates.nearest_class(mine, tables) == amx["key"]  # shares avx512_bf16 too
    assert rates.nearest_class(avx2 | {"key": "mine"}, tables) == avx2["key"]
    assert rates.nearest_class(_cls([]), {k: v for k, v in tables.items() if k != avx2["key"]}) is None
    assert rates.nearest_class(amx, tables) == amx["key"]  # its own


def test_a_fresh_install_plans_with_its_class_table_and_does_not_calibrate(shipped_dir):
    _table(shipped_dir, cpu.cpu_class(), 0.0, 0.0)
    rates.reload()
    assert rates.current().source.startswith("shipped table for this CPU class")
    assert calibration.note_call(100.0) is None  # this class's table needs no background calibration
    q = torch.randn(1, 2, 64, 16)
    assert "shipped table for this CPU class" in str(attnlab.explain(q, q, q))


def test_another_class_table_is_named_and_refined(shipped_dir):
    other = cpu.cpu_class()
    other = dict(other, model=(other["model"] or 0) + 1000)
    other["key"] = cpu.class_key(other)
    _table(shipped_dir, other, 0.0, 0.0)
    rates.reload()
    src = rates.current().source
    assert src.startswith("shipped table of the nearest recorded class") and other["key"] in src
    t = calibration.note_call(100.0)  # another class's table: the background calibration refines it
    assert t is not None
    t.join(30)


@needs_ext
@pytest.mark.parametrize("fwd,train", [(0.0, None), (None, 0.0)])
def test_a_call_that_will_run_a_backward_is_planned_by_the_training_threshold(shipped_dir, fwd, train):
    _table(shipped_dir, cpu.cpu_class(), fwd, train)
    rates.reload()
    plancache.clear()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 96, 32, generator=g) for _ in range(3))
    infer = attnlab.explain(q, k, v).kernel.name
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    train = attnlab.explain(qg, kg, vg).kernel.name
    assert (infer, train) == (("compiled", "sdpa") if fwd == 0.0 else ("sdpa", "compiled"))
    out = attnlab.attention(qg, kg, vg)
    out.sum().backward()
    ref = torch.as_tensor(reference.attention(q.double(), k.double(), v.double())[0])
    naive = torch.softmax(q @ k.transpose(-2, -1) / 32 ** 0.5, -1) @ v
    assert max_err(out, ref) <= FUSED_ERROR_FACTOR * max_err(naive, ref) + 1e-6
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qd, kd, vd).sum().backward()
    qn, kn, vn = (x.clone().requires_grad_() for x in (q, k, v))  # the naive fp32 gradients: the budget
    (torch.softmax(qn @ kn.transpose(-2, -1) / 32 ** 0.5, -1) @ vn).sum().backward()
    for got, naive_g, ref_g in ((qg.grad, qn.grad, qd.grad), (kg.grad, kn.grad, kd.grad), (vg.grad, vn.grad, vd.grad)):
        assert max_err(got, ref_g) <= 8 * max_err(naive_g, ref_g) + 1e-6


def test_every_shipped_table_loads_and_this_class_plans_alike():
    """The tables shipped in the package parse, name their class, and, where this CPU's class has one, the plans
    it makes give the same results as the built-in table's, within the chosen kernels' rounding (a plan and its
    rates change only the kernel chosen)."""
    tables = rates.shipped_tables(Path(rates.__file__).parent / "tables")  # the package's (conftest hides them)
    for key, doc in tables.items():
        assert doc["class"]["key"] == key and doc["format"] == rates.FORMAT
        r = rates._from_json(doc, Path(doc["_path"]), source="test")
        assert r.compiled_dense_min_pairs and r.kernel_gflops
    mine = cpu.cpu_class()["key"]
    if mine not in tables:
        pytest.skip(f"no shipped table for this CPU class ({mine})")
    before = rates.current()
    table = rates._from_json(tables[mine], Path(tables[mine]["_path"]), source="test: this class's shipped table")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for n in (64, 512, 2048):
            q, k, v = (torch.randn(1, 8, n, 64, generator=g).to(dt) for _ in range(3))
            for causal in (False, True):
                ref = torch.as_tensor(reference.attention(q.double(), k.double(), v.double(), is_causal=causal)[0])
                s_ = (q.float() @ k.float().transpose(-2, -1)) / 8
                if causal:
                    s_ = s_.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
                naive = torch.softmax(s_, -1).to(dt).float() @ v.float()
                budget = FUSED_ERROR_FACTOR * max_err(naive, ref) + (1e-6 if dt == torch.float32 else 4e-3)
                outs = []
                for r in (rates.builtin(), table):
                    rates.make_current(r)
                    with torch.no_grad():
                        outs.append(attnlab.attention(q, k, v, is_causal=causal))
                rates.make_current(before)
                assert all(max_err(o, ref) <= budget for o in outs), (dt, n, causal, [max_err(o, ref) for o in outs])
