"""Per-head, batched and attribution patching, against plain PyTorch hooks on the unwrapped HF model.

Ground truth: the clean run's tensor captured by a hook at the value's module boundary, then one plain forward of
the corrupted prompt per patch with a hook that replaces that piece (a position of the value; a head's slice of
the output projection's input); for attribution patching, the gradient of the metric at the hooked corrupted
tensors from plain ``torch.autograd.grad``, times the hooked clean minus corrupted tensors. Batched patching must
give the hooks' numbers bit for bit: a pass of one patched run those of a hooked run of the prompt alone, a batched
pass those of a hooked batch of two rows (a batch of one can round differently: GPT-BigCode's multi-query attention
does, in the last bits; every batch of two or more rows rounds each row alike).
"""

from __future__ import annotations

import pytest
import torch

from nnterp import activation_patching
from nnterp.tools.patching import attribution_patching

from ..families.test_edits import hook_edit
from ..families.test_families import make, module_of, register_edit
from ..remote.test_remote import assert_same, checkpoints, requests, server  # noqa: F401  (the remote harness's fixtures)
from ..remote.test_remote import load as load_remote

CASES = ["gpt2", "llama", "gpt_bigcode", "qwen2"]  # Llama and Qwen2: GQA (4 heads, 2 kv); GPT-BigCode: MQA
CLEAN, CORRUPTED = "the cat sat on the mat", "the dog sat on the mat"
SEQ = 6
METRIC = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
VALUES = ("layer_input", "attention_output", "mlp_output", "layer_output")


