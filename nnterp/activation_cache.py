"""Many standard values of one forward pass, kept in memory: ``logits, cache = model.run_with_cache(prompts)``.

``cache["layer_output", 5]`` is one block's value, ``cache["layer_output"]`` the value of every
cached block stacked ``[layers, ...]``. The values are read with the engine's ``read_value`` in
forward order, inside one trace, so ``remote=True`` runs it on the remote model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import nnsight
import torch
from transformers import BatchEncoding

from .catalog import BY_NAME
from .errors import ValueUnavailable
from .selection import forward_order, layer_indices, layer_ranges, value_name


class ActivationCache:
    """The values of one forward pass, by ``(name, layer)``.

    ``cache[name, layer]``: one block's value (a negative layer counts from the model's end).
    ``cache[name]``: every cached block's value stacked on a new first dimension, ``[layers, ...]``,
    in the order of ``cache.layers``. A name may be ``"mlp_output"`` or ``"mlp.mlp_output"``.
    A value that has no meaning on the block raises the model's ``ValueUnavailable``, with its reason.
    """

    def __init__(self, values: dict[tuple[str, int], torch.Tensor], names: list[str], layers: list[int],
                 unavailable: dict[tuple[str, int], ValueUnavailable], num_layers: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self._values, self._unavailable = values, unavailable
        self.names, self.layers, self.num_layers = names, layers, num_layers
        self.input_ids, self.attention_mask = input_ids, attention_mask

    def __getitem__(self, key) -> torch.Tensor:
        name, layer = (key if isinstance(key, tuple) and len(key) == 2 else (key, None))
        if not isinstance(name, str):
            raise TypeError(f"Index a cache with a value name, or (name, layer): cache['layer_output', 5], not {key!r}.")
        name = value_name(name)
        if name not in self.names and not any(key[0] == name for key in self._unavailable):
            raise KeyError(f"{name!r} was not cached: this cache holds {', '.join(self.names)}. Pass it in "
                           "run_with_cache(..., names=[...]), or names=None for every available value.")
        if layer is None:
            return self._stacked(name)
        return self._one(name, self._layer(layer))

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"The layer of cache[name, layer] is an int, not {layer!r}.")
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers.")
        layer %= self.num_layers
        if layer not in self.layers:
            raise KeyError(f"Layer {layer} was not cached: this cache holds layers {layer_ranges(sorted(self.layers))}.")
        return layer

    def _one(self, name: str, layer: int) -> torch.Tensor:
        if (name, layer) in self._unavailable:
            error = self._unavailable[(name, layer)]
            raise ValueUnavailable(error.key, error.family, error.reason)
        return self._values[(name, layer)]

    def _stacked(self, name: str) -> torch.Tensor:
        missing = [layer for layer in self.layers if (name, layer) in self._unavailable]
        if missing:
            error = self._unavailable[(name, missing[0])]
            partly = len(missing) < len(self.layers)
            raise ValueUnavailable(error.key, error.family, error.reason + (
                f" (at layers {layer_ranges(sorted(missing))}: read the layers that have it one at a time, "
                f"cache[{name!r}, layer])" if partly else ""))
        tensors = [self._values[(name, layer)] for layer in self.layers]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"{name!r} has different shapes across the cached layers ({sorted(shapes)}), so it "
                             f"cannot be stacked: read one layer at a time, cache[{name!r}, layer].")
        return torch.stack([t.to(tensors[0].device) for t in tensors])

    def keys(self) -> list[tuple[str, int]]:
        """The ``(name, layer)`` pairs that hold a tensor, by layer, then in the catalog's order."""
        return [(name, layer) for layer in self.layers for name in self.names if (name, layer) in self._values]

    def __contains__(self, key) -> bool:
        return key in self._values

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        batch, seq = self.input_ids.shape
        return (f"ActivationCache({len(self)} tensors: {', '.join(self.names)} at layers "
                f"{layer_ranges(sorted(self.layers))}; {batch} prompt(s) of {seq} tokens)")


def run_with_cache(model, prompts: str | Sequence[str] | torch.Tensor, names: str | Iterable[str] | None = None,
                   layers: int | Iterable[int] | None = None, remote: bool | str = False
                   ) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass: ``(logits, cache)`` with the standard values ``names`` of blocks ``layers``.

    ``prompts``: a string, a list of strings (padded as the model's traces pad them; the cache's
    ``attention_mask`` marks the real tokens) or token ids ``[batch, seq]``. ``names=None`` caches
    every value each block has (the attention internals while they are on,
    ``model.enable_attention_values()``); a value named explicitly that a block lacks raises the
    model's ``ValueUnavailable`` before anything runs. Runs without gradients.
    """
    explicit = names is not None
    names = list(BY_NAME) if names is None else [value_name(n) for n in ([names] if isinstance(names, str) else names)]
    names = [name for name in BY_NAME if name in names]  # the catalog's order, each once
    layers = layer_indices(model, layers)
    inputs = _inputs(model, prompts)
    plan, unavailable = {}, {}
    for layer in forward_order(layers):
        order = model.order(layer, aliases=True)
        here = []
        for name in names:
            try:
                model.location(layer, name)
            except ValueUnavailable as error:
                if explicit:
                    error.add_note(f"run_with_cache was asked for it at layer {layer}: leave it out, choose layers "
                                   "that have it, or pass names=None to cache what each layer has.")
                    raise
                unavailable[(name, layer)] = error
                continue
            here.append(name)
        plan[layer] = sorted(here, key=lambda name, order=order: order[BY_NAME[name].key])  # forward order
    with torch.no_grad(), model.trace(inputs, remote=remote):
        # detached: a server may run the pass with autograd on
        values = nnsight.save({(name, layer): model.read_value(layer, name).detach()
                               for layer in plan for name in plan[layer]})
        logits = nnsight.save(model.logits.detach())
    names = [name for name in names if any((name, layer) in values for layer in layers)]  # those it holds
    return logits, ActivationCache(values, names, list(dict.fromkeys(layers)), unavailable, model.num_layers,
                                   inputs["input_ids"], inputs["attention_mask"])


def _inputs(model, prompts) -> BatchEncoding:
    """The batch a trace runs on: strings tokenized as the model's traces tokenize them, or ids as given."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts.unsqueeze(0) if prompts.dim() == 1 else prompts
        if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"Token ids are an integer tensor [batch, seq] or [seq], not {ids.dtype} {tuple(ids.shape)}.")
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts is a string, a non-empty list of strings, or a tensor of token ids.")
    return model.tokenizer(prompts, return_tensors="pt", padding=True)


__all__ = ["ActivationCache", "run_with_cache"]
