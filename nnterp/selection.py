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
