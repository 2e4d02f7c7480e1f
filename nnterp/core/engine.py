"""The engine: each block's standard values bound to where they are read, and what a pass prepares before them.

A ``Slot`` is a block of a wrapped model (or one run of a looped block). Its values are ``BoundValue`` objects,
built on a value's first use and kept until the values are placed anew (the attention values turned on or off, the
weights dispatched): the location, the envoy that serves it, the number of heads its views split by. A read goes
from the envoy's descriptor straight to its bound value, and from there to nnsight. Everything here runs inside
traces, also on a server where nnterp is not installed (the classes travel by value): hand-written methods only,
explicit base calls, pure tensor steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from nnsight.intervention.interleaver import Mediator, OutOfOrderError

from ..families import Block, Family
from ..spec import attention
from ..spec.catalog import value_named
from ..spec.errors import NNterpError, RunNotChosen, ValueUnavailable
from ..spec.locations import At, Unavailable, envoy_at
from ..spec.views import View


class WrappedModel(Protocol):
    """What the engine and the mixins of ``StandardizedTransformer`` use of the wrapped model, for the type checker
    (mixin methods take ``self: WrappedModel``): nnsight's ``TransformersModel`` members, the attributes the class
    sets, and the methods one mixin calls of another. Never instantiated; it sits beside the engine classes it names,
    since a module of its own would close an import circle with them. A member the class holds read-only, or with a
    narrower type, is a property here."""

    # nnsight's TransformersModel: the transformers model it wraps, and envoys
    _module: Any
    tokenizer: Any
    layers: Any  # the blocks' envoys: nnsight's block list, or StackedLayers
    ln_final: Any
    lm_head: Any
    dispatched: bool

    @property
    def inputs(self) -> Any: ...

    @property
    def output(self) -> Any: ...

    def dispatch(self) -> None: ...

    # set by StandardizedTransformer
    _nnterp_text_config: Any  # a transformers PretrainedConfig
    _nnterp_block_paths: tuple[str, ...]
    _nnterp_structure: tuple[Block, ...]
    _nnterp_attention_on: bool
    _nnterp_validate: bool
    _nnterp_warned_hooks: set
    _nnterp_slots: tuple[Slot, ...]
    _nnterp_run_slots: dict[tuple[int, int], Slot]
    _forward_events: dict[tuple[str, str], int]

    @property
    def _nnterp_class(self) -> type: ...

    @property
    def family(self) -> Family: ...

    @property
    def num_layers(self) -> int: ...

    def runs_of(self, layer: int) -> int: ...

    def num_heads_of(self, layer: int) -> int | None: ...

    # the engine (Values)
    _nnterp_blocks: tuple[Block, ...]
    _nnterp_sourced: tuple[str, ...]
    _nnterp_pass: PassPreparation | None

    def _place_values(self) -> None: ...

    def _unbind(self) -> None: ...

    def block_spec(self, layer: int) -> Block: ...

    def block_path(self, layer: int, path: str = "") -> str: ...

    def location(self, layer: int, name: str) -> At: ...

    def _run_slot(self, layer: int, run: int) -> Slot: ...

    def _slot(self, layer: int, run: int | None) -> Slot: ...

    # the order (ValueOrder) and the readout (Readout)
    def timeline(self, layer: int) -> list[tuple[tuple[int, ...], str, At]]: ...

    def _event_index(self, name: str, side: str, key: str) -> int: ...

    @property
    def logits(self) -> torch.Tensor: ...

    def refuse_unreadable_stream(self) -> None: ...


class Values:
    """The placed values of a wrapped model (a mixin of ``StandardizedTransformer``): each block's spec with the
    attention internals as they are on or off, the blocks' slots, and reads and writes by layer and name."""

    def _place_values(self: WrappedModel) -> None:
        """Every block's values (the attention internals as they are on or off), the modules read through
        ``.source``, which each pass instruments before its first value, and the slots' values unbound (bound
        again on first use)."""
        where = attention.internal_locations(self.family, self._nnterp_text_config, self._nnterp_attention_on)
        # a block that places the internals itself (unavailable: a hybrid's block without attention) keeps them;
        # where it reads them elsewhere (Gemma-3n's shared keys, read as copies), only while they are on
        off = {name for name, location in where.items() if isinstance(location, Unavailable)}
        self._nnterp_blocks = tuple(dataclasses.replace(block, values={**where, **{
            name: location for name, location in block.values.items() if not (name in off and isinstance(location, At))
        }}) for block in self._nnterp_structure)
        self._nnterp_sourced = tuple(sorted({self.block_path(i, location.path)
                                             for i, block in enumerate(self._nnterp_blocks)
                                             for location in (*block.values.values(), *block.extra.values())
                                             if isinstance(location, At) and location.op}))
        self._unbind()

    def _unbind(self: WrappedModel) -> None:
        """Forget every bound value: the blocks' places changed (the attention values turned on or off, a test's
        spec swapped in) or the envoys stand for other modules (the weights dispatched)."""
        self._nnterp_pass = preparation(self, self._nnterp_blocks, self._nnterp_sourced)
        for slot in (*self._nnterp_slots, *self._nnterp_run_slots.values()):
            slot.values.clear()

    def block_spec(self: WrappedModel, layer: int) -> Block:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers (0 to {self.num_layers - 1}).")
        return self._nnterp_blocks[layer]

    def block_path(self: WrappedModel, layer: int, path: str = "") -> str:
        """The native module name of ``path`` (relative to block ``layer``) in the HF model."""
        return ".".join(filter(None, (self._nnterp_block_paths[layer % self.num_layers], path)))

    def location(self: WrappedModel, layer: int, name: str) -> At:
        """Where value ``name`` of block ``layer`` is read; ``ValueUnavailable`` where it has no meaning."""
        value = value_named(name)
        location = self.block_spec(layer).resolve(value.name)
        if isinstance(location, Unavailable):
            raise ValueUnavailable(value.key, self.family.name, location.reason)
        return location

    def _run_slot(self: WrappedModel, layer: int, run: int) -> Slot:
        """The slot of run ``run`` of block ``layer``; an ``IndexError`` names the runs the block has."""
        runs = self.runs_of(layer)
        if not 0 <= run < runs:
            raise IndexError(f"Run {run} is out of range: layers[{layer}] runs {runs} time{'s' * (runs > 1)} in each "
                             f"forward pass (runs 0 to {runs - 1}).")
        layer %= self.num_layers
        slot = self._nnterp_run_slots.get((layer, run))
        if slot is None:
            slot = self._nnterp_run_slots[(layer, run)] = Slot(self, layer, run)
        return slot

    def _slot(self: WrappedModel, layer: int, run: int | None) -> Slot:
        if run is None:
            self.block_spec(layer)  # an out-of-range layer says so
            return self._nnterp_slots[layer % self.num_layers]
        return self._run_slot(layer, run)

    def read_value(self: WrappedModel, layer: int, name: str, run: int | None = None):
        """Inside a trace: value ``name`` of block ``layer`` (what ``model.layers[layer].<name>`` gives), at run
        ``run`` of a block that runs several times per pass (``model.layers[layer].run(run).<name>``)."""
        return self._slot(layer, run).value(name).read()

    def write_value(self: WrappedModel, layer: int, name: str, value, run: int | None = None) -> None:
        """Inside a trace: replace value ``name`` of block ``layer`` (``model.layers[layer].<name> = value``), at
        run ``run`` of a block that runs several times per pass."""
        self._slot(layer, run).value(name).write(value)

    def read_at(self: WrappedModel, layer: int, location: At, key: str | None = None, run: int | None = None):
        """Inside a trace: the tensor at ``location`` of block ``layer`` (at run ``run`` of a looped block)."""
        if run is not None:
            self._run_slot(layer, run)  # an out-of-range run says so
        return BoundValue(self, layer % self.num_layers, run, key or location.describe(), location).read()


