"""Patchscopes: a source's value read at its last token, patched into a target prompt, read out as next-token
probabilities, per layer (nnterp 1.x's ``TargetPrompt`` calls: ``nnterp.compat.interventions``)."""

from __future__ import annotations

import nnsight
import torch

from ..spec.selection import forward_order, layer_indices, token_index, value_name
from .refusals import refuse_unsupported


def patchscope_lens(model, source_prompts, target_prompt: str, index_to_patch: int = -1, layers=None,
                    value: str = "layer_output", remote: bool | str = False) -> torch.Tensor:
    """Next-token probabilities of ``target_prompt`` with ``value`` at ``index_to_patch`` replaced, per layer,
    by the sources' last-token ``value`` at the same layer: ``[sources, layers, vocab]``.

    ``index_to_patch`` counts the target's own tokens (``-1`` its last).
    """
    refuse_unsupported(model, "patchscope_lens")
    if not isinstance(target_prompt, str):
        raise TypeError(f"patchscope_lens(model, source_prompts, target_prompt, index_to_patch, layers): the target "
                        f"prompt is a string, not {type(target_prompt).__name__} (1.x's TargetPrompt calls are "
                        "nnterp.interventions.patchscope_lens's).")
    name = value_name(value)
    sources = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
    layers = layer_indices(model, layers)
    latents = last_token_values(model, sources, layers, remote, name)
    return patched_next_token_probs(model, [target_prompt] * len(sources), [index_to_patch] * len(sources), layers,
                                    latents, remote, name).float()


def last_token_values(model, prompts, layers, remote, name: str = "layer_output") -> torch.Tensor:
    """``[layers, prompts, ...]``: value ``name`` at every prompt's last token (whichever side pads), on the CPU."""
    inputs = model.tokenizer(prompts, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(prompts)), token_index(inputs.attention_mask, -1)
    with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
        read = nnsight.save({layer: model.read_value(layer, name)[rows, last].cpu() for layer in forward_order(layers)})
        tracer.stop()  # nothing past the last layer read is needed
    return torch.stack([read[layer] for layer in layers])


def patched_next_token_probs(model, prompts, indices, layers, latents, remote, name: str = "layer_output"
                             ) -> torch.Tensor:
    """``[prompts, layers, vocab]``: next-token probabilities with value ``name`` of row ``j`` at its own token
    ``indices[j]`` replaced by ``latents[k][j]``, one trace per layer ``k``, on the CPU."""
    inputs = model.tokenizer(prompts, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(prompts)), token_index(inputs.attention_mask, -1)
    patched = torch.stack([token_index(inputs.attention_mask[j:j + 1], int(i))[0] for j, i in enumerate(indices)])
    probs = []
    for k, layer in enumerate(layers):
        with torch.no_grad(), model.trace(inputs, remote=remote):
            value = model.read_value(layer, name)
            value[rows, patched.to(value.device)] = latents[k].to(device=value.device, dtype=value.dtype)
            logits = model.logits
            layer_probs = nnsight.save(logits[rows, last.to(logits.device)].softmax(dim=-1).cpu())
        probs.append(layer_probs)  # after the trace: a remote run returns saved values, not edited lists
    return torch.stack(probs, dim=1)
