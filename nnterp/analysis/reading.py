"""Reading one pass's cache as TransformerLens's analyses do: its slices, its ``layer`` argument, the stream at a
layer, a block's value or identity extra by name, and a warning where a slice picks padding."""

from __future__ import annotations

import warnings

import torch

from ..spec.catalog import BY_NAME


def _take(tensor: torch.Tensor, index, dim: int) -> torch.Tensor:
    """TransformerLens's slices: None (all), an int (that one, the dimension dropped), a tuple (a slice of
    its arguments), a slice, or a list or tensor of indices."""
    if index is None:
        return tensor
    dim %= tensor.dim()
    if isinstance(index, int):
        return tensor.select(dim, index)
    if isinstance(index, tuple):
        index = slice(*index)
    if isinstance(index, slice):
        return tensor[(slice(None),) * dim + (index,)]
    return tensor.index_select(dim, torch.as_tensor(index, dtype=torch.long, device=tensor.device))


def _warn_if_pads(cache, pos_slice, what: str) -> None:
    """``pos_slice`` picks columns of the batch, as TransformerLens's does, not each prompt's own positions: warn
    where a column it picks is padding for some prompt (the short prompts' last tokens are not at -1 when the
    tokenizer pads on the right)."""
    mask = getattr(cache, "attention_mask", None)
    if pos_slice is None or mask is None or bool(mask.all()):
        return
    pads = _take(mask, pos_slice, -1) == 0
    if pads.any():
        prompts = sorted(set(pads.nonzero()[:, 0].tolist()))
        side = "right" if bool((mask[:, -1] == 0).any()) else "left"
        warnings.warn(f"{what}: pos_slice={pos_slice!r} picks columns of the batch, and they are padding for prompt(s) "
                      f"{prompts} of this batch, padded on the {side}: those prompts' rows there are a pad's. Pad on "
                      "the left (as the model's traces do) for pos_slice=-1 to be each prompt's last token, or pick "
                      "positions per prompt (cache.attention_mask.sum(-1) - 1 is each one's last under right padding).",
                      UserWarning, stacklevel=3)


def _value(cache, name: str, layer: int) -> torch.Tensor:
    """Block ``layer``'s value ``name``, or its identity's extra term ``name``."""
    return cache[name if name in BY_NAME else f"extra.{name}", layer]


def _layer(model, layer: int | None, what: str) -> int:
    """TransformerLens's ``layer``: 0 to ``num_layers`` (the stream the final norm reads); None or -1 mean the last."""
    n = model.num_layers
    if layer is None or layer == -1:
        return n
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
        raise IndexError(f"{what}'s layer is 0 to {n} (the stream the final norm reads; None or -1 too), not {layer!r}.")
    return layer


def _readout_refusal(model) -> str | None:
    family = model.family
    if family.readout_unavailable:
        return family.readout_unavailable
    if family.stream_readout:
        return f"the model collapses parallel streams ({family.stream_readout}) before its final norm"
    if family.before_final_norm:
        return "the model changes the last block's output before its final norm reads it"
    return None


def stream_at(cache, layer: int) -> torch.Tensor:
    """The stream block ``layer`` receives; at ``num_layers``, the stream the final norm reads (the last block's
    output on a model without one)."""
    model = cache.model
    if layer < model.num_layers:
        return cache["layer_input", layer]
    if model.family.ln_final:
        return cache["ln_final_input"]
    return cache["layer_output", model.num_layers - 1]
