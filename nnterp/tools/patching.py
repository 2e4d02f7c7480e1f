"""Activation patching and attribution patching, written once for every family.

Activation patching runs the corrupted prompt with one piece of a standard value (one position of it, or one
head of ``attention_premix``) replaced by the clean run's, and scores each patched run with a metric; several
patched copies of the prompt run as the rows of one batch. Attribution patching is its linear approximation:
the metric's gradient at the corrupted run times the clean run's value minus the corrupted run's, from one
forward pass with gradients and one backward pass over the corrupted prompt, and one forward over the clean one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import nnsight
import torch
from tqdm.auto import tqdm

from ..spec.selection import forward_order, layer_indices, value_name

PER_VALUE = {"position": None, "head": "attention_premix", "neuron": "mlp_neurons"}


def _value_for(per: str, value: str | None, kinds: Sequence[str]) -> str:
    """The value patched: ``value`` (default ``layer_output``) per position, the heads' or neurons' own value."""
    if per not in kinds:
        raise ValueError(f"per is one of {', '.join(map(repr, kinds))}, not {per!r}.")
    own = PER_VALUE[per]
    if own is None:
        return value_name("layer_output" if value is None else value)
    if value is not None and value_name(value) != own:
        raise ValueError(f"per={per!r} patches {own} (a {per}'s slice of it); value={value!r} has no {per}s: leave "
                         f"value out, or use per='position' to patch {value} at each position.")
    return own


def _prompt_ids(model, clean: str, corrupted: str, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    clean_ids, corrupted_ids = (model.tokenizer(p, return_tensors="pt").input_ids for p in (clean, corrupted))
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(f"{what} needs prompts of one length: the clean prompt has {clean_ids.shape[1]} tokens, "
                         f"the corrupted one {corrupted_ids.shape[1]}.")
    return clean_ids, corrupted_ids


def _heads(sources: dict[int, torch.Tensor]) -> int:
    counts = {int(source.shape[-2]) for source in sources.values()}
    if len(counts) != 1:
        raise ValueError(f"Per-head patching returns one column per head, and these blocks have different numbers of "
                         f"heads ({sorted(counts)}): patch the blocks of each count in a call of their own (layers=).")
    return counts.pop()


def activation_patching(model, clean: str, corrupted: str, metric: Callable[[torch.Tensor], torch.Tensor],
                        value: str | None = None, layers=None, positions: Sequence[int] | None = None,
                        remote: bool | str = False, progress: bool = True, *, per: str = "position",
                        batch_size: int | None = None) -> torch.Tensor:
    """Patch ``value`` (default ``layer_output``) from the clean run into the corrupted one, one piece at a time,
    and return ``metric`` of each patched run (one score per batch row: ``logit_difference``, ``target_probability``).

    ``per="position"``: one (layer, position) at a time, ``[layers, positions]``. ``per="head"``: one head of
    ``attention_premix`` (the heads' outputs before the output projection) at a time, at every position at once
    (``[layers, heads]``) or at each of ``positions`` (``[layers, positions, heads]``). The two prompts must
    tokenize to the same length.

    Each patched run is a row of a batch of copies of the corrupted prompt. ``batch_size`` rows per forward pass,
    their patches taken in order across layers; ``None``: one pass per layer, a row for each of its patches.
    Every row is the same forward pass as a run of its own, so the numbers agree up to the last bits of the
    dtype: a CPU's matrix products can round differently with the number of rows (another kernel for fewer than
    about 16 token rows, another split over threads), as can multi-query attention (GPT-BigCode) at one row.
    """
    name = _value_for(per, value, ("position", "head"))
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size is a number of rows per forward pass (1 or more) or None, not {batch_size!r}.")
    layers = layer_indices(model, layers)
    clean_ids, corrupted_ids = _prompt_ids(model, clean, corrupted, "Activation patching")
    every_position = positions is None
    positions = list(range(clean_ids.shape[1])) if every_position else list(positions)
    with torch.no_grad(), model.trace(clean_ids, remote=remote) as tracer:
        sources = nnsight.save({layer: model.read_value(layer, name) for layer in forward_order(layers)})
        tracer.stop()  # nothing past the last layer read is needed
    # each patch: (its cell of the result, its layer, its index into the value after the batch row)
    if per == "head":
        heads = range(_heads(sources))
        at = [slice(None)] if every_position else positions
        shape = (len(layers), len(heads)) if every_position else (len(layers), len(positions), len(heads))
        patches = [(layer, (position, head)) for layer in layers for position in at for head in heads]
    else:
        shape = (len(layers), len(positions))
        patches = [(layer, (position,)) for layer in layers for position in positions]
    if batch_size is None:  # one pass per layer asked
        per_pass = len(patches) // len(layers)
    else:
        per_pass = batch_size
    passes = [range(start, min(start + per_pass, len(patches))) for start in range(0, len(patches), per_pass)]
    effects = torch.empty(len(patches))
    for cells in tqdm(passes, desc="patching", unit="pass", disable=not progress or len(passes) < 2):
        edits: dict[int, list[tuple[int, tuple]]] = {}
        for row, cell in enumerate(cells):
            layer, index = patches[cell]
            edits.setdefault(layer, []).append((row, index))
        with torch.no_grad(), model.trace(corrupted_ids.repeat(len(cells), 1), remote=remote):
            for layer in forward_order(list(edits)):
                target, source = model.read_value(layer, name), sources[layer]
                for row, index in edits[layer]:
                    target[(row, *index)] = source[(0, *index)]
            scores = nnsight.save(metric(model.logits))
        if scores.dim() != 1 or scores.shape[0] != len(cells):
            raise ValueError(f"The metric must give one score per batch row, a [{len(cells)}] tensor for this pass's "
                             f"{len(cells)} patched runs; it gave shape {tuple(scores.shape)}. Score each row on its "
                             f"own (logit_difference, target_probability), without reducing over the batch.")
        effects[cells.start:cells.stop] = scores.float().cpu()
    return effects.view(shape)


def attribution_patching(model, clean: str, corrupted: str, metric: Callable[[torch.Tensor], torch.Tensor],
                         value: str | None = None, per: str = "position", layers=None,
                         remote: bool | str = False) -> torch.Tensor:
    """The linear approximation of ``activation_patching``: the gradient of ``metric`` (summed over the batch) at
    the corrupted run times the clean run's value minus the corrupted run's, ``[layers, positions]`` summed over
    the value's other dimensions (``per="position"``, ``value`` default ``layer_output``), per head of
    ``attention_premix`` ``[layers, positions, heads]`` (``per="head"``) or per neuron of ``mlp_neurons``
    ``[layers, positions, neurons]`` (``per="neuron"``). Sum over positions (``.sum(1)``) to approximate
    patching a head at every position at once, as ``activation_patching(..., per="head")`` does.

    One forward pass over the clean prompt; one forward with gradients and one backward over the corrupted
    prompt, which computes the gradients of the values only (the weights' are neither computed nor kept).
    The products are computed in float32.
    """
    name = _value_for(per, value, tuple(PER_VALUE))
    layers = layer_indices(model, layers)
    clean_ids, corrupted_ids = _prompt_ids(model, clean, corrupted, "Attribution patching")
    order = forward_order(layers)
    with torch.no_grad(), model.trace(clean_ids, remote=remote) as tracer:
        sources = nnsight.save({layer: model.read_value(layer, name) for layer in order})
        tracer.stop()
    with torch.enable_grad(), model.trace(corrupted_ids, remote=remote):
        values = [model.read_value(layer, name) for layer in order]
        score = metric(model.logits).sum()
        grads = nnsight.save({})
        with score.backward(inputs=values):  # the values' gradients only, not the weights'
            for layer, read in reversed(list(zip(order, values))):  # backward computes them last layer first
                grads[layer] = read.grad
        targets = nnsight.save({layer: read.detach() for layer, read in zip(order, values)})
    rows = []
    for layer in layers:
        product = (sources[layer].float().cpu() - targets[layer].float().cpu()) * grads[layer].float().cpu()
        product = product[0]  # [seq, ...]: the prompt's one row
        rows.append(product.flatten(1).sum(-1) if per == "position" else product.sum(-1) if per == "head" else product)
    return torch.stack(rows)
