"""TransformerLens's semantics where TransformerLens code can observe them: padded token batches, hook edits in place,
remove_batch_dim, generation (padding, EOS, hooks), and the tokenizer a user passes left as it was. Each is compared
with TransformerLens 3.9 itself on the same tiny weights."""

from __future__ import annotations

import pytest
import torch
import transformers

import nnterp

from .tl_models import pair, tiny_gpt2

BATCH = ["The cat sat on the mat in Paris", "Hi"]
TEXT = "The cat sat on the mat"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    return pair(request.param, gpt2_tokenizer_dir)


@pytest.fixture
def left(models):
    """Both tokenizers pad on the left for the test, as they were after it."""
    _, ours, theirs = models
    sides = ours.tokenizer.padding_side, theirs.tokenizer.padding_side
    ours.tokenizer.padding_side = theirs.tokenizer.padding_side = "left"
    yield models
    ours.tokenizer.padding_side, theirs.tokenizer.padding_side = sides


def close(a, b, atol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4)


def test_a_left_padded_token_batch_is_masked_as_transformerlens_masks_it(left):
    _, ours, theirs = left
    tokens = theirs.to_tokens(BATCH)
    assert torch.equal(ours.to_tokens(BATCH), tokens) and (tokens[1, :3] == theirs.tokenizer.pad_token_id).all()
    real = slice(-theirs.to_tokens(BATCH[1]).shape[1], None)  # the short prompt's BOS and tokens, ending the row
    with torch.no_grad():
        expected, expected_cache = theirs.run_with_cache(tokens)
        close(ours(tokens)[1, real], expected[1, real])  # before: the short prompt attended to its pads (off by 1-2)
        close(ours(tokens)[0], expected[0])
        logits, cache = ours.run_with_cache(tokens)
    close(logits[1, real], expected[1, real])
    close(cache["blocks.1.hook_resid_post"][1, real], expected_cache["blocks.1.hook_resid_post"][1, real])
    close(ours.run_with_hooks(tokens)[1, real], expected[1, real])


def test_an_in_place_edit_of_hook_mlp_in_reaches_the_mlp(models):
    _, ours, theirs = models

    def edit(x, hook):
        x[:, :, 0] += 5.0  # in place, None returned

    with torch.no_grad():
        expected = theirs.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.hook_mlp_in", edit)])
        got = ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.hook_mlp_in", edit)])
        assert (expected - theirs(TEXT)).abs().max() > 1e-2  # the edit moves TransformerLens's logits
    close(got, expected)


def test_remove_batch_dim_keeps_the_logits_batch_axis(models):
    _, ours, theirs = models
    with torch.no_grad():
        expected, expected_cache = theirs.run_with_cache(TEXT, remove_batch_dim=True)
        logits, cache = ours.run_with_cache(TEXT, remove_batch_dim=True)
        stream, _ = ours.run_with_cache(TEXT, remove_batch_dim=True, stop_at_layer=1)
        expected_stream, _ = theirs.run_with_cache(TEXT, remove_batch_dim=True, stop_at_layer=1)
    assert logits.shape == expected.shape and logits.dim() == 3
    close(logits[0, -1], expected[0, -1])
    assert stream.shape == expected_stream.shape
    assert cache["blocks.1.hook_resid_post"].shape == expected_cache["blocks.1.hook_resid_post"].shape


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_batch_generates_left_padded_whatever_padding_side_says(models, padding_side):
    _, ours, theirs = models
    settings = dict(max_new_tokens=5, do_sample=False, verbose=False, return_type="tokens")
    expected = theirs.generate(BATCH, padding_side=padding_side, **settings)
    assert torch.equal(ours.generate(BATCH, padding_side=padding_side, **settings), expected)


def test_left_padded_token_ids_generate_masked(left):
    _, ours, theirs = left
    tokens = theirs.to_tokens(BATCH)
    settings = dict(max_new_tokens=5, do_sample=False, verbose=False)
    assert torch.equal(ours.generate(tokens, **settings), theirs.generate(tokens, **settings))


def test_a_finished_row_goes_on_with_the_eos_transformerlens_fills_with(models):
    _, ours, theirs = models
    settings = dict(do_sample=False, verbose=False, return_type="tokens")
    eos = int(theirs.generate(BATCH, max_new_tokens=1, **settings)[0, -1])  # row 0 finishes at once
    assert eos != theirs.tokenizer.eos_token_id
    expected = theirs.generate(BATCH, max_new_tokens=4, eos_token_id=eos, **settings)
    assert (expected[0, -4:] == eos).all()  # before: filled with the tokenizer's pad token
    assert torch.equal(ours.generate(BATCH, max_new_tokens=4, eos_token_id=eos, **settings), expected)


