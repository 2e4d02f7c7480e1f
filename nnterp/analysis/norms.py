"""Norms frozen as the affine map they applied in one pass, and stacks passed through them.

A norm is frozen as ``(x - mean(x)) / s * gain + bias`` (no centring on an RMSNorm; ``gain`` is the weight as the
norm applies it, Gemma's ``1 + weight``), with ``s`` per position, read off the norm's cached input and output
(TransformerLens's ``hook_scale``). Centring and the weight's convention are read by calling the module on a probe;
a norm whose output in the pass is not that map is refused. A stack whose rows sum to the stream sums, through the
frozen norm, to the normed stream the model saw less the norm's bias (within rounding); the bias is a row of its own
only where asked (``incl_bias=True``), so a stack keeps TransformerLens's number of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..spec.errors import ValueUnavailable
from ..spec.identity import native
from ..spec.locations import At
from ..spec.sourced import sourced
from .checks import _far, _refuse, _why_not_exact
from .reading import _layer, _take


@sourced
@dataclass(frozen=True, eq=False)
class FrozenNorm:
    """A norm as the affine map it applied in one pass: ``(x - mean(x)) / scale * gain + bias`` (no centring where
    ``centred`` is False: an RMSNorm), ``scale`` per position ``[batch, seq, 1]``; ``gain`` is the weight as the
    norm applies it (None: no weight), ``bias`` None where it has none. In float32."""

    label: str
    centred: bool
    scale: torch.Tensor
    gain: torch.Tensor | None
    bias: torch.Tensor | None

    def linear(self, stack: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The norm's linear part, at ``scale`` (the pass's, sliced as ``stack`` is), on each row of ``stack``."""
        stack = stack.float()
        if self.centred:
            stack = stack - stack.mean(-1, keepdim=True)
        stack = stack / scale.to(stack.device)
        return stack if self.gain is None else stack * self.gain.to(stack.device)


def _module(model, layer: int | None, path: str | None) -> nn.Module:
    return model.ln_final._module if layer is None else model.layers[layer]._module.get_submodule(path)


def frozen_norm(cache, layer: int | None = None, mlp_input: bool = False) -> FrozenNorm | None:
    """The norm that reads the stream at ``layer`` (None or ``num_layers``: the final norm; else block ``layer``'s
    attention norm, or its MLP norm with ``mlp_input``), frozen as it was in the pass; None where the model has
    no final norm (its head reads the stream)."""
    model = cache.model
    what = "apply_ln_to_stack"
    layer = _layer(model, layer, what)
    if layer == model.num_layers:
        if mlp_input:
            raise ValueError("apply_ln_to_stack: mlp_input=True names a block's MLP norm; the final norm has none.")
        if model.family.ln_final is None:
            return None
        module, label = _module(model, None, None), "ln_final"
        x, y = cache["ln_final_input"], cache["ln_final_output"]
        reads = "the stream the final norm reads"
    else:
        name = "mlp_norm_output" if mlp_input else "attention_norm_output"
        try:
            location = model.location(layer, name)
        except ValueUnavailable as error:
            _refuse(model, what, f"block {layer} has no {'MLP' if mlp_input else 'attention'} norm to freeze "
                                 f"({error.reason})")
        if location.op or location.side != "output":
            _refuse(model, what, f"block {layer}'s {name} is not one norm module's output")
        stream = "layer_mid" if mlp_input and isinstance(model.block_spec(layer).resolve("layer_mid"), At) else "layer_input"
        module = _module(model, layer, location.path)
        label = f"{layer}_{'mlp' if mlp_input else 'attention'}_norm"
        x, y = cache[stream, layer], cache[name, layer]
        reads = f"block {layer}'s {stream}"
    centred, offset = _norm_form(model, module, x, label)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    gain = None if weight is None else weight.detach().float().to(x.device) + offset
    bias = None if bias is None else bias.detach().float().to(x.device)
    u, numerator, denominator = _fit(x, y, centred, gain, bias)
    # where the norm's input is flat (zero after centring: a pad's zero stream), its output says nothing of the
    # scale, which is then the norm's sqrt(eps) (TransformerLens's hook_scale there)
    flat = denominator == 0
    scale = numerator / torch.where(flat, 1, denominator)
    if flat.any():
        scale = torch.where(flat, _flat_scale(module, centred, gain, bias, x), scale)
    predicted = u / scale + (0 if bias is None else bias)
    difference = _far(predicted, y, y.dtype) if y.shape == x.shape else 1.0
    if difference is not None:
        _why_not_exact(cache, what, [(reads, x), (f"{label}'s output", y)], f"{label}'s output")
        _refuse(model, what, f"{label} ({type(module).__name__}) is not, in this pass, {reads} normed at one scale "
                             f"per position as a LayerNorm or an RMSNorm does (relative difference {difference:.2g}), "
                             "so it cannot be frozen")
    return FrozenNorm(label, centred, scale, gain, bias)


