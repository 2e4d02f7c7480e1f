"""TransformerLens's Main Demo and Exploratory Analysis Demo, and SAELens's loading and HookedSAETransformer
tutorials, as their code runs with the load line changed: the same sequence of calls made on nnterp's
``HookedTransformer`` and on TransformerLens 3.9 (SAELens 6's ``HookedSAETransformer`` for the SAE parts), both
holding the same tiny weights, unprocessed, and every number compared.

The calls are written here after the notebooks' cells (token helpers, loss, induction scores with filter hooks, head
ablation, direct logit attribution over the accumulated and decomposed stream and the heads, activation patching
over layers and positions and over heads, persistent hooks, weights and ``FactoredMatrix``, SAEs spliced, their
features cached and ablated); the ground truth is always TransformerLens's (or SAELens's) own call on its model.
"""

from __future__ import annotations

import warnings

import nnterp.utils as utils
import numpy as np
import pytest
import torch

import nnterp
from nnterp.compat.transformer_lens.config import WeightRefused
from nnterp.compat.transformer_lens.hooks import context_hooks

from .tl_models import pair, transformer_lens_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from transformer_lens import utils as tl_utils

TEXT = "The cat sat on the mat. The cat sat on the"
# an IOI-like batch: prompts of one token length, each with a right and a wrong answer
PROMPTS = ["When John and Mary went to the shops, John gave the bag to",
           "When Tom and James went to the park, James gave the ball to",
           "When Dan and Sid went to the shops, Sid gave an apple to",
           "After Martin and Amy went to the park, Amy gave a drink to"]
ANSWERS = [(" Mary", " John"), (" Tom", " James"), (" Dan", " Sid"), (" Martin", " Amy")]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, gpt2_tokenizer_dir):
    return pair(request.param, gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer_dir):
    return pair("gpt2", gpt2_tokenizer_dir)


def close(a, b, atol=3e-5):
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=atol, rtol=1e-4)


def ioi(model):
    tokens = model.to_tokens(PROMPTS)
    answers = torch.tensor([[model.to_single_token(a), model.to_single_token(b)] for a, b in ANSWERS])
    return tokens, answers


def logit_diff(logits, answers):
    last = logits[:, -1]
    return (last.gather(-1, answers[:, :1]) - last.gather(-1, answers[:, 1:])).mean()


# -- Main Demo --------------------------------------------------------------------------------------------------


def test_tokens_as_the_main_demo_uses_them(gpt2):
    _, ours, theirs = gpt2
    assert torch.equal(ours.to_tokens(TEXT), theirs.to_tokens(TEXT))
    assert torch.equal(ours.to_tokens(TEXT, prepend_bos=False), theirs.to_tokens(TEXT, prepend_bos=False))
    assert ours.to_str_tokens(TEXT) == theirs.to_str_tokens(TEXT)
    assert ours.to_str_tokens(TEXT, prepend_bos=False) == theirs.to_str_tokens(TEXT, prepend_bos=False)
    assert ours.to_single_token(" John") == theirs.to_single_token(" John")
    for mode in ("first", "last"):
        assert ours.get_token_position(" cat", TEXT, mode=mode) == theirs.get_token_position(" cat", TEXT, mode=mode)
        assert ours.get_token_position(" cat", TEXT, mode=mode, prepend_bos=False) == theirs.get_token_position(
            " cat", TEXT, mode=mode, prepend_bos=False)
    assert ours.to_string(ours.to_tokens(TEXT)[0, 1:]) == theirs.to_string(theirs.to_tokens(TEXT)[0, 1:])
    assert ours.to_string(256) == theirs.to_string(256)
    for field in ("n_layers", "n_heads", "d_model", "d_head", "d_vocab"):
        assert getattr(ours.cfg, field) == getattr(theirs.cfg, field)


def test_loss_and_loss_fn(models):
    _, ours, theirs = models
    with torch.no_grad():
        close(ours(TEXT, return_type="loss"), theirs(TEXT, return_type="loss"))
        tokens = ours.to_tokens(TEXT)
        logits = ours(tokens)
        close(logits, theirs(tokens))
        close(ours.loss_fn(logits, tokens, per_token=True), theirs.loss_fn(logits, tokens, per_token=True))
        close(ours.loss_fn(logits, tokens), theirs.loss_fn(logits, tokens))
        batch = ours.to_tokens(["The cat sat", TEXT], padding_side="right")
        mask = (torch.arange(batch.shape[1]) < torch.tensor([[4], [batch.shape[1]]])).long()
        batch_logits = ours(batch)
        for per_token in (False, True):
            close(ours.loss_fn(batch_logits, batch, attention_mask=mask, per_token=per_token),
                  theirs.loss_fn(batch_logits, batch, attention_mask=mask, per_token=per_token))
    with pytest.raises(ValueError, match="logits"):
        ours.loss_fn(logits[0], tokens)