def ids(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def forward(hf_model, input_ids, hooks=(), grad=False):
    """The HF model's logits with ``hooks`` (``(module, side, edit)``) installed for the call."""
    handles = [register_edit(hf_model, module, side, edit) for module, side, edit in hooks]
    try:
        with torch.set_grad_enabled(grad):
            return hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        for handle in handles:
            handle.remove()


def captured(model, hf_model, truth, name, text, grad=False):
    """``({layer: tensor at the value's boundary}, logits)`` of one plain forward (clones unless ``grad``)."""
    seen = {}

    def keep(layer):
        def record(t):
            seen[layer] = t if grad else t.detach().clone()
            return t
        return record

    hooks = [(*module_of(hf_model, truth, layer, name), keep(layer)) for layer in range(model.num_layers)]
    return seen, forward(hf_model, ids(model, text), hooks, grad)


def head_count(hf_model) -> int:
    return hf_model.config.num_attention_heads


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param, *make(request.param, torch.float32)[:3]


def test_per_head_patching_equals_a_hook_on_the_output_projection(case):
    _, model, hf_model, truth = case
    clean, _ = captured(model, hf_model, truth, "attention_premix", CLEAN)
    heads = head_count(hf_model)

    def hooked(layer, head, position=slice(None), rows=1):
        """The corrupted run with head ``head``'s slice of the output projection's input the clean run's (in row 0
        of ``rows`` copies of the prompt)."""
        def patch(t):
            t = t.clone()
            view, source = t.view(*t.shape[:2], heads, -1), clean[layer].view(1, SEQ, heads, -1)
            view[0, position, head] = source[0, position, head]
            return t
        module, side = module_of(hf_model, truth, layer, "attention_premix")
        return METRIC(forward(hf_model, ids(model, CORRUPTED).repeat(rows, 1), [(module, side, patch)]))[0]

    for positions in (None, [1, 4, -1]):
        at = [slice(None)] if positions is None else positions
        shape = (model.num_layers, heads) if positions is None else (model.num_layers, len(positions), heads)
        for rows, sizes in ((1, (1,)), (2, (None, 3, 64))):  # one patched run per pass; batched passes
            expected = torch.tensor([[[hooked(layer, head, p, rows) for head in range(heads)] for p in at]
                                     for layer in range(model.num_layers)]).view(shape)
            for batch_size in sizes:
                effects = activation_patching(model, CLEAN, CORRUPTED, METRIC, per="head", positions=positions,
                                              batch_size=batch_size, progress=False)
                assert effects.shape == shape
                assert torch.equal(effects, expected), f"positions={positions}, batch_size={batch_size}"


def test_batched_patching_equals_sequential_and_hooks_on_every_value(case):
    _, model, hf_model, truth = case
    for name in VALUES:
        clean, _ = captured(model, hf_model, truth, name, CLEAN)

        def hooked(layer, position, rows, name=name, clean=clean):
            def patch(t):
                t = t.clone()
                t[0, position] = clean[layer][0, position]
                return t
            module, side = module_of(hf_model, truth, layer, name)
            patched = forward(hf_model, ids(model, CORRUPTED).repeat(rows, 1), [(module, side, hook_edit(name, patch))])
            return METRIC(patched)[0]

        sequential = activation_patching(model, CLEAN, CORRUPTED, METRIC, value=name, batch_size=1, progress=False)
        expected = torch.tensor([[hooked(layer, p, 1) for p in range(SEQ)] for layer in range(model.num_layers)])
        assert torch.equal(sequential, expected), f"{name}: one patched run per pass"
        expected = torch.tensor([[hooked(layer, p, 2) for p in range(SEQ)] for layer in range(model.num_layers)])
        for batch_size in (None, 4, 7, 64):  # 4 and 7 rows: passes that span two layers
            batched = activation_patching(model, CLEAN, CORRUPTED, METRIC, value=name, batch_size=batch_size,
                                          progress=False)
            assert torch.equal(batched, expected), f"{name}: batch_size={batch_size}"
            # a batch rounds as a single run within float32 (bit for bit on all but MQA's attention)
            assert torch.allclose(batched, sequential, rtol=1e-5, atol=1e-6)
    # layers in any order, repeated, and a subset of positions: the rows as asked
    layers, positions = [2, 0, 2], [5, 1]
    batched = activation_patching(model, CLEAN, CORRUPTED, METRIC, layers=layers, positions=positions, batch_size=3,
                                  progress=False)
    assert torch.equal(batched, expected[layers][:, positions])


@pytest.mark.parametrize("per, name", [("position", "layer_output"), ("position", "attention_output"),
                                       ("position", "mlp_output"), ("head", "attention_premix"),
                                       ("neuron", "mlp_neurons")])
def test_attribution_patching_equals_autograd_on_hooked_activations(case, per, name):
    _, model, hf_model, truth = case
    clean, _ = captured(model, hf_model, truth, name, CLEAN)
    corrupted, logits = captured(model, hf_model, truth, name, CORRUPTED, grad=True)
    layers = list(range(model.num_layers))
    grads = torch.autograd.grad(METRIC(logits).sum(), [corrupted[layer] for layer in layers])
    rows = []
    for layer, grad in zip(layers, grads):
        product = ((clean[layer] - corrupted[layer].detach()) * grad)[0]  # [seq, ...]
        if per == "head":
            rows.append(product.view(SEQ, head_count(hf_model), -1).sum(-1))
        else:
            rows.append(product.sum(-1) if per == "position" else product)
    expected = torch.stack(rows)
    value = None if name in ("attention_premix", "mlp_neurons") else name
    attributions = attribution_patching(model, CLEAN, CORRUPTED, METRIC, value=value, per=per)
    assert attributions.shape == expected.shape
    assert torch.equal(attributions, expected)
    assert all(p.grad is None for p in hf_model.parameters()), "the weights' gradients are not computed"
    # a subset of layers, as asked
    assert torch.equal(attribution_patching(model, CLEAN, CORRUPTED, METRIC, value=value, per=per, layers=[2, 0]),
                       expected[[2, 0]])


def test_refusals(case):
    _, model, _, _ = case
    with pytest.raises(ValueError, match="per='head' patches attention_premix"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, value="layer_output", per="head")
    with pytest.raises(ValueError, match="per is one of"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, per="neuron")
    with pytest.raises(ValueError, match="batch_size"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, batch_size=0)
    with pytest.raises(ValueError, match="one score per batch row"):  # a mean over the batch would mix the rows
        activation_patching(model, CLEAN, CORRUPTED, lambda logits: METRIC(logits).mean(), progress=False)
    with pytest.raises(ValueError, match="one length"):
        attribution_patching(model, CLEAN, "the dog", METRIC)
    with pytest.raises(ValueError, match="per='neuron' patches mlp_neurons"):
        attribution_patching(model, CLEAN, CORRUPTED, METRIC, value="mlp_output", per="neuron")


@pytest.mark.parametrize("remote_case", ["gpt2", "llama"])
def test_patching_runs_remotely_bit_exactly(remote_case, checkpoints, requests):  # noqa: F811
    model = load_remote(remote_case, checkpoints)
    for kwargs in (dict(per="head", batch_size=5), dict(value="mlp_output", layers=[0, 2], batch_size=4)):
        assert_same(activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False, **kwargs),
                    activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False, remote=True, **kwargs))
    for per in ("position", "head", "neuron"):
        assert_same(attribution_patching(model, CLEAN, CORRUPTED, METRIC, per=per),
                    attribution_patching(model, CLEAN, CORRUPTED, METRIC, per=per, remote=True))
    assert requests
