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
from nnsight import Envoy

from .catalog import BY_NAME

if TYPE_CHECKING:
    from .standardized import StandardizedTransformer


@dataclass
class Slot:
    model: StandardizedTransformer
    layer: int


class StandardValue:
    """A standard value of the block: read it, edit it in place, or assign it, inside a trace."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"{BY_NAME[name].meaning}, {BY_NAME[name].shape}."

    def __get__(self, envoy, owner=None) -> torch.Tensor:
        if envoy is None:
            return self
        slot = envoy._nnterp_slot
        return slot.model.read_value(slot.layer, self.name)

    def __set__(self, envoy, value: torch.Tensor) -> None:
        slot = envoy._nnterp_slot
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
        return Envoy.__getattr__(self, name)  # explicit: the class travels by value, without a __class__ cell


class BlockEnvoy(StandardEnvoy):
    """A block, with the stream and the values between its sublayers."""

    layer_input = StandardValue()
    attention_norm_output = StandardValue()
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


class BlockWithMLPEnvoy(BlockEnvoy, MLPEnvoy):
    """A block whose MLP layers sit on the block itself (OPT): ``layers[i].mlp`` is the block."""

    @property
    def mlp(self) -> BlockWithMLPEnvoy:
        return self


class LayersEnvoy(Envoy):
    """The block list: an index out of range says so, instead of a missing attribute."""

    def __getitem__(self, key: Any) -> Envoy:
        count = len(self._module)
        if isinstance(key, int) and not -count <= key < count:
            raise IndexError(f"Layer {key} is out of range: the model has {count} layers (0 to {count - 1}).")
        return Envoy.__getitem__(self, key)
