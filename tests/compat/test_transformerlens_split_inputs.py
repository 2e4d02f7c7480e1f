"""TransformerLens's split attention inputs (``set_use_split_qkv_input(True)``, ``blocks.L.hook_q_input`` /
``hook_k_input`` / ``hook_v_input``: a copy of the stream per head): read and edited per head, against TransformerLens
3.9 itself on the same tiny GPT-2 and Llama weights."""

from __future__ import annotations

import pytest
import torch

from nnterp.spec.errors import ValueUnavailable

from .tl_models import pair

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
TEXT = ["The cat sat on the mat in Paris", "The dog sat on the rug in Rome"]  # one length: no pads


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    _, ours, theirs = pair(request.param, gpt2_tokenizer_dir)
    for model in (ours, theirs):
        model.set_use_split_qkv_input(True)
    yield ours, theirs
    ours.set_use_split_qkv_input(False)


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_editing_one_head_s_copy_changes_that_head_only(models, which):
    ours, theirs = models
    direction = torch.randn(ours.cfg.d_model, generator=torch.Generator().manual_seed(0))
    seen = {}

    def patch(copies, hook):  # the Hooked SAE Transformer Demo's path patching of one head's value input
        copies[:, 3, 1, :] = copies[:, 3, 1, :] - direction
        return copies

    def record(values, hook, side):
        seen[side] = values.clone()

    got = []
    with torch.no_grad():
        for side, model in (("theirs", theirs), ("ours", ours)):
            got.append(model.run_with_hooks(TEXT, fwd_hooks=[
                (f"blocks.1.hook_{which}_input", patch),
                (f"blocks.1.attn.hook_{which}", lambda values, hook, side=side: record(values, hook, side))]))
        clean = theirs(TEXT)
    assert (got[0] - clean).abs().max() > 1e-3  # the patch changes TransformerLens's logits
    close(got[1], got[0])  # before: hook_q_input refused (not a hook name nnterp serves)
    close(seen["ours"], seen["theirs"])  # the patched head's values, and the others' as they were


def test_the_copies_are_cached(models):
    ours, theirs = models
    with torch.no_grad():
        _, cache = ours.run_with_cache(TEXT)
        _, expected = theirs.run_with_cache(TEXT)
    for name in ("blocks.0.hook_q_input", "blocks.1.hook_k_input", "blocks.1.hook_v_input"):
        assert cache[name].shape == expected[name].shape
        close(cache[name], expected[name])


def test_without_the_switch_they_are_not_there(models):
    ours, _ = models
    ours.set_use_split_qkv_input(False)
    try:
        with pytest.raises(ValueUnavailable, match=r"set_use_split_qkv_input\(True\)"):
            ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.1.hook_v_input", lambda copies, hook: None)])
        with torch.no_grad():
            _, cache = ours.run_with_cache(TEXT)
        assert "blocks.1.hook_v_input" not in cache.keys()
    finally:
        ours.set_use_split_qkv_input(True)
    with pytest.raises(TypeError, match="hook_attn_in"):
        ours.set_use_attn_in(True)
