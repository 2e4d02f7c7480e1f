"""SAEs on a HookedTransformer where SAELens code can observe them: an SAE at ``hook_mlp_in`` (TransformerLens's copy
of the stream that only the MLP's norm reads), SAEs during generation, and ``remove_batch_dim`` on the SAE entries.
Ground truth is SAELens 6's ``HookedSAETransformer`` itself, on the same tiny weights."""

from __future__ import annotations

import pytest
import torch

from ..tools.test_saelens_interop import sae_lens
from .tl_models import pair

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
TEXT = "The cat sat on the mat in Paris"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    _, ours, theirs = pair(request.param, gpt2_tokenizer_dir, model_class=sae_lens.HookedSAETransformer)
    return ours, theirs


def make_sae(hook: str, d_in: int = 64, seed: int = 0):
    """A SAELens JumpReLU SAE at ``hook``, random weights off SAELens's initial zeros and ones."""
    config = sae_lens.JumpReLUSAEConfig(d_in=d_in, d_sae=48)
    config.metadata.hook_name = hook
    torch.manual_seed(seed)
    sae = sae_lens.JumpReLUSAE(config)
    with torch.no_grad():
        for name, parameter in sae.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.1 if parameter.dim() == 1 else 0.3))
            if name == "threshold":
                parameter.abs_()
    return sae.eval()


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def test_an_sae_at_hook_mlp_in_feeds_the_mlp_not_the_stream(models):
    ours, theirs = models
    sae = make_sae("blocks.0.hook_mlp_in")
    with torch.no_grad():
        expected, expected_cache = theirs.run_with_cache_with_saes(TEXT, saes=[sae])
        logits, cache = ours.run_with_cache_with_saes(TEXT, saes=[sae])
        assert (expected - theirs(TEXT)).abs().max() > 1e-2  # the SAE changes SAELens's logits
    close(logits, expected)  # before: spliced into the stream, logits ~3 apart
    close(cache["blocks.0.hook_resid_post"], expected_cache["blocks.0.hook_resid_post"])
    close(cache["blocks.0.hook_mlp_in.hook_sae_output"], expected_cache["blocks.0.hook_mlp_in.hook_sae_output"])
    close(ours.run_with_saes(TEXT, saes=[sae]), expected)


def test_an_attached_sae_runs_in_every_generation_step(models):
    ours, theirs = models
    sae = make_sae("blocks.1.hook_resid_post")
    settings = dict(max_new_tokens=5, do_sample=False, verbose=False, return_type="tokens")
    clean = theirs.generate(TEXT, **settings)
    theirs.add_sae(sae)
    ours.add_sae(sae)
    try:
        expected = theirs.generate([TEXT, "Hi"], **settings)
        got = ours.generate([TEXT, "Hi"], **settings)
    finally:
        theirs.reset_saes()
        ours.reset_saes()
    assert not torch.equal(expected[:1, :clean.shape[1]], clean)  # the SAE changes SAELens's generation
    assert torch.equal(got, expected)  # before: the SAE ran in the prompt's pass only


def test_remove_batch_dim_removes_it_from_the_sae_entries(models):
    ours, theirs = models
    sae = make_sae("blocks.1.hook_resid_post")
    with torch.no_grad():
        expected, expected_cache = theirs.run_with_cache_with_saes(TEXT, saes=[sae], remove_batch_dim=True)
        logits, cache = ours.run_with_cache_with_saes(TEXT, saes=[sae], remove_batch_dim=True)
    close(logits, expected)
    for entry in ("hook_sae_acts_post", "hook_sae_input", "hook_sae_output"):
        name = f"blocks.1.hook_resid_post.{entry}"
        assert cache[name].shape == expected_cache[name].shape, name
        close(cache[name], expected_cache[name])


def test_run_with_saes_takes_the_model_calls_arguments(models):
    """SAELens hands run_with_saes's other keywords to the model's call: prepend_bos, padding_side, stop_at_layer
    (before, a bare TypeError)."""
    ours, theirs = models
    sae = make_sae("blocks.0.hook_resid_post")
    batch = [TEXT, "Hi"]
    # TransformerLens masks a batch's pads where its tokenizer pads on the left (padding_side= alone does not)
    sides = theirs.tokenizer.padding_side, ours.tokenizer.padding_side
    theirs.tokenizer.padding_side = ours.tokenizer.padding_side = "left"
    with torch.no_grad():
        for options in ({"prepend_bos": False}, {"padding_side": "left"}, {"stop_at_layer": 1},
                        {"padding_side": "right", "prepend_bos": True, "stop_at_layer": 1}):
            expected = theirs.run_with_saes(batch, saes=[sae], **options)
            got = ours.run_with_saes(batch, saes=[sae], **options)
            assert got.shape == expected.shape, options
            length = theirs.to_tokens("Hi", prepend_bos=options.get("prepend_bos", True)).shape[1]
            real = slice(None, length) if options.get("padding_side") == "right" else slice(-length, None)
            close(got[0], expected[0])
            close(got[1, real], expected[1, real])
    theirs.tokenizer.padding_side, ours.tokenizer.padding_side = sides
    with pytest.raises(TypeError, match="its arguments are"):
        ours.run_with_saes(TEXT, saes=[sae], start_at_layer=1)