def _flat_scale(module: nn.Module, centred: bool, gain, bias, like: torch.Tensor) -> float:
    """What the norm divides by where its input is flat (zero after centring): ``sqrt(eps)``, its declared epsilon
    (transformers' norms name it one of these), or else read off its output on a small probe."""
    for name in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) ** 0.5
    probe = torch.full((1, 1, like.shape[-1]), 1e-3)
    probe[..., ::2] = -1e-3
    probe = (probe - probe.mean(-1, keepdim=True) if centred else probe).to(like.device)
    with torch.no_grad():
        y = native(module, probe.to(like.dtype))
    _, numerator, denominator = _fit(probe, y, False, gain, bias)  # already centred
    scale = (numerator / denominator).item()
    return max(scale * scale - probe.pow(2).mean().item(), 0.0) ** 0.5


def _fit(x: torch.Tensor, y: torch.Tensor, centred: bool, gain, bias):
    """``(u, u·u, u·r)`` per position, in float32: ``u`` the norm's input centred (where it centres) times its gain,
    ``r`` its output less its bias; ``y = u / scale + bias`` gives ``scale = u·u / u·r``."""
    u = x.float() - x.float().mean(-1, keepdim=True) if centred else x.float()
    u = u if gain is None else u * gain
    r = y.float() if bias is None else y.float() - bias
    return u, (u * u).sum(-1, keepdim=True), (u * r).sum(-1, keepdim=True)


def _norm_form(model, module: nn.Module, x: torch.Tensor, label: str) -> tuple[bool, float]:
    """(centred, offset of the weight) of a norm, from its output on a probe: a LayerNorm's output does not
    change when a constant is added to its input; the weight is applied as ``weight`` or ``1 + weight``."""
    what = "apply_ln_to_stack"
    parameters = dict(module.named_parameters())
    if set(parameters) - {"weight", "bias"}:
        _refuse(model, what, f"{label} ({type(module).__name__}) has parameters {sorted(parameters)}: it is not a "
                             "LayerNorm or an RMSNorm, so it cannot be frozen")
    if any(p.device.type == "meta" for p in parameters.values()):
        _refuse(model, what, f"{label}'s weights are not loaded here (meta), so it cannot be frozen")
    hidden = x.shape[-1]
    if any(tuple(p.shape) != (hidden,) for p in parameters.values()):
        _refuse(model, what, f"{label}'s parameters are not one per channel of the stream")
    device = next(iter(parameters.values())).device if parameters else x.device
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(-8, 9, (1, 8, hidden), generator=generator).float()  # integers: exact in any dtype
    try:
        with torch.no_grad():
            plain = native(module, probe.to(device, x.dtype))
            shifted = native(module, (probe + 16).to(device, x.dtype))
    except Exception as error:
        _refuse(model, what, f"{label} ({type(module).__name__}) cannot be called on a stream alone "
                             f"({type(error).__name__}: {error}), so it cannot be frozen")
    if not isinstance(plain, torch.Tensor) or plain.shape != probe.shape:
        _refuse(model, what, f"{label} ({type(module).__name__}) does not return a stream, so it cannot be frozen")
    centred = _far(plain, shifted, x.dtype) is None
    if "weight" not in parameters:
        return centred, 0.0
    normed = probe - probe.mean(-1, keepdim=True) if centred else probe
    normed = normed / normed.pow(2).mean(-1, keepdim=True).sqrt()
    weight = parameters["weight"].detach().float().cpu()
    bias = parameters["bias"].detach().float().cpu() if "bias" in parameters else 0
    plain = plain.float().cpu()
    error = {offset: (normed * (weight + offset) + bias - plain).abs().max().item() for offset in (0.0, 1.0)}
    return centred, min(error, key=error.get)


