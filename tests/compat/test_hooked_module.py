"""HookPoint and HookedRootModule for a user's own module, as TransformerLens's Main Demo builds one: the same toy
model written once over nnterp's classes and once over TransformerLens 3.9's, run the demo's way."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformer_lens import hook_points as theirs

from nnterp.compat.transformer_lens import HookedRootModule, HookPoint


def toy(root, point):
    """The demo's TwoLayerModel over ``root`` and ``point`` (one library's HookedRootModule and HookPoint)."""

    class SquareThenAdd(nn.Module):
        def __init__(self, offset):
            super().__init__()
            self.offset = nn.Parameter(torch.tensor(offset))
            self.hook_square = point()

        def forward(self, x):
            return self.offset + self.hook_square(x * x)

    class TwoLayerModel(root):
        def __init__(self):
            super().__init__()
            self.layer1 = SquareThenAdd(3.0)
            self.layer2 = SquareThenAdd(-4.0)
            self.hook_in, self.hook_mid, self.hook_out = point(), point(), point()
            super().setup()

        def forward(self, x):
            return self.hook_out(self.layer2(self.hook_mid(self.layer1(self.hook_in(x)))))

    return TwoLayerModel()


@pytest.fixture
def models():
    return toy(HookedRootModule, HookPoint), toy(theirs.HookedRootModule, theirs.HookPoint)


def test_run_with_cache_and_hooks_as_transformerlens(models):
    ours, tl = models
    x = torch.tensor(5.0)
    out, cache = ours.run_with_cache(x)
    expected, expected_cache = tl.run_with_cache(x)
    assert out.item() == expected.item() == 780.0
    assert list(cache) == list(expected_cache.keys())
    for key in cache:
        assert torch.equal(cache[key], expected_cache[key]), key
    _, only = ours.run_with_cache(x, names_filter=lambda name: name.endswith("square"))
    assert list(only) == ["layer1.hook_square", "layer2.hook_square"]
    seen = []

    def set_to_zero(tensor, hook):
        seen.append(hook.name)
        return torch.tensor(0.0)

    got = ours.run_with_hooks(x, fwd_hooks=[("layer2.hook_square", set_to_zero)])
    assert got.item() == tl.run_with_hooks(x, fwd_hooks=[("layer2.hook_square", set_to_zero)]).item() == -4.0
    assert seen == ["layer2.hook_square"] * 2
    assert ours(x).item() == 780.0  # the hook gone after the call


def test_persistent_hooks_contexts_and_gradients(models):
    ours, tl = models
    for model in (ours, tl):
        def count(tensor, hook):
            hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
            return tensor * 2

        model.add_hook("hook_mid", count)
        model(torch.tensor(2.0))
        assert model.hook_dict["hook_mid"].ctx["calls"] == 1
        doubled = model(torch.tensor(2.0)).item()
        model.reset_hooks()
        assert model.hook_dict["hook_mid"].ctx == {}
        assert doubled == ((2 * 2 + 3.0) * 2) ** 2 - 4.0
        grads = []
        x = torch.tensor(2.0, requires_grad=True)
        with model.hooks(bwd_hooks=[("hook_mid", lambda grad, hook, grads=grads: grads.append(grad.clone()))]):
            model(x).backward()
        assert grads[0].item() == 2 * (2 * 2 + 3.0)  # d(mid^2 - 4)/d mid
    with pytest.raises(KeyError, match="no hook point"):
        ours.add_hook("hook_nothing", lambda t, hook: None)