def test_generate_greedy(gpt2):
    _, ours, theirs = gpt2
    assert ours.generate(TEXT, max_new_tokens=5, do_sample=False, stop_at_eos=False) == theirs.generate(
        TEXT, max_new_tokens=5, do_sample=False, stop_at_eos=False, verbose=False)


def induction_scores(model, tokens, half):
    """The Main Demo's induction score: each head's mean attention from a token to the one after its first copy,
    recorded by a hook on every hook_pattern (a filter hook, writing by hook.layer())."""
    scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)

    def record(pattern, hook):
        stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - half)
        scores[hook.layer()] = stripe.mean(dim=(0, -1)).detach()

    model.run_with_hooks(tokens, return_type=None, fwd_hooks=[(lambda name: name.endswith("pattern"), record)])
    return scores


def test_induction_scores_with_a_filter_hook(models):
    _, ours, theirs = models
    generator = torch.Generator().manual_seed(0)
    half = 10
    random = torch.randint(1000, 10000, (4, half), generator=generator)
    tokens = torch.cat([torch.full((4, 1), 50256), random, random], dim=1)
    with torch.no_grad():
        ours_scores, theirs_scores = induction_scores(ours, tokens, half), induction_scores(theirs, tokens, half)
    assert ours_scores.abs().sum() > 0
    close(ours_scores, theirs_scores)


def test_head_ablation_through_hook_v_and_hook_z(models):
    _, ours, theirs = models

    def ablate_head(value, hook, head=1):
        value[:, :, head] = 0.0
        return value

    tokens = ours.to_tokens(TEXT)
    with torch.no_grad():
        clean = ours(tokens, return_type="loss")
        for name in (utils.get_act_name("v", 0), utils.get_act_name("z", 1)):
            ablated = ours.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name, ablate_head)])
            close(ablated, theirs.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name, ablate_head)]))
            assert (ablated - clean).abs() > 1e-5


def test_persistent_hooks_as_transformerlens_keeps_them(models):
    """add_hook stays on for every later call until reset_hooks, runs before a call's own hooks, and prepend, permanent
    hooks and hook.ctx follow TransformerLens's rules; the same sequence on both models."""
    _, ours, theirs = models
    tokens = ours.to_tokens(TEXT)

    def double(resid, hook):
        return resid * 2

    def shift(resid, hook):  # not a constant: the norms would take a constant out
        return resid + torch.linspace(0, 1, resid.shape[-1])

    def count(resid, hook):
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1

    def run(model):
        out = {}
        model.add_hook("blocks.0.hook_resid_post", double)
        out["call"] = model(tokens)
        out["hooks"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", shift)])  # after double
        out["cache"] = model.run_with_cache(tokens)[1]["blocks.0.hook_resid_post"]
        model.add_hook(lambda name: name == "blocks.0.hook_resid_post", shift, prepend=True)  # before double
        out["prepended"] = model(tokens)
        model.add_perma_hook("blocks.1.hook_resid_pre", count)
        model(tokens)
        model(tokens)
        model.reset_hooks(clear_contexts=False)  # the permanent one stays
        out["reset"] = model(tokens)
        model.blocks[1].attn.hook_z.add_hook(lambda z, hook: z * 0)
        out["hook_z"] = model(tokens)
        model.reset_hooks(including_permanent=True)
        out["after"] = model(tokens)
        return out

    with torch.no_grad():
        got, expected = run(ours), run(theirs)
        clean = theirs(tokens)
    for key in expected:
        close(got[key], expected[key])
    close(got["after"], clean)
    assert (got["call"] - clean).abs().max() > 1e-3 and (got["hooks"] - got["call"]).abs().max() > 1e-3
    assert (got["prepended"] - got["hooks"]).abs().max() > 1e-3  # (x + s) * 2 is not 2x + s


def test_persistent_hook_ctx_and_refusals(gpt2):
    _, ours, theirs = gpt2
    seen = {}

    def count(resid, hook):
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
        seen[hook.name] = hook.ctx["calls"]

    ours.add_hook("blocks.1.hook_resid_pre", count)
    ours(TEXT)
    ours(TEXT)
    assert seen["blocks.1.hook_resid_pre"] == 2  # ctx kept from pass to pass
    ours.generate(TEXT, max_new_tokens=2, stop_at_eos=False, verbose=False)
    assert seen["blocks.1.hook_resid_pre"] == 4  # the hook runs in each step's pass, as TransformerLens's
    ours.reset_hooks()
    ours(TEXT)
    assert seen["blocks.1.hook_resid_pre"] == 4  # gone, and its ctx cleared
    with pytest.raises(nnterp.tools.hook_points.HookError, match="no gradient reaches it"):
        ours.add_hook("blocks.0.ln1.hook_scale", count, dir="bwd")
    with pytest.raises(nnterp.tools.hook_points.HookError, match="not a TransformerLens hook name"):
        ours.add_hook("blocks.0.hook_nothing", count)
    assert context_hooks(ours) == []
    # reset_hooks_end=False keeps a call's hooks on the model, as TransformerLens does
    with torch.no_grad():
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.hook_resid_post", lambda r, hook: r * 3)],
                            reset_hooks_end=False)
        theirs.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.hook_resid_post", lambda r, hook: r * 3)],
                              reset_hooks_end=False)
        close(ours(TEXT), theirs(TEXT))
        ours.reset_hooks()
        theirs.reset_hooks()
        close(ours(TEXT), theirs(TEXT))


