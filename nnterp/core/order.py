"""The values of a block in forward order (``order``, ``timeline``), where each is read or why it is unavailable
(``availability``), and the summary a model prints: a mixin of ``StandardizedTransformer``."""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass

import torch
from nnsight.modeling.transformers import TransformersModel
from torch._subclasses.fake_tensor import FakeTensorMode

from ..spec.catalog import BY_NAME, CATALOG, WHERE_PRESENT
from ..spec.errors import NNterpError
from ..spec.locations import At, SameAs, Unavailable
from ..spec.selection import layer_ranges
from ..spec.sourced import sourced
from .engine import WrappedModel


@sourced
@dataclass(frozen=True)
class Availability:
    """Where a value of one block is read, or why it has no meaning there."""

    location: str | None = None
    reason: str | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        return f"unavailable: {self.reason}" if self.reason is not None else str(self.location)


class AvailabilityTable(dict):
    """``{value: Availability}``, printed as a table, one value an entry (a long reason wrapped at word breaks)."""

    def __repr__(self) -> str:
        width = max(map(len, self), default=0)
        return "\n".join(textwrap.fill(f"{key:<{width}}  {entry}", width=max(120, width + 60),
                                        subsequent_indent=" " * (width + 2), break_long_words=False,
                                        break_on_hyphens=False) for key, entry in self.items())

    __str__ = __repr__


def _listed(values, key: str, aliases: bool, where_present: bool) -> bool:
    """Whether ``order`` lists the value ``key`` of a block whose spec places ``values``: a value the block has where its
    module is only with ``where_present``; one that is another value's place under another name only with
    ``aliases``."""
    name = key.rpartition(".")[2]
    if name in WHERE_PRESENT and not where_present:
        return False
    return aliases or not (name in ("mixer_output", *WHERE_PRESENT) and isinstance(values.get(name), SameAs))


class ValueOrder:
    """Availability and forward order of the values of each block."""

    def availability(self: WrappedModel, layer: int) -> dict[str, Availability]:
        """Every standard value of block ``layer``: where it is read, or why it is unavailable."""
        block = self.block_spec(layer)
        result = AvailabilityTable()
        for value in CATALOG:
            location = block.resolve(value.name)
            if isinstance(location, Unavailable):
                result[value.key] = Availability(reason=location.reason)
            else:
                result[value.key] = Availability(location=location.describe())
        return result

    def order(self: WrappedModel, layer: int, aliases: bool = False, where_present: bool = False) -> dict[str, int]:
        """Forward-order ranks of block ``layer``'s available values; equal ranks share a location.

        Read a block's values in this order within one trace: reading one after a later one
        raises nnsight's ``OutOfOrderError``. ``mixer_output`` is listed where it is not simply
        the attention's output (a hybrid's blocks without attention); ``aliases=True`` lists it
        on every block. ``where_present=True`` adds the values a block has where its module is (the
        q/k norms' inputs and outputs, the router's logits, the activation's input, and, where a norm
        follows a sublayer, its output before that norm).
        """
        values = self.block_spec(layer).values
        events = {key: event for event, key, _ in self.timeline(layer)
                  if not key.startswith("extra.") and _listed(values, key, aliases, where_present)}
        ranks = {event: rank for rank, event in enumerate(sorted(set(events.values())))}
        return {key: ranks[event] for key, event in events.items()}

    def timeline(self: WrappedModel, layer: int) -> list[tuple[tuple[int, ...], str, At]]:
        """(event, key, location) of every available value and identity extra of a block, in forward order."""
        block = self.block_spec(layer)
        placed = [(value.key, block.resolve(value.name)) for value in CATALOG]
        placed += [(f"extra.{name}", location) for name, location in block.extra.items()]
        located = [(key, location) for key, location in placed if isinstance(location, At)]
        # module boundaries are ordered by the recorded forward pass; an operation inside a forward
        # (read through .source) comes right after the last module-boundary value the catalog puts before it
        events: dict[str, tuple[int, ...]] = {
            key: (self._event_index(self.block_path(layer, location.path), location.side, key), 0)
            for key, location in located if not location.op}
        rank = {key: BY_NAME[key.rpartition(".")[2]].rank for key, _ in located if not key.startswith("extra.")}
        block_input = (self._event_index(self.block_path(layer), "input", "layer_input"), 0)
        # and after its module is called (Falcon-H1 runs its Mamba between the norm and the attention). Operations
        # of equal rank at different places (Falcon-H1's scaled attention output, then the sum that is its mixer's
        # output) follow the catalog's order; values read at one operation share its event.
        places: dict[tuple[str, str, str], int] = {}
        for key, location in located:
            if location.op:
                called = self._forward_events.get((self.block_path(layer, location.path), "input"), -1)
                before = [events[k] for k in events if k in rank and rank[k] < rank[key]]
                place = places.setdefault((location.path, location.op, location.side), len(places))
                events[key] = (max(max(before, default=block_input)[0], called), 1 + rank[key], place)
        return sorted(((events[key], key, location) for key, location in located), key=lambda item: item[0])

    def _event_index(self: WrappedModel, name: str, side: str, key: str) -> int:
        index = self._forward_events.get((name, side))
        if index is None:
            raise NNterpError(
                f"The module where '{key}' is read never ran in a forward pass of this {self.family.name} "
                "model: the family spec does not match it. Please report this with the model's config."
            )
        return index