class Slot:
    """A block of a wrapped model, or run ``run`` of a looped block: its label, and its bound values."""

    def __init__(self, model: WrappedModel, layer: int, run: int | None = None):
        self.model, self.layer, self.run = model, layer, run  # run None: the block's only run (or not chosen)
        self.values: dict[str, BoundValue] = {}

    def __repr__(self) -> str:
        return f"Slot({self.label()})"

    def label(self) -> str:
        return f"layers[{self.layer}]" + ("" if self.run is None else f".run({self.run})")

    def value(self, name: str) -> BoundValue:
        """The bound value ``name`` (a catalog name or key); ``ValueUnavailable`` with the reason, each time, where
        the block has no such value."""
        bound = self.values.get(name)
        if bound is None:
            location = self.model.location(self.layer, name)  # an unavailable value raises here
            bound = self.values[name] = BoundValue(self.model, self.layer, self.run, value_named(name).key, location)
        return bound


class BoundValue:
    """One value of one block (or of one run of a looped block), bound to where it is read."""

    def __init__(self, model: WrappedModel, layer: int, run: int | None, key: str, location: At):
        self.model, self.layer, self.run, self.key, self.location = model, layer, run, key, location
        self.block = model.layers[layer]
        # an operation inside a forward is looked up on each read: nnsight instruments ``.source`` per pass (None);
        # a plain value's envoy is always set
        self.envoy: Any = None if location.op else location.envoy(self.block)
        self.heads = model.num_heads_of(layer)
        runs = model.runs_of(layer)
        self.unchosen = run is None and runs > 1  # a looped block's value is read at a run
        self.pinned = bool(run)  # run 0 is nnsight's own binding, a request to a module's first call
        self.prepare = model._nnterp_pass  # what a pass prepares before its first value (None: nothing)
        # the module's own tensor, with no view or copy: read as directly as raw nnsight reads it
        self.plain = self.envoy is not None and not location._derived and not (self.unchosen or self.pinned)
        # where nnsight serves the module's output or inputs (what ``envoy.output`` / ``envoy.inputs`` ask for, their
        # views being the identity): a plain read asks nnsight's mediator for it directly, and takes the location's
        # element of it (bound once: a read makes no lookup of it)
        self.where = None if self.envoy is None else f"{self.envoy.path}.{location.side}"
        self.element = location.element

    def __repr__(self) -> str:
        return f"<{self.label()}: {self.location.describe()}>"

    def label(self) -> str:
        return f"layers[{self.layer}]" + ("" if self.run is None else f".run({self.run})") + f".{self.key}"

    def read(self):
        """Inside a trace: nnsight's live tensor of this value (in-place edits reach the model)."""
        if self.prepare is not None:
            self.prepare.begin(self.block)
        if not self.plain:
            return self._step(self._view)
        try:
            return self.element(Mediator.value(self.where))
        except OutOfOrderError as error:
            raise self._out_of_order(error) from None

    def write(self, value) -> None:
        """Inside a trace: replace this value by ``value`` (checked for shape, dtype and device)."""
        if self.prepare is not None:
            self.prepare.begin(self.block)
        self._step(lambda: self.location.write(self.block, value, self.heads, self.key, self.envoy))

    def _view(self):
        return self.location.read(self.block, self.heads, self.envoy)

    def _step(self, step):
        """``step()`` at this value's run, with nnsight's ordering error in the standard names."""
        pinned = self._pin()
        try:
            return step()
        except OutOfOrderError as error:
            raise self._out_of_order(error) from None
        finally:
            if pinned is not None:
                pinned.iteration = 0  # back to nnsight's own binding: each request to a module's first call

    def _pin(self) -> Mediator | None:
        """Bind the requests that follow to this value's run of a looped block (nnsight binds a request to a
        module's first call unless the mediator is pinned to a later occurrence, as ``tracer.iter`` pins it per
        generation step): the mediator pinned, or None."""
        if self.unchosen:
            runs = self.model.runs_of(self.layer)
            raise RunNotChosen(
                f"layers[{self.layer}] runs {runs} times in each forward pass of {self.model.family.name} (a looped "
                f"section), so '{self.key}' has a value per run: read one with model.layers[{self.layer}].run(k)."
                f"{self.key}, k from 0 to {runs - 1} (model.schedule lists the block calls in forward order).")
        if not self.pinned:
            return None
        mediator = Mediator.current("a standard value")
        if mediator.iteration != 0:
            raise NNterpError(
                f"{self.label()}: the runs of a looped block are read in a trace, or in the first step of a "
                "generation (tracer.iter[0]); a later step's runs cannot be told apart from the earlier steps' calls.")
        where = f"{self.location.envoy(self.block).path}.{self.location.side}"
        if mediator.occurrence(where) > self.run:  # pinned, nnsight would wait for a call that never comes
            raise OutOfOrderError(f"'{where}.i{self.run}' was requested but the model already ran past it")
        mediator.iteration = self.run
        return mediator

    def _out_of_order(self, error: Exception) -> OutOfOrderError:
        """nnsight's error, in the standard names: which value, and the order to read a block's values in."""
        return OutOfOrderError(
            f"layers[{self.layer}].{self.key} was requested, but the model already ran past it: read a block's "
            f"values in forward order (model.order({self.layer}) lists them) and the blocks in order. ({error})"
        )


