"""nnsight's constructor options and tools as nnsight has them: the user's own aliases through ``rename=`` beside the
standard names, the tokenizer found from the model's ``name_or_path``, ``scan`` on any prompt. Ground truth: a plain
nnsight model of the same module tree, and a real trace."""

from __future__ import annotations

import nnsight
import pytest
import torch
from nnsight import LanguageModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from nnterp import StandardizedTransformer
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def gpt2():
    return build_tiny(BY_MODEL_TYPE["gpt2"].tiny_config())


def test_the_users_own_aliases_reach_the_modules_beside_the_standard_names(gpt2):
    rename = {"mlp": "feedforward", "transformer.h": "my_blocks"}
    model = StandardizedTransformer(gpt2, tokenizer=tiny_tokenizer(), rename=rename)
    plain = LanguageModel(gpt2, tokenizer=tiny_tokenizer(), rename=rename)
    with torch.no_grad(), model.trace(PROMPT):
        mine = model.my_blocks[1].feedforward.output.save()
        standard = model.layers[1].mlp.mlp_output.save()
        native = model.transformer.h[1].mlp.output.save()
    with torch.no_grad(), plain.trace(PROMPT):
        theirs = plain.my_blocks[1].feedforward.output.save()
    assert torch.equal(mine, theirs) and torch.equal(mine, standard) and torch.equal(mine, native)
    with torch.no_grad(), model.trace(PROMPT):  # an edit through the user's alias is the model's
        model.my_blocks[1].feedforward.output[:] = 0
        zeroed = model.layers[1].mlp.mlp_output.save()
    assert not zeroed.any()


@pytest.mark.parametrize(("alias", "what"), [("layer_output", "is a standard value"),
                                               ("trace", "is a name the model or its envoys already have"),
                                               ("mlp", "names transformer.h.*.attn.c_proj as mlp, but the spec places "
                                                       r"mlp at transformer.h.\*.mlp")])
def test_an_alias_that_would_hide_a_standard_name_is_refused_saying_which(gpt2, alias, what):
    with pytest.raises((ValueError, TypeError), match=rf"rename=\{{'attn.c_proj': '{alias}'\}}:? .*{what}"):
        StandardizedTransformer(gpt2, tokenizer=tiny_tokenizer(), rename={"attn.c_proj": alias})


def test_the_tokenizer_is_found_from_the_models_name_or_path(gpt2, tmp_path):
    """nnsight's models take the tokenizer's source from the model's ``name_or_path``; here it is loaded from it."""
    gpt2.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    model = StandardizedTransformer(loaded)
    assert model.tokenizer(PROMPT).input_ids == AutoTokenizer.from_pretrained(tmp_path)(PROMPT).input_ids
    assert model.tokenizer(PROMPT).input_ids == tiny_tokenizer()(PROMPT).input_ids
    bare = tmp_path / "bare"  # a folder without tokenizer files: the error says what to pass
    gpt2.save_pretrained(bare)
    with pytest.raises(ValueError, match="No tokenizer could be loaded from the model's name_or_path"):
        StandardizedTransformer(AutoModelForCausalLM.from_pretrained(bare))
    gpt2.name_or_path = ""
    with pytest.raises(ValueError, match="needs its tokenizer"):
        StandardizedTransformer(gpt2)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "granite"])
def test_scan_gives_the_shapes_of_a_real_trace_on_a_prompt_of_several_tokens(model_type):
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE[model_type].tiny_config()), tokenizer=tiny_tokenizer())
    with model.scan(PROMPT):
        scanned = nnsight.save([model.layers[1].self_attn.attention_output.shape, model.layers[1].layer_output.shape,
                                model.logits.shape])
    with torch.no_grad(), model.trace(PROMPT):
        real = nnsight.save([model.layers[1].self_attn.attention_output.shape, model.layers[1].layer_output.shape,
                             model.logits.shape])
    assert len(tiny_tokenizer()(PROMPT).input_ids) > 1
    assert [tuple(s) for s in scanned] == [tuple(s) for s in real]
