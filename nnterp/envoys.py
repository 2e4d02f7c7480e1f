"""Envoy classes that expose the catalog as properties of blocks, attentions and MLPs.

The properties are generated from the catalog: one per value, on the envoy of its
owner. Each envoy carries a ``_nnterp_slot`` (the model and the block index) set by
``StandardizedTransformer`` once the tree is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nnsight import Envoy

from .catalog import Value, values_of

if TYPE_CHECKING:
    from .standardized import StandardizedTransformer


@dataclass
class Slot:
    model: "StandardizedTransformer"
    layer: int


def _property(value: Value) -> property:
    def fget(self):
        return self._nnterp_slot.model.read_value(self._nnterp_slot.layer, value.name)

    def fset(self, new):
        self._nnterp_slot.model.write_value(self._nnterp_slot.layer, value.name, new)

    return property(fget, fset, doc=f"{value.meaning}, {value.shape}.")


class StandardEnvoy(Envoy):
    _nnterp_owners: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        # A property that raised AttributeError (an unavailable value) lands here; raise
        # the value's own error rather than nnsight's generic "has no attribute".
        slot = self.__dict__.get("_nnterp_slot")
        if slot is not None and name in {v.name for owner in self._nnterp_owners for v in values_of(owner)}:
            return slot.model.read_value(slot.layer, name)
        return Envoy.__getattr__(self, name)  # explicit: the class travels by value, without a __class__ cell


def _envoy_class(class_name: str, *owners: str, **extra) -> type[StandardEnvoy]:
    namespace = {v.name: _property(v) for owner in owners for v in values_of(owner)}
    namespace["_nnterp_owners"] = owners
    namespace["__doc__"] = f"Envoy of a {' and '.join(owners)}, with the standard values as properties."
    return type(class_name, (StandardEnvoy,), {**namespace, **extra})


BlockEnvoy = _envoy_class("BlockEnvoy", "block")
AttentionEnvoy = _envoy_class("AttentionEnvoy", "self_attn")
MLPEnvoy = _envoy_class("MLPEnvoy", "mlp")
# A block whose MLP layers sit on the block itself (OPT): ``layers[i].mlp`` is the block.
BlockWithMLPEnvoy = _envoy_class("BlockWithMLPEnvoy", "block", "mlp", mlp=property(lambda self: self))


class LayersEnvoy(Envoy):
    """The block list: an index out of range says so, instead of a missing attribute."""

    def __getitem__(self, key: Any) -> Envoy:
        count = len(self._module)
        if isinstance(key, int) and not -count <= key < count:
            raise IndexError(f"Layer {key} is out of range: the model has {count} layers (0 to {count - 1}).")
        return Envoy.__getitem__(self, key)