def test_weights_in_transformerlens_layout(models):
    _, ours, theirs = models
    names = ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out", "b_in", "b_out", "W_U", "W_E"]
    gated = theirs.cfg.gated_mlp
    names += ["W_gate"] if gated else ["W_pos", "W_E_pos"]
    for name in names:
        assert getattr(ours, name).shape == getattr(theirs, name).shape, name
        close(getattr(ours, name), getattr(theirs, name))
    for layer in range(ours.cfg.n_layers):
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q"):
            close(getattr(ours.blocks[layer].attn, name), getattr(theirs.blocks[layer].attn, name))
        close(ours.blocks[layer].mlp.W_in, theirs.blocks[layer].mlp.W_in)
        if theirs.cfg.n_key_value_heads:  # grouped-query attention: the key-value heads as held, then repeated
            for name in ("_W_K", "_W_V", "_b_K", "_b_V"):
                close(getattr(ours.blocks[layer].attn, name), getattr(theirs.blocks[layer].attn, name))
            assert ours.blocks[layer].attn._W_K.shape[0] == theirs.cfg.n_key_value_heads < ours.W_K.shape[1]
    # the Main Demo's listing of the weights by TransformerLens's names
    for name, weight in ours.tl_named_parameters():
        *path, attribute = name.split(".")
        owner = theirs
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        close(weight, getattr(owner, attribute))
    assert "blocks.1.attn.W_O" in ours.tl_parameters() and "unembed.W_U" in ours.tl_parameters()
    close(ours.unembed.W_U, theirs.unembed.W_U)
    close(ours.unembed.b_U, theirs.unembed.b_U)
    close(ours.embed.W_E, theirs.embed.W_E)
    # the weights give the model's own values: hook_q from W_Q and b_Q on the normed stream
    _, cache = ours.run_with_cache(TEXT, names_filter=["blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_q"])
    normed = cache["blocks.0.ln1.hook_normalized"]
    if not gated:
        normed = normed * ours._module.transformer.h[0].ln_1.weight + ours._module.transformer.h[0].ln_1.bias
    else:
        normed = normed * ours._module.model.layers[0].input_layernorm.weight
    close(torch.einsum("bpd,hde->bphe", normed, ours.W_Q[0]) + ours.b_Q[0], cache["blocks.0.attn.hook_q"], atol=1e-4)


def test_factored_matrices_are_transformerlens_s(models):
    _, ours, theirs = models
    for name in ("OV", "QK"):
        mine, reference = getattr(ours, name), getattr(theirs, name)
        assert isinstance(mine, nnterp.FactoredMatrix) and mine.shape == reference.shape  # nnterp's own
        close(mine.AB, reference.AB, atol=1e-4)
        close(mine[1, 0].norm(), reference[1, 0].norm(), atol=1e-4)
    close(ours.OV[0, 0].S, theirs.OV[0, 0].S, atol=1e-4)


