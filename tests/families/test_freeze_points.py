"""The freeze points of a pass as cache entries (a linearised analysis reads them): the attention pattern
(``cache["attention_probabilities", i]``, TransformerLens's ``pattern``) and a routed block's router choice
(``expert_indices``, ``expert_weights``, with what the experts read and gave), against plain PyTorch hooks on the
unwrapped HF model; and their refusals, each with its reason.
"""

from __future__ import annotations

import functools

import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.analysis import AnalysisUnavailable
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.errors import ValueUnavailable

from ..conftest import build_tiny, tiny_tokenizer
from ..hooks import first_calls

IDS = torch.tensor([[5, 9, 17, 3, 44, 8], [60, 12, 7, 99, 4, 31]])
# the module whose output is the router's (logits, weights, indices) and the experts module, per block
ROUTERS = {"mixtral": ("mlp.gate", "mlp.experts"), "qwen2_moe": ("mlp.gate", "mlp.experts"),
           "gpt_oss": ("mlp.router", "mlp.experts"), "deepseek_v3": ("mlp.gate", "mlp.experts")}


@functools.cache
def build(case: str, dtype=torch.float32, attention_values: bool = False):
    config = BY_MODEL_TYPE[case].tiny_config()
    config._attn_implementation = "eager"  # the hooked pass's attention returns its probabilities
    hf = build_tiny(config, dtype)
    return hf, StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), attention_values=attention_values)


def hooked(hf, paths: list[str]) -> dict[str, tuple]:
    """A plain forward with hooks: ``{path: (args, output)}`` of each module's first call."""
    return first_calls(hf, {path: hf.model.get_submodule(path) for path in paths}, IDS)


@pytest.mark.parametrize("case, dtype", [("llama", torch.float32), ("mixtral", torch.float32),
                                         ("llama", torch.bfloat16)], ids=str)
def test_attention_probabilities_and_pattern_are_the_hooked_attention_weights(case, dtype):
    hf, model = build(case, dtype, attention_values=True)
    _, cache = model.run_with_cache(IDS)
    truth = hooked(hf, [f"layers.{i}.self_attn" for i in range(model.num_layers)])
    for i in range(model.num_layers):
        weights = truth[f"layers.{i}.self_attn"][1][1]  # eager attention: (output, probabilities)
        assert torch.equal(cache["attention_probabilities", i], weights)
        assert torch.equal(cache["pattern", i], weights)
        assert torch.equal(cache["attn.hook_pattern", i], weights)
    assert torch.equal(cache["pattern"][1], truth["layers.1.self_attn"][1][1])  # stacked over the layers


def test_attention_probabilities_of_a_model_that_serves_them_not_are_refused_with_what_to_do():
    _, model = build("llama")  # the model's own (sdpa-like) attention: no probabilities
    _, cache = model.run_with_cache(IDS)
    with pytest.raises(ValueUnavailable, match="attention_values=True"):
        cache["pattern", 0]
    with pytest.raises(ValueUnavailable, match="attention_values=True"):
        model.run_with_cache(IDS, names=["attention_probabilities"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_router_choice_is_the_hooked_routers_output(case, dtype):
    hf, model = build(case, dtype)
    _, cache = model.run_with_cache(IDS)
    router, experts = ROUTERS[case]
    routed = [i for i, block in enumerate(hf.model.layers) if hasattr(block.mlp, "experts")]
    truth = hooked(hf, [f"layers.{i}.{path}" for i in routed for path in (router, experts)])
    for i in routed:
        _, weights, indices = truth[f"layers.{i}.{router}"][1][-3:]  # (logits, weights, indices)
        args, output = truth[f"layers.{i}.{experts}"]
        assert torch.equal(cache["expert_indices", i], indices.view(*IDS.shape, -1))
        assert torch.equal(cache["expert_weights", i], weights.view(*IDS.shape, -1))
        assert torch.equal(cache["expert_input", i], args[0].view(*IDS.shape, -1))
        assert torch.equal(cache["expert_output", i], output.view(*IDS.shape, -1))
    if len(routed) == model.num_layers:
        assert torch.equal(cache["expert_weights"][routed[-1]], cache["expert_weights", routed[-1]])


def test_router_choice_of_a_dense_block_or_other_experts_is_refused_with_the_reason():
    _, model = build("qwen2_moe")  # block 1 is dense (mlp_only_layers)
    _, cache = model.run_with_cache(IDS)
    with pytest.raises(AnalysisUnavailable, match="block 1 has no routed experts"):
        cache["expert_weights", 1]
    _, cache = model.run_with_cache(IDS, names=["mlp_output"])
    with pytest.raises(KeyError, match="names=None"):
        cache["expert_weights", 0]
    hf, model = build("llama4_text")  # experts of its own form, called without the router's choice
    _, cache = model.run_with_cache(IDS)
    layer = next(i for i, block in enumerate(hf.model.layers) if hasattr(block.feed_forward, "experts"))
    with pytest.raises(AnalysisUnavailable, match="not transformers' standard experts module"):
        cache["expert_indices", layer]


def test_longcat_flash_router_choice_is_read_before_the_pairs_that_follow_its_shortcut():
    """LongCat-Flash's routed shortcut runs inside the block's first pair: its experts' reads come before the
    shortcut's output and the later pairs (on a transformers whose LongCat experts are the standard module, 5.25)."""
    from nnterp.analysis import experts_of

    hf, model = build("longcat_flash")
    try:
        experts_of(model, 0, "this test")
    except AnalysisUnavailable as error:
        pytest.skip(f"the installed transformers' LongCat-Flash experts are not read: {error}")
    _, cache = model.run_with_cache(IDS)
    truth = hooked(hf, [f"layers.{i}.mlp.experts" for i in range(model.num_layers)])
    for i in range(model.num_layers):
        args, output = truth[f"layers.{i}.mlp.experts"]
        for name, hooked_tensor in zip(("expert_input", "expert_indices", "expert_weights"), args[:3]):
            assert torch.equal(cache[name, i], hooked_tensor.view(*IDS.shape, -1)), (i, name)
        assert torch.equal(cache["expert_output", i], output.view(*IDS.shape, -1))
