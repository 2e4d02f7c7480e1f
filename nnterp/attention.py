"""The values inside the attention sublayer: queries, keys, values, scores, probabilities, per-head outputs.

Attention implementations fuse these (sdpa, flash), so nnterp registers one of its own,
``"nnterp"``: the eager computation of transformers' attention interface, with each
intermediate passing through an identity probe module (``self_attn.nnterp_attention.queries``,
``.keys``, ``.values``, ``.scores``, ``.probabilities``). The values are those modules' outputs,
live like every other value, at the cost of eager attention instead of sdpa. Turn it on with
``StandardizedTransformer(..., attention_values=True)`` or ``model.enable_attention_values()``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

IMPLEMENTATION = "nnterp"
PROBES = ("queries", "keys", "values", "scores", "probabilities")


class Probe(nn.Module):
    """An identity: a module boundary where nnsight can read and replace a tensor."""

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class AttentionValues(nn.Module):
    """Eager attention, ``softmax(q·kᵀ·scale (+ softcap) + mask) · v``, through probes.

    ``style`` follows the family's own eager code where it differs: ``"standard"`` (softmax in
    float32, then the query's dtype), ``"gpt2"`` (softmax in the scores' dtype, then the value's),
    ``"float32_scores"`` (GPT-J, CodeGen: scores computed in float32, softmax, then the value's dtype).
    ``s_aux`` (attention sinks, GPT-OSS) adds one logit per head to each row's softmax and drops
    it, so the rows sum to less than 1.
    """

    def __init__(self, style: str = "standard"):
        super().__init__()
        self.style = style
        for name in PROBES:
            self.add_module(name, Probe())

    def forward(self, attention: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                softcap=None, s_aux=None):
        query, key, value = self.queries(query), self.keys(key), self.values(value)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        groups = query.shape[1] // key.shape[1]
        key_states = key.repeat_interleave(groups, dim=1) if groups > 1 else key
        value_states = value.repeat_interleave(groups, dim=1) if groups > 1 else value
        if self.style == "float32_scores":
            scores = torch.matmul(query.to(torch.float32), key_states.to(torch.float32).transpose(2, 3)) * scaling
        else:
            scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        scores = self.scores(scores)
        if s_aux is not None:
            sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
            combined = torch.cat([scores, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probabilities = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value_states.dtype)
        elif self.style in ("gpt2", "float32_scores"):
            probabilities = F.softmax(scores, dim=-1).to(value_states.dtype)
        else:
            probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probabilities = F.dropout(probabilities, p=dropout, training=attention.training)
        probabilities = self.probabilities(probabilities)
        output = torch.matmul(probabilities, value_states).transpose(1, 2).contiguous()
        return output, probabilities


def nnterp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                             s_aux=None, **kwargs):
    """transformers' attention-interface signature, served by the module's probes."""
    probes = getattr(module, "nnterp_attention", None)
    if probes is None:
        raise RuntimeError(f"{type(module).__name__} has no nnterp attention probes: wrap the model with "
                           "StandardizedTransformer(..., attention_values=True).")
    return probes(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap,
                  s_aux=s_aux)


AttentionInterface.register(IMPLEMENTATION, nnterp_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)  # the additive float mask of eager attention


def install_probes(attention_modules: list[nn.Module], style: str) -> None:
    """Give every attention module its probes (inert until the ``"nnterp"`` implementation runs)."""
    for module in attention_modules:
        if not hasattr(module, "nnterp_attention"):
            module.add_module("nnterp_attention", AttentionValues(style))


def implementation_of(model: nn.Module) -> str | None:
    return model.config.get_text_config()._attn_implementation


def set_implementation(model: nn.Module, implementation: str | None) -> None:
    """Set the attention implementation on every config of the model (Falcon ignores set_attn_implementation)."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)] if c is not None}
    for config in list(configs.values()):
        for sub in (config, config.get_text_config()):
            sub._attn_implementation = implementation


def probe_location(attention_path: str, name: str):
    """Where an attention internal is read: its probe's output (q, k, v viewed as ``[batch, seq, heads, dim]``)."""
    from .locations import At

    probe = {"attention_scores": "scores", "attention_probabilities": "probabilities"}.get(name, name)
    return At(f"{attention_path}.nnterp_attention.{probe}", "output", heads_first=name in ("queries", "keys", "values"))


def internal_locations(family, on: bool = True) -> dict:
    """Where a family's attention internals are read (their probes), or why they are unavailable."""
    from .catalog import ATTENTION_INTERNALS
    from .standardized import ATTENTION_OFF

    if not isinstance(family.attention_internals, str):
        return dict.fromkeys(ATTENTION_INTERNALS, family.attention_internals)
    if not on:
        return dict.fromkeys(ATTENTION_INTERNALS, ATTENTION_OFF)
    return {name: probe_location(family.attention, name) for name in ATTENTION_INTERNALS}


def head_outputs(model, layer: int) -> torch.Tensor:
    """Inside a trace: each head's contribution through the output projection, ``[batch, seq, heads, out]``.

    Their sum over heads, plus the projection's bias, is the projection's output (the attention's
    output before any norm after it). A computed tensor, not a live one: to ablate or scale a head,
    edit ``attention_premix`` (``scale_heads``).
    """
    projection = _output_projection(model, layer)
    premix = model.layers[layer].self_attn.attention_premix  # [batch, seq, heads, head_dim]
    weight = projection.weight
    if type(projection).__name__ == "Conv1D":  # GPT-2's projections store [in, out]
        weight = weight.t()
    heads, head_dim = premix.shape[-2], premix.shape[-1]
    per_head = weight.reshape(weight.shape[0], heads, head_dim)  # [out, heads, head_dim]
    return torch.einsum("bshd,ohd->bsho", premix, per_head.to(premix.dtype))


def scale_heads(model, layer: int, heads, factor: float = 0.0) -> None:
    """Inside a trace: multiply the output of ``heads`` of block ``layer`` by ``factor`` (0 ablates them)."""
    premix = model.layers[layer].self_attn.attention_premix
    premix[:, :, heads] *= factor


def _output_projection(model, layer: int) -> nn.Module:
    from .errors import ValueUnavailable
    from .locations import At

    location = model.block_spec(layer).resolve("attention_premix")
    projection = location.module(model.layers[layer]._module) if isinstance(location, At) else None
    if not isinstance(projection, nn.Linear) and type(projection).__name__ != "Conv1D":
        raise ValueUnavailable("self_attn.head_outputs", model.family.name,
                               "the heads are not mixed by one linear output projection")
    return projection
