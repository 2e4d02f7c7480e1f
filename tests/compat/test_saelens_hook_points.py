"""Hooks left on the model (``add_hook``) on an attached SAE's own hook points, backward hooks (``dir="bwd"``) on the
model's hook points and an SAE's features, the SAE's hook points named after its site on attach, and ``model.to``'s
message: the ground truth is TransformerLens 3.9 and SAELens 6 themselves (``HookedSAETransformer``) on the same tiny
weights, and for the gradients plain torch too."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch

import nnterp

from ..tools.test_saelens_interop import sae_lens
from .test_saelens_semantics import close, make_sae
from .tl_models import pair

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
PROMPTS = ["When John and Mary went to the shops, John gave the bag to", "The cat sat on the mat in Paris"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    _, ours, theirs = pair(request.param, gpt2_tokenizer_dir, model_class=sae_lens.HookedSAETransformer)
    return ours, theirs


def metric(logits):
    return logits[:, -1].log_softmax(-1)[:, 11].sum() - logits[:, -1, 42].sum()


def forward_and_backward(model, tokens, names):
    """SAELens's tutorial's ``get_cache_fwd_and_bwd``: a forward and a backward hook left on the model by a
    predicate, one forward pass, ``backward()``."""
    model.reset_hooks()
    cache, grads = {}, {}
    model.add_hook(names, lambda act, hook: cache.__setitem__(hook.name, act.detach()), "fwd")
    model.add_hook(names, lambda grad, hook: grads.__setitem__(hook.name, grad.detach()), "bwd")
    value = metric(model(tokens))
    value.backward()
    model.reset_hooks()
    return value.item(), cache, grads


@pytest.mark.parametrize("use_error_term", [False, True])
def test_hooks_left_on_the_model_on_an_sae_s_features_forward_and_backward(models, use_error_term):
    ours, theirs = models
    sae = make_sae("blocks.1.hook_resid_pre")
    tokens = theirs.to_tokens(PROMPTS)
    ours.add_sae(sae, use_error_term=use_error_term)
    theirs.add_sae(sae, use_error_term=use_error_term)
    chosen = lambda name: "hook_sae_acts_post" in name  # noqa: E731
    try:
        with torch.enable_grad():
            expected = forward_and_backward(theirs, tokens, chosen)
            got = forward_and_backward(ours, tokens, chosen)  # before: refused (TypeError)
    finally:
        ours.reset_saes()
        theirs.reset_saes()
    assert list(got[1]) == list(expected[1]) == ["blocks.1.hook_resid_pre.hook_sae_acts_post"]
    assert list(got[2]) == list(expected[2])
    assert got[0] == pytest.approx(expected[0], abs=1e-4)
    for name in expected[1]:
        close(got[1][name], expected[1][name])
        assert expected[2][name].abs().max() > 0
        close(got[2][name], expected[2][name])


def test_a_forward_hook_left_on_an_sae_s_features_edits_what_the_model_goes_on_with(models):
    ours, theirs = models
    sae = make_sae("blocks.0.hook_resid_post")
    name = "blocks.0.hook_resid_post.hook_sae_acts_post"

    def ablate(acts, hook):
        acts[:, -1, :5] = 0.0

    with torch.no_grad():
        for model in (ours, theirs):
            model.add_sae(sae)
        try:
            clean = theirs(PROMPTS[0])
            for model in (ours, theirs):
                model.add_hook(name, ablate)
            expected, got = theirs(PROMPTS[0]), ours(PROMPTS[0])
            cached_expected = theirs.run_with_cache(PROMPTS[0])[1][name]
            cached = ours.run_with_cache(PROMPTS[0])[1][name]
            for model in (ours, theirs):
                model.reset_hooks()
            after = ours(PROMPTS[0])
        finally:
            for model in (ours, theirs):
                model.reset_hooks()
                model.reset_saes()
    assert (expected - clean).abs().max() > 1e-3  # the hook changes SAELens's logits
    close(got, expected)
    close(cached[:, -1], cached_expected[:, -1])
    close(after, clean)  # reset_hooks removed it


@pytest.mark.parametrize("name", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.hook_mlp_out",
                                  "blocks.1.attn.hook_pattern"])
def test_a_backward_hook_gets_the_hook_point_s_gradient(models, name):
    ours, theirs = models
    tokens = theirs.to_tokens(PROMPTS)
    with torch.enable_grad():
        expected = forward_and_backward(theirs, tokens, name)
        got = forward_and_backward(ours, tokens, name)  # before: refused (TypeError)
    assert got[0] == pytest.approx(expected[0], abs=1e-4)
    assert list(got[2]) == [name]
    close(got[2][name], expected[2][name])


def test_a_backward_hook_agrees_with_torch_s_own_gradient(models):
    ours, _ = models
    tokens = ours.to_tokens(PROMPTS)
    grads, kept = {}, {}

    def keep(value, hook):
        value.retain_grad()
        kept["value"] = value

    ours.add_hook("blocks.1.hook_resid_pre", keep)
    ours.add_hook("blocks.1.hook_resid_pre", lambda grad, hook: grads.__setitem__("grad", grad), "bwd")
    try:
        with torch.enable_grad():
            metric(ours(tokens)).backward()
    finally:
        ours.reset_hooks()
    torch.testing.assert_close(grads["grad"], kept["value"].grad)


def test_a_backward_hook_returning_a_tensor_replaces_the_gradient(models):
    ours, theirs = models
    tokens = theirs.to_tokens(PROMPTS[0])
    found = []
    for model in (theirs, ours):
        model.add_hook("blocks.1.hook_resid_pre", lambda grad, hook: grad * 0, "bwd")
        grads = {}
        model.add_hook("blocks.0.hook_resid_pre", lambda grad, hook, grads=grads: grads.__setitem__("g", grad.clone()),
                       "bwd")
        try:
            with torch.enable_grad():
                metric(model(tokens)).backward()
        finally:
            model.reset_hooks()
        found.append(grads["g"])
    close(found[1], found[0])


def test_backward_hooks_of_run_with_hooks_end_with_the_call(models):
    ours, _ = models
    called = []
    with torch.enable_grad(), pytest.warns(UserWarning, match="reset_hooks_end"):
        logits = ours.run_with_hooks(PROMPTS[0], bwd_hooks=[("blocks.0.hook_resid_post",
                                                             lambda grad, hook: called.append(1))])
    metric(logits).backward()
    assert called == []  # TransformerLens removes them before any backward pass too
    with torch.enable_grad():
        logits = ours.run_with_hooks(PROMPTS[0], reset_hooks_end=False,
                                     bwd_hooks=[("blocks.0.hook_resid_post", lambda grad, hook: called.append(1))])
    metric(logits).backward()
    ours.reset_hooks()
    assert called == [1]


def test_a_backward_hook_on_a_computed_point_is_refused(models):
    ours, _ = models
    with pytest.raises(nnterp.tools.hook_points.HookError, match="no gradient reaches it"):
        ours.add_hook("blocks.0.attn.hook_result", lambda grad, hook: None, "bwd")


def test_an_attached_sae_s_hook_points_are_named_after_its_site(models):
    ours, theirs = models
    names = {}
    for side, model in (("ours", ours), ("theirs", theirs)):
        sae = make_sae("blocks.1.hook_resid_pre")
        model.add_sae(sae)
        named = {entry: hook.name for entry, hook in sae.hook_dict.items()}
        model.reset_saes()
        kept = copy.deepcopy(sae)
        names[side] = (named, {entry: hook.name for entry, hook in sae.hook_dict.items()}, repr(kept))
    assert names["theirs"][0]["hook_sae_acts_post"] == "blocks.1.hook_resid_pre.hook_sae_acts_post"
    assert names["ours"] == names["theirs"]  # before: the SAE's own names ("hook_sae_acts_post")


def test_to_prints_what_transformer_lens_prints(models):
    ours, theirs = models
    printed = []
    for model in (theirs, ours):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            same = model.to("cpu")
            model.to(torch.device("cpu"))
            model.cpu()
            model.to("cpu", print_details=False)
        assert same is model
        printed.append(out.getvalue())
    assert printed[1] == printed[0]  # before: nothing printed
