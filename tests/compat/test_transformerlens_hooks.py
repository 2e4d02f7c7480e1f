"""TransformerLens code on nnterp by its load line: hook names, cache keys, hooks, loss and generation, compared with
TransformerLens 3.9 itself on the same tiny weights (and with plain PyTorch hooks for the edits)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import nnterp
from nnterp.compat.transformer_lens.config import WeightRefused
from nnterp.tools.hook_points import HookError, get_act_name

from .tl_models import pair

TEXT = "The cat sat on the mat in Paris"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    return pair(request.param, gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer_dir):
    return pair("gpt2", gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def caches(models):
    hf, ours, theirs = models
    with torch.no_grad():
        return ours.run_with_cache(TEXT), theirs.run_with_cache(TEXT)


def close(a, b, atol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4)


def test_every_hook_value_is_transformerlens_s(models, caches):
    _, ours, theirs = models
    (logits, cache), (tl_logits, tl_cache) = caches
    close(logits, tl_logits)
    served = set(cache.keys())
    for name in tl_cache.keys():
        assert name in served, name
        ours_value, theirs_value = cache[name], tl_cache[name]
        if name.endswith("hook_pos_embed"):  # the model's own table output, shared over the batch
            theirs_value = theirs_value[:1]
        assert ours_value.shape == theirs_value.shape, name
        if name.endswith("hook_attn_scores"):  # TransformerLens masks with -inf, transformers with the dtype's minimum
            real = torch.isfinite(theirs_value)
            assert (ours_value[~real] < -1e30).all()
            ours_value, theirs_value = ours_value[real], theirs_value[real]
        close(ours_value, theirs_value)


def test_cache_keys_in_every_transformerlens_form(models, caches):
    _, ours, _ = models
    (_, cache), (_, tl_cache) = caches
    forms = {
        ("resid_post", 0): "blocks.0.hook_resid_post", ("pattern", 1, "attn"): "blocks.1.attn.hook_pattern",
        ("z", 0): "blocks.0.attn.hook_z", ("scale", 1, "ln1"): "blocks.1.ln1.hook_scale",
        ("resid_pre", torch.tensor(1)): "blocks.1.hook_resid_pre", ("mlp_out", np.int64(1)): "blocks.1.hook_mlp_out",
        "ln_final.hook_scale": "ln_final.hook_scale", "hook_embed": "hook_embed", "scale": "ln_final.hook_scale",
    }
    for key, name in forms.items():
        close(cache[key], tl_cache[name])
    assert torch.equal(cache["layer_output", 0], cache["resid_post", 0])  # the standard names beside them
    assert "blocks.0.hook_resid_post" in cache and "blocks.9.hook_resid_post" not in cache
    assert ("layer_output", 1) in cache


def test_a_standard_cache_serves_the_transformerlens_names_it_can(models, caches):
    """A StandardizedTransformer's default cache (standard values) reads TransformerLens's names too, computing the
    norms' scales and each head's result from the values it holds."""
    _, ours, theirs = models
    (_, tl_cache) = caches[1]
    plain = nnterp.StandardizedTransformer(ours._module, tokenizer=ours.tokenizer)
    _, cache = plain.run_with_cache(theirs.to_tokens(TEXT))
    for name in ("blocks.1.hook_resid_mid", "blocks.0.ln1.hook_scale", "blocks.1.ln2.hook_normalized",
                 "ln_final.hook_scale", "ln_final.hook_normalized", "blocks.1.mlp.hook_post", "blocks.0.attn.hook_result",
                 "blocks.0.ln1.hook_normalized"):
        close(cache[name], tl_cache[name])
    with pytest.raises(KeyError, match="names_filter"):
        cache["hook_embed"]


def test_names_filter_caches_what_it_chooses(models, caches):
    _, ours, theirs = models
    (_, tl_cache) = caches[1]
    _, cache = ours.run_with_cache(TEXT, names_filter=lambda name: name.endswith("hook_z"))
    assert cache.keys() == [f"blocks.{i}.attn.hook_z" for i in range(2)]
    close(cache["z", 1], tl_cache["z", 1])
    _, cache = ours.run_with_cache(TEXT, names_filter=["blocks.1.attn.hook_pattern", "hook_embed"],
                                   remove_batch_dim=True)
    close(cache["pattern", 1], tl_cache["pattern", 1][0])
    assert not ours._nnterp_attention_on  # turned on for the call only
    residual, _ = ours.run_with_cache(TEXT, names_filter="hook_embed", stop_at_layer=1)
    close(residual, tl_cache["blocks.1.hook_resid_pre"])


def ablate_head(z, hook):
    z[:, :, 1] = 0  # in place: None returned


def zero_position(resid, hook):
    resid = resid.clone()
    resid[:, 3] = 0
    return resid


def test_run_with_hooks_edits_as_transformerlens(models):
    _, ours, theirs = models
    hooks = [("blocks.1.hook_resid_post", zero_position), ("blocks.0.attn.hook_z", ablate_head)]  # any order
    with torch.no_grad():
        expected = theirs.run_with_hooks(TEXT, fwd_hooks=hooks)
        clean = theirs(TEXT)
        got = ours.run_with_hooks(TEXT, fwd_hooks=hooks)
        close(got, expected)
        assert (got - clean).abs().max() > 1e-2  # the edits changed the logits
        # TransformerLens's semantics of the stream between the sublayers: resid_mid is the stream (the MLP and the
        # residual both read the edit), mlp_in a copy only the MLP's norm reads
        for name in ("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_in", "blocks.1.hook_resid_pre",
                     "blocks.0.mlp.hook_pre", "hook_embed"):
            close(ours.run_with_hooks(TEXT, fwd_hooks=[(name, zero_position)]),
                  theirs.run_with_hooks(TEXT, fwd_hooks=[(name, zero_position)]))
        # a predicate hook applies to every matching name
        everywhere = [(lambda name: name.endswith("hook_z"), ablate_head)]
        close(ours.run_with_hooks(TEXT, fwd_hooks=everywhere), theirs.run_with_hooks(TEXT, fwd_hooks=everywhere))


def test_a_hook_edit_reaches_the_model_as_a_pytorch_hook_would(gpt2):
    hf, ours, _ = gpt2
    ids = ours.to_tokens(TEXT)
    handle = hf.transformer.h[1].register_forward_hook(lambda module, args, output: zero_position(output, None))
    try:
        with torch.no_grad():
            expected = hf(ids).logits
    finally:
        handle.remove()
    with torch.no_grad():
        close(ours.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_post", zero_position)]), expected)


def test_hooks_context_manager(models):
    _, ours, theirs = models
    hooks = [("blocks.0.attn.hook_z", ablate_head)]
    with torch.no_grad():
        with theirs.hooks(fwd_hooks=hooks):
            expected = theirs(TEXT)
        with ours.hooks(fwd_hooks=hooks):
            got = ours(TEXT)
            logits, cache = ours.run_with_cache(TEXT)
            assert cache["z", 0][:, :, 1].abs().max() == 0  # the cache holds what the hook left
        close(got, expected)
        close(logits, expected)
        close(ours(TEXT), theirs(TEXT))  # gone after the block
        assert (ours(TEXT) - got).abs().max() > 1e-3


def test_loss_and_per_token_loss(models):
    _, ours, theirs = models
    with torch.no_grad():
        close(ours(TEXT, return_type="loss"), theirs(TEXT, return_type="loss"))
        close(ours(TEXT, return_type="loss", loss_per_token=True),
              theirs(TEXT, return_type="loss", loss_per_token=True))
        logits, loss = ours(TEXT, return_type="both")
        close(loss, theirs(TEXT, return_type="loss"))
        close(ours.loss_per_token(TEXT), theirs(TEXT, return_type="loss", loss_per_token=True))
        assert ours(TEXT, return_type=None) is None
        # the loss from the logits by the math: the mean negative log-probability of each next token
        ids = ours.to_tokens(TEXT)
        log_probs = ours(ids).log_softmax(-1)[0, :-1]
        close(ours(ids, return_type="loss"), -log_probs.gather(-1, ids[0, 1:, None]).mean())


def test_generate_as_transformerlens(models):
    _, ours, theirs = models
    greedy = ours.generate(TEXT, max_new_tokens=6, do_sample=False)
    assert greedy == theirs.generate(TEXT, max_new_tokens=6, do_sample=False, verbose=False)
    tokens = ours.to_tokens(TEXT)
    assert torch.equal(ours.generate(tokens, max_new_tokens=4, do_sample=False),
                       theirs.generate(tokens, max_new_tokens=4, do_sample=False, verbose=False))
    torch.manual_seed(0)
    sampled = ours.generate(TEXT, max_new_tokens=6)
    torch.manual_seed(0)
    assert ours.generate(TEXT, max_new_tokens=6) == sampled != greedy
    torch.manual_seed(0)
    assert ours.generate(TEXT, max_new_tokens=6, top_k=1) == greedy  # top_k honoured


def test_the_tools_that_generate_still_trace_nnsight_s_generation(gpt2, tmp_path):
    """HookedTransformer.generate is TransformerLens's; the tools open nnsight's generation tracer all the same."""
    hf, ours, _ = gpt2
    prompt = ours.to_tokens("The cat")  # with its BOS, as TransformerLens tokenizes
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                               min_new_tokens=3, pad_token_id=50256)
    ids, cache = ours.run_with_cache(prompt, names=["layer_output"], max_new_tokens=3)
    assert torch.equal(ids, expected) and cache["layer_output", 1].shape[1] == prompt.shape[1] + 2
    steered = nnterp.steered_generate(ours, prompt, layers=1, vector=torch.zeros(ours.hidden_size), max_new_tokens=3)
    assert steered is not None
    # a HookedTransformer pads on the right, as TransformerLens does: a batch generation of nnterp's tools says so
    with pytest.raises(ValueError, match="right-padded"):
        nnterp.collect(ours, ["The cat", "A dog sat"], tmp_path / "right", ["layer_output"], layers=[1],
                       max_new_tokens=2, progress=False)
    ours.tokenizer.padding_side = "left"
    try:
        collection = nnterp.collect(ours, ["The cat", "A dog sat"], tmp_path, ["layer_output"], layers=[1],
                                    max_new_tokens=2, progress=False)
    finally:
        ours.tokenizer.padding_side = "right"
    assert collection.rows == 2 and collection["layer_output"].shape[0] == 2


def test_get_act_name_is_transformerlens_s():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from transformer_lens.utils import get_act_name as theirs
    names = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_in", "embed", "pos_embed", "q", "k",
             "v", "z", "rot_q", "rot_k", "result", "pattern", "attn", "attn_scores", "attn_logits", "key", "query",
             "value", "pre", "post", "mid", "pre_linear", "mlp_pre", "mlp_post", "mlp_mid", "scale", "normalized"]
    cases = [(n, layer, kind) for n in names for layer in (None, 0, 5) for kind in (None, "a", "m", "b", "block",
                                                                                  "blocks", "attention", "ln1", "ln2")]
    cases += [("k6",), ("scale4ln1",), ("pre5",), ("blocks.3.hook_resid_post",), ("hook_embed",), ("normalized27ln2",)]
    for case in cases:
        assert get_act_name(*case) == theirs(*case), case
    import nnterp.utils

    assert nnterp.utils.get_act_name("resid_post", 5) == "blocks.5.hook_resid_post"


def test_cfg_and_weights(models):
    _, ours, theirs = models
    for field in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "n_key_value_heads",
                  "act_fn", "normalization_type", "positional_embedding_type", "default_prepend_bos",
                  "original_architecture"):
        assert getattr(ours.cfg, field) == getattr(theirs.cfg, field), field
    close(ours.W_U, theirs.W_U)
    close(ours.b_U, theirs.b_U)
    close(ours.W_E, theirs.W_E)
    if ours.cfg.positional_embedding_type == "standard":
        close(ours.W_pos, theirs.W_pos)
    else:
        with pytest.raises(WeightRefused, match="no learned position embeddings"):
            ours.W_pos  # noqa: B018
    close(ours.W_Q, theirs.W_Q)  # the blocks' weights: tests/compat/test_transformerlens_demos.py
    with pytest.raises(AttributeError, match="read from the model"):
        ours.cfg.n_layers = 3


def test_refusals_say_what_to_do(models):
    hf, ours, _ = models
    with pytest.raises(HookError, match="Edit blocks.0.attn.hook_z "):
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_result", lambda t, hook: t * 0)])
    def double_in_place(tensor, hook):
        tensor.mul_(2)

    with pytest.raises(HookError, match="computes from the pass"):
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.ln1.hook_scale", double_in_place)])
    with pytest.raises(HookError, match="no gradient reaches it"):
        ours.run_with_hooks(TEXT, bwd_hooks=[("blocks.0.attn.hook_result", ablate_head)])
    with pytest.raises(TypeError, match=r"device=.*cache\[name\]\.to\(device\)"):
        ours.run_with_cache(TEXT, device="cpu")
    with pytest.raises(TypeError, match="start_at_layer=.*layer_input"):
        ours(TEXT, start_at_layer=1)
    with pytest.raises(TypeError, match="run_with_hooks got colour: its arguments are input, fwd_hooks"):
        ours.run_with_hooks(TEXT, colour=1)
    with pytest.raises(TypeError, match="generate got num_beams"):
        ours.generate(TEXT, num_beams=2)
    with pytest.raises(HookError, match="not a TransformerLens hook name"):
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.hook_nothing", ablate_head)])
    with pytest.raises(ValueError, match="fold_ln=True.*checkpoint's own weights"):
        nnterp.HookedTransformer.from_pretrained("x", hf_model=hf, tokenizer=ours.tokenizer, fold_ln=True)
    if ours.cfg.positional_embedding_type == "rotary":
        with pytest.raises(AttributeError, match="no learned position embeddings"):
            ours.run_with_hooks(TEXT, fwd_hooks=[("hook_pos_embed", ablate_head)])
    else:
        with pytest.raises(AttributeError, match="no rotary embeddings"):
            ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_rot_q", ablate_head)])


def test_a_hook_is_told_its_name_and_layer(gpt2):
    _, ours, _ = gpt2
    seen = []
    ours.run_with_hooks(TEXT, fwd_hooks=[(lambda name: name.endswith("resid_post") or name == "hook_embed",
                                          lambda tensor, hook: seen.append((hook.name, hook.layer() if "blocks" in
                                                                            hook.name else None)))])
    assert seen == [("hook_embed", None), ("blocks.0.hook_resid_post", 0), ("blocks.1.hook_resid_post", 1)]


def test_from_pretrained_loads_a_folder(gpt2, tmp_path):
    hf, ours, theirs = gpt2
    hf.save_pretrained(tmp_path)
    ours.tokenizer.save_pretrained(tmp_path)
    loaded = nnterp.HookedTransformer.from_pretrained_no_processing(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        close(loaded(TEXT), theirs(TEXT))
    plain = nnterp.StandardizedTransformer(str(tmp_path))
    logits, cache = plain.run_with_cache(TEXT, prepend_bos=True)
    assert torch.equal(cache.input_ids, theirs.to_tokens(TEXT))
    with torch.no_grad():
        close(logits, theirs(TEXT))


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_batch_gives_transformerlens_s_logits_on_its_real_tokens(models, side):
    """Both pad the shorter text and mask it out; the real tokens' logits agree on either side (the pads' do not:
    TransformerLens runs a right-padded batch without a mask)."""
    _, ours, theirs = models
    texts = [TEXT, "A dog"]
    _, mask = nnterp.core.tokens.tokenized(ours, texts, padding_side=side)
    real = mask.bool()
    with torch.no_grad():
        close(ours(texts, padding_side=side)[real], theirs(texts, padding_side=side)[real])
