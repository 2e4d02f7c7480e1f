"""Inputs a model cannot run, refused in one clear line before the forward (an empty prompt, a token id outside the
vocabulary, a prompt longer than the position table, weights dropped by ``model.to("meta")``), where torch would
say ``cannot reshape tensor of 0 elements`` or ``index out of range in self`` from deep inside the model."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..spec.errors import NNterpError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BadInput(NNterpError, ValueError):
    """An input the model cannot run."""


def _is_empty(data) -> bool:
    if isinstance(data, str):
        return False  # a string may tokenize to nothing: seen once it is tokenized
    if isinstance(data, (list, tuple)):
        return len(data) == 0
    return isinstance(data, torch.Tensor) and data.numel() == 0


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def refuse_empty(inputs: tuple) -> None:
    """An invoke given an empty list or tensor: nnsight would take it for parameters only and fail later."""
    if inputs and _is_empty(inputs[0]):
        raise BadInput("The prompt list (or token tensor) is empty: pass at least one prompt or one token.")


def position_limit(model: PreTrainedModel) -> int | None:
    """How many positions the model's learned position table holds (GPT-2's ``wpe``, OPT's ``embed_positions``), or
    None where positions are not looked up in a table (rotary, ALiBi): those run at any length."""
    config = model.config.get_text_config()
    limit = next((getattr(config, key) for key in ("n_positions", "max_position_embeddings")
                  if isinstance(getattr(config, key, None), int)), None)
    if limit is None:
        return None
    tokens = model.get_input_embeddings()
    tables = (module for module in model.modules() if isinstance(module, torch.nn.Embedding) and module is not tokens)
    # a table of exactly that many rows (OPT's keeps 2 more, for an offset)
    return limit if any(limit <= table.num_embeddings <= limit + 2 for table in tables) else None


def check_batch(model: PreTrainedModel, kwargs: dict, limit: int | None) -> None:
    """Refuse a batched forward input that would fail inside the model."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.device.type == "meta" or _is_fake(ids):
        return  # no values to check: weightless, or nnsight's scan (fake tensors, shapes only)
    if ids.shape[-1] == 0:
        raise BadInput("A prompt is empty: the tokenizer gave it no tokens (and adds no beginning-of-text token). "
                       "Pass at least one token.")
    vocabulary = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if vocabulary is None:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocabulary:
        bad = low if low < 0 else high
        raise BadInput(f"Token id {bad} is outside the model's vocabulary of {vocabulary} ids (0 to {vocabulary - 1}).")
    if limit is not None and ids.shape[-1] > limit:
        raise BadInput(f"The input has {ids.shape[-1]} tokens, more than the {limit} positions this model's position "
                       "table holds: shorten the prompt (or the generation).")


def refuse_meta(model: torch.nn.Module) -> None:
    """A dispatched model whose weights were moved to the meta device (``model.to("meta")``) has none left."""
    if getattr(model, "hf_device_map", None) is not None:  # offloaded weights stay on meta between uses, by design
        return
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "meta" and all(p.device.type == "meta" for p in model.parameters()):
        raise BadInput("The model's weights are on the meta device (model.to('meta') drops them), so it cannot run: "
                       "load it again.")


def warn_foreign_hooks(model: torch.nn.Module, warned: set) -> None:
    """Warn (once per hook) where a module carries a PyTorch forward hook the user registered: nnsight reads a
    module's own output, before the hook replaces it, so a hooked block's ``layer_output`` is not the next block's
    ``layer_input``, and a remote run (the server's model has no such hook) computes something else."""
    for module in model.modules():  # on every trace: names only where there is a hook
        if not (module._forward_hooks or module._forward_pre_hooks):
            continue
        name = next(path for path, candidate in model.named_modules() if candidate is module)
        for kind, hooks in (("forward hook", module._forward_hooks), ("forward pre-hook", module._forward_pre_hooks)):
            for key, hook in hooks.items():
                if (id(module), kind, key) in warned:
                    continue
                warned.add((id(module), kind, key))
                where = name or "the model"
                warnings.warn(
                    f"{where} carries a {kind} ({getattr(hook, '__qualname__', hook)}) registered on the model: the "
                    "standard values are read at the module's own inputs and outputs, so an edit the hook makes is "
                    "not in them (e.g. a hooked block's layer_output is not the next block's layer_input), and a "
                    "remote run, whose model has no such hook, differs. Remove it (handle.remove()) and make the "
                    "edit inside the trace, where it reaches the values.", UserWarning, stacklevel=4)
