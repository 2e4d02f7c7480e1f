"""Envoy classes that expose the catalog's values as declared attributes of blocks, attentions and MLPs.

Each value is a ``StandardValue`` descriptor, declared below so that editors and type checkers
see it; a test checks that the declarations are exactly the catalog's. Each envoy carries a
``_nnterp_slot`` (``nnterp.core.engine.Slot``: the model and the block index) set by ``StandardizedTransformer``, and
a value is read or written through the slot's bound value (``Slot.value(name)``), straight to nnsight.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from greenlet import getcurrent
from nnsight import Envoy

from ..spec.catalog import BY_NAME, suggestion
from ..spec.errors import ValueUnavailable
from ..spec.locations import Unavailable
from .engine import Slot, ValueOutsideTrace

__all__ = ["Slot", "ValueOutsideTrace", "StandardValue", "BlockEnvoy", "AttentionEnvoy", "MLPEnvoy", "SublayerEnvoy",
           "BlockWithMLPEnvoy", "LayersEnvoy", "BlockRun", "standard_values", "in_trace"]


def in_trace() -> bool:
    """Whether intervention code is running now (nnsight runs it in a worker that carries a mediator)."""
    return getattr(getcurrent(), "mediator", None) is not None


class StandardValue:
    """A standard value of the block: read it, edit it in place, or assign it, inside a trace."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"{BY_NAME[name].meaning}, {BY_NAME[name].shape}."

    # on the class, the descriptor; on an envoy, the value's tensor inside a trace (outside one, where it is read)
    @overload
    def __get__(self, envoy: None, owner: type | None = None) -> StandardValue: ...
    @overload
    def __get__(self, envoy: object, owner: type | None = None) -> torch.Tensor: ...
    def __get__(self, envoy, owner=None) -> Any:
        if envoy is None:
            return self
        slot = envoy._nnterp_slot
        bound = slot.values.get(self.name) or slot.value(self.name)  # an unavailable value raises here
        if getattr(getcurrent(), "mediator", None) is None:  # outside a trace: where it is read
            return ValueOutsideTrace(slot.label(), bound.key, bound.location.describe())
        return bound.read()

    def __set__(self, envoy, value: torch.Tensor) -> None:
        if isinstance(value, Envoy):  # nnsight mounting a module of the block that has this value's name (Inkling-2's
            # mlp_input): it goes under nnsight's prefix for the names an envoy serves itself (layers[i].E_mlp_input)
            envoy.__dict__[f"{Envoy.OVERLOAD_PREFIX}{self.name}"] = value
            return
        slot = envoy._nnterp_slot
        bound = slot.value(self.name)
        if not in_trace():
            raise ValueError(f"{slot.label()}.{bound.key} can be assigned only inside a trace: "
                             f"`with model.trace(prompt): model.{slot.label()}.{bound.key} = tensor`.")
        bound.write(value)


def standard_values(envoy_class: type) -> set[str]:
    return {name for klass in envoy_class.__mro__ for name, attribute in vars(klass).items()
            if isinstance(attribute, StandardValue)}


class StandardEnvoy(Envoy):
    def __getattr__(self, name: str) -> Any:
        # A value that raised AttributeError (an unavailable value) lands here; raise the value's
        # own error rather than nnsight's generic "has no attribute".
        slot = self.__dict__.get("_nnterp_slot")
        if slot is not None and name in standard_values(type(self)):
            return slot.value(name).read()  # an unavailable value raises its own error
        if slot is not None and name in SUBLAYERS and isinstance(self, BlockEnvoy):
            _no_sublayer(slot, name)
        try:
            return Envoy.__getattr__(self, name)  # explicit: the class travels by value, without a __class__ cell
        except AttributeError as error:
            guess = suggestion(name) if slot is not None and not name.startswith("_") else None
            if guess is None or slot is None:
                raise
            where = slot.label() + ("" if guess.owner == "block" else f".{guess.owner}")
            raise AttributeError(f"{error} Did you mean `model.{where}.{guess.name}`?") from None


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

    def run(self, k: int) -> BlockRun:
        """Run ``k`` of a block that runs several times in each forward pass (a looped section): its values, and
        those of its ``self_attn`` and ``mlp``, as that run computes them (``model.runs_of(i)`` runs, from 0)."""
        slot = self._nnterp_slot
        return BlockRun(slot.model._run_slot(slot.layer, k))

    layer_input = StandardValue()
    attention_norm_output = StandardValue()
    mixer_output = StandardValue()
    layer_mid = StandardValue()
    mlp_norm_output = StandardValue()
    mlp_input = StandardValue()
    layer_output = StandardValue()


class AttentionEnvoy(StandardEnvoy):
    """A block's attention, with the values inside it."""

    query_norm_input = StandardValue()
    query_norm_output = StandardValue()
    key_norm_input = StandardValue()
    key_norm_output = StandardValue()
    queries = StandardValue()
    keys = StandardValue()
    values = StandardValue()
    attention_scores = StandardValue()
    attention_probabilities = StandardValue()
    attention_premix = StandardValue()
    attention_output_before_norm = StandardValue()
    attention_output = StandardValue()


class MLPEnvoy(StandardEnvoy):
    """A block's MLP, with the values inside it."""

    router_logits = StandardValue()
    mlp_pre_activation = StandardValue()
    mlp_up_output = StandardValue()
    mlp_activation = StandardValue()
    mlp_neurons = StandardValue()
    mlp_output_before_norm = StandardValue()
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


class _Run:
    """Values at one run of a looped block (``Slot.run``), declared like the envoys' (``_run_class``)."""

    def __init__(self, slot: Slot):
        self._nnterp_slot = slot

    def __repr__(self) -> str:
        return f"<{self._nnterp_slot.label()} of {self._nnterp_slot.model.family.name}>"


def _run_class(name: str, envoy_class: type, doc: str) -> type:
    return type(name, (_Run,), {"__doc__": doc, **{value: StandardValue() for value in standard_values(envoy_class)}})


_AttentionRun = _run_class("AttentionRun", AttentionEnvoy, "The attention of one run of a looped block.")
_MLPRun = _run_class("MLPRun", MLPEnvoy, "The MLP of one run of a looped block.")


_BlockValues: Any = _run_class("_BlockValues", BlockEnvoy, "")  # built at import: its values are unknown to the checker


class BlockRun(_BlockValues):
    """One run of a looped block: ``model.layers[i].run(k)``. Its standard values are read and assigned like a
    block's, at that run; ``self_attn`` and ``mlp`` give the values inside the sublayers at that run. The native
    modules are the block's, ``model.layers[i]``, and nnsight reads their first run."""

    @property
    def self_attn(self):
        _no_sublayer(self._nnterp_slot, "self_attn")
        return _AttentionRun(self._nnterp_slot)

    @property
    def mlp(self):
        _no_sublayer(self._nnterp_slot, "mlp")
        return _MLPRun(self._nnterp_slot)