def _frozen_at(cache, layer: int, mlp_input: bool, pos_slice, batch_slice, has_batch_dim: bool):
    """``(the frozen norm, its scale sliced as a stack is)``, or ``(None, None)`` where there is no final norm."""
    norm = frozen_norm(cache, layer, mlp_input)
    if norm is None:
        return None, None
    scale = _take(norm.scale, batch_slice, 0)
    if not has_batch_dim:
        if scale.dim() == norm.scale.dim():  # still a batch dimension: it must be one prompt
            if scale.shape[0] != 1:
                raise ValueError("apply_ln_to_stack(has_batch_dim=False) needs one prompt: a cache of one, or an int "
                                 "batch_slice.")
            scale = scale[0]
    return norm, _take(scale, pos_slice, -2)


def apply_ln_to_stack(cache, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                      pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                      incl_bias: bool = False, labels: Sequence[str] | None = None):
    """``residual_stack`` ``[rows, batch, pos, hidden]`` (rows that sum to a stream) through the norm that reads the
    stream at ``layer`` (None: the final norm; else block ``layer``'s attention norm, or its MLP norm with
    ``mlp_input``), frozen at the scale it had in the pass, with its weight as it applies it: each row is
    ``(row - mean(row)) / scale * gain`` (no centring on an RMSNorm), the same shape as the stack, as in
    TransformerLens. The norm's bias belongs to no row: the rows sum to the normed stream the model saw minus the
    bias. ``incl_bias=True`` adds the bias as one more row (where the norm has one), so the rows sum to the normed
    stream itself. (TransformerLens's ``apply_ln_to_stack`` divides by the scale only: its ``fold_ln`` moves the
    gain into the next weights and the bias into the next biases.) ``pos_slice`` and ``batch_slice`` say which
    positions and prompts the stack holds (it is already sliced by ``pos_slice``; ``batch_slice`` is applied to
    it). ``recompute_ln=True`` (the final norm only) norms each row with its own statistics instead, as a stream of
    its own, bias included. With ``labels``, returns ``(stack, labels)``, the bias's label (``ln_final_bias``,
    ``{layer}_attention_norm_bias``, ...) added with its row."""
    model = cache.model
    layer = _layer(model, layer, "apply_ln_to_stack")
    stack = _take(residual_stack, batch_slice, 1) if has_batch_dim else residual_stack
    labels = None if labels is None else list(labels)
    if recompute_ln:
        if layer != model.num_layers:
            raise ValueError("apply_ln_to_stack: recompute_ln=True norms with the final norm (layer None).")
        normed = stack.float()
        if model.family.ln_final is not None and len(stack):
            with torch.no_grad():
                normed = torch.stack([native(_module(model, None, None), row).float() for row in stack])
        return normed if labels is None else (normed, labels)
    norm, scale = _frozen_at(cache, layer, mlp_input, pos_slice, batch_slice, has_batch_dim)
    if norm is None:  # no final norm: the head reads the stream as it is
        return stack.float() if labels is None else (stack.float(), labels)
    normed = norm.linear(stack, scale)
    if incl_bias and norm.bias is not None:
        normed = torch.cat([normed, norm.bias.expand(normed.shape[1:])[None]])
        labels = None if labels is None else [*labels, f"{norm.label}_bias"]
    return normed if labels is None else (normed, labels)
