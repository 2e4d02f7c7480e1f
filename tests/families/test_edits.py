"""Every edit of every value of every family reaches the model exactly as the same edit made with plain hooks.

Ground truth is the unwrapped HF model with a forward hook at the value's module boundary. What an
edit means depends on the value: the stream (``layer_input``, ``layer_mid``, ``layer_output``) is one
tensor the block keeps using, so editing it changes it everywhere (the hook edits it in place);
any other value is what one module receives or returns, so editing it changes only that (the hook
replaces the tensor at that boundary). An in-place edit, an assignment, ``add_to`` and a patch
through nnterp must each give the hook's logits bit for bit.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from nnterp import activation_patching, add_to
from nnterp.spec.catalog import BY_NAME

from ..families.test_families import CASES, IDS, make, module_of, register_edit

STREAM = ("layer_input", "layer_mid", "layer_output")
LAYER = 1


def hook_edit(name, edit):
    """The hook's edit of the tensor at the boundary: in place for the stream, a replacement otherwise."""
    if name in STREAM:
        return lambda t: t.copy_(edit(t))
    return edit


def expected_logits(hf_model, truth, name, edit, ids=IDS):
    module, side = module_of(hf_model, truth, LAYER, name)
    handle = register_edit(hf_model, module, side, hook_edit(name, edit))
    try:
        with torch.no_grad():
            return hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        handle.remove()


def edited_values(case):
    """(value, truth) for the values of block LAYER that sit at a module boundary the hooks can reach."""
    model, hf_model, truth, *_ = make(case, torch.float32)
    names = [name for name, where in truth(LAYER).items()
             if name in BY_NAME and where is not None and BY_NAME[name].key in model.order(LAYER)]
    return model, hf_model, truth, names


def one_per_place(model, names):
    """The first of the values that share one location (a parallel block's one norm output)."""
    seen, kept = set(), []
    for name in names:
        if model.location(LAYER, name) not in seen:
            seen.add(model.location(LAYER, name))
            kept.append(name)
    return kept


def envoy_of(model, name):
    owner = BY_NAME[name].owner
    block = model.layers[LAYER]
    return block if owner == "block" else getattr(block, owner)


@pytest.mark.parametrize("case", CASES)
def test_in_place_edits_and_assignments_match_hooks_on_every_value(case):
    model, hf_model, truth, names = edited_values(case)
    tried = 0
    for name in names:
        envoy = envoy_of(model, name)
        with torch.no_grad(), model.trace(IDS):
            getattr(envoy, name)[:] *= 0.5
            in_place = model.logits.save()
        with torch.no_grad(), model.trace(IDS):
            setattr(envoy, name, getattr(envoy, name) * 0.5)
            assigned = model.logits.save()
        expected = expected_logits(hf_model, truth, name, lambda t: t * 0.5)
        assert torch.equal(in_place, expected), f"{case}: in-place edit of {name}"
        assert torch.equal(assigned, expected), f"{case}: assignment of {name}"
        tried += 1
    assert tried >= 6


@pytest.mark.parametrize("case", CASES)
def test_add_to_matches_hooks_on_every_hidden_sized_value(case):
    model, hf_model, truth, names = edited_values(case)
    vector = torch.linspace(-0.5, 0.5, model.hidden_size)
    for name in names:
        if BY_NAME[name].shape != "[batch, seq, hidden_size]":
            continue
        with torch.no_grad(), model.trace(IDS):
            add_to(model, LAYER, vector, name, factor=2.0, positions=[2, 5])
            steered = model.logits.save()

        def add(t):
            t = t.clone()
            view = t.view(*IDS.shape, -1) if t.dim() == 2 else t  # OPT's MLP tensors are [batch * seq, hidden]
            view[:, [2, 5]] += 2.0 * vector  # (DeepSeek-V4's stream: into every parallel stream)
            return t
        assert torch.equal(steered, expected_logits(hf_model, truth, name, add)), f"{case}: add_to {name}"


PATCHED = ("layer_input", "layer_mid", "attention_output", "mlp_input", "mlp_output", "layer_output")


@pytest.mark.parametrize("case", CASES)
def test_activation_patching_matches_hooks(case):
    model, hf_model, truth, names = edited_values(case)
    clean, corrupted = IDS[:1], IDS[1:]
    text = [model.tokenizer.decode(row) for row in (clean[0], corrupted[0])]
    clean_ids, corrupted_ids = (model.tokenizer(t, return_tensors="pt").input_ids for t in text)
    metric = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
    for name in (n for n in PATCHED if n in names):
        effects = activation_patching(model, text[0], text[1], metric, value=name, layers=[LAYER], positions=[1, 3])
        # ground truth: capture the clean tensor with a hook, then patch one position of the corrupted run
        module, side = module_of(hf_model, truth, LAYER, name)
        captured = []
        handle = register_edit(hf_model, module, side, lambda t, captured=captured: captured.append(t.clone()) or t)
        with torch.no_grad():
            hf_model(input_ids=clean_ids, attention_mask=torch.ones_like(clean_ids))
        handle.remove()
        # one batched run, as the patching runs it: row j patched at position j's place
        positions = [1, 3]

        def patch(t, positions=positions, captured=captured):
            t = t.clone()
            seq = clean_ids.shape[1]
            view = t.view(len(positions), seq, *t.shape[1 if t.dim() == 2 else 2:])
            source = captured[0].view(1, seq, *view.shape[2:])
            for row, position in enumerate(positions):
                view[row, position] = source[0, position]
            return t
        logits = expected_logits(hf_model, truth, name, patch, corrupted_ids.repeat(len(positions), 1))
        assert torch.equal(effects[0], metric(logits).float()), f"{case}: patching {name}"


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_autograd_on_every_value(case):
    """``.grad`` of every value inside ``with loss.backward()`` is torch.autograd's gradient at that boundary."""
    model, hf_model, truth, names = edited_values(case)
    names = one_per_place(model, names)
    captured = {}

    def capture(name):
        def grab(t):
            if name not in STREAM:
                t = t.clone()  # a node only this boundary's consumer uses: the gradient through it alone
            captured[name] = t
            return t
        return grab

    expected = {}
    for name in names:  # one boundary per run: the same graph as one value read through nnterp
        handle = register_edit(hf_model, *module_of(hf_model, truth, LAYER, name), capture(name))
        try:
            loss = hf_model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits.square().mean()
            expected[name] = torch.autograd.grad(loss, captured[name])[0]
        finally:
            handle.remove()
    for name in names:  # one value per trace: nnsight serves gradients in the order backward computes them
        with model.trace(IDS):
            value = getattr(envoy_of(model, name), name)
            loss = model.logits.square().mean()
            with loss.backward():
                grad = nnsight.save(value.grad)
        assert torch.equal(grad.reshape(expected[name].shape), expected[name]), f"{case}: gradient of {name}"
