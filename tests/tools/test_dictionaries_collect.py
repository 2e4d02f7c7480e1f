"""A dictionary's features collected to disk, and collections exported in SAELens's cached-activations layout.

Ground truth is independent of nnterp: the values are captured by plain PyTorch forward hooks on the unwrapped
HF model (GPT-2 and Llama), one prompt at a time (no padding); the features are each format's own encoding of
them, written out from SAELens's source in test_dictionaries. The layout is SAELens's ``CacheActivationsRunner``'s
(``Array2D(shape=(context_size, d_in), dtype)`` per hook name, ``token_ids`` a ``Sequence(int32,
length=context_size)``), read back as its ``ActivationsStore`` reads it: ``datasets.load_from_disk``, then
``set_format(type="torch", columns=[hook_name, "token_ids"])``.
"""

from __future__ import annotations

import datasets
import pytest
import torch

from nnterp import Collection, StandardizedTransformer, collect
from nnterp.collection import CollectionError
from nnterp.dictionaries import load_dictionary
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..tools.test_dictionaries import saelens_features, saelens_folder

SAME_LENGTH = ["the cat sat on", "a dog is in", "Paris is a city", "the mat of Rome", "Rome is in the"]
PROMPTS = ["the cat sat on the mat", "Paris is in", "a dog", "the Eiffel Tower is in the city of Paris", "Rome"]
MODELS: dict = {}


def model_of(case):
    if case not in MODELS:
        MODELS[case] = StandardizedTransformer(build_tiny(BY_MODEL_TYPE[case].tiny_config()),
                                               tokenizer=tiny_tokenizer())
    return MODELS[case]


def hooked(model, prompt, layer, where):
    """``[tokens, d]`` of one prompt alone: a block's output (``"output"``) or its attention's per-head outputs
    before the output projection (``"premix"``), by a plain forward hook on the unwrapped model."""
    hf = model._module
    block = hf.base_model.layers[layer] if hasattr(hf.base_model, "layers") else hf.base_model.h[layer]
    captured = []
    if where == "output":
        handle = block.register_forward_hook(lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o))
    else:
        projection = block.attn.c_proj if hasattr(block, "attn") else block.self_attn.o_proj
        handle = projection.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    try:
        with torch.no_grad():
            hf(input_ids=model.tokenizer(prompt, return_tensors="pt").input_ids)
    finally:
        handle.remove()
    return captured[0][0]


def ids_of(model, prompts):
    return torch.cat([model.tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts])


