"""A hook that returns fewer positions than the pass has (SAELens's loading tutorial: an SAE's output for the prompt
returned in a pass over the prompt and its answer): TransformerLens runs on with those positions. Against
TransformerLens 3.9 itself on the same tiny GPT-2 and Llama weights."""

from __future__ import annotations

import pytest
import torch

from nnterp.tools.hook_points import HookError

from .tl_models import pair

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
TEXT = "When John and Mary went to the shops, John gave the bag to"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    _, ours, theirs = pair(request.param, gpt2_tokenizer_dir)
    return ours, theirs


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def test_a_hook_returning_fewer_positions_runs_on_with_them(models):
    ours, theirs = models
    with torch.no_grad():
        _, cache = theirs.run_with_cache(TEXT)
    prompt = cache["blocks.1.hook_resid_pre"] * 1.5  # computed for the prompt alone
    tokens = theirs.to_tokens(TEXT + " Mary")  # one position more
    results = []
    for model in (theirs, ours):
        seen = {}

        def later(value, hook, seen=seen):
            seen[hook.name] = value.clone()

        hooks = [("blocks.1.hook_resid_pre", lambda value, hook: prompt),
                 ("blocks.1.attn.hook_pattern", later), ("blocks.1.hook_resid_post", later)]
        with torch.no_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
            with model.hooks(fwd_hooks=hooks[:1]):
                called = model(tokens)
        results.append((logits, called, seen))
    (expected, expected_call, expected_seen), (got, got_call, got_seen) = results
    assert expected.shape[1] == tokens.shape[1] - 1
    assert got.shape == expected.shape  # before: refused (BadAssignment)
    close(got, expected)
    close(got_call, expected_call)
    for name, value in expected_seen.items():
        assert got_seen[name].shape == value.shape
        close(got_seen[name], value)


def test_the_loss_of_a_shortened_pass_is_refused_as_it_fails_in_transformer_lens(models):
    ours, theirs = models
    tokens = theirs.to_tokens(TEXT)
    hooks = [("blocks.1.hook_resid_pre", lambda value, hook: value[:, :-1])]
    with torch.no_grad(), pytest.raises(RuntimeError):
        theirs.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss")
    with torch.no_grad(), pytest.raises(HookError, match="positions"):
        ours.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss")
