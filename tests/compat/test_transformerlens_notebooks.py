"""What TransformerLens's own notebooks observe (benchmarks/demo_cells.py runs them cell by cell), each compared with
TransformerLens 3.9 or SAELens 6 themselves on the same tiny weights."""

from __future__ import annotations

import pytest
import torch

from .tl_models import pair

TEXT = "The cat sat on the mat"
BATCH = ["The cat sat on the mat in Paris", "Hi"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    return pair(request.param, gpt2_tokenizer_dir)


def close(a, b, atol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4)


def test_hook_attn_scores_holds_minus_infinity_where_masked_as_transformerlens(models):
    # the Main Demo compares whole caches: transformers masks with the dtype's lowest value, TransformerLens with -inf
    _, ours, theirs = models
    with torch.no_grad():
        _, expected = theirs.run_with_cache(TEXT, remove_batch_dim=True)
        _, cache = ours.run_with_cache(TEXT, remove_batch_dim=True)
        _, filtered = ours.run_with_cache(TEXT, names_filter=["blocks.1.attn.hook_attn_scores"])
    for layer in (0, 1):
        scores = expected[f"blocks.{layer}.attn.hook_attn_scores"]
        assert scores.isneginf().any()
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_attn_scores"], scores, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(filtered["blocks.1.attn.hook_attn_scores"][0], expected["blocks.1.attn.hook_attn_scores"],
                               atol=2e-5, rtol=1e-4)
    # what a hook is called with
    seen = {}

    def record(scores, hook):
        seen[hook.name] = scores.clone()

    with torch.no_grad():
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_attn_scores", record)])
    close(seen["blocks.0.attn.hook_attn_scores"][0], expected["blocks.0.attn.hook_attn_scores"])


@pytest.mark.parametrize("in_place", [True, False])
def test_an_edit_of_hook_attn_scores_reaches_the_model_as_in_transformerlens(models, in_place):
    _, ours, theirs = models

    def double(scores, hook):
        if in_place:
            scores.mul_(2.0)
            return None
        return scores * 2.0

    with torch.no_grad():
        plain = theirs(TEXT)
        expected = theirs.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_attn_scores", double)])
        logits = ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_attn_scores", double)])
    assert (expected - plain).abs().max() > 1e-3
    close(logits, expected)
    assert logits.isfinite().all()


def test_a_padded_batch_keeps_its_scores_and_logits_finite(models):
    _, ours, theirs = models
    sides = ours.tokenizer.padding_side, theirs.tokenizer.padding_side
    ours.tokenizer.padding_side = theirs.tokenizer.padding_side = "left"
    try:
        tokens = theirs.to_tokens(BATCH)
        real = slice(-theirs.to_tokens(BATCH[1]).shape[1], None)
        with torch.no_grad():
            expected, expected_cache = theirs.run_with_cache(tokens)
            logits, cache = ours.run_with_cache(tokens)
            hooked = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda s, hook: s * 1.0)])
    finally:
        ours.tokenizer.padding_side, theirs.tokenizer.padding_side = sides
    key = "blocks.1.attn.hook_attn_scores"
    close(cache[key][1, :, real, real], expected_cache[key][1, :, real, real])
    close(cache[key][0], expected_cache[key][0])
    close(hooked[1, real], expected[1, real])
    assert hooked[1].isfinite().all()  # the pads' rows, all masked, run as unhooked (no NaN from a -inf row)


@pytest.fixture(scope="module")
def gpt2_models(gpt2_tokenizer_dir):
    return pair("gpt2", gpt2_tokenizer_dir)


def test_hook_pos_embed_has_the_batch_axis_transformerlens_broadcasts_it_to(gpt2_models):
    # the Exploratory Analysis Demo caches a batch of 8 prompts: TransformerLens's hook_pos_embed is [8, pos, d_model]
    _, ours, theirs = gpt2_models
    tokens = theirs.to_tokens(["The cat sat on the mat", "A dog sat on the mat"])
    with torch.no_grad():
        _, expected = theirs.run_with_cache(tokens)
        _, cache = ours.run_with_cache(tokens)
        _, filtered = ours.run_with_cache(tokens, names_filter=lambda name: name == "hook_pos_embed")
    assert expected["hook_pos_embed"].shape[0] == 2
    close(cache["hook_pos_embed"], expected["hook_pos_embed"])
    close(filtered["hook_pos_embed"], expected["hook_pos_embed"])

    def edit_second_prompt(pos_embed, hook):
        pos_embed[1, 2, :8] += 2.0  # in place, one prompt's position only (not by a constant: the norm centres it)

    with torch.no_grad():
        plain = theirs(tokens)
        wanted = theirs.run_with_hooks(tokens, fwd_hooks=[("hook_pos_embed", edit_second_prompt)])
        logits = ours.run_with_hooks(tokens, fwd_hooks=[("hook_pos_embed", edit_second_prompt)])
    close(wanted[0], plain[0])
    assert (wanted[1] - plain[1]).abs().max() > 1e-3
    close(logits, wanted)


def test_hooks_on_every_name_are_called_in_transformerlens_order(models):
    # the Main Demo prints the hook names a predicate hooks, as the pass calls them
    _, ours, theirs = models
    called = {"ours": [], "theirs": []}

    def recorder(side):
        def record(x, hook):
            called[side].append(hook.name)
        return record

    first_block = lambda name: name.startswith("blocks.0.") or not name.startswith("blocks")  # noqa: E731
    with torch.no_grad():
        theirs.run_with_hooks(TEXT, return_type=None, fwd_hooks=[(first_block, recorder("theirs"))])
        ours.run_with_hooks(TEXT, return_type=None, fwd_hooks=[(first_block, recorder("ours"))])
    both = set(called["ours"]) & set(called["theirs"])
    assert {"blocks.0.ln1.hook_scale", "blocks.0.ln1.hook_normalized", "blocks.0.ln2.hook_scale",
            "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_in", "blocks.0.attn.hook_z"} <= both
    # the order of each name's first call (TransformerLens calls ln1's hooks once per query, key and value input)
    first = {side: [n for n in dict.fromkeys(names) if n in both] for side, names in called.items()}
    assert first["ours"] == first["theirs"]