def test_weights_refused_where_the_modules_do_not_give_them(gpt2_tokenizer_dir):
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=128)
    model = nnterp.HookedTransformer.from_pretrained(
        "neox", hf_model=transformers.AutoModelForCausalLM.from_config(config),
        tokenizer=transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir))
    with pytest.raises(WeightRefused, match="fused c_attn and separate q_proj"):
        model.W_Q  # noqa: B018
    with pytest.raises(WeightRefused, match="gate_proj/up_proj/down_proj"):
        model.W_in  # noqa: B018


# -- Exploratory Analysis Demo ----------------------------------------------------------------------------------


def test_direct_logit_attribution(models, gpt2_tokenizer_dir):
    """The residual stream's components at the last position, their share of the logit difference, and each head's:
    TransformerLens's accumulated_resid, decompose_resid, stack_head_results and logit_attrs. nnterp's norm applies its
    weight (the checkpoint's), which is what TransformerLens computes after fold_ln: the reference attributions are
    its folded model's, the stacks its plain model's."""
    hf, ours, theirs = models
    folded = transformer_lens_model(hf, ours.tokenizer, fold_ln=True)
    tokens, answers = ioi(ours)
    with torch.no_grad():
        logits, cache = ours.run_with_cache(tokens)
        tl_logits, tl_cache = theirs.run_with_cache(tokens)
        _, tl_folded = folded.run_with_cache(tokens)
    close(logit_diff(logits, answers), logit_diff(tl_logits, answers))
    right, wrong = answers[:, 0], answers[:, 1]

    stack, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    tl_stack, tl_labels = tl_cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    assert labels == tl_labels
    close(stack, tl_stack)
    close(cache.logit_attrs(stack, right, incorrect_tokens=wrong, pos_slice=-1),
          tl_folded.logit_attrs(tl_stack, right, incorrect_tokens=wrong, pos_slice=-1), atol=1e-4)
    scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    close(scaled, tl_folded.apply_ln_to_stack(tl_stack, layer=-1, pos_slice=-1) * _final_norm_weight(hf))

    per_layer, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    tl_per_layer, tl_labels = tl_cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    if "pos_embed" in tl_labels:  # GPT-2: TransformerLens's embed and pos_embed rows are nnterp's one embed row
        tl_per_layer = torch.cat([tl_per_layer[:1] + tl_per_layer[1:2], tl_per_layer[2:]])
        tl_labels = tl_labels[:1] + tl_labels[2:]
    assert labels == tl_labels
    close(per_layer, tl_per_layer)

    heads, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    tl_heads, tl_labels = tl_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    assert labels == tl_labels
    close(heads, tl_heads)
    close(cache.logit_attrs(heads, right, incorrect_tokens=wrong, pos_slice=-1),
          tl_folded.logit_attrs(tl_heads, right, incorrect_tokens=wrong, pos_slice=-1), atol=1e-4)
    # the Exploratory Analysis Demo's cache keys
    for key in [("pattern", 1, "attn"), ("attn", 0), ("resid_post", -1), "ln_final.hook_scale",
                utils.get_act_name("scale", 1, "ln1"), utils.get_act_name("result", 0, "attn")]:
        close(cache[key], tl_cache[key])


def _final_norm_weight(hf):
    return hf.transformer.ln_f.weight if hf.config.model_type == "gpt2" else hf.model.norm.weight


def patch_sweep(model, clean_tokens, corrupted_tokens, answers, clean_cache, name):
    """The Exploratory Analysis Demo's activation patching: the corrupted run with ``name`` at one (layer, position)
    taken from the clean run, for every layer and position, scored by the logit difference."""
    layers, positions = model.cfg.n_layers, clean_tokens.shape[1]
    results = torch.zeros(layers, positions)
    for layer in range(layers):
        for position in range(positions):
            def patch(activation, hook, position=position):
                activation[:, position] = clean_cache[hook.name][:, position]
                return activation

            logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name(name, layer), patch)])
            results[layer, position] = logit_diff(logits, answers)
    return results


