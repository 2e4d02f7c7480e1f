"""Model types that reuse an existing family's blocks: each, built from its default config's miniature,
gives every value and the logits of plain hooks, and keeps its family's identity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer
from nnterp.core.validation import check_identity
from nnterp.families import BORROWER_NAMES, BY_MODEL_TYPE, SAME_BLOCKS
from nnterp.families.unserved import SINCE
from nnterp.proof.miniature import miniature_config

from ..conftest import perturb, tiny_tokenizer
from ..families.test_families import (
    APERTUS_TRUTH,
    CASES,
    GPT2_TRUTH,
    IDS,
    LLAMA,
    LLAMA4_DENSE,
    LLAMA4_ROUTED,
    NO_PRE_NORM,
    ROUTED,
    SHARED_NORM,
    assert_placed_as_hooks,
    hooks_and_reads,
)

TRUTH = {"Llama": LLAMA, "Cohere": SHARED_NORM(LLAMA), "OLMo-2": NO_PRE_NORM, "GPT-2": GPT2_TRUTH, "Granite": LLAMA,
         "Apertus": APERTUS_TRUTH}
NEWER = "a type of a newer transformers than the installed one (nnterp.families.unserved.SINCE)"
TYPES = [pytest.param(family, model_type, id=model_type,
                      marks=[pytest.mark.skipif(model_type not in CONFIG_MAPPING, reason=NEWER)])
         for family, types in SAME_BLOCKS.items() for model_type in types]


def build(model_type, dtype=torch.float32):
    """The type's default config, made whole where checkpoints always set what the default leaves out
    (a head size, a key-value head count), then miniaturized."""
    config = CONFIG_MAPPING[model_type]()
    per_layer = config.get_text_config().per_layer_attributes or ()  # set by each layer: nothing to make whole
    if "head_dim" not in per_layer and hasattr(config, "head_dim") and config.head_dim is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if ("num_key_value_heads" not in per_layer and hasattr(config, "num_key_value_heads")
            and config.num_key_value_heads is None):
        config.num_key_value_heads = config.num_attention_heads
    for name, value in (("num_experts_per_tok", 2), ("n_routed_experts", 4), ("n_shared_experts", 1)):
        if hasattr(config, name) and getattr(config, name) is None:
            setattr(config, name, value)
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types and getattr(config, "rope_parameters", None) == {}:  # rope keyed by layer type, left empty
        config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in layer_types}
    torch.manual_seed(0)
    return perturb(AutoModelForCausalLM.from_config(miniature_config(config))).to(dtype).eval()


def truth_of(family, blocks):
    """Where each value is, by the family's module layout; a mixture block is routed when it has experts."""
    if family in TRUTH:
        return lambda i: TRUTH[family]

    def per_block(i):
        mlp = blocks[i].feed_forward if family == "Llama 4" else blocks[i].mlp
        routed = any("expert" in name for name, _ in mlp.named_modules())
        if family == "Llama 4":
            return LLAMA4_ROUTED if routed else LLAMA4_DENSE
        return ROUTED if routed else LLAMA
    return per_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family, model_type", TYPES)
def test_the_type_gives_the_hooks_values(family, model_type, dtype):
    hf = build(model_type, dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # validated on a miniature at load
    built = hf.config.model_type  # the config's own type: gpt-sw3's is GPT-2's, dots3_note's model dots3_note_text's
    assert model.family.name == (f"{BORROWER_NAMES[built]} ({family}'s blocks)" if built in SAME_BLOCKS[family]
                                 else family)
    hf.base_model_blocks = model.layers._module
    truth = truth_of(family, hf.base_model_blocks)
    ids = IDS % model.vocab_size
    expected, saved, logits = hooks_and_reads(model, hf, truth, ids)
    assert_placed_as_hooks(saved, expected, truth, model.num_layers)
    compared = sum(where is not None for i in range(model.num_layers) for where in truth(i).values())
    assert compared >= 8 * model.num_layers
    assert all(result.exact for result in check_identity(model, ids))


def test_every_added_type_is_registered_once():
    added = [t for _, types in SAME_BLOCKS.items() for t in types]
    assert len(added) == len(set(added)) == 50
    assert all(BY_MODEL_TYPE[t].name == f for f, ts in SAME_BLOCKS.items() for t in ts)
    assert all(t in CONFIG_MAPPING or t in SINCE for t in added)  # a type the installed transformers may not have yet
    assert not set(added) & {case_config().model_type for case_config, *_ in CASES.values()}
    assert set(BORROWER_NAMES) == set(added)  # each is named as itself when it is served


def test_a_borrowed_spec_refuses_in_the_name_of_the_model_it_serves():
    """EXAONE-4's blocks are OLMo-2's: what it refuses names EXAONE-4, never OLMo-2 alone."""
    from nnterp import ValueUnavailable

    model = StandardizedTransformer(build("exaone4"), tokenizer=tiny_tokenizer(256))
    with pytest.raises(ValueUnavailable, match=r"'attention_norm_output' is unavailable on EXAONE-4 \(OLMo-2's blocks\): "
                                               r"no norm before the attention"):
        with model.trace(IDS % model.vocab_size):
            model.layers[0].attention_norm_output.save()


@pytest.mark.parametrize("model_type", ["granite_swa", "flint", "bitnet", "diffllama", "mimo_v2_flash", "laguna", "axk2",
                                        "dots3_note", pytest.param("minicpm5_moe", marks=pytest.mark.skipif(
                                            "minicpm5_moe" not in CONFIG_MAPPING, reason=NEWER))])
def test_attention_internals_that_do_not_hold_are_refused_and_the_rest_stays(model_type):
    """Their attention is more than softmax(q·k)·v (sinks, sub-norms, gates, two softmaxes): the internals' proof
    fails, so only they are unavailable."""
    from nnterp import ValueUnavailable

    model = StandardizedTransformer(build(model_type), tokenizer=tiny_tokenizer(256))
    with pytest.raises(ValueUnavailable, match="does not compute them where"):
        model.enable_attention_values()
    ids = IDS % model.vocab_size
    with torch.no_grad(), model.trace(ids):
        out = model.layers[0].layer_output.save()
    assert out.shape[:2] == ids.shape