def test_hooks_on_the_model_run_in_every_generation_step(models):
    _, ours, theirs = models
    settings = dict(max_new_tokens=4, do_sample=False, verbose=False, return_type="tokens")

    def edit(x, hook):
        x[:, :, 3] += 4.0

    try:
        theirs.add_hook("blocks.0.hook_resid_post", edit)
        ours.add_hook("blocks.0.hook_resid_post", edit)
        expected = theirs.generate(BATCH, **settings)
        got = ours.generate(BATCH, **settings)  # before: refused
    finally:
        theirs.reset_hooks()
        ours.reset_hooks()
    assert torch.equal(got, expected)
    assert not torch.equal(got, ours.generate(BATCH, **settings))  # the hook changed the generation


def test_the_tokenizer_passed_is_left_as_it_was(gpt2_tokenizer_dir):
    """A tokenizer shared with a TransformerLens model: building nnterp's model from it changes nothing that
    TransformerLens reads (before, nnsight's padding side "left" made TransformerLens mask and shift the batch)."""
    from .tl_models import transformer_lens_model

    shared = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    hf = tiny_gpt2()
    theirs = transformer_lens_model(hf, shared)
    state = shared.padding_side, shared.pad_token, shared.bos_token, len(shared)
    tokens = theirs.to_tokens(BATCH)
    with torch.no_grad():
        expected = theirs(tokens)
        nnterp.HookedTransformer.from_pretrained("gpt2", hf_model=hf, tokenizer=shared)
        nnterp.StandardizedTransformer(hf, tokenizer=shared)
        assert (shared.padding_side, shared.pad_token, shared.bos_token, len(shared)) == state
        assert torch.equal(theirs.to_tokens(BATCH), tokens)
        assert torch.equal(theirs(tokens), expected)


def test_activation_patching_keeps_the_bos_and_runs_the_models_hooks(models):
    """nnterp's activation_patching on a HookedTransformer against TransformerLens's own patching
    (``patching.get_act_patch_resid_pre``): positions as ``to_str_tokens`` counts them (the BOS first), and the hooks
    left on the model by ``add_hook`` run in every pass, as TransformerLens's ``run_with_hooks`` runs them."""
    from transformer_lens import patching

    _, ours, theirs = models
    clean, corrupted = "The cat sat on the mat", "The dog sat on the rug"
    answer = theirs.to_single_token(" the")

    def metric(logits):
        return logits[:, -1, answer].mean()

    def edit(x, hook):
        x[:, :, 5] += 3.0

    results = []
    for hooked in (False, True):
        if hooked:
            theirs.add_hook("blocks.0.hook_attn_out", edit)
            ours.add_hook("blocks.0.hook_attn_out", edit)
        try:
            with torch.no_grad():
                _, clean_cache = theirs.run_with_cache(clean)
                expected = patching.get_act_patch_resid_pre(theirs, theirs.to_tokens(corrupted), clean_cache, metric)
            got = nnterp.activation_patching(ours, clean, corrupted, metric, value="layer_input", progress=False)
        finally:
            theirs.reset_hooks()
            ours.reset_hooks()
        assert got.shape == expected.shape == (2, len(ours.to_str_tokens(clean)))
        close(got, expected.cpu(), atol=1e-4)
        results.append(expected)
    assert (results[0] - results[1]).abs().max() > 1e-3  # the hook changes TransformerLens's patching


def test_stop_at_layer_never_calls_the_hooks_past_the_stop(models):
    _, ours, theirs = models
    results = {}
    for model in (theirs, ours):
        calls = []

        def record(x, hook, calls=calls):
            calls.append(hook.name)
            x[:, :, 2] += 1.0

        hooks = [("blocks.1.hook_resid_post", record), ("blocks.0.hook_resid_post", record), ("ln_final.hook_scale",
                                                                                                  lambda x, hook: None)]
        with torch.no_grad():
            stream = model.run_with_hooks(TEXT, fwd_hooks=hooks, stop_at_layer=1)  # before: OutOfOrderError
            model.add_hook("blocks.1.attn.hook_z", record)
            try:
                cached, cache = model.run_with_cache(TEXT, stop_at_layer=1)
            finally:
                model.reset_hooks()
        results[model is ours] = stream, cached, calls, cache["blocks.0.hook_resid_post"]
    (stream, cached, calls, resid), (expected, expected_cached, expected_calls, expected_resid) = results[True], results[False]
    assert calls == expected_calls == ["blocks.0.hook_resid_post"]
    close(stream, expected)
    close(cached, expected_cached)
    close(resid, expected_resid)


