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
from typing import Any

from nnsight.intervention.interleaver import Mediator, OutOfOrderError

from . import attention
from .catalog import value_named
from .errors import NNterpError, RunNotChosen, ValueUnavailable
from .families import Block
from .locations import At, Unavailable, leading_shape, token_count


class Values:
    """The placed values of a wrapped model (a mixin of ``StandardizedTransformer``): each block's spec with the
    attention internals as they are on or off, the blocks' slots, and reads and writes by layer and name."""

    def _place_values(self) -> None:
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

    def _unbind(self) -> None:
        """Forget every bound value: the blocks' places changed (the attention values turned on or off, a test's
        spec swapped in) or the envoys stand for other modules (the weights dispatched)."""
        self._nnterp_pass = preparation(self, self._nnterp_blocks, self._nnterp_sourced)
        for slot in (*self._nnterp_slots, *self._nnterp_run_slots.values()):
            slot.values.clear()

    def block_spec(self, layer: int) -> Block:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers (0 to {self.num_layers - 1}).")
        return self._nnterp_blocks[layer]

    def block_path(self, layer: int, path: str = "") -> str:
        """The native module name of ``path`` (relative to block ``layer``) in the HF model."""
        return ".".join(filter(None, (self._nnterp_block_paths[layer % self.num_layers], path)))

    def location(self, layer: int, name: str) -> At:
        """Where value ``name`` of block ``layer`` is read; ``ValueUnavailable`` where it has no meaning."""
        value = value_named(name)
        location = self.block_spec(layer).resolve(value.name)
        if isinstance(location, Unavailable):
            raise ValueUnavailable(value.key, self.family.name, location.reason)
        return location

    def run_slot(self, layer: int, run: int) -> Slot:
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

    def _slot(self, layer: int, run: int | None) -> Slot:
        if run is None:
            self.block_spec(layer)  # an out-of-range layer says so
            return self._nnterp_slots[layer % self.num_layers]
        return self.run_slot(layer, run)

    def read_value(self, layer: int, name: str, run: int | None = None):
        """Inside a trace: value ``name`` of block ``layer`` (what ``model.layers[layer].<name>`` gives), at run
        ``run`` of a block that runs several times per pass (``model.layers[layer].run(run).<name>``)."""
        return self._slot(layer, run).value(name).read()

    def write_value(self, layer: int, name: str, value, run: int | None = None) -> None:
        """Inside a trace: replace value ``name`` of block ``layer`` (``model.layers[layer].<name> = value``), at
        run ``run`` of a block that runs several times per pass."""
        self._slot(layer, run).value(name).write(value)

    def read_at(self, layer: int, location: At, key: str | None = None, run: int | None = None):
        """Inside a trace: the tensor at ``location`` of block ``layer`` (at run ``run`` of a looped block)."""
        if run is not None:
            self.run_slot(layer, run)  # an out-of-range run says so
        return BoundValue(self, layer % self.num_layers, run, key or location.describe(), location).read()


class Slot:
    """A block of a wrapped model, or run ``run`` of a looped block: its label, and its bound values."""

    def __init__(self, model: Any, layer: int, run: int | None = None):
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

    def __init__(self, model: Any, layer: int, run: int | None, key: str, location: At):
        self.model, self.layer, self.run, self.key, self.location = model, layer, run, key, location
        self.block = model.layers[layer]
        # an operation inside a forward is looked up on each read: nnsight instruments ``.source`` per pass
        self.envoy = None if location.op else location.envoy(self.block)
        self.heads = model.num_heads_of(layer)
        runs = model.runs_of(layer)
        self.unchosen = run is None and runs > 1  # a looped block's value is read at a run
        self.pinned = bool(run)  # run 0 is nnsight's own binding, a request to a module's first call
        self.prepare = model._nnterp_pass  # what a pass prepares before its first value (None: nothing)
        # the module's own tensor, with no view or copy: read as directly as raw nnsight reads it
        self.plain = self.envoy is not None and not location._derived and not (self.unchosen or self.pinned)
        self.output, self.index = location.side == "output", location.index
        self.arg, self.kwarg = location.arg, location.kwarg

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
            if self.output:
                raw = self.envoy.output
                return raw[self.index] if isinstance(raw, (tuple, list)) else raw
            args, kwargs = self.envoy.inputs
            return args[self.arg] if len(args) > self.arg else kwargs[self.kwarg]
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
    first asked, for the calls that start after that: a fresh server model included); the stream's ``[batch,
    seq]`` read where a block flattens it, or how many positions are tokens where the model pads it after them;
    a pass given a filled cache refused where the model prepends positions that are not tokens."""

    def __init__(self, model: Any, sourced: tuple[str, ...], flattens: bool, counted: str, prefixed: bool):
        self.model, self.sourced, self.flattens, self.counted, self.prefixed = model, sourced, flattens, counted, prefixed

    def __repr__(self) -> str:
        return f"PassPreparation(sourced={list(self.sourced)}, flattens={self.flattens}, counted={self.counted!r}, " \
               f"prefixed={self.prefixed})"

    def begin(self, block) -> None:
        if self.sourced:
            mediator = Mediator.current("a standard value")
            if not mediator.__dict__.get("_nnterp_sourced"):
                for path in self.sourced:
                    envoy_at(self.model, path).source  # noqa: B018 - the access instruments the module
                mediator._nnterp_sourced = True
        if self.flattens:
            leading_shape(block)
        if self.counted:
            token_count(block, self.counted)
        if self.prefixed:
            self.refuse_a_cached_pass()

    def refuse_a_cached_pass(self) -> None:
        """A model that prepends positions to the tokens does so fully only on a pass without a cache: given a
        filled one, its stream holds other positions, which the values' view cannot tell apart. Read from the
        model's own inputs, the first event of each pass (per invoke and generation step)."""
        mediator = Mediator.current("a standard value")
        checked = mediator.__dict__.setdefault("_nnterp_uncached", set())
        if mediator.iteration in checked:
            return
        _, kwargs = self.model.inputs
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and getattr(cache, "get_seq_length", lambda: 0)() > 0:
            raise ValueError(
                f"{self.model.family.name} prepends its prompt positions to the stream in full only on a pass without a "
                "cache, "
                "so the values of a pass given a filled one (a generation's later steps too) cannot be told apart "
                "from them: trace the whole sequence without past_key_values."
            )
        checked.add(mediator.iteration)


def preparation(model: Any, blocks, sourced: tuple[str, ...]) -> PassPreparation | None:
    """The preparation a pass needs before the values of ``blocks`` (the placed block specs), or None."""
    def in_use(view: str):  # the view as the first value of some block read through it sets it
        return next((getattr(location, view) for block in blocks for location in block.values.values()
                     if isinstance(location, At) and getattr(location, view)), None)

    flattens, counted, prefixed = bool(in_use("unflatten")), in_use("count") or "", bool(in_use("prefix"))
    if not (sourced or flattens or counted or prefixed):
        return None
    return PassPreparation(model, sourced, flattens, counted, prefixed)


def envoy_at(model: Any, path: str):
    """The envoy of the module at native path ``path``."""
    envoy = model
    for part in path.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


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
