"""The logit lens: every layer's stream read through the model's own final norm and head."""

from __future__ import annotations

from typing import Sequence

import nnsight
import torch

from .catalog import BY_NAME


def logit_lens(model, prompts: str | Sequence[str], layers: Sequence[int] | None = None,
               value: str = "layer_output") -> torch.Tensor:
    """Next-token probabilities ``[prompts, layers, vocab]`` from each layer's ``value`` at the last position.

    ``value`` is any block-level standard value whose shape is ``[batch, seq, hidden_size]``
    (``layer_input``, ``layer_mid``, ``layer_output``). On the last layer's ``layer_output`` it is
    the model's own next-token distribution.
    """
    if value not in BY_NAME or BY_NAME[value].owner != "block" or "hidden_size" not in BY_NAME[value].shape:
        raise ValueError(f"logit_lens reads a block-level stream value (layer_input, layer_mid, layer_output), not {value!r}.")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    layers = range(model.num_layers) if layers is None else [model.num_layers + i if i < 0 else i for i in layers]
    with torch.no_grad():
        with model.trace(prompts):
            last = nnsight.save([model._read_value(i, value)[:, -1] for i in layers])
        return torch.stack([model.project_on_vocab(h).softmax(dim=-1) for h in last], dim=1)


def top_tokens(model, probs: torch.Tensor, k: int = 5) -> list[list[list[tuple[str, float]]]]:
    """``[prompts][layers]`` lists of the ``k`` most likely ``(token, probability)`` pairs."""
    top = probs.topk(k, dim=-1)
    return [
        [[(model.tokenizer.decode(int(t)), float(p)) for t, p in zip(ids, ps)] for ids, ps in zip(layer_ids, layer_ps)]
        for layer_ids, layer_ps in zip(top.indices, top.values)
    ]