class PassPreparation:
    """What a forward pass prepares before its first value (per invoke and generation step), where a model's
    values need it: the modules read through ``.source`` instrumented (nnsight instruments a module when it is
    first asked, for the calls that start after that: a fresh server model included), and what the views in use
    read before a block's first value (``View.prepare``: the stream's ``[batch, seq]`` where a block flattens it,
    how many positions are tokens where the model pads it, no filled cache where it prepends positions)."""

    def __init__(self, model: WrappedModel, sourced: tuple[str, ...], views: tuple[View, ...]):
        self.model, self.sourced, self.views = model, sourced, views

    def __repr__(self) -> str:
        return f"PassPreparation(sourced={list(self.sourced)}, views={list(self.views)})"

    def begin(self, block) -> None:
        if self.sourced:
            mediator = Mediator.current("a standard value")
            if not mediator.__dict__.get("_nnterp_sourced"):
                for path in self.sourced:
                    envoy_at(self.model, path).source  # noqa: B018 - the access instruments the module
                mediator._nnterp_sourced = True
        for view in self.views:
            view.prepare(block, self.model)


def preparation(model: WrappedModel, blocks, sourced: tuple[str, ...]) -> PassPreparation | None:
    """The preparation a pass needs before the values of ``blocks`` (the placed block specs), or None: each kind of
    view that prepares, as the first value read through it sets it."""
    views: dict[type, View] = {}
    for block in blocks:
        for location in block.values.values():
            if isinstance(location, At):
                for view in location.views:
                    if view.prepares:
                        views.setdefault(type(view), view)
    if not (sourced or views):
        return None
    return PassPreparation(model, sourced, tuple(views.values()))


class ValueOutsideTrace:
    """What ``model.layers[i].<value>`` is outside a trace: where the value is read. Its tensor exists only
    inside one, so any use of it says how to read it there; ``hasattr`` thus tells availability everywhere."""

    def __init__(self, label: str, key: str, where: str):
        self.label, self.key, self.where = label, key, where

    def __repr__(self) -> str:
        value = value_named(self.key)
        return (f"{self.label}.{self.key}: {value.meaning}, {value.shape}; read at {self.where}. "
                "It holds a tensor inside `with model.trace(...)`.")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe dunders: plain "no such attribute"
            raise AttributeError(name)
        raise ValueError(
            f"{self.label}.{self.key} is a tensor only inside a trace: "
            f"`with model.trace(prompt): x = model.{self.label}.{self.key}.save()`, then use `x`."
        )