def head_sweep(model, corrupted_tokens, answers, clean_cache, name):
    """Each head's ``name`` (hook_z, hook_v: ``[batch, pos, head, d_head]``; hook_pattern: ``[batch, head, q, k]``)
    taken from the clean run, one head at a time."""
    results = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
    for layer in range(model.cfg.n_layers):
        heads = model.cfg.n_key_value_heads or model.cfg.n_heads if name == "v" else model.cfg.n_heads
        for head in range(heads):
            def patch(value, hook, head=head):
                if name == "attn":
                    value[:, head] = clean_cache[hook.name][:, head]
                else:
                    value[:, :, head] = clean_cache[hook.name][:, :, head]
                return value

            logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name(name, layer, "attn"), patch)])
            results[layer, head] = logit_diff(logits, answers)
    return results


def test_activation_patching_over_layers_positions_and_heads(models):
    _, ours, theirs = models
    clean_tokens, answers = ioi(ours)
    corrupted_tokens = clean_tokens[[1, 0, 3, 2]]  # the Demo's corruption: another prompt's names
    with torch.no_grad():
        _, cache = ours.run_with_cache(clean_tokens)
        _, tl_cache = theirs.run_with_cache(clean_tokens)
        for name in ("resid_pre", "attn_out", "mlp_out"):
            got = patch_sweep(ours, clean_tokens, corrupted_tokens, answers, cache, name)
            close(got, patch_sweep(theirs, clean_tokens, corrupted_tokens, answers, tl_cache, name), atol=1e-4)
        # the Main Demo's spelling, get_act_name("in", layer): TransformerBridge's name of the block's input
        close(patch_sweep(ours, clean_tokens, corrupted_tokens, answers, cache, "in"),
              patch_sweep(theirs, clean_tokens, corrupted_tokens, answers, tl_cache, "resid_pre"), atol=1e-4)
        for name in ("z", "v", "attn"):
            got = head_sweep(ours, corrupted_tokens, answers, cache, name)
            close(got, head_sweep(theirs, corrupted_tokens, answers, tl_cache, name), atol=1e-4)
            assert got.std() > 0


def test_utils_as_the_notebooks_import_them(gpt2, capsys):
    _, ours, theirs = gpt2
    tensor = torch.randn(4, 5, 6)
    assert np.array_equal(utils.to_numpy(tensor), tl_utils.to_numpy(tensor))
    assert np.array_equal(utils.to_numpy(tensor.bfloat16()), tl_utils.to_numpy(tensor.bfloat16()))
    assert np.array_equal(utils.to_numpy([1, 2]), tl_utils.to_numpy([1, 2])) and utils.to_numpy(3.0) == 3.0
    assert torch.equal(utils.get_corner(tensor), tl_utils.get_corner(tensor))
    assert torch.equal(utils.get_corner(tensor, 2), tl_utils.get_corner(tensor, 2))
    assert utils.get_device() == tl_utils.get_device()
    # test_prompt: TransformerLens's argument order; the answer's ranks and probabilities from TransformerLens's logits
    prompt, answer = "The cat sat on the", "mat"
    for prepend_bos in (True, False):
        results = utils.test_prompt(prompt, answer, ours, prepend_bos=prepend_bos, print_details=False)
        prompt_tokens = theirs.to_tokens(prompt, prepend_bos=prepend_bos)
        answer_id = theirs.to_single_token(" mat")
        with torch.no_grad():
            probs = theirs(prompt_tokens)[0, -1].softmax(-1)
        assert len(results) == 1 and results[0].id == answer_id
        close(results[0].probability, probs[answer_id])
        assert results[0].rank == int((probs > probs[answer_id]).sum()) + 1  # nnterp ranks from 1
    # the basic-loading tutorial calls it inside with model.hooks(...): the hooks apply to its pass
    def zero_stream(resid, hook):
        return torch.zeros_like(resid)

    with ours.hooks(fwd_hooks=[("blocks.1.hook_resid_post", zero_stream)]):
        hooked = utils.test_prompt(prompt, answer, ours, print_details=False)
    with torch.no_grad():
        hooked_probs = theirs.run_with_hooks(theirs.to_tokens(prompt), fwd_hooks=[
            ("blocks.1.hook_resid_post", zero_stream)])[0, -1].softmax(-1)
    close(hooked[0].probability, hooked_probs[answer_id])
    assert abs(hooked[0].probability - results[0].probability) > 1e-6
    results = utils.test_prompt(prompt, [" mat", "dog"], ours, prepend_space_to_answer=True, print_details=False)
    assert [r.token for r in results] == [" mat", " dog"]
    capsys.readouterr()
    # TransformerLens's printed table (ranks from 0), line for line, with details or without them
    for options in ({"top_k": 3}, {"print_details": False}, {"prepend_bos": False, "top_k": 2}):
        for answers in (answer, [" mat", "dog"], "mat and"):
            tl_utils.test_prompt(prompt, answers, theirs, **options)
            expected = capsys.readouterr().out
            utils.test_prompt(prompt, answers, ours, **options)
            assert capsys.readouterr().out == expected, (options, answers)
    # the training tutorial imports TransformerLens's own test_prompt: it runs on nnterp's model, printing the same
    tl_utils.test_prompt(prompt, answer, theirs, top_k=3)
    expected = capsys.readouterr().out
    tl_utils.test_prompt(prompt, answer, ours, top_k=3)
    assert capsys.readouterr().out == expected and "Rank" in expected


