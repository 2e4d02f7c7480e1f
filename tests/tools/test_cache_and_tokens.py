"""run_with_cache, to_str_tokens, test_prompt and readable top tokens, against plain hooks and a plain forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config

from nnterp import StandardizedTransformer, ValueUnavailable, top_tokens, visible
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "the dog sat"]  # two lengths: the batch is padded
# family -> (attention module, MLP module, activation module), relative to a block: written from the HF code
MODULES = {"gpt2": ("attn", "mlp", "mlp.act"), "llama": ("self_attn", "mlp", "mlp.act_fn"),
           "gptj": ("attn", "mlp", "mlp.act")}


def tiny(model_type, eager=False):
    config = BY_MODEL_TYPE[model_type].tiny_config()
    if eager:
        config._attn_implementation = "eager"
    return StandardizedTransformer(build_tiny(config), tokenizer=tiny_tokenizer())


def first(x):
    return (x[0] if isinstance(x, tuple) else x).detach().clone()


def hooked(model, inputs, model_type):
    """Ground truth: plain forward hooks on the unwrapped HF model. ``{(name, layer): tensor}``, logits."""
    attention, mlp, act = MODULES[model_type]
    found, handles = {}, []

    def keep(name, layer, pre=False):
        if pre:
            return lambda m, args, kwargs: found.__setitem__(
                (name, layer), first(args[0] if args else kwargs["hidden_states"]))
        return lambda m, args, out: found.__setitem__((name, layer), first(out))

    for i, block in enumerate(model.layers._module):
        handles.append(block.register_forward_pre_hook(keep("layer_input", i, pre=True), with_kwargs=True))
        handles.append(block.register_forward_hook(keep("layer_output", i)))
        handles.append(block.get_submodule(attention).register_forward_hook(keep("attention_output", i)))
        handles.append(block.get_submodule(mlp).register_forward_hook(keep("mlp_output", i)))
        handles.append(block.get_submodule(act).register_forward_hook(keep("mlp_activation", i)))
    positions = (inputs.attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
    try:
        with torch.no_grad():
            logits = model._module(**inputs, position_ids=positions).logits
    finally:
        for handle in handles:
            handle.remove()
    return found, logits


@pytest.mark.parametrize("model_type", list(MODULES))
def test_run_with_cache_equals_hooks(model_type):
    model = tiny(model_type)
    inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    truth, truth_logits = hooked(model, inputs, model_type)
    logits, cache = model.run_with_cache(PROMPTS)
    assert torch.equal(cache.input_ids, inputs.input_ids) and torch.equal(cache.attention_mask, inputs.attention_mask)
    assert torch.allclose(logits, truth_logits, atol=1e-6)
    for (name, layer), expected in truth.items():
        assert torch.allclose(cache[name, layer], expected, atol=1e-6), (name, layer)
    last = model.num_layers - 1
    assert torch.equal(cache["layer_output", -1], cache["layer_output", last])
    stacked = cache["mlp.mlp_output"]  # the owner's prefix is accepted
    assert stacked.shape == (model.num_layers, *truth["mlp_output", 0].shape)
    assert torch.allclose(stacked, torch.stack([truth["mlp_output", i] for i in range(model.num_layers)]), atol=1e-6)


def test_a_value_a_parallel_block_lacks_is_unavailable_with_its_reason():
    gptj = tiny("gptj")
    _, cache = gptj.run_with_cache(PROMPTS[0])
    assert ("layer_mid", 0) not in cache and ("layer_output", 0) in cache
    with pytest.raises(ValueUnavailable, match="parallel"):
        cache["layer_mid", 0]
    with pytest.raises(ValueUnavailable, match="parallel"):
        cache["layer_mid"]
    with pytest.raises(ValueUnavailable, match="attention_values=True"):  # off: the engine's reason
        cache["attention_probabilities", 0]
    with pytest.raises(ValueUnavailable, match="parallel"):  # asked for by name: refused before running
        gptj.run_with_cache(PROMPTS[0], names=["layer_output", "layer_mid"])


def test_cached_attention_probabilities_are_the_eager_weights():
    llama = tiny("llama", eager=True)
    llama.enable_attention_values()
    inputs = llama.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        positions = (inputs.attention_mask.cumsum(-1) - 1).clamp(min=0)
        attentions = llama._module(**inputs, position_ids=positions, output_attentions=True).attentions  # transformers' own weights
    _, cache = llama.run_with_cache(PROMPTS, names=["attention_probabilities", "layer_output"], layers=[2, 0])
    assert cache.layers == [2, 0] and cache.names == ["attention_probabilities", "layer_output"]
    assert torch.allclose(cache["attention_probabilities"], torch.stack([attentions[2], attentions[0]]), atol=1e-6)
    assert torch.allclose(cache["attention_probabilities", 0], attentions[0], atol=1e-6)


def test_cache_indexing_errors_say_what_is_there():
    llama = tiny("llama")
    _, cache = llama.run_with_cache(PROMPTS[0], names="layer_output", layers=[1])
    with pytest.raises(KeyError, match="holds layers 1"):
        cache["layer_output", 0]
    with pytest.raises(KeyError, match="was not cached"):
        cache["mlp_output", 1]
    with pytest.raises(ValueError, match="Unknown standard value"):
        cache["resid_postt", 1]
    assert torch.equal(cache["resid_post", 1], cache["layer_output", 1])  # TransformerLens's name of it
    with pytest.raises(IndexError, match="out of range"):
        cache["layer_output", 7]
    with pytest.raises(TypeError):
        cache["layer_output", "1"]
    assert list(cache) == [("layer_output", 1)] and len(cache) == 1


# -- tokens ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer_dir):
    """A tiny GPT-2 with GPT-2's real tokenizer: whitespace-bearing tokens, one BPE vocabulary."""
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64)
    return StandardizedTransformer(build_tiny(config), tokenizer=AutoTokenizer.from_pretrained(gpt2_tokenizer_dir))


