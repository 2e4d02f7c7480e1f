"""Checked choices of standard values and layers, shared by the research tools."""

from __future__ import annotations

from collections.abc import Iterable

from .catalog import value_named


def value_name(value: str) -> str:
    """``"mlp.mlp_output"`` or ``"mlp_output"`` -> ``"mlp_output"``; a clear error for an unknown value."""
    return value_named(value).name


def layer_indices(model, layers: int | Iterable[int] | None) -> list[int]:
    """Layers in forward order (nnsight reads them in that order), negatives counted from the end."""
    if layers is None:
        return list(range(model.num_layers))
    layers = [layers] if isinstance(layers, int) else list(layers)
    for layer in layers:
        model.block_spec(layer)  # a clear IndexError when out of range
    return sorted({layer % model.num_layers for layer in layers})


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
