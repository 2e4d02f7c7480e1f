"""An edit of ``router_logits`` reaches the router's choice of experts, as the same edit made by a plain forward hook
that recomputes the router's outputs from the edited logits (the router's own arithmetic, written out here) does.

nnterp reads the logits where the router computes them (an operation of its forward), before it chooses from them:
an edit of the router module's returned logits would change nothing, its choice being made already.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

IDS = torch.tensor([[5, 17, 33, 9, 60, 41, 12]])
LAYER = 1


def _mixtral_choice(logits, router):
    """Mixtral's router from its logits: softmax over the experts, the top k, renormalized."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    top, index = torch.topk(probabilities, router.top_k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), index


def _gpt_oss_choice(logits, router):
    """GPT-OSS's router from its logits: the top k logits, softmaxed among themselves."""
    top, index = torch.topk(logits, router.top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), index


def _granite_choice(logits, router):
    """Granite-MoE's router from its (float32) logits: the top k, softmaxed among themselves."""
    logits = logits.float()
    top, index = logits.topk(router.top_k, dim=-1)
    return torch.softmax(top, dim=-1), index


CASES = {"mixtral": ("mlp.gate", _mixtral_choice), "gpt_oss": ("mlp.router", _gpt_oss_choice),
         "granitemoe": ("block_sparse_moe.router", _granite_choice)}


def _hooked_logits(hf, path, choice, delta):
    """The plain model's logits with block LAYER's router returning what it computes from its logits plus ``delta``."""
    router = hf.base_model_blocks[LAYER].get_submodule(path)

    def hook(module, args, out):
        logits = out[0] + delta
        weights, index = choice(logits, module)
        return logits, weights.to(out[1].dtype), index
    handle = router.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_an_edit_of_the_router_logits_reaches_the_choice_of_experts(model_type):
    path, choice = CASES[model_type]
    config = BY_MODEL_TYPE[model_type].tiny_config()
    hf = build_tiny(config)
    hf.base_model_blocks = hf.get_submodule(BY_MODEL_TYPE[model_type].layers)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(config.vocab_size))
    experts = hf.base_model_blocks[LAYER].get_submodule(path).weight.shape[0]
    delta = torch.zeros(experts)
    delta[0] = 8.0  # every token sent to expert 0
    with torch.no_grad():
        with model.trace(IDS):
            clean = model.logits.save()
        with model.trace(IDS):
            logits = model.layers[LAYER].mlp.router_logits
            assert logits.shape == (*IDS.shape, experts)
            logits[:] += delta
            edited = model.logits.save()
        with model.trace(IDS):
            model.layers[LAYER].mlp.router_logits = model.layers[LAYER].mlp.router_logits + delta
            assigned = model.logits.save()
    want = _hooked_logits(hf, path, choice, delta)
    assert (want - clean).abs().max() > 1e-3, "the edit does not change the choice, so it proves nothing"
    torch.testing.assert_close(edited, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(assigned, want, rtol=0, atol=1e-5)