# -- SAELens: basic loading and analysing, Hooked SAE Transformer ----------------------------------------------


@pytest.fixture(scope="module")
def with_saes(gpt2, gpt2_tokenizer_dir):
    sae_lens = pytest.importorskip("sae_lens")
    import transformers

    hf, ours, _ = gpt2
    theirs = transformer_lens_model(hf, transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir),
                                    model_class=sae_lens.HookedSAETransformer)
    saes = {}
    for seed, (hook, d_in) in enumerate([("blocks.0.hook_resid_pre", 64), (utils.get_act_name("z", 1), 64)]):
        config = sae_lens.StandardSAEConfig(d_in=d_in, d_sae=32,
                                            reshape_activations="hook_z" if hook.endswith("hook_z") else "none")
        config.metadata.hook_name = hook
        torch.manual_seed(seed)
        sae = sae_lens.StandardSAE(config)
        with torch.no_grad():
            for parameter in sae.parameters():
                parameter.copy_(torch.randn_like(parameter) * (0.1 if parameter.dim() == 1 else 0.3))
        saes[hook] = sae.eval()
    return ours, theirs, saes


def test_run_with_saes_and_their_cache(with_saes):
    ours, theirs, saes = with_saes
    tokens = ours.to_tokens(TEXT)
    with torch.no_grad():
        clean = theirs(tokens)
        for sae in saes.values():
            for use_error_term in (False, True):
                got = ours.run_with_saes(tokens, saes=[sae], use_error_term=use_error_term)
                close(got, theirs.run_with_saes(tokens, saes=[sae], use_error_term=use_error_term), atol=1e-4)
            assert (got - clean).abs().max() < 1e-4  # with the error term: the model as it was
        logits, cache = ours.run_with_cache_with_saes(tokens, saes=list(saes.values()))
        tl_logits, tl_cache = theirs.run_with_cache_with_saes(tokens, saes=list(saes.values()))
        close(logits, tl_logits, atol=1e-4)
        for hook in saes:
            for entry in ("hook_sae_acts_post", "hook_sae_recons"):
                close(cache[f"{hook}.{entry}"], tl_cache[f"{hook}.{entry}"], atol=1e-4)
        # the basic-loading tutorial: the SAE's hook in a plain cache, encoded by SAELens
        sae = saes["blocks.0.hook_resid_pre"]
        _, plain = ours.run_with_cache(tokens)
        _, tl_plain = theirs.run_with_cache(tokens)
        close(sae.encode(plain[sae.cfg.metadata.hook_name]), sae.encode(tl_plain[sae.cfg.metadata.hook_name]))


def test_feature_ablation_with_hooks_on_the_sae_features(with_saes):
    ours, theirs, saes = with_saes
    tokens = ours.to_tokens(TEXT)
    hook = utils.get_act_name("z", 1)
    sae = saes[hook]
    _, cache = ours.run_with_cache_with_saes(tokens, saes=[sae])
    feature = int(cache[f"{hook}.hook_sae_acts_post"][0, -1].argmax())

    def ablate_feature(acts, hook):
        acts[:, :, feature] = 0.0
        return acts

    with torch.no_grad():
        for use_error_term in (False, True):
            sae.use_error_term = use_error_term  # as the Hooked SAE Transformer tutorial sets it
            try:
                expected = theirs.run_with_hooks_with_saes(tokens, saes=[sae],
                                                           fwd_hooks=[(f"{hook}.hook_sae_acts_post", ablate_feature)])
                got = ours.run_with_hooks_with_saes(tokens, saes=[sae],
                                                    fwd_hooks=[(f"{hook}.hook_sae_acts_post", ablate_feature)])
                unablated = ours.run_with_saes(tokens, saes=[sae])
            finally:
                sae.use_error_term = False
            close(got, expected, atol=1e-4)
            assert (got - unablated).abs().max() > 1e-4
        # a model hook beside it, and a predicate over the SAE's names
        both = [(lambda name: name.endswith("hook_sae_acts_post"), ablate_feature),
                ("blocks.0.hook_resid_post", lambda resid, hook: resid * 0.5)]
        close(ours.run_with_hooks_with_saes(tokens, saes=[sae], fwd_hooks=both),
              theirs.run_with_hooks_with_saes(tokens, saes=[sae], fwd_hooks=both), atol=1e-4)
    with pytest.raises(TypeError, match="hook_sae_acts_post"):
        ours.run_with_hooks_with_saes(tokens, saes=[sae], fwd_hooks=[(f"{hook}.hook_sae_input", ablate_feature)])