@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu", "gated"])
def test_collected_features_are_the_formats_encoding_of_the_hooked_value(case, architecture, tmp_path):
    model = model_of(case)
    extra = {"k": 8} if architecture == "topk" else {}
    folder, cfg, weights = saelens_folder(tmp_path, architecture, model.hidden_size, "blocks.1.hook_resid_post",
                                          extra_cfg=extra)
    sae = load_dictionary(folder)
    collection = collect(model, PROMPTS, tmp_path / "c", values=["layer_output"], layers=[0], positions="all",
                         batch_size=2, dictionaries=[sae], progress=False)
    expected = torch.cat([saelens_features(cfg, weights, hooked(model, p, 1, "output")) for p in PROMPTS])
    name = "features/layers.1.layer_output"
    assert collection.features == [name]
    read = Collection(tmp_path / "c")[name]
    assert read.shape == (len(expected), sae.d_sae) and read.dtype == torch.float32
    torch.testing.assert_close(read, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(collection[name, 3:5], expected[3:5], atol=1e-5, rtol=1e-4)
    # the values collected alongside are still the block's output at layer 0
    torch.testing.assert_close(collection["layer_output"][:, 0],
                               torch.cat([hooked(model, p, 0, "output") for p in PROMPTS]), atol=1e-5, rtol=1e-4)


def test_features_only_named_by_the_caller_at_the_last_token_and_a_per_head_site(tmp_path):
    model = model_of("gpt2")
    folder, cfg, weights = saelens_folder(tmp_path, "standard", model.hidden_size, "blocks.1.attn.hook_z")
    other, cfg_other, weights_other = saelens_folder(tmp_path, "topk", model.hidden_size,
                                                     "blocks.0.hook_resid_post", seed=5, extra_cfg={"k": 8})
    collection = collect(model, PROMPTS, tmp_path / "c", values=[], positions="last", batch_size=3,
                         dictionaries={"z": load_dictionary(folder), "stream": load_dictionary(other)}, progress=False)
    assert collection.values == [] and collection.features == ["features/z", "features/stream"]
    z = torch.stack([saelens_features(cfg, weights, hooked(model, p, 1, "premix"))[-1] for p in PROMPTS])
    stream = torch.stack([saelens_features(cfg_other, weights_other, hooked(model, p, 0, "output"))[-1]
                          for p in PROMPTS])
    torch.testing.assert_close(collection["features/z"], z, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(collection["features/stream"], stream, atol=1e-5, rtol=1e-4)
    with pytest.raises(KeyError, match="features/z"):
        collection["features/nothing"]


def test_a_resume_with_another_dictionary_is_refused(tmp_path):
    model = model_of("gpt2")
    first, *_ = saelens_folder(tmp_path, "standard", model.hidden_size, "blocks.1.hook_resid_post", seed=0)
    second, *_ = saelens_folder(tmp_path, "standard", model.hidden_size, "blocks.1.hook_resid_post", seed=9)
    arguments = dict(values=["layer_output"], layers=[1], positions="all", batch_size=2, progress=False)
    done = collect(model, PROMPTS, tmp_path / "c", dictionaries=[load_dictionary(first)], **arguments)
    again = collect(model, PROMPTS, tmp_path / "c", dictionaries=[load_dictionary(first)], **arguments)  # resumes
    assert torch.equal(again["features/layers.1.layer_output"], done["features/layers.1.layer_output"])
    with pytest.raises(CollectionError, match="the dictionaries whose features are collected"):
        collect(model, PROMPTS, tmp_path / "c", dictionaries=[load_dictionary(second)], **arguments)
    with pytest.raises(CollectionError, match="other settings"):  # without the dictionary: not the same collection
        collect(model, PROMPTS, tmp_path / "c", **arguments)


def test_two_unnamed_dictionaries_at_one_site_are_refused(tmp_path):
    model = model_of("gpt2")
    first, *_ = saelens_folder(tmp_path, "standard", model.hidden_size, "blocks.1.hook_resid_post", seed=0)
    second, *_ = saelens_folder(tmp_path, "standard", model.hidden_size, "blocks.1.hook_resid_post", seed=9)
    with pytest.raises(ValueError, match="name them"):
        collect(model, PROMPTS, tmp_path / "c", dictionaries=[load_dictionary(first), load_dictionary(second)],
                progress=False)


def read_as_saelens(folder, hook):
    """What SAELens's ActivationsStore.load_cached_activation_dataset and _load_buffer_from_cached read."""
    dataset = datasets.load_from_disk(str(folder))
    dataset.set_format(type="torch", columns=[hook, "token_ids"], dtype=torch.float32)
    rows = dataset[0:len(dataset)]
    return dataset, rows[hook], rows["token_ids"]


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_the_saelens_layout_holds_the_hooked_activations_one_prompt_per_context(case, tmp_path):
    model = model_of(case)
    collection = collect(model, SAME_LENGTH, tmp_path / "c", values=["layer_output", "attention_premix"],
                         layers=[0, 1], positions="all", batch_size=2, progress=False)
    collection.to_saelens(tmp_path / "sae")
    context = len(model.tokenizer(SAME_LENGTH[0]).input_ids)
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    dataset = datasets.load_from_disk(str(tmp_path / "sae"))
    assert dataset.column_names == [*hooks, "token_ids"] and len(dataset) == len(SAME_LENGTH)
    for hook in hooks:
        assert dataset.features[hook] == datasets.Array2D(shape=(context, model.hidden_size), dtype="float32")
    assert dataset.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=context)
    for hook, (layer, where) in zip(hooks, [(0, "output"), (1, "output"), (0, "premix"), (1, "premix")]):
        _, acts, tokens = read_as_saelens(tmp_path / "sae", hook)
        expected = torch.stack([hooked(model, p, layer, where) for p in SAME_LENGTH])
        assert acts.shape == (len(SAME_LENGTH), context, model.hidden_size)
        torch.testing.assert_close(acts, expected, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, torch.stack([model.tokenizer(p, return_tensors="pt").input_ids[0]
                                                for p in SAME_LENGTH]).to(tokens.dtype))


def test_the_saelens_layout_packs_rows_into_contexts_and_names_what_it_leaves_out(tmp_path):
    model = model_of("gpt2")
    collection = collect(model, PROMPTS, tmp_path / "c", values=["layer_output"], layers=[1], positions="all",
                         batch_size=2, dtype=torch.bfloat16, progress=False)
    with pytest.raises(ValueError, match="context_size=N"):
        collection.to_saelens(tmp_path / "refused", hook_names=["blocks.1.hook_resid_post"])
    with pytest.warns(UserWarning, match="the last 1 of 21 rows"):  # 6 + 3 + 2 + 9 + 1 tokens
        collection.to_saelens(tmp_path / "sae", hook_names=["blocks.1.hook_resid_post"], context_size=4)
    dataset, acts, tokens = read_as_saelens(tmp_path / "sae", "blocks.1.hook_resid_post")
    assert dataset.features["blocks.1.hook_resid_post"].dtype == "float32"  # bfloat16 widened: Arrow lacks it
    expected = torch.cat([hooked(model, p, 1, "output") for p in PROMPTS]).to(torch.bfloat16).float()
    assert len(expected) == 21 and acts.shape == (len(expected) // 4, 4, model.hidden_size)
    assert torch.equal(acts.reshape(-1, model.hidden_size), expected[:len(expected) // 4 * 4])
    assert torch.equal(tokens.reshape(-1), ids_of(model, PROMPTS)[:len(expected) // 4 * 4].to(tokens.dtype))


def test_the_saelens_export_refuses_what_it_cannot_name_or_does_not_hold(tmp_path):
    model = model_of("gpt2")
    collection = collect(model, SAME_LENGTH, tmp_path / "c", values=["mlp_input", "layer_output"], layers=[1],
                         positions="all", batch_size=5, progress=False)
    with pytest.raises(ValueError, match="mlp_input has no TransformerLens hook name"):
        collection.to_saelens(tmp_path / "a")
    with pytest.raises(KeyError, match="not collected here"):
        collection.to_saelens(tmp_path / "b", hook_names=["blocks.0.hook_resid_post"])
    with pytest.raises(ValueError, match="no standard value"):
        collection.to_saelens(tmp_path / "c2", hook_names=["blocks.1.attn.hook_q"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        collection.to_saelens(tmp_path / "full", hook_names=["blocks.1.hook_resid_post"])
