"""Token arguments: one parser (``nnterp.core.tokens.token_ids``) behind every tool that takes tokens.

Ground truth is the math: the id a tool reads is the id given (a row of the logits indexed by it, a plain
forward's softmax for ``test_prompt``), and a refused input raises, naming what was given and what is accepted.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from nnterp import Prompt, StandardizedTransformer, logit_difference, target_probability
from nnterp import test_prompt as answer_ranks  # under its own name, pytest would collect it
from nnterp.core.tokens import single_token, token_ids
from nnterp.families import BY_MODEL_TYPE
from nnterp.tools.lens import _lens_table
from nnterp.tools.plots import plot_logit_lens

from ..conftest import build_tiny, tiny_tokenizer

VOCAB = 128
ACCEPTS = "give an id"  # the start of the accepted forms, in every refusal of a form


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def vocab(llama):
    return llama.tokenizer.get_vocab()  # the tokenizer's own table: "cat" -> its id


@pytest.mark.parametrize("given, expected", [
    (17, 17), (np.int64(17), 17), (np.uint8(17), 17), (torch.tensor(17), 17), (torch.tensor(17, dtype=torch.int32), 17),
    (torch.tensor(17.0), 17), (17.0, 17), (0, 0), (VOCAB - 1, VOCAB - 1),
    ([3, np.int64(4), torch.tensor(5)], [3, 4, 5]), ((3, 4), [3, 4]), (np.array([1, 2]), [1, 2]),
    (torch.tensor([[1, 2], [3, 4]]), [[1, 2], [3, 4]]), ([[1, 2], [3, 4]], [[1, 2], [3, 4]]), ([], []),
], ids=repr)
def test_token_ids_keep_the_ids_and_the_shape_given(llama, given, expected):
    ids = token_ids(llama, given, "The token")
    assert ids.dtype == torch.long and ids.shape == torch.tensor(expected, dtype=torch.long).shape
    assert ids.tolist() == expected


def test_a_string_is_its_one_token(llama, vocab):
    assert token_ids(llama, "cat", "The token").tolist() == vocab["cat"] and token_ids(llama, "cat").dim() == 0
    assert token_ids(llama, ["cat", 7, "dog"]).tolist() == [vocab["cat"], 7, vocab["dog"]]
    assert single_token(llama, " Paris") == vocab["Paris"]


@pytest.mark.parametrize("given, shown, reason", [
    (-1, "-1", "outside the vocabulary"), (torch.tensor(-1), "tensor(-1)", "outside the vocabulary"),
    (np.int64(-3), "-3", "outside the vocabulary"), (VOCAB, "128", "outside the vocabulary"),
    (torch.tensor([5, VOCAB]), "tensor([  5, 128])", "outside the vocabulary"),
    ([5, -2], "-2", "outside the vocabulary"),
    (True, "True", "boolean"), (np.bool_(False), "False", "boolean"), (torch.tensor(True), "tensor(True)", "boolean"),
    (torch.tensor([1, 0]).bool(), "tensor([ True, False])", "boolean"),
    (torch.tensor(17.9), "tensor(17.9000)", "not a whole number"), (17.9, "17.9", "not a whole number"),
    (np.float32(2.5), "2.5", "not a whole number"), (float("nan"), "nan", "not a whole number"),
    (torch.tensor([1.0, float("inf")]), "tensor([1., inf])", "not a whole number"),
    (None, "None", "not a token"), ({"a": 1}, "{'a': 1}", "not a token"), ([[1], [1, 2]], "[[1], [1, 2]]", "ragged"),
    ("the cat", "'the cat'", "is 2 tokens"), ([1, "the cat"], "'the cat'", "is 2 tokens"),
], ids=repr)
def test_refused_tokens_say_what_was_given_and_what_is_accepted(llama, given, shown, reason):
    with pytest.raises((TypeError, ValueError)) as error:
        token_ids(llama, given, "The token")
    message = str(error.value)
    assert message.startswith("The token") and re.search(re.escape(shown), message) and reason in message, message
    assert "give one token" in message if reason == "is 2 tokens" else ACCEPTS in message or "0 to 127" in message


def test_without_a_model_strings_are_refused_and_negatives_still_are():
    assert token_ids(None, np.int64(500)).tolist() == 500  # no vocabulary to check against
    with pytest.raises(ValueError, match="-1 is negative"):
        token_ids(None, torch.tensor(-1))
    with pytest.raises(TypeError, match="'cat' is a string.*tokenizer"):
        token_ids(None, "cat")


def test_single_token_is_one_token(llama):
    assert single_token(llama, np.int64(17)) == 17 and isinstance(single_token(llama, torch.tensor(17)), int)
    with pytest.raises(ValueError, match=r"The target \[1, 2\] is 2 tokens: give one"):
        single_token(llama, [1, 2], "The target")


# -- the tools ------------------------------------------------------------------------------------

def test_metrics_read_the_ids_given(llama, vocab):
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0))
    for correct, incorrect in ((np.int64(5), torch.tensor(7)), (torch.tensor(5.0), 7), (5, np.int32(7))):
        assert torch.equal(logit_difference(correct, incorrect)(logits), logits[:, -1, 5] - logits[:, -1, 7])
    assert torch.equal(target_probability(np.int64(9))(logits), logits[:, -1].softmax(-1)[:, 9])
    cat, dog = vocab["cat"], vocab["dog"]
    assert torch.equal(logit_difference("cat", "dog", model=llama)(logits), logits[:, -1, cat] - logits[:, -1, dog])
    assert torch.equal(target_probability(" cat", model=llama)(logits), logits[:, -1].softmax(-1)[:, cat])
    for bad, reason in ((torch.tensor(-1), "negative"), (17.9, "not a whole number"), (True, "boolean")):
        with pytest.raises((TypeError, ValueError), match=reason):
            logit_difference(bad, 5)
        with pytest.raises((TypeError, ValueError), match=reason):
            target_probability(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        logit_difference(5, VOCAB, model=llama)


def test_test_prompt_takes_the_answers_ids(llama, vocab):
    prompt, answer = "the cat sat on the", [vocab["mat"], vocab["dog"]]
    prompt_ids = llama.tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = llama._module(torch.tensor([prompt_ids + answer[:1]])).logits[0]
    for given in (answer, np.array(answer), torch.tensor(answer)):
        results = answer_ranks(llama, prompt, given, print_results=False)
        assert [r.id for r in results] == answer
        for k, result in enumerate(results):
            probs = logits[len(prompt_ids) - 1 + k].softmax(-1)
            assert result.probability == pytest.approx(float(probs[answer[k]]), abs=1e-6)
    assert [r.id for r in answer_ranks(llama, prompt, np.int64(vocab["mat"]), print_results=False)] == answer[:1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        answer_ranks(llama, prompt, torch.tensor([-1]), print_results=False)
    with pytest.raises(ValueError, match="not a whole number"):
        answer_ranks(llama, prompt, torch.tensor(3.5), print_results=False)


def test_the_lens_target_is_the_id_given(llama):
    probs = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(1)).softmax(-1)
    rows = _lens_table(llama, probs, np.int64(5)).splitlines()[1:]
    assert [float(row.split()[1]) for row in rows] == pytest.approx(probs[:, 5].tolist(), abs=1e-4)
    for bad in (torch.tensor(-1), torch.tensor(17.9)):
        with pytest.raises(ValueError, match="The target"):
            _lens_table(llama, probs, bad)
        with pytest.raises(ValueError, match="The target"):  # refused before anything runs
            plot_logit_lens(llama, "the cat", None, target=bad)


def test_prompt_targets_are_the_ids_given():
    probs = torch.rand(2, VOCAB, generator=torch.Generator().manual_seed(2)).softmax(-1)
    prompt = Prompt("the cat", {"one": np.int64(5), "two": torch.tensor([5, 9]), "list": [3]})
    assert prompt.targets == {"one": [5], "two": [5, 9], "list": [3]}
    got = prompt.target_probabilities(probs)
    assert torch.equal(got["one"], probs[:, 5]) and torch.allclose(got["two"], probs[:, 5] + probs[:, 9])
    with pytest.raises(ValueError, match="negative"):
        Prompt("the cat", {"animal": [5, -1]})
    with pytest.raises(TypeError, match="'cat' is a string"):  # words go through Prompt.from_strings
        Prompt("the cat", {"animal": ["cat"]})
