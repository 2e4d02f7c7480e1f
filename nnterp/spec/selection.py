"""Checked choices of standard values and layers, shared by the research tools."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .catalog import value_named


def value_name(value: str) -> str:
    """``"mlp.mlp_output"`` or ``"mlp_output"`` -> ``"mlp_output"``; a clear error for an unknown value."""
    return value_named(value).name


def layer_indices(model, layers: int | Iterable[int] | None) -> list[int]:
    """The layers asked for, in the order asked (repeats kept), negatives counted from the end.

    A tool returns one row per entry of this list; it reads them with ``forward_order`` (nnsight
    reads a model's values in the order they are computed).
    """
    if layers is None:
        return list(range(model.num_layers))
    layers = [layers] if isinstance(layers, int) else list(layers)
    for layer in layers:
        model.block_spec(layer)  # a clear IndexError when out of range
    return [layer % model.num_layers for layer in layers]


def block_calls(model, layers) -> list[tuple[int, int | None]]:
    """The block calls asked for, as ``(layer, run)``: an int is a layer (its one run: run None), a ``(layer, run)``
    pair one run of a looped block (``model.layers[layer].run(run)``); None: every call of a forward pass, in
    order (``model.schedule``), which on a model without looped blocks is every layer."""
    if layers is None:
        return [(layer, run if model.runs_of(layer) > 1 else None) for layer, run in model.schedule]
    calls = []
    for entry in [layers] if isinstance(layers, int) else list(layers):
        layer, run = entry if isinstance(entry, tuple) else (entry, None)
        layer = layer_indices(model, [layer])[0]
        if run is not None:
            model._run_slot(layer, run)  # a clear IndexError for a run the block does not have
        calls.append((layer, run))
    return calls


def calls_in_forward_order(model, calls: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """Each call once, in the order the model makes them."""
    position = {call: n for n, call in enumerate(model.schedule)}
    return sorted(set(calls), key=lambda call: position[(call[0], call[1] or 0)])


def forward_order(layers: list[int]) -> list[int]:
    """Each layer once, in the order the model computes them."""
    return sorted(set(layers))


def token_index(attention_mask: torch.Tensor, position: int) -> torch.Tensor:
    """``[batch]``: where each row's own token ``position`` sits in the padded batch, whichever side pads.

    A position beyond a row's own length is an error naming the row, never a padding token.
    """
    index = torch.empty(attention_mask.shape[0], dtype=torch.long)
    for row, mask in enumerate(attention_mask.bool()):
        real = mask.nonzero().flatten()
        if not -len(real) <= position < len(real):
            raise IndexError(f"Position {position} is beyond prompt {row}'s {len(real)} tokens.")
        index[row] = real[position]
    return index


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
