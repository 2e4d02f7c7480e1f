"""Direct logit attribution against TransformerLens 3.9 itself, on one tiny GPT-2 loaded into both.

Ground truth: TransformerLens's ``ActivationCache`` (``apply_ln_to_stack``, ``logit_attrs``, ``decompose_resid``,
``hook_scale``) on a ``HookedTransformer`` built from a hand-written config and given the same weights by
TransformerLens's own conversion (``convert_gpt2_weights``): once without weight processing, as
``from_pretrained_no_processing`` loads a checkpoint, and once with ``fold_ln`` alone, where the norm's weight is
in ``W_U`` and its bias in ``b_U``. GPT-2's LayerNorms have a weight and a bias, both moved well off 1 and 0.
"""

from __future__ import annotations

import pytest
import torch

transformer_lens = pytest.importorskip("transformer_lens")

from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402
from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights  # noqa: E402

from nnterp import StandardizedTransformer  # noqa: E402
from nnterp.families import BY_MODEL_TYPE  # noqa: E402

from ..conftest import build_tiny, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

BATCH, SEQ = 8, 7  # an IOI-like batch: prompts of one length, one answer and one wrong answer each
CLOSE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def both():
    config = BY_MODEL_TYPE["gpt2"].tiny_config()
    hf = build_tiny(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms whose weight and bias change the numbers
        for module in hf.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(torch.randn(module.weight.shape, generator=generator) * 0.5)
                module.bias.add_(torch.randn(module.bias.shape, generator=generator) * 0.5)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    cfg = HookedTransformerConfig(n_layers=config.n_layer, d_model=config.n_embd, n_heads=config.n_head,
                                  d_head=config.n_embd // config.n_head, d_mlp=4 * config.n_embd,
                                  d_vocab=config.vocab_size, n_ctx=config.n_positions, act_fn="gelu_new",
                                  normalization_type="LN", eps=config.layer_norm_epsilon,
                                  original_architecture="GPT2LMHeadModel")
    plain = HookedTransformer(cfg)
    plain.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    folded = HookedTransformer(cfg)
    folded.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=True, center_writing_weights=False,
                                       center_unembed=False, fold_value_biases=False)
    ids = torch.randint(3, config.vocab_size, (BATCH, SEQ), generator=generator)
    logits, cache = model.run_with_cache(ids)
    tl_logits, tl_cache = plain.run_with_cache(ids)
    torch.testing.assert_close(tl_logits, hf(ids).logits, **CLOSE)  # the premise: one model in both
    _, tl_folded = folded.run_with_cache(ids)
    processed = HookedTransformer(cfg)  # from_pretrained's default processing, every step
    processed.load_and_process_state_dict(convert_gpt2_weights(hf, cfg))
    _, tl_processed = processed.run_with_cache(ids)
    answers, wrong = ids[:, 1], ids[:, 2]
    return dict(hf=hf, ids=ids, logits=logits, cache=cache, tl=tl_cache, plain=plain, folded=folded,
                tl_folded=tl_folded, tl_processed=tl_processed, answers=answers, wrong=wrong)


def test_the_frozen_scales_are_transformerlens_hook_scale(both):
    cache, tl = both["cache"], both["tl"]
    torch.testing.assert_close(cache["ln_final_scale"], tl["ln_final.hook_scale"], **CLOSE)
    torch.testing.assert_close(cache["attention_norm_scale", 1], tl["blocks.1.ln1.hook_scale"], **CLOSE)
    torch.testing.assert_close(cache["mlp_norm_scale", 1], tl["blocks.1.ln2.hook_scale"], **CLOSE)


@pytest.mark.parametrize("layer, mlp_input, norm", [(None, False, "ln_f"), (1, False, "h.1.ln_1"),
                                                    (1, True, "h.1.ln_2")])
