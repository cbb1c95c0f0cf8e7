"""``output_attentions=True`` on attn_implementation="attnlab" returns every layer's weights for each kind of
HF model, however the model passes the flag (Note [Weights asked for] in integrations/hf.py): BERT and Llama
through kwargs, GPT-2 as a named argument its model drops. Tiny random configs, no download; the oracle is
HF's own eager weights. And ``run_with_cache(gpt2, ids, mask)`` written as for MiniLM is one clear error."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_close

transformers = pytest.importorskip("transformers")
from attnlab import capture as C  # noqa: E402
from attnlab.integrations import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")

V, T = 53, 7


def _bert():
    return transformers.BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                   intermediate_size=37, max_position_embeddings=32), transformers.BertModel


def _gpt2():
    return transformers.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=3, n_positions=32, bos_token_id=0,
                                   eos_token_id=0), transformers.GPT2LMHeadModel


def _llama():  # grouped-query attention and rotary positions
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0), transformers.LlamaForCausalLM


@pytest.mark.parametrize("make", [_bert, _gpt2, _llama], ids=["bert", "gpt2", "llama"])
def test_output_attentions_match_eager(make):
    hf.register()
    cfg, cls = make()
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(1, V, (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: in a causal model these query rows see no key at all
    ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model.set_attn_implementation("attnlab")
    got = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert got is not None and len(got) == len(ref) == 2, f"{len(got or ())} layers of weights, want 2"
    real = mask.bool()  # rows of real query tokens; a row with no key left is 0 here, uniform in eager
    for layer, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape
        assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-6, what=f"layer {layer} weights")
    # without the flag, no weights are computed or returned
    assert not model(input_ids=ids, attention_mask=mask).attentions


def test_run_with_cache_positional_mask_on_gpt2_is_one_clear_error():
    hf.register()
    cfg, cls = _gpt2()
    model = cls._from_config(cfg, attn_implementation="attnlab").eval()
    ids, mask = torch.randint(0, V, (1, T)), torch.ones(1, T, dtype=torch.long)
    with pytest.raises(TypeError, match=r"second argument is 'cache'.*attention_mask=mask") as e:
        C.run_with_cache(model, ids, mask)
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="run_with_hooks"):
        C.run_with_hooks(model, ids, mask)
    _, cache = C.run_with_cache(model, ids, attention_mask=mask)  # by name: runs
    assert cache["blocks.1.attn.weights"].shape == (1, 3, T, T)


def test_run_with_cache_positional_mask_still_works_where_it_is_the_mask():
    hf.register()
    cfg, cls = _bert()
    model = cls._from_config(cfg, attn_implementation="attnlab").eval()
    ids, mask = torch.randint(0, V, (1, T)), torch.ones(1, T, dtype=torch.long)
    _, cache = C.run_with_cache(model, ids, mask)  # BertModel's second argument is attention_mask
    assert cache["blocks.0.attn.weights"].shape == (1, 3, T, T)


def test_show_takes_a_model_and_a_tokenizers_batch_encoding():
    """``viz.show(model, tokens, inputs=enc)`` with ``enc`` as a tokenizer returns it (a BatchEncoding: a
    Mapping, not a dict), on GPT-2 whose default attention returns no weights."""
    from attnlab import viz

    cfg, cls = _gpt2()
    model = cls._from_config(cfg).eval()
    enc = transformers.BatchEncoding({"input_ids": torch.randint(0, V, (1, T)),
                                      "attention_mask": torch.ones(1, T, dtype=torch.long)})
    page = viz.show(model, [f"t{i}" for i in range(T)], inputs=enc)
    assert (page.data["layers"], page.data["heads"], page.data["T"]) == (2, 3, T)