def test_to_str_tokens_are_the_tokens_the_model_reads(gpt2):
    text = "The Eiffel Tower\nis in Paris"
    tokens = gpt2.to_str_tokens(text)
    ids = gpt2.tokenizer(text).input_ids
    assert "".join(tokens) == text and len(tokens) == len(ids)  # byte-level BPE: the pieces rebuild the text
    assert gpt2.to_str_tokens(torch.tensor(ids)) == tokens == gpt2.to_str_tokens(ids)
    assert gpt2.to_str_tokens([text, "Paris"]) == [tokens, gpt2.to_str_tokens("Paris")]
    with pytest.raises(TypeError):
        gpt2.to_str_tokens(3.5)


def test_test_prompt_against_a_plain_forward(gpt2, capsys):
    prompt, answer = "The Eiffel Tower is in", "Paris of France"
    results = gpt2.test_prompt(prompt, answer, top_k=4)
    prompt_ids = gpt2.tokenizer(prompt).input_ids
    answer_ids = gpt2.tokenizer(" " + answer).input_ids  # a space is put before the answer
    with torch.no_grad():
        logits = gpt2._module(torch.tensor([prompt_ids + answer_ids])).logits[0]
    assert [r.id for r in results] == answer_ids and len(results) == 3
    for k, result in enumerate(results):
        position = len(prompt_ids) - 1 + k  # the position that predicts answer token k
        probs = logits[position].softmax(-1)
        order = probs.argsort(descending=True).tolist()
        assert result.rank == order.index(answer_ids[k]) + 1
        assert result.probability == pytest.approx(float(probs[answer_ids[k]]), abs=1e-6)
        assert result.logit == pytest.approx(float(logits[position, answer_ids[k]]), abs=1e-5)
        assert [p for _, p in result.top] == pytest.approx(probs[order[:4]].tolist(), abs=1e-6)
        assert [t for t, _ in result.top] == [gpt2.tokenizer.decode([i]).replace(" ", "␣") for i in order[:4]]
    printed = capsys.readouterr().out
    assert "␣Paris" in printed and f"rank {results[0].rank}," in printed and f"{results[0].probability:.4f}" in printed


def test_test_prompt_shows_its_report_once_in_a_notebook(gpt2, capsys):
    results = gpt2.test_prompt("The Eiffel Tower is in", "Paris", top_k=2)
    printed = capsys.readouterr().out
    assert printed.strip() == str(results) and "␣Paris" in printed
    results._ipython_display_()  # the notebook showing the cell's value right after the call printed it
    assert capsys.readouterr().out == ""
    results._ipython_display_()  # shown when asked again
    assert capsys.readouterr().out.strip() == str(results)
    quiet = gpt2.test_prompt("The Eiffel Tower is in", "Paris", top_k=2, print_results=False)
    assert capsys.readouterr().out == "" and [r.rank for r in quiet] == [r.rank for r in results]
    quiet._ipython_display_()  # nothing printed: the notebook shows it
    assert capsys.readouterr().out.strip() == str(results)
    assert isinstance(results, list) and "rank" in repr(results) and "\n" not in repr(results)


def test_top_tokens_show_whitespace(gpt2):
    space, newline, paris = 220, 198, gpt2.tokenizer.encode(" Paris")[0]
    assert [gpt2.tokenizer.decode([i]) for i in (space, newline, paris)] == [" ", "\n", " Paris"]
    probs = torch.zeros(gpt2.vocab_size)
    probs[[space, newline, paris]] = torch.tensor([0.5, 0.3, 0.2])
    assert top_tokens(gpt2, probs, k=3) == [("␣", 0.5), ("\\n", pytest.approx(0.3)), ("␣Paris", pytest.approx(0.2))]
    assert [t for t, _ in top_tokens(gpt2, probs, k=3, readable=False)] == [" ", "\n", " Paris"]
    assert visible("") == "∅" and visible("a\tb\x00") == "a\\tb\\x00"


def test_a_value_some_blocks_lack_is_cached_where_it_exists():
    deepseek = tiny("deepseek_v3")  # block 0 has a dense MLP, blocks 1 and 2 route to experts
    activation = {}
    handle = deepseek.layers._module[0].mlp.act_fn.register_forward_hook(
        lambda m, a, out: activation.__setitem__(0, out.clone()))
    ids = deepseek.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    try:
        with torch.no_grad():
            deepseek._module(ids)
    finally:
        handle.remove()
    _, cache = deepseek.run_with_cache(ids[0])  # token ids are taken as they are
    assert torch.equal(cache.input_ids, ids)
    assert torch.allclose(cache["mlp_activation", 0], activation[0], atol=1e-6)
    with pytest.raises(ValueUnavailable, match="routed"):
        cache["mlp_activation", 1]
    with pytest.raises(ValueUnavailable, match="at layers 1-2"):
        cache["mlp_activation"]
    with pytest.raises(ValueUnavailable, match="routed"):
        deepseek.run_with_cache(ids, names="mlp_activation")
    _, dense = deepseek.run_with_cache(ids, names="mlp_activation", layers=[0])
    assert torch.equal(dense["mlp_activation"][0], cache["mlp_activation", 0])