@pytest.mark.parametrize("case", ["qwen3", "olmo2"])
def test_hook_q_and_hook_k_are_the_projections_output_before_the_query_and_key_norms(case):
    """TransformerLens records hook_q / hook_k at q_proj / k_proj's output, per head, before the norm of the queries
    and keys (Qwen3's per head, OLMo-2's over the whole width); before, refused. Checked against plain PyTorch hooks
    on the projections, reading and editing."""
    from nnterp.families import BY_MODEL_TYPE

    from ..conftest import build_tiny, tiny_tokenizer

    hf = build_tiny(BY_MODEL_TYPE[case].tiny_config())
    model = nnterp.HookedTransformer.from_pretrained(case, hf_model=hf, tokenizer=tiny_tokenizer())
    attention = model._module.model.layers[1].self_attn
    head_dim = attention.head_dim
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    seen = {}
    handles = [getattr(attention, f"{w}_proj").register_forward_hook(
        lambda m, a, out, w=w: seen.__setitem__(w, out.detach().unflatten(-1, (-1, head_dim)))) for w in "qk"]
    try:
        with torch.no_grad():
            plain = hf(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    _, cache = model.run_with_cache(ids, names_filter=["blocks.1.attn.hook_q", "blocks.1.attn.hook_k"])
    assert torch.equal(cache["q", 1], seen["q"]) and torch.equal(cache["k", 1], seen["k"])

    def zero_head(x, hook):
        x[:, :, 0] = 0

    def zero_plain(module, args, out):
        out = out.clone()
        out[..., :head_dim] = 0
        return out

    handle = attention.q_proj.register_forward_hook(zero_plain)
    try:
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
    finally:
        handle.remove()
    assert (expected - plain).abs().max() > 1e-4
    got = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_q", zero_head)])
    torch.testing.assert_close(got, expected)


def test_the_cache_methods_transformerlens_code_calls(models):
    """items, values, cache_dict, to, remove_batch_dim, stack_activation, compute_head_results, get_neuron_results and
    get_full_resid_decomposition (before: AttributeError), against TransformerLens's own cache of the same pass."""
    _, ours, theirs = models
    batch = ["The cat sat on the mat", "A dog ran in the park"]
    with torch.no_grad():
        _, expected = theirs.run_with_cache(batch)
        _, cache = ours.run_with_cache(batch)
    assert cache.to("cpu") is cache
    assert set(cache.cache_dict) == set(expected.cache_dict) and len(cache.items()) == len(cache.values()) == len(cache)
    for name, tensor in cache.items():
        if name.endswith(("hook_resid_post", "hook_mlp_out")):
            close(tensor, expected[name])
    close(cache.stack_activation("resid_post"), expected.stack_activation("resid_post"))
    close(cache.stack_activation("scale", 1, "ln1"), expected.stack_activation("scale", 1, "ln1"))
    cache.compute_head_results()
    close(cache["result", 1], expected["result", 1])
    close(cache.get_neuron_results(1, pos_slice=-1), expected.get_neuron_results(1, pos_slice=-1))
    for options in ({}, {"expand_neurons": False}, {"layer": 1, "mlp_input": True}, {"pos_slice": -1}):
        got, labels = cache.get_full_resid_decomposition(return_labels=True, **options)
        want, expected_labels = expected.get_full_resid_decomposition(return_labels=True, **options)
        assert labels == expected_labels, options
        close(got, want, atol=1e-4)
    with torch.no_grad():
        _, one = ours.run_with_cache(batch[0])
        _, expected_one = theirs.run_with_cache(batch[0])
    one.remove_batch_dim()
    expected_one.remove_batch_dim()
    close(one["blocks.1.hook_resid_post"], expected_one["blocks.1.hook_resid_post"])
    with pytest.raises(ValueError, match="one prompt"):
        cache.remove_batch_dim()


def test_a_bias_the_module_lacks_reads_as_zeros_and_refuses_an_edit(models):
    """TransformerLens gives zeros for Llama's absent biases; before, nnterp's zeros took an edit that changed nothing
    in the model (silently). Now an in-place edit says so; a real bias (GPT-2's) is the model's own parameter."""
    from nnterp.compat.transformer_lens.config import WeightRefused

    hf, ours, theirs = models
    for name in ("b_O", "b_Q"):
        close(getattr(ours.blocks[0].attn, name), getattr(theirs.blocks[0].attn, name))
    close(ours.blocks[1].mlp.b_out, theirs.blocks[1].mlp.b_out)
    close(ours.b_U, theirs.b_U)
    bias = ours.blocks[0].attn.b_O
    if hf.config.model_type == "llama":
        for edit in (lambda: bias.add_(1.0), lambda: bias.__setitem__(0, 1.0), lambda: bias.copy_(torch.ones(64))):
            with pytest.raises(WeightRefused, match="change nothing"):
                edit()
        assert float((bias + 1).sum()) == 64.0  # arithmetic on it is plain
    else:
        assert bias is hf.transformer.h[0].attn.c_proj.bias


def test_to_tokens_pads_on_the_side_transformerlens_pads(models):
    """A HookedTransformer's tokenizer pads on the right, TransformerLens's default (before, nnsight's left): the same
    ids, and a padded batch's real positions give TransformerLens's logits."""
    _, ours, theirs = models
    assert ours.tokenizer.padding_side == theirs.tokenizer.padding_side == "right"
    tokens = theirs.to_tokens(BATCH)
    assert torch.equal(ours.to_tokens(BATCH), tokens) and (tokens[1, -3:] == theirs.tokenizer.pad_token_id).all()
    with torch.no_grad():
        expected = theirs(BATCH)
        got = ours(BATCH)
    real = theirs.to_tokens(BATCH[1]).shape[1]
    close(got[0], expected[0])
    close(got[1, :real], expected[1, :real])


def test_a_model_in_eval_mode_is_left_as_it_was_and_one_in_training_mode_is_told(gpt2_tokenizer_dir):
    hf = tiny_gpt2()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    state = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    config = hf.config.to_dict(), hf.generation_config.to_dict()
    model = nnterp.HookedTransformer.from_pretrained("gpt2", hf_model=hf, tokenizer=tokenizer)
    with torch.no_grad():
        model.run_with_cache(TEXT)
        model.generate(BATCH, max_new_tokens=2, do_sample=False, verbose=False)
    assert not hf.training and (hf.config.to_dict(), hf.generation_config.to_dict()) == config
    assert all(torch.equal(tensor, state[name]) for name, tensor in hf.state_dict().items())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in hf.modules())
    hf.train()
    with pytest.warns(UserWarning, match="training mode"):
        nnterp.HookedTransformer.from_pretrained("gpt2", hf_model=hf, tokenizer=tokenizer)
    assert not hf.training


