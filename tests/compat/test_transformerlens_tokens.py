"""TransformerLens's token methods on nnterp, against TransformerLens 3.9 with GPT-2's tokenizer (offline)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import nnterp

from .tl_models import pair

TEXTS = ["The cat sat on the mat", "Paris is in France, said the dog"]


@pytest.fixture(scope="module")
def models(gpt2_tokenizer_dir):
    return pair("gpt2", gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def plain(models, gpt2_tokenizer_dir):
    hf, _, _ = models
    return nnterp.StandardizedTransformer(hf, tokenizer=transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir))


@pytest.mark.parametrize("prepend_bos", [None, True, False])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_to_tokens(models, prepend_bos, padding_side):
    _, ours, theirs = models
    kwargs = {} if prepend_bos is None else {"prepend_bos": prepend_bos}
    assert torch.equal(ours.to_tokens(TEXTS[0], **kwargs), theirs.to_tokens(TEXTS[0], **kwargs))
    assert torch.equal(ours.to_tokens(TEXTS, padding_side=padding_side, **kwargs),
                       theirs.to_tokens(TEXTS, padding_side=padding_side, **kwargs))


def test_a_standardized_transformer_tokenizes_as_its_tokenizer_unless_asked(plain, models):
    _, _, theirs = models
    from nnterp.compat.transformer_lens.config import cfg
    from nnterp.core.tokens import to_tokens

    # TransformerLens's names are HookedTransformer's; nnterp's tools tokenize a StandardizedTransformer's input
    # with the same function
    assert not hasattr(plain, "to_tokens") and not hasattr(plain, "cfg")
    own = torch.tensor([plain.tokenizer(TEXTS[0]).input_ids])
    assert torch.equal(to_tokens(plain, TEXTS[0]), own)  # GPT-2's tokenizer adds no BOS
    assert cfg(plain).default_prepend_bos is False and cfg(plain).tokenizer_prepends_bos is False
    assert torch.equal(to_tokens(plain, TEXTS[0], prepend_bos=True), theirs.to_tokens(TEXTS[0]))


def test_to_str_tokens(models, plain):
    _, ours, theirs = models
    ids = theirs.to_tokens(TEXTS[0])
    for given in (TEXTS[0], ids, ids[0], ids[0].numpy(), ids.numpy(), TEXTS):
        assert ours.to_str_tokens(given) == theirs.to_str_tokens(given)
    assert ours.to_str_tokens(TEXTS[0], prepend_bos=False) == theirs.to_str_tokens(TEXTS[0], prepend_bos=False)
    assert plain.to_str_tokens(ids) == theirs.to_str_tokens(ids)  # [1, seq]: one list, as TransformerLens squeezes it
    two = torch.cat([ids, ids])
    assert plain.to_str_tokens(two) == [theirs.to_str_tokens(ids)] * 2  # several rows: one list each


def test_to_string_and_single_tokens(models):
    _, ours, theirs = models
    ids = theirs.to_tokens(TEXTS, padding_side="right")
    assert ours.to_string(ids) == theirs.to_string(ids)
    assert ours.to_string(ids[0]) == theirs.to_string(ids[0])
    assert ours.to_string(ids[0].tolist()) == theirs.to_string(ids[0].tolist())
    assert ours.to_single_token(" Paris") == theirs.to_single_token(" Paris")
    with pytest.raises(ValueError, match="not a single token"):
        ours.to_single_token(" Parisians are")


@pytest.mark.parametrize("mode", ["first", "last"])
def test_get_token_position(models, mode):
    _, ours, theirs = models
    text = "the cat and the dog and the mat"
    for token in (" the", theirs.to_single_token(" and"), torch.tensor(theirs.to_single_token(" the"))):
        assert ours.get_token_position(token, text, mode=mode) == theirs.get_token_position(token, text, mode=mode)
        assert ours.get_token_position(token, text, mode=mode, prepend_bos=False) == theirs.get_token_position(
            token, text, mode=mode, prepend_bos=False)
    ids = theirs.to_tokens(text)
    assert ours.get_token_position(" dog", ids) == theirs.get_token_position(" dog", ids)
    assert ours.get_token_position(" dog", ids[0]) == theirs.get_token_position(" dog", ids[0])
    with pytest.raises(ValueError, match="does not occur"):
        ours.get_token_position(" Paris", text)
    with pytest.raises(ValueError, match="'first' or 'last'"):
        ours.get_token_position(" the", text, mode="middle")


def test_a_padded_batch_masks_its_pads_where_transformerlens_counts_them(models):
    """A batch of texts: nnterp masks the pads (their loss is 0 and out of the mean); TransformerLens runs a
    right-padded batch without a mask, so its loss counts the pads. The real positions agree."""
    _, ours, theirs = models
    side = ours.tokenizer.padding_side  # nnterp's traces pad on the left; TransformerLens's default is the right
    ours.tokenizer.padding_side = "right"
    try:
        with torch.no_grad():
            ours_losses = ours(TEXTS, return_type="loss", loss_per_token=True)
    finally:
        ours.tokenizer.padding_side = side
    with torch.no_grad():
        theirs_losses = theirs(TEXTS, return_type="loss", loss_per_token=True)
    short = len(theirs.to_tokens(TEXTS[0])[0]) - 1
    torch.testing.assert_close(ours_losses[0, :short], theirs_losses[0, :short], atol=2e-5, rtol=1e-4)
    assert (ours_losses[0, short:] == 0).all() and (theirs_losses[0, short:] != 0).all()
    with torch.no_grad():
        separate = torch.cat([ours(text, return_type="loss", loss_per_token=True)[0] for text in TEXTS])
        torch.testing.assert_close(ours(TEXTS, return_type="loss"), separate.mean(), atol=2e-5, rtol=1e-4)


def test_tokens_errors(models):
    _, ours, _ = models
    with pytest.raises(TypeError, match="string or a non-empty list"):
        ours.to_tokens(np.array([1, 2]))
    with pytest.raises(ValueError, match="padding_side"):
        ours.to_tokens(TEXTS, padding_side="middle")
