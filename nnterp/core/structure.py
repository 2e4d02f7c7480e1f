"""A wrapped model's structure from its family and config: the blocks' calls in a pass, their head counts, and
``model.layers`` where the blocks are in several lists."""

from __future__ import annotations

import torch

from ..families import Family


def schedule_of(family: Family, config, num_layers: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """``(layer, run)`` of each block call of a forward pass, in order (``Family.schedule``), and each block's number
    of runs."""
    order = family.schedule(config) if family.schedule else range(num_layers)
    runs = [0] * num_layers
    calls = []
    for layer in order:
        calls.append((layer, runs[layer]))
        runs[layer] += 1
    return tuple(calls), tuple(runs)


def global_of(config, name: str):
    """``config.<name>``, the global value where the config's layers override it (a heterogeneous config)."""
    if getattr(config, "is_heterogeneous", False):
        return config._getattr_without_heterogeneous_validation(name, None)
    return getattr(config, name, None)


def heads_per_layer(family: Family, config, num_layers: int) -> tuple[int | None, ...]:
    """Each block's number of attention heads: the family's count per block, the config's list per layer or a
    heterogeneous config's layer's own, else the config's."""
    if family.heads:
        return tuple(family.heads(config, i) for i in range(num_layers))
    listed = getattr(config, "num_attention_heads_per_layer", None)  # Laguna
    if isinstance(listed, (list, tuple)) and len(listed) == num_layers:
        return tuple(listed)
    if "num_attention_heads" in (getattr(config, "per_layer_attributes", None) or ()):
        return tuple(config.per_layer_config[i].num_attention_heads for i in range(num_layers))
    return (getattr(config, "num_attention_heads", None),) * num_layers  # None: a recurrent model


class StackedLayers(list):
    """``model.layers`` where the blocks are in several lists (stacks): their envoys, in order. ``_module`` lists
    their modules (a plain list: nothing is added to the model)."""

    @property
    def _module(self) -> list[torch.nn.Module]:
        return [envoy._module for envoy in self]

    def __getitem__(self, key):
        if isinstance(key, int) and not -len(self) <= key < len(self):
            raise IndexError(f"Layer {key} is out of range: the model has {len(self)} layers (0 to {len(self) - 1}).")
        return list.__getitem__(self, key)