def test_transformerlens_evals_run_on_the_model_with_its_numbers(models):
    """TransformerLens's own evals module, imported as TransformerLens users import it, on nnterp's model."""
    from transformer_lens import evals

    _, ours, theirs = models
    with torch.no_grad():
        assert float(evals.sanity_check(ours)) == pytest.approx(float(evals.sanity_check(theirs)), abs=1e-4)
        torch.manual_seed(0)
        expected = evals.induction_loss(theirs, subseq_len=16, device="cpu")
        torch.manual_seed(0)
        assert float(evals.induction_loss(ours, subseq_len=16, device="cpu")) == pytest.approx(float(expected), abs=1e-4)


def test_tl_named_parameters_in_transformerlens_order_with_its_values(models):
    """The names and order of TransformerLens's own get_bridge_params (TransformerBridge's tl_named_parameters) read
    over the model's TransformerLens components, and each value TransformerLens's model holds for it."""
    from transformer_lens.model_bridge.get_params_util import get_bridge_params

    _, ours, theirs = models
    named = list(ours.tl_named_parameters())
    assert [name for name, _ in named] == list(get_bridge_params(ours))  # before: W_gate before W_out, no norms
    for name, tensor in named:
        *path, attribute = name.split(".")
        component = theirs
        for part in path:
            component = component[int(part)] if part.isdigit() else getattr(component, part)
        close(tensor, getattr(component, attribute))
    assert getattr(ours.blocks[0].mlp, "W_gate", None) is None or theirs.cfg.gated_mlp
