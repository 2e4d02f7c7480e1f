"""TransformerLens's split attention inputs: ``blocks.L.hook_q_input``, ``hook_k_input`` and ``hook_v_input``, served
after ``model.set_use_split_qkv_input(True)``.

TransformerLens gives each head a copy of the stream entering the block, ``[batch, pos, head_index, d_model]`` (one per
query head for ``hook_q_input``, one per key-value head for ``hook_k_input`` and ``hook_v_input``), and runs the
attention's norm and that head's projection on its own copy, so that editing one head's copy changes only that head's
queries (keys, values). The model nnterp wraps reads one stream for every head: the copies are the attention norm's
input, repeated per head; where a hook edits one, the heads whose copy changed get their queries (keys, values)
computed from it, as tensor steps (the norm as the module computes it, then the head's columns of the projection,
``model.W_Q`` / ``blocks[L].attn._W_K`` / ``_W_V`` and their biases), written at ``attn.hook_q`` (``hook_k``,
``hook_v``) before the hooks there run; the other heads keep the model's own values. A norm after the attention (a
post-norm block) or a projection nnterp cannot split per head is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core import norms
from ...spec.catalog import TRANSFORMERLENS_NORMS
from ...spec.errors import ValueUnavailable
from ...spec.locations import envoy_at
from ...tools import hook_points
from ...tools.hook_points import HookError, Point, _event, _plain_module_output, point, scale_and_normalized

# the split input's tail, the hook point its edit reaches, TransformerLens's weights of it
SPLIT = {"hook_q_input": ("attn.hook_q", "W_Q", "b_Q"), "hook_k_input": ("attn.hook_k", "_W_K", "_b_K"),
         "hook_v_input": ("attn.hook_v", "_W_V", "_b_V")}


def split_on(model) -> bool:
    return bool(model.__dict__.get("_nnterp_split_qkv_input", False))


def set_use_split_qkv_input(model, use_split_qkv_input: bool) -> None:
    """TransformerLens's switch for ``hook_q_input``, ``hook_k_input`` and ``hook_v_input``: served while on."""
    model.__dict__["_nnterp_split_qkv_input"] = bool(use_split_qkv_input)


class SplitInputPoint(Point):
    """One block's ``hook_q_input`` (``hook_k_input``, ``hook_v_input``): the attention norm's input repeated per
    head. A hook's edit of some heads' copies is kept as those heads' new queries (keys, values), which ``follow`` (a
    hook function on ``attn.hook_q``, run there first) writes over the model's own."""

    copy = True

    def __init__(self, name: str, layer: int, event: tuple, norm_path: str, norm, weight, bias, target: Point):
        Point.__init__(self, name, layer, event)
        self.norm_path, self.norm, self.weight, self.bias, self.target = norm_path, norm, weight, bias, target
        self._input = self._pending = None
        self.follow = (target, self._write_heads)

    def read(self, model) -> torch.Tensor:
        self._pending = None
        self._input = envoy_at(model, self.norm_path).input
        return self._input.unsqueeze(-2).expand(*self._input.shape[:-1], self.weight.shape[0],
                                                self._input.shape[-1]).clone()

    def write(self, model, value: torch.Tensor) -> None:
        heads = self.weight.shape[0]
        expected = (*self._input.shape[:-1], heads, self._input.shape[-1])
        if tuple(value.shape) != expected:
            raise HookError(f"A hook on {self.name} gave a tensor of shape {tuple(value.shape)}: the copies of the "
                            f"stream per head are {expected}.")
        changed = (value != self._input.unsqueeze(-2)).flatten(0, -3).any(0).any(-1)  # [heads]
        if not bool(changed.any()):
            return
        normed = self.norm(value)
        weight = self.weight.to(normed.device, normed.dtype)
        bias = self.bias.to(normed.device, normed.dtype)
        projected = torch.einsum("...hd,hde->...he", normed, weight) + bias  # [batch, pos, heads, d_head]
        self._pending = (changed, projected)

    def _write_heads(self, value: torch.Tensor, hook) -> torch.Tensor | None:
        if self._pending is None:
            return None
        changed, projected = self._pending
        self._pending = None
        if projected.shape != value.shape:
            raise HookError(f"{self.name}: the heads' new values are {tuple(projected.shape)}, {self.target.name} is "
                            f"{tuple(value.shape)}.")
        return torch.where(changed[:, None].to(value.device), projected.to(value.dtype), value)


def _norm_function(module, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm module as tensor steps: its scale of the (centred) input, then its weight and bias."""
    try:
        centred, eps = norms.norm_form(module)
    except ValueError as error:
        raise HookError(f"{what}: {error}, so nnterp cannot run it on one head's copy of the stream.") from None
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    offset = norms.declared_offset(module)

    def apply(x: torch.Tensor) -> torch.Tensor:
        normalized = scale_and_normalized(x, centred, eps)[1]
        if weight is not None:
            normalized = normalized * (weight.to(normalized.dtype) + offset)
        if bias is not None:
            normalized = normalized + bias.to(normalized.dtype)
        return normalized

    return apply


def split_input_point(model, name: str, layer: int, tail: str) -> Point:
    """The point of ``blocks.<layer>.hook_q_input`` (``hook_k_input``, ``hook_v_input``); unavailable until
    ``model.set_use_split_qkv_input(True)``, as TransformerLens runs them only then."""
    from .config import WeightRefused, block_weight

    if not split_on(model):
        raise ValueUnavailable(name, model.family.name, "TransformerLens runs the split attention inputs only after "
                                                        "model.set_use_split_qkv_input(True)")
    target_tail, weight_name, bias_name = SPLIT[tail]
    relative = _plain_module_output(model, layer, TRANSFORMERLENS_NORMS["ln1"])
    if relative is None:
        raise ValueUnavailable(name, model.family.name, "TransformerLens's split inputs go through the attention's "
                                                        "norm, and on this block no norm module's output is what the "
                                                        "attention reads")
    norm_path = model.block_path(layer, relative)
    norm = _norm_function(model._module.get_submodule(norm_path), name)
    try:
        weight, bias = block_weight(model, layer, weight_name), block_weight(model, layer, bias_name)
    except WeightRefused as error:
        raise HookError(f"{name}: {error}") from None
    target = point(model, f"blocks.{layer}.{target_tail}")
    event = _event(model, norm_path, "input", name, after=-1)  # before the norm's hook_scale, as TransformerLens
    return SplitInputPoint(name, layer, event, norm_path, norm, weight.detach(), bias.detach(), target)


hook_points.DOOR_POINTS.update(dict.fromkeys(SPLIT, split_input_point))

__all__ = ["SPLIT", "SplitInputPoint", "set_use_split_qkv_input", "split_input_point", "split_on"]
