"""nnterp 1.3.0's tests that failed on the 1.x shims: ``get_ignores``, the final norm on the backbone, ``steer``'s one
warning, and 1.x's rename options (taken where they name what the family spec places, refused where they contradict);
and 1.x client code that reached the transformers model through ``model._model``.

Ground truth: plain PyTorch forward hooks on a copy of the unwrapped model, and its module tree.
"""

from __future__ import annotations

import copy
import re
import warnings

import nnsight
import pytest
import torch
from nnsight import LanguageModel

from nnterp import StandardizedTransformer

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES
from ..hooks import capture_once, output_tensor

IDS = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])


def tiny(case: str):
    return build_tiny(CASES[case][0]())


def truth(hf_model, blocks, places):
    """``({(layer, name): tensor}, logits)`` from plain hooks on a copy of ``hf_model`` (the wrapper keeps its own)."""
    hf_model = copy.deepcopy(hf_model)
    return capture_once(hf_model, [hf_model.get_submodule(block) for block in blocks], places, IDS)


def test_get_ignores_names_the_sublayer_modules_a_block_lacks():
    from nnterp.rename_utils import RenameConfig, get_ignores

    for case, blocks, attention in (("opt", "model.decoder.layers", "self_attn"), ("llama", "model.layers", "self_attn"),
                                    ("gpt2", "transformer.h", "attn")):
        hf_model = tiny(case)
        block = hf_model.get_submodule(blocks)[0]
        # the module tree: OPT's MLP is fc1/fc2 in the block, no module of its own
        lacks = [name for name, native in (("mlp", "mlp"), ("attention", attention)) if not hasattr(block, native)]
        assert lacks == (["mlp"] if case == "opt" else []), case
        with pytest.warns(DeprecationWarning, match="use model.availability"):
            assert get_ignores(hf_model) == lacks, case
        std = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
        with pytest.warns(DeprecationWarning):
            assert get_ignores(std) == lacks and get_ignores(std._module) == lacks, case
            assert get_ignores(hf_model, RenameConfig(ignore_attn=True)) == [*lacks, "attention"], case


@pytest.mark.parametrize("case, norm", [("gpt2", "transformer.ln_f"), ("llama", "model.norm"),
                                        ("opt", "model.decoder.final_layer_norm")])
def test_the_final_norm_is_also_named_on_the_backbone(case, norm):
    """1.x's rename dict named the final norm on the backbone too: ``model.model.ln_final``, on nnterp's model and on
    a plain nnsight model renamed with ``get_rename_dict()``."""
    from nnterp.rename_utils import get_rename_dict

    hf_model = tiny(case)
    hooked, _ = truth(hf_model, [norm], {"out": ("", "out")})
    std = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    with pytest.warns(DeprecationWarning):
        plain = LanguageModel(copy.deepcopy(hf_model), tokenizer=tiny_tokenizer(), rename=get_rename_dict())
    for model in (std, plain):
        assert model.model.ln_final is model.ln_final
        assert model.model.ln_final._module is model._module.get_submodule(norm)
        with torch.no_grad(), model.trace(IDS):
            out = model.model.ln_final.output.save()
        assert torch.equal(out, hooked[(0, "out")])


def test_steer_with_positions_warns_once_and_adds_at_that_position():
    hf_model = tiny("llama")
    vector = torch.linspace(-1, 1, hf_model.config.hidden_size)
    twin = copy.deepcopy(hf_model)

    def add(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[:, 1] += 2.0 * vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = twin.model.layers[1].register_forward_hook(add)
    with torch.no_grad():
        expected = twin(input_ids=IDS).logits
    handle.remove()
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), model.trace(IDS):
            model.steer(layers=1, steering_vector=vector, factor=2.0, positions=1)
            steered = model.logits.save()
    assert len(caught) == 1 and caught[0].category is DeprecationWarning
    assert "positions" in str(caught[0].message) and "nnterp.add_to" in str(caught[0].message)
    assert torch.equal(steered, expected)
    with pytest.raises(ValueError, match="Cannot specify both"), model.trace(IDS):
        model.steer(layers=1, steering_vector=vector, positions=1, token_positions=1)


def test_rename_options_that_name_the_spec_placement_are_taken_with_a_warning(tmp_path):
    from nnterp.rename_utils import RenameConfig

    hf_model = tiny("gpt2")
    places = {"attention_output": ("attn", "out"), "mlp_output": ("mlp", "out"), "layer_output": ("", "out")}
    blocks = [f"transformer.h.{i}" for i in range(hf_model.config.n_layer)]
    hooked, logits = truth(hf_model, blocks, places)
    config = RenameConfig(attn_name="attn", mlp_name=["mlp"], ln_final_name="ln_f", layers_name="h",
                          model_name="transformer", lm_head_name="lm_head", attn_head_config_key="n_head",
                          hidden_size_config_key=hf_model.config.n_embd, ignore_mlp=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer(), attn_rename="attn", rename_config=config,
                                        rename={"attn": "self_attn", "ln_f": "ln_final"})
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    for option in ("attn_rename='attn'", "RenameConfig(attn_name='attn')", "RenameConfig(layers_name='h')",
                   "RenameConfig(model_name='transformer')", "rename={'ln_f': 'ln_final'}",
                   "RenameConfig(attn_head_config_key='n_head')"):
        assert any(message.startswith(option) for message in messages), option
    with torch.no_grad(), model.trace(IDS):
        got = nnsight.save({(i, name): model.read_value(i, name) for i in range(model.num_layers) for name in places})
        out = model.logits.save()
    assert all(torch.equal(got[key], hooked[key]) for key in hooked) and torch.equal(out, logits)

    # 1.x's own test: a name that matches no module, with the checks off, is ignored (1.x ignored it too)
    hf_model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.warns(DeprecationWarning, match="attn_rename='nonexistent_attn' .*names no module"):
        loaded = StandardizedTransformer(str(tmp_path), attn_rename="nonexistent_attn", check_renaming=False)
    with torch.no_grad(), loaded.trace(IDS):
        out = loaded.logits.save()
    assert torch.equal(out, logits)


