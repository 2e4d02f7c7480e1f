"""The embedded SmolLM2-135M-Instruct: a real pretrained model, offline."""

from __future__ import annotations

import pytest
import torch

from nnterp.core.validation import check_identity
from nnterp.tools.embedded import load_embedded
from nnterp.tools.lens import logit_lens

pytestmark = pytest.mark.real
PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def smollm():
    return load_embedded()


def test_predicts_paris(smollm):
    with torch.no_grad(), smollm.trace(PROMPT):
        probs = smollm.next_token_probs.save()
    assert smollm.tokenizer.decode(probs[0].argmax()) == " Paris"
    assert probs[0].max() > 0.5


def test_identity_is_exact_on_every_layer(smollm):
    results = check_identity(smollm, smollm.tokenizer(PROMPT, return_tensors="pt").input_ids)
    assert len(results) == 30 and all(r.exact for r in results), [str(r) for r in results if not r.exact]


def test_logit_lens_last_layer_is_the_model(smollm):
    probs = logit_lens(smollm, [PROMPT, "The capital of France is"])
    assert probs.shape == (2, 30, smollm.vocab_size)
    with torch.no_grad(), smollm.trace([PROMPT, "The capital of France is"]):
        expected = smollm.next_token_probs.save()
    assert torch.allclose(probs[:, -1], expected, atol=1e-6)
    paris = smollm.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    assert (probs[:, -1].argmax(-1) == paris).all()
    assert (probs[:, 0, paris] < 0.01).all()  # it emerges late, not at the embedding
