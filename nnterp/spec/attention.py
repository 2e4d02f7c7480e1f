"""The values inside the attention sublayer: queries, keys, values, scores, probabilities, per-head outputs.

Fused attention implementations (sdpa, flash) compute these without ever holding them, so they
are read from the model's own *eager* attention function, through nnsight's ``.source``: the
inputs of the attention-interface call (queries, keys and values), the input of its softmax
(the scores) and the pattern its last matmul mixes the values with (the probabilities). Nothing
is added to the model: the same reads run on a plain nnsight model anywhere. Turn them on with
``StandardizedTransformer(..., attention_values=True)`` or ``model.enable_attention_values()``,
which switch the model to transformers' ``"eager"`` attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .catalog import ATTENTION_INTERNALS
from .errors import ValueUnavailable
from .locations import At, Unavailable
from .sourced import sourced

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPLEMENTATION = "eager"


@sourced
@dataclass(frozen=True)
class EagerAttention:
    """Where a family's eager attention computes its internals, as nnsight ``.source`` operation names.

    ``call`` is the attention module's call of its attention function (queries, keys and values
    are its arguments 1 to 3, ``[batch, heads, seq, head_dim]``); ``scores`` is the operation
    whose input (or output) is the masked scores; ``probabilities`` the matmul whose first
    argument is the pattern that mixes the values.
    """

    call: str = "attention_interface_1"
    scores: str = "nn_functional_softmax_0"
    scores_side: str = "input"
    probabilities: str = "torch_matmul_1"
    queries_arg: int = 1  # the attention interface takes the module first

    def locations(self, attention: str) -> dict[str, At]:
        inner = f"{self.call}."
        q = self.queries_arg
        return {
            "queries": At(attention, "input", op=self.call, arg=q, heads_first=True),
            "keys": At(attention, "input", op=self.call, arg=q + 1, heads_first=True),
            "values": At(attention, "input", op=self.call, arg=q + 2, heads_first=True),
            "attention_scores": At(attention, self.scores_side, op=inner + self.scores),
            "attention_probabilities": At(attention, "input", op=inner + self.probabilities),
        }


@sourced
@dataclass(frozen=True)
class OwnCode(EagerAttention):
    """An attention that computes in its own code, outside transformers' attention interface: each internal
    is read at one operation of its forward, ``places`` giving ``(name, op, side, i)`` (the operation's output,
    element ``i`` of a tuple, or its argument ``i``). Queries, keys and values are ``[batch, heads, seq,
    head_dim]`` there. ``module`` is the attention's submodule whose forward that is ("" for the attention)."""

    places: tuple[tuple[str, str, str, int], ...] = ()
    module: str = ""

    def locations(self, attention: str) -> dict[str, At]:
        path = f"{attention}.{self.module}" if self.module else attention

        def at(name, op, side, i):
            where = {"index": i} if side == "output" else {"arg": i}
            return At(path, side, op=op, heads_first=name in ("queries", "keys", "values"), **where)

        return {name: at(name, *place) for name, *place in self.places}


STANDARD = EagerAttention()
# Attention sinks (GPT-OSS, DeepSeek-V4): the softmax runs over the scores plus one sink logit per
# head, so the scores are the masked scores before the sink column joins them.
WITH_SINKS = EagerAttention(scores="attn_weights_1", scores_side="output")

OFF = Unavailable(
    "the values inside the attention are off: load with StandardizedTransformer(..., attention_values=True) "
    "or call model.enable_attention_values() (it runs eager attention, slower than sdpa)"
)


def internal_locations(family, config, on: bool = True) -> dict:
    """Where a family's attention internals are read with ``config``, or why they are unavailable."""
    where = family.attention_of(config)
    if isinstance(where, Unavailable):
        return dict.fromkeys(ATTENTION_INTERNALS, where)
    if not on:
        return dict.fromkeys(ATTENTION_INTERNALS, OFF)
    return where.locations(family.attention)


def implementation_of(model: PreTrainedModel) -> str | None:
    return model.config.get_text_config()._attn_implementation


def set_implementation(model: nn.Module, implementation: str | None) -> None:
    """Set the attention implementation on every config of the model (Falcon ignores set_attn_implementation)."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)] if c is not None}
    for config in list(configs.values()):
        for sub in (config, config.get_text_config()):
            sub._attn_implementation = implementation


def head_outputs(model, layer: int) -> torch.Tensor:
    """Inside a trace: each head's contribution through the output projection, ``[batch, seq, heads, out]``.

    Their sum over heads, plus the projection's bias, is the projection's output (the attention's
    output before any norm after it). A computed tensor, not a live one: to ablate or scale a head,
    edit ``attention_premix`` (``scale_heads``). The projection's weight is read inside its own
    forward, as the forward uses it, so an offloaded weight is the real one, on its device.
    """
    location = _output_projection(model, layer)
    envoy = location.envoy(model.layers[layer])
    conv1d = type(envoy._module).__name__ == "Conv1D"  # GPT-2's projections: addmm(bias, x, weight [in, out])
    offloaded = envoy._module.weight.device.type == "meta"
    # an offloaded weight exists only while the projection runs: read it as the forward uses it (its
    # operations instrumented before it runs). Then nothing of this block earlier than that is readable.
    operations = envoy.source if offloaded else None
    premix = model.layers[layer].self_attn.attention_premix  # [batch, seq, heads, head_dim]
    if operations is not None and (conv1d or "F_linear_0" in operations.names):  # offloaded
        weight = operations.torch_addmm_0.inputs[0][2] if conv1d else operations.F_linear_0.inputs[0][1]
    elif operations is not None:  # offloaded, of its own code (Falcon's FalconLinear): its weight loads while it runs
        getattr(operations, next(iter(operations.names))).inputs  # noqa: B018 - wait for its first operation
        weight = envoy._module.weight.detach().clone()
    else:
        weight = envoy._module.weight
    if conv1d:
        weight = weight.t()
    heads, head_dim = premix.shape[-2], premix.shape[-1]
    if weight.shape[-1] != heads * head_dim:
        raise ValueUnavailable("self_attn.head_outputs", model.family.name,
                               "the output projection mixes groups of heads, not every head at once")
    per_head = weight.reshape(weight.shape[0], heads, head_dim)  # [out, heads, head_dim]
    return torch.einsum("bshd,ohd->bsho", premix, per_head.to(device=premix.device, dtype=premix.dtype))


def scale_heads(model, layer: int, heads, factor: float = 0.0) -> None:
    """Inside a trace: multiply the output of ``heads`` of block ``layer`` by ``factor`` (0 ablates them)."""
    premix = model.layers[layer].self_attn.attention_premix
    premix[:, :, heads] *= factor


def _output_projection(model, layer: int) -> At:
    location = model.block_spec(layer).resolve("attention_premix")
    if isinstance(location, Unavailable):  # (a hybrid's block that mixes tokens otherwise)
        raise ValueUnavailable("self_attn.head_outputs", model.family.name, location.reason)
    projection = None
    if isinstance(location, At) and not location.op:
        projection = model._module.get_submodule(model.block_path(layer, location.path))
    if not isinstance(projection, nn.Linear) and type(projection).__name__ != "Conv1D":
        raise ValueUnavailable("self_attn.head_outputs", model.family.name,
                               "the heads are not mixed by one linear output projection")
    return location

