"""``mlp.mlp_up_output``: a gated MLP's up projection output, against plain hooks on the projection (its output's
second half where one projection computes the gate and the up parts, ``[gate | up]``, as on Phi-3 and GLM-4), and the
product it makes with the activation, ``mlp_neurons``; an edit of it reaches the logits as the same edit by a hook."""

from __future__ import annotations

import nnsight
import pytest
import torch

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

IDS = torch.tensor([[5, 17, 33, 9, 60, 41, 12]])
# model type -> (the up projection, relative to a block; whether its output is [gate | up], the up part second)
UP = {"llama": ("mlp.up_proj", False), "qwen3": ("mlp.up_proj", False), "gemma2": ("mlp.up_proj", False),
      "olmo2": ("mlp.up_proj", False), "granite": ("mlp.up_proj", False), "cohere": ("mlp.up_proj", False),
      "stablelm": ("mlp.up_proj", False), "phi3": ("mlp.gate_up_proj", True), "glm4": ("mlp.gate_up_proj", True),
      "glm": ("mlp.gate_up_proj", True), "vaultgemma": ("mlp.up_proj", False)}


def make(model_type):
    config = BY_MODEL_TYPE[model_type].tiny_config()
    hf = build_tiny(config)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(config.vocab_size))
    return model, hf, hf.get_submodule(BY_MODEL_TYPE[model_type].layers)


def up_part(tensor, fused):
    return tensor.chunk(2, dim=-1)[1] if fused else tensor


@pytest.mark.parametrize("model_type", sorted(UP))
def test_up_output_is_the_up_projections_output(model_type):
    model, hf, blocks = make(model_type)
    path, fused = UP[model_type]
    seen = {}
    handles = [block.get_submodule(path).register_forward_hook(
        lambda _m, _a, out, i=i: seen.setdefault(i, out[0] if isinstance(out, tuple) else out))
        for i, block in enumerate(blocks)]
    try:
        with torch.no_grad():
            hf(input_ids=IDS)
    finally:
        for handle in handles:
            handle.remove()
    names = ("mlp_up_output", "mlp_activation", "mlp_neurons")
    with torch.no_grad(), model.trace(IDS):  # in forward order: the up projection runs after the activation on most
        saved = nnsight.save([{name: getattr(model.layers[i].mlp, name).clone() for name in sorted(
            names, key=lambda name: model.order(i, where_present=True)[f"mlp.{name}"])} for i in range(len(blocks))])
    for i, read in enumerate(saved):
        up, activation, neurons = (read[name] for name in names)
        assert torch.equal(up, up_part(seen[i], fused).reshape(up.shape)), i
        assert torch.equal(activation * up, neurons), i  # what the down projection sums


@pytest.mark.parametrize("model_type", ["phi3", "llama"])
def test_an_edit_of_the_up_output_is_the_hooks_edit(model_type):
    model, hf, blocks = make(model_type)
    path, fused = UP[model_type]

    def edit(t):
        return t * 1.5 + 0.3 * t.abs()

    def hook(_m, _a, out):
        if not fused:
            return edit(out)
        gate, up = out.chunk(2, dim=-1)
        return torch.cat([gate, edit(up)], dim=-1)
    handle = blocks[1].get_submodule(path).register_forward_hook(hook)
    try:
        with torch.no_grad():
            want = hf(input_ids=IDS).logits
    finally:
        handle.remove()
    with torch.no_grad():
        with model.trace(IDS):
            clean = model.logits.save()
        with model.trace(IDS):
            up = model.layers[1].mlp.mlp_up_output
            up[:] = edit(up)
            edited = model.logits.save()
        with model.trace(IDS):
            model.layers[1].mlp.mlp_up_output = edit(model.layers[1].mlp.mlp_up_output)
            assigned = model.logits.save()
    assert (want - clean).abs().max() > 1e-3
    assert torch.equal(edited, want) and torch.equal(assigned, want)


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral"])
def test_no_up_output_without_a_gated_mlp(model_type):
    model, _, _ = make(model_type)
    reason = model.availability(1)["mlp.mlp_up_output"].reason
    assert reason and ("not gated" in reason or "routed mixture" in reason)
    with pytest.raises(ValueUnavailable):
        with model.trace(IDS):
            model.layers[1].mlp.mlp_up_output.save()