def test_rename_options_that_contradict_the_spec_are_refused_naming_both(tmp_path):
    from nnterp.rename_utils import AttnProbFunction, RenameConfig

    hf_model, tokenizer = tiny("gpt2"), tiny_tokenizer()
    assert isinstance(hf_model.transformer.h[0].mlp, torch.nn.Module)  # a module of the model, not the attention
    locator = type("Locator", (AttnProbFunction,), {"get_attention_prob_source": lambda self, module, r=False: None})
    refused = {  # what the message says -> the options
        "attn_rename='mlp' names transformer.h.*.mlp as self_attn, but the spec places self_attn at "
        "transformer.h.*.attn: the two contradict": dict(attn_rename="mlp"),
        "RenameConfig(ln_final_name='ln_1') names no module": dict(rename_config=RenameConfig(ln_final_name="ln_1")),
        "gives num_heads 5, but the model's is 4": dict(rename_config=RenameConfig(attn_head_config_key=5)),
        "RenameConfig(attn_prob_source=) is not taken": dict(rename_config=RenameConfig(attn_prob_source=locator())),
    }
    assert hf_model.config.n_head == 4
    for message, options in refused.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any warning
            with pytest.raises(TypeError, match=re.escape(message)):
                StandardizedTransformer(hf_model, tokenizer=tokenizer, **options)
    hf_model.save_pretrained(tmp_path)  # by folder: checked on the model it loaded
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=re.escape("names transformer.h.*.mlp as self_attn")):
        StandardizedTransformer(str(tmp_path), attn_rename="mlp", check_renaming=False)


def test_module_accessor_takes_a_rename_config_that_agrees():
    from nnterp.nnsight_utils import ModuleAccessor
    from nnterp.rename_utils import RenameConfig

    hf_model = tiny("llama")
    with pytest.warns(DeprecationWarning):
        for config in (RenameConfig(), RenameConfig(attn_name="self_attn", ln_final_name="norm")):
            accessor = ModuleAccessor(hf_model, rename_config=config)
            assert accessor.get_attention(1) is hf_model.model.layers[1].self_attn
            assert accessor.get_unembed_norm() is hf_model.model.norm
        accessor = ModuleAccessor(hf_model, rename={"q_proj": "query"})  # the user's own name, on plain nnsight
        assert accessor.nn_model.layers[0].self_attn.query._module is hf_model.model.layers[0].self_attn.q_proj
        with pytest.raises(TypeError, match=re.escape("names model.layers.*.mlp as self_attn")):
            ModuleAccessor(hf_model, rename_config=RenameConfig(attn_name="mlp"))


def test_a_1x_client_reads_the_transformers_model_at_model_dot_model():
    """1.x's ``model._model`` was the transformers model: 1.x code read its submodules there, applied the final norm
    and the unembedding by hand, and patched across the traces of a session. Ground truth: plain forwards of a copy,
    with a forward hook for the patch."""
    from transformers import GPT2LMHeadModel

    hf_model = tiny("gpt2")
    twin = copy.deepcopy(hf_model)
    last = twin.config.n_layer - 1
    with torch.no_grad():
        logits = twin(input_ids=IDS).logits
        source = {}
        handle = twin.transformer.h[1].register_forward_hook(lambda m, a, o: source.setdefault("x", output_tensor(o)))
        twin(input_ids=IDS[:1])
        handle.remove()

        def patch(module, args, output):
            hidden = output_tensor(output).clone()
            hidden[:, -1] = source["x"][:, -1]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        handle = twin.transformer.h[1].register_forward_hook(patch)
        patched_truth = twin(input_ids=IDS[1:]).logits
        handle.remove()

    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    with pytest.warns(DeprecationWarning, match=re.escape("model._model is nnterp 1.x's spelling: use model._module")):
        hf = model._model
    assert hf is hf_model and hf is model._module

    # 1.x client code, as written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert isinstance(model._model, GPT2LMHeadModel) and len(model._model.transformer.h) == last + 1
        assert torch.equal(model._model.transformer.wte(IDS), twin.transformer.wte(IDS))
        with torch.no_grad(), model.trace(IDS):
            hidden = model.layers_output[last].save()
            lens = model._model.lm_head(model._model.transformer.ln_f(hidden)).save()
        with torch.no_grad():
            by_hand = model._model.transformer.ln_f(hidden) @ model._model.lm_head.weight.T
        with torch.no_grad(), model.session():
            with model.trace(IDS[:1]):
                stream = model.layers_output[1]
            with model.trace(IDS[1:]):
                model.layers_output[1][:, -1] = stream[:, -1]
                patched = model.logits.save()
    assert torch.equal(lens, logits)
    assert torch.equal(by_hand, logits)
    assert torch.equal(patched, patched_truth) and not torch.equal(patched, logits[1:])
