"""Edits of standard values written once for every family: adding a vector, skipping blocks.

Part of the core (the model's ``steer`` and ``skip_layers`` methods use them); the research tools
build on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..spec.selection import forward_order, layer_indices, value_name
from .refusals import refuse_unsupported

Positions = int | slice | Sequence[int] | torch.Tensor | None


def add_to(model, layers, vector: torch.Tensor, value: str = "layer_output", factor: float = 1.0,
           positions: Positions = None, batch: Positions = None) -> None:
    """Inside a trace: add ``factor * vector`` in place to ``value`` at ``layers``, ``positions`` and ``batch`` rows.

    ``vector`` has the value's last dimension (``hidden_size`` for the stream and the contributions).
    ``positions`` and ``batch`` index the sequence and batch dimensions (``None``: all).
    """
    name = value_name(value)
    for layer in forward_order(layer_indices(model, layers)):
        tensor = model.read_value(layer, name)
        if vector.shape[-1] != tensor.shape[-1]:
            raise ValueError(f"The steering vector has {vector.shape[-1]} features; '{value}' has {tensor.shape[-1]}.")
        rows = slice(None) if batch is None else batch
        columns = slice(None) if positions is None else positions
        delta = (factor * vector).to(device=tensor.device, dtype=tensor.dtype)
        if isinstance(rows, slice) or isinstance(columns, slice):
            tensor[rows, columns] += delta
        else:  # two index lists: select rows, then positions
            for row in torch.as_tensor(rows).reshape(-1).tolist():
                tensor[row, columns] += delta


def skip_layers(model, start: int, end: int | None = None, stream: torch.Tensor | None = None) -> None:
    """Inside a trace: make blocks ``start`` to ``end`` (inclusive) identities on the stream.

    Block ``end + 1`` receives block ``start``'s input (or ``stream``, when given). Works on
    families whose blocks return a tuple (or a list): the skipped block hands on the stream in the
    container the next block expects (``Family.skip_output``).
    """
    refuse_unsupported(model, "skip_layers")
    end = start if end is None else end
    start, end = (layer_indices(model, [layer])[0] for layer in (start, end))
    if end < start:
        raise ValueError(f"skip_layers skips blocks start to end inclusive: end ({end}) is before start ({start}).")
    layers = list(range(start, end + 1))
    looped = [layer for layer in layers if model.runs_of(layer) > 1]
    if looped:  # nnsight's skip replaces a module's first call only
        raise ValueError(f"skip_layers cannot skip layers[{looped[0]}]: it runs {model.runs_of(looped[0])} times in "
                         f"each forward pass of {model.family.name} (a looped section), and a skip replaces one call.")
    stream = model.layers[layers[0]].layer_input if stream is None else stream
    for layer in layers:
        block = model.layers[layer]
        block.skip(model.family.skip_output(stream, block) if model.family.skip_output else stream)