def summary(model) -> str:
    """The model's own module tree (standard aliases shown as ``alias/native``), then the standard names."""
    # nnsight keeps the renames in the private `_aliases` (the one private attribute nnterp uses): its tree lists
    # the mounts of dotted paths again, below, so they are left out of it while it prints
    aliases = model._aliases
    model._aliases = {alias: path for alias, path in aliases.items() if "." not in path}  # mounts: listed below
    try:
        tree = TransformersModel.__repr__(model)
    finally:
        model._aliases = aliases
    family = model.family
    lines = [tree, "",
             f"Standard names ({family.name} family, {model.num_layers} blocks):",
             f"  model.layers[i] = {' then '.join(f'{path}[i]' for path in family.block_lists)}",
             f"  model.embed_tokens = {family.embed_tokens},  model.ln_final = "
             f"{family.ln_final or 'none (the head reads the last block output)'},  "
             f"model.lm_head = {family.lm_head}"
             + (f" (reading {family.head_input}'s output)" if family.head_input else "")
             + (f" (then {family.vocab_projection}, the projection on the vocabulary)" if family.vocab_projection else "")]
    groups: dict[tuple, list[int]] = {}
    for i in range(model.num_layers):
        table = model.availability(i)
        available = tuple(model.order(i))
        unavailable = tuple(key for key, entry in table.items() if not entry.available)
        groups.setdefault((available, unavailable), []).append(i)
    for (available, unavailable), layers in groups.items():
        which = "every block" if len(groups) == 1 else f"blocks {layer_ranges(layers)}"
        lines.append(f"  {which}, in forward order: {', '.join(available)}")
        if unavailable:
            lines.append(f"    unavailable (model.availability({layers[0]}) says why): {', '.join(unavailable)}")
    return "\n".join(lines)


SMALL_ENOUGH_TO_RUN = 200_000_000  # parameters: a real two-token forward is cheaper than a fake one


def forward_events(model: torch.nn.Module) -> dict[tuple[str, str], int]:
    """The order module inputs and outputs fire in a forward pass (first call of each), by module name.

    The order depends on the architecture, not the weights: a small model runs two real tokens,
    a large one runs on fake tensors (no compute, no memory).
    """
    events: dict[tuple[str, str], int] = {}

    def recorder(name: str, side: str):
        def hook(*_):  # returns None: the hook must not replace the module's inputs or output
            events.setdefault((name, side), len(events))
        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(recorder(name, "input")))
        handles.append(module.register_forward_hook(recorder(name, "output")))
    parameters = list(model.parameters())
    ids = torch.zeros(1, 2, dtype=torch.long, device=parameters[0].device)
    small = sum(p.numel() for p in parameters) < SMALL_ENOUGH_TO_RUN and parameters[0].device.type != "meta"
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    try:
        if not small:
            fake_log.level = logging.CRITICAL
            try:
                with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
                    model(input_ids=ids)
                return events
            except Exception:  # an op without a fake kernel (grouped_mm in float32): run it for real
                events.clear()
        with torch.no_grad():
            model(input_ids=ids)
        return events
    finally:
        fake_log.level = level
        for handle in handles:
            handle.remove()
