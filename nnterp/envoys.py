"""Envoy classes that expose the catalog's values as declared attributes of blocks, attentions and MLPs.

Each value is a ``StandardValue`` descriptor, declared below so that editors and type checkers
see it; a test checks that the declarations are exactly the catalog's. Each envoy carries a
``_nnterp_slot`` (the model and the block index) set by ``StandardizedTransformer``, and a value
is read or written through the model's engine (``read_value`` / ``write_value``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from greenlet import getcurrent
from nnsight import Envoy

from .catalog import BY_NAME, value_named
from .errors import ValueUnavailable
from .locations import Unavailable

if TYPE_CHECKING:
    from .standardized import StandardizedTransformer


@dataclass
class Slot:
    model: StandardizedTransformer
    layer: int


def in_trace() -> bool:
    """Whether intervention code is running now (nnsight runs it in a worker that carries a mediator)."""
    return getattr(getcurrent(), "mediator", None) is not None


class ValueOutsideTrace:
    """What ``model.layers[i].<value>`` is outside a trace: where the value is read. Its tensor exists only
    inside one, so any use of it says how to read it there; ``hasattr`` thus tells availability everywhere."""

    def __init__(self, layer: int, key: str, where: str):
        self.layer, self.key, self.where = layer, key, where

    def __repr__(self) -> str:
        value = value_named(self.key)
        return (f"layers[{self.layer}].{self.key}: {value.meaning}, {value.shape}; read at {self.where}. "
                "It holds a tensor inside `with model.trace(...)`.")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe dunders: plain "no such attribute"
            raise AttributeError(name)
        raise ValueError(
            f"layers[{self.layer}].{self.key} is a tensor only inside a trace: "
            f"`with model.trace(prompt): x = model.layers[{self.layer}].{self.key}.save()`, then use `x`."
        )


class StandardValue:
    """A standard value of the block: read it, edit it in place, or assign it, inside a trace."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"{BY_NAME[name].meaning}, {BY_NAME[name].shape}."

    def __get__(self, envoy, owner=None) -> torch.Tensor:
        if envoy is None:
            return self
        slot = envoy._nnterp_slot
        if not in_trace():
            location, key, *_ = slot.model._resolved(slot.layer, self.name)  # an unavailable value raises here
            return ValueOutsideTrace(slot.layer, key, location.describe())
        return slot.model.read_value(slot.layer, self.name)

    def __set__(self, envoy, value: torch.Tensor) -> None:
        slot = envoy._nnterp_slot
        if not in_trace():
            key = slot.model._resolved(slot.layer, self.name)[1]
            raise ValueError(f"layers[{slot.layer}].{key} can be assigned only inside a trace: "
                             f"`with model.trace(prompt): model.layers[{slot.layer}].{key} = tensor`.")
        slot.model.write_value(slot.layer, self.name, value)


def standard_values(envoy_class: type) -> set[str]:
    return {name for klass in envoy_class.__mro__ for name, attribute in vars(klass).items()
            if isinstance(attribute, StandardValue)}


class StandardEnvoy(Envoy):
    def __getattr__(self, name: str) -> Any:
        # A value that raised AttributeError (an unavailable value) lands here; raise the value's
        # own error rather than nnsight's generic "has no attribute".
        slot = self.__dict__.get("_nnterp_slot")
        if slot is not None and name in standard_values(type(self)):
            return slot.model.read_value(slot.layer, name)
        if slot is not None and name in SUBLAYERS and isinstance(self, BlockEnvoy):
            _no_sublayer(slot, name)
        return Envoy.__getattr__(self, name)  # explicit: the class travels by value, without a __class__ cell


# a block's sublayer -> the value that is its contribution: the sublayer exists where the value does
SUBLAYERS = {"self_attn": "attention_output", "mlp": "mlp_output"}


def _no_sublayer(slot: Slot, name: str) -> None:
    """Raise ``ValueUnavailable`` with the reason where block ``slot.layer`` has no such sublayer (a hybrid's block
    that mixes tokens otherwise has no attention, a recurrent block no MLP)."""
    location = slot.model.block_spec(slot.layer).resolve(SUBLAYERS[name])
    if isinstance(location, Unavailable):
        raise ValueUnavailable(name, slot.model.family.name, location.reason)


class BlockEnvoy(StandardEnvoy):
    """A block, with the stream and the values between its sublayers."""

    layer_input = StandardValue()
    attention_norm_output = StandardValue()
    mixer_output = StandardValue()
    layer_mid = StandardValue()
    mlp_norm_output = StandardValue()
    mlp_input = StandardValue()
    layer_output = StandardValue()


class AttentionEnvoy(StandardEnvoy):
    """A block's attention, with the values inside it."""

    queries = StandardValue()
    keys = StandardValue()
    values = StandardValue()
    attention_scores = StandardValue()
    attention_probabilities = StandardValue()
    attention_premix = StandardValue()
    attention_output = StandardValue()


class MLPEnvoy(StandardEnvoy):
    """A block's MLP, with the values inside it."""

    mlp_activation = StandardValue()
    mlp_neurons = StandardValue()
    mlp_output = StandardValue()


class SublayerEnvoy(AttentionEnvoy, MLPEnvoy):
    """A module that is the attention on some blocks and the MLP on others (Nemotron-H's ``mixer``): the values of
    either, each available where the block's spec places it."""


class BlockWithMLPEnvoy(BlockEnvoy, MLPEnvoy):
    """A block whose MLP layers sit on the block itself (OPT): ``layers[i].mlp`` is the block. The envoy of a
    family with no MLP module too: where the block has no MLP (a recurrent block), ``mlp`` says why."""

    @property
    def mlp(self) -> BlockWithMLPEnvoy:
        slot = self.__dict__.get("_nnterp_slot")
        if slot is not None:  # a block with no MLP at all (a recurrent one): say why
            _no_sublayer(slot, "mlp")
        return self


class LayersEnvoy(Envoy):
    """The block list: an index out of range says so, instead of a missing attribute."""

    def __getitem__(self, key: Any) -> Envoy:
        count = len(self._module)
        if isinstance(key, int) and not -count <= key < count:
            raise IndexError(f"Layer {key} is out of range: the model has {count} layers (0 to {count - 1}).")
        return Envoy.__getitem__(self, key)