def test_add_sae_and_reset_saes(with_saes):
    """The Hooked SAE Transformer tutorial's attached SAEs: model(tokens), run_with_cache with the SAE's entries, and
    run_with_hooks on its features and on its error (use_error_term=True), then reset_saes."""
    import copy

    ours, theirs, saes = with_saes
    tokens = ours.to_tokens(TEXT)
    hook = utils.get_act_name("z", 1)

    def ablate(value, hook):
        value[:, 3] = 0.0
        return value

    for name, error_term in (("blocks.0.hook_resid_pre", False), (hook, True)):
        sae = copy.deepcopy(saes[name])
        sae.use_error_term = error_term
        with torch.no_grad():
            ours.add_sae(sae)
            theirs.add_sae(sae)
            try:
                assert list(ours.acts_to_saes) == list(theirs.acts_to_saes) == [name]
                close(ours(tokens), theirs(tokens), atol=1e-4)
                _, cache = ours.run_with_cache(tokens)
                _, tl_cache = theirs.run_with_cache(tokens)
                close(cache["blocks.1.hook_resid_post"], tl_cache["blocks.1.hook_resid_post"], atol=1e-4)
                close(cache[f"{name}.hook_sae_acts_post"], tl_cache[f"{name}.hook_sae_acts_post"], atol=1e-4)
                for entry in ("hook_sae_acts_post", *(("hook_sae_error",) if error_term else ())):
                    got = ours.run_with_hooks(tokens, fwd_hooks=[(f"{name}.{entry}", ablate)])
                    close(got, theirs.run_with_hooks(tokens, fwd_hooks=[(f"{name}.{entry}", ablate)]), atol=1e-4)
                    assert (got - ours(tokens)).abs().max() > 1e-4
            finally:
                ours.reset_saes()
                theirs.reset_saes()
        assert not ours.acts_to_saes
        close(ours(tokens), theirs(tokens))


def test_hooks_on_the_model_on_an_sae_s_values(with_saes):
    ours, theirs, saes = with_saes
    name = "blocks.0.hook_resid_pre.hook_sae_acts_post"
    with pytest.raises(KeyError, match="No attached SAE has the hook point"):
        ours.add_hook(name, lambda acts, hook: acts * 0)  # no SAE attached there (TransformerLens: a KeyError too)
    got = []
    with torch.no_grad():
        for model in (ours, theirs):
            model.add_sae(saes["blocks.0.hook_resid_pre"])
            try:  # before: refused (hooks on an SAE's values ran for one call only)
                with model.hooks(fwd_hooks=[(name, lambda acts, hook: acts * 0.5)]):
                    got.append(model(TEXT))
                model.add_hook(lambda n: n.endswith("hook_sae_acts_post"), lambda acts, hook: acts * 0)
                got.append(model(TEXT))
            finally:
                model.reset_hooks()
                model.reset_saes()
    close(got[0], got[2])
    close(got[1], got[3])
    assert context_hooks(ours) == []


def test_the_hook_point_switches(gpt2):
    _, ours, theirs = gpt2
    ours.set_use_attn_result(True)  # the Exploratory Analysis Demo's first call: hook_result is always served
    theirs.set_use_attn_result(True)
    with torch.no_grad():
        _, cache = ours.run_with_cache(TEXT)
        _, tl_cache = theirs.run_with_cache(TEXT)
    close(cache["result", 1, "attn"], tl_cache["result", 1, "attn"])
    with pytest.raises(TypeError, match="hook_attn_in"):
        ours.set_use_attn_in(True)