def test_apply_ln_to_stack_keeps_transformerlens_shape_and_applies_the_weight(both, layer, mlp_input, norm):
    cache, tl = both["cache"], both["tl"]
    weight = both["hf"].transformer.get_submodule(norm).weight.detach()
    bias = both["hf"].transformer.get_submodule(norm).bias.detach()
    stack = tl.decompose_resid(layer=layer, mlp_input=mlp_input)  # TransformerLens's own rows, embed and pos_embed
    ours = cache.apply_ln_to_stack(stack, layer=layer, mlp_input=mlp_input)
    theirs = tl.apply_ln_to_stack(stack, layer=layer, mlp_input=mlp_input)
    assert ours.shape == theirs.shape == stack.shape
    # TransformerLens divides by the scale; the checkpoint's norm then multiplies by its weight
    torch.testing.assert_close(ours, theirs * weight, **CLOSE)
    # the rows sum to the normed stream less the norm's bias; incl_bias adds it as one more row
    normed = tl[f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_normalized"] * weight + bias if layer is not None \
        else tl["ln_final.hook_normalized"] * weight + bias
    torch.testing.assert_close(ours.sum(0) + bias, normed, **CLOSE)
    with_bias, labels = cache.apply_ln_to_stack(stack, layer=layer, mlp_input=mlp_input, incl_bias=True,
                                                labels=[str(k) for k in range(len(stack))])
    assert with_bias.shape[0] == len(stack) + 1 and len(labels) == len(with_bias)
    torch.testing.assert_close(with_bias.sum(0), normed, **CLOSE)
    # position- and batch-sliced, as TransformerLens slices its scale
    last = cache.apply_ln_to_stack(stack[:, 2:5, -1], layer=layer, mlp_input=mlp_input, pos_slice=-1,
                                   batch_slice=slice(2, 5))
    torch.testing.assert_close(last, tl.apply_ln_to_stack(stack[:, 2:5, -1], layer=layer, mlp_input=mlp_input,
                                                          pos_slice=-1, batch_slice=slice(2, 5)) * weight, **CLOSE)


def test_decompose_resid_is_transformerlens_with_the_embeddings_in_one_row(both):
    ours, labels = both["cache"].decompose_resid(return_labels=True)
    theirs, tl_labels = both["tl"].decompose_resid(return_labels=True)
    assert tl_labels[:2] == ["embed", "pos_embed"] and labels[1:] == tl_labels[2:]
    torch.testing.assert_close(ours[0], theirs[0] + theirs[1], **CLOSE)
    torch.testing.assert_close(ours[1:], theirs[2:], **CLOSE)
    normed = both["cache"].decompose_resid(apply_ln=True)
    assert normed.shape == ours.shape  # no row for the bias


def test_logit_attrs_is_transformerlens_and_sums_to_the_logit_difference_with_the_documented_term(both):
    cache, tl, tl_folded = both["cache"], both["tl"], both["tl_folded"]
    answers, wrong, logits = both["answers"], both["wrong"], both["logits"]
    stack = tl.decompose_resid(pos_slice=-1)  # [components, batch, hidden]
    ours = cache.logit_attrs(stack, answers, incorrect_tokens=wrong, pos_slice=-1)
    theirs = tl.logit_attrs(stack, answers, incorrect_tokens=wrong, pos_slice=-1)
    assert ours.shape == theirs.shape == (len(stack), BATCH)
    # TransformerLens's own arithmetic with the norm's weight applied: its folded model, and by hand on the plain one
    folded = tl_folded.logit_attrs(stack, answers, incorrect_tokens=wrong, pos_slice=-1)
    torch.testing.assert_close(ours, folded, **CLOSE)
    hf = both["hf"]
    gain, norm_bias = hf.transformer.ln_f.weight.detach(), hf.transformer.ln_f.bias.detach()
    direction = both["plain"].W_U[:, answers] - both["plain"].W_U[:, wrong]  # [hidden, batch]
    by_hand = (tl.apply_ln_to_stack(stack, pos_slice=-1) * gain * direction.T).sum(-1)
    torch.testing.assert_close(ours, by_hand, **CLOSE)
    # the term the rows leave out: the final norm's bias on the head's rows (GPT-2's head has no bias), which is
    # TransformerLens's b_U after fold_ln; plus it, the rows sum to the model's logit difference
    rows = torch.arange(BATCH)
    difference = logits[rows, -1, answers] - logits[rows, -1, wrong]
    term = norm_bias @ direction
    b_U = both["folded"].b_U
    torch.testing.assert_close(term, b_U[answers] - b_U[wrong], **CLOSE)
    torch.testing.assert_close(ours.sum(0) + term, difference, **CLOSE)
    torch.testing.assert_close(folded.sum(0) + b_U[answers] - b_U[wrong], difference, **CLOSE)
    # incl_bias=True: the term as a row of its own, labelled, and alone from an empty stack
    labels = [str(k) for k in range(len(stack))]
    with_bias, names = cache.logit_attrs(stack, answers, incorrect_tokens=wrong, pos_slice=-1, incl_bias=True,
                                         labels=labels)
    assert names == [*labels, "ln_final_bias"] and with_bias.shape == (len(stack) + 1, BATCH)
    torch.testing.assert_close(with_bias.sum(0), difference, **CLOSE)
    alone = cache.logit_attrs(stack[:0], answers, incorrect_tokens=wrong, pos_slice=-1, incl_bias=True)
    torch.testing.assert_close(alone.sum(0), term, **CLOSE)


def test_logit_attrs_of_every_position_and_of_heads_keep_transformerlens_shapes(both):
    cache, tl = both["cache"], both["tl"]
    ids = both["ids"]
    following = ids.roll(-1, dims=1)  # one token per position, [batch, pos]
    stack = tl.accumulated_resid()
    ours = cache.logit_attrs(stack, following)
    assert ours.shape == tl.logit_attrs(stack, following).shape == stack.shape[:-1]
    torch.testing.assert_close(ours, both["tl_folded"].logit_attrs(stack, following), **CLOSE)
    heads = cache.stack_head_results(pos_slice=-1, incl_remainder=True, apply_ln=True)
    tl_heads = tl.stack_head_results(pos_slice=-1, incl_remainder=True, apply_ln=True)
    assert heads.shape == tl_heads.shape


def test_under_transformerlens_default_processing_logit_difference_attributions_are_unchanged(both):
    """fold_ln, center_writing_weights, center_unembed and fold_value_biases change TransformerLens's rows and single
    logits, not a logit difference's attributions of the stream's components."""
    cache, processed = both["cache"], both["tl_processed"]
    answers, wrong = both["answers"], both["wrong"]
    ours = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), answers, incorrect_tokens=wrong, pos_slice=-1)
    theirs = processed.logit_attrs(processed.decompose_resid(pos_slice=-1), answers, incorrect_tokens=wrong,
                                   pos_slice=-1)
    torch.testing.assert_close(ours, torch.cat([theirs[:1] + theirs[1:2], theirs[2:]]), **CLOSE)
    # what the processing does change: the stream's rows are centred, one token's attribution moves
    raw = cache.decompose_resid(pos_slice=-1)
    centred = processed.decompose_resid(pos_slice=-1)[2:]
    torch.testing.assert_close(centred, raw[1:] - raw[1:].mean(-1, keepdim=True), **CLOSE)
    single = cache.logit_attrs(raw, answers, pos_slice=-1)
    assert not torch.allclose(single[1:], processed.logit_attrs(centred, answers, pos_slice=-1), **CLOSE)


def test_fold_value_biases_moves_each_head_value_bias_out_of_its_row(both):
    plain, processed = both["plain"], both["tl_processed"]
    ours = both["cache"].stack_head_results(pos_slice=-1)  # the checkpoint's heads, value bias included
    torch.testing.assert_close(ours, both["tl"].stack_head_results(pos_slice=-1), **CLOSE)
    # the value bias as the head's values receive it (fold_ln adds the norm's bias through W_V), through W_O
    shift = torch.einsum("lhd,lhdm->lhm", both["folded"].b_V, plain.W_O).flatten(0, 1)[:, None]
    expected = ours - shift
    expected = expected - expected.mean(-1, keepdim=True)  # and centred, as center_writing_weights leaves W_O
    torch.testing.assert_close(processed.stack_head_results(pos_slice=-1), expected, **CLOSE)
