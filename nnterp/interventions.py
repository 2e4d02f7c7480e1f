"""Interventions written once for every family: steering, skipping, activation patching, patchscopes.

Everything here reads and writes standard values (``layer_output`` by default, any value of
the catalog by name), so it means the same thing on every family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import nnsight
import torch

from .edits import Positions, add_to, skip_layers  # noqa: F401  (add_to, skip_layers: part of the toolkit's API)
from .lens import logit_lens  # noqa: F401  (its 1.x import path)
from .selection import forward_order, layer_indices, token_index, value_name

# -- steering -------------------------------------------------------------------------------------

def steered_generate(model, prompts, vector: torch.Tensor, layers, *, value: str = "layer_output",
                     factor: float = 1.0, scope: str | range = "all", positions: Positions = None,
                     batch: Positions = None, max_new_tokens: int = 20, remote: bool | str = False,
                     **generate_kwargs) -> torch.Tensor:
    """Generate with a steering vector added during an explicit ``scope`` of the generation.

    ``scope`` is ``"prompt"`` (the forward pass over the prompt only), ``"generated"`` (every
    generated step, not the prompt), ``"all"`` (both), or a ``range`` of step numbers (step 0
    is the prompt, step k the k-th generated token). ``positions`` apply to the prompt step;
    a generated step steers its one new position. The generation runs exactly
    ``max_new_tokens`` steps (``min_new_tokens`` is set to it) so that every scope is reached.
    Returns the token ids, prompt included.
    """
    steps = _scope_steps(scope, max_new_tokens)
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs["min_new_tokens"] = max_new_tokens
    with torch.no_grad(), model.generate(prompts, max_new_tokens=max_new_tokens, remote=remote,
                                         **generate_kwargs) as tracer:
        for step in tracer.iter[0:max_new_tokens]:
            if step in steps:
                add_to(model, layers, vector, value, factor, positions if step == 0 else None, batch)
        ids = nnsight.save(tracer.result)
    return ids


def _scope_steps(scope: str | range, max_new_tokens: int) -> set[int]:
    every = range(max_new_tokens)
    named = {"prompt": range(0, 1), "generated": range(1, max_new_tokens), "all": every}
    if isinstance(scope, range):
        outside = sorted(set(scope) - set(every))
        if outside:
            raise ValueError(f"scope {scope} asks for steps {outside}, which a generation of {max_new_tokens} new "
                             f"tokens never runs (steps 0 to {max_new_tokens - 1}; step 0 is the prompt).")
        return set(scope)
    if scope not in named:
        raise ValueError(f"scope is 'prompt', 'generated', 'all' or a range of steps, not {scope!r}.")
    return set(named[scope])


# -- activation patching ---------------------------------------------------------------------------

def logit_difference(correct: int, incorrect: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position logit of ``correct`` minus that of ``incorrect``, per batch row."""
    return lambda logits: logits[:, -1, correct] - logits[:, -1, incorrect]


def target_probability(token: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position probability of ``token``, per batch row."""
    return lambda logits: logits[:, -1].softmax(dim=-1)[:, token]


def activation_patching(model, clean: str, corrupted: str, metric: Callable[[torch.Tensor], torch.Tensor],
                        value: str = "layer_output", layers=None, positions: Sequence[int] | None = None,
                        remote: bool | str = False) -> torch.Tensor:
    """Patch ``value`` from the clean run into the corrupted one, one (layer, position) at a time.

    Returns ``metric`` of the patched runs as a ``[layers, positions]`` tensor. The two prompts
    must tokenize to the same length. Each layer is one batched trace: row j of the batch patches
    position ``positions[j]``.
    """
    name = value_name(value)
    layers = layer_indices(model, layers)
    clean_ids, corrupted_ids = (model.tokenizer(p, return_tensors="pt").input_ids for p in (clean, corrupted))
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(f"Activation patching needs prompts of one length: the clean prompt has "
                         f"{clean_ids.shape[1]} tokens, the corrupted one {corrupted_ids.shape[1]}.")
    positions = list(range(clean_ids.shape[1])) if positions is None else list(positions)
    with torch.no_grad(), model.trace(clean_ids, remote=remote):
        sources = nnsight.save({layer: model.read_value(layer, name) for layer in forward_order(layers)})
    effects = torch.empty(len(layers), len(positions))
    batch = corrupted_ids.repeat(len(positions), 1)
    for row, layer in enumerate(layers):  # the rows in the order asked for
        source = sources[layer]
        with torch.no_grad(), model.trace(batch, remote=remote):
            target = model.read_value(layer, name)
            for j, position in enumerate(positions):
                target[j, position] = source[0, position]
            scores = nnsight.save(metric(model.logits))
        effects[row] = scores.float().cpu()
    return effects


# -- patchscopes ----------------------------------------------------------------------------------

def patchscope_lens(model, source_prompts: str | Sequence[str], target_prompt: str, index_to_patch: int = -1,
                    layers=None, value: str = "layer_output", remote: bool | str = False) -> torch.Tensor:
    """Next-token probabilities of ``target_prompt`` with ``value`` at ``index_to_patch`` replaced, per layer,
    by the sources' last-token ``value`` at the same layer: ``[sources, layers, vocab]``."""
    name = value_name(value)
    sources = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
    layers = layer_indices(model, layers)
    inputs = model.tokenizer(sources, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(sources)), token_index(inputs.attention_mask, -1)  # whichever side pads
    with torch.no_grad(), model.trace(inputs, remote=remote):
        latents = nnsight.save({layer: model.read_value(layer, name)[rows, last] for layer in forward_order(layers)})
    probs = []
    for layer in layers:
        latent = latents[layer]
        with torch.no_grad(), model.trace([target_prompt] * len(sources), remote=remote):
            model.read_value(layer, name)[:, index_to_patch] = latent
            layer_probs = nnsight.save(model.next_token_probs)
        probs.append(layer_probs)  # after the trace: a remote run returns saved values, not edited lists
    return torch.stack([p.float().cpu() for p in probs], dim=1)
