"""Where a standard value is read, and how it is written back: portable data over the unmodified model.

A location is relative to one block: a module boundary or an operation inside a module's
forward (``At``), the same place as another value (``SameAs``), or nothing (``Unavailable``).
Reading and writing interpret the data with nnsight alone (native module paths, ``.source``
operations, pure tensor views), so a trace that reads standard values runs wherever nnsight
runs it: locally, or on a server that has only torch, transformers and nnsight. Reading
returns nnsight's live tensor, so in-place edits reach the model; writing swaps the tensor in
place of the module's own, keeping any tuple around it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from nnsight.intervention.eproperty import eproperty

from .errors import BadAssignment
from .sourced import sourced
from .views import Count, Heads, HeadsFirst, Prefix, StreamsFirst, Unflatten, View, chain


@sourced
@dataclass(frozen=True)
class At:
    """A tensor at a module boundary of the block, or at an operation inside a module's forward.

    ``path`` is relative to the block ("" is the block itself). ``op`` names an operation of
    that module's forward as nnsight's ``.source`` labels it, dotted to reach into a called
    function (``"attention_interface_1.torch_matmul_1"``). An ``"output"`` is the return value,
    or its element ``index`` when it is a tuple (or a list). An ``"input"`` is positional argument ``arg``,
    or keyword ``kwarg`` when it was passed by keyword.

    ``views`` are the pure tensor steps between the module's tensor and the value (the ``View`` classes of
    ``nnterp.spec.views``, each saying how it reads), given in any order: the location holds them in the order they
    apply, and refuses two that do not combine. The keywords ``heads``, ``unflatten``, ``heads_first``, ``prefix``,
    ``streams_first`` and ``count`` name one view each (``SUGAR``: ``heads=True`` is ``views=(Heads(),)``,
    ``prefix=3`` is ``views=(Prefix(3),)``): the two spellings are the same location, and a location's keywords
    read what its views are, however they were given.
    ``copy`` reads a clone, for a tensor the block uses for more than this value (Falcon's parallel
    MLP output, which the block then adds the attention output to in place; the stream entering an
    MLP with no norm before it): in-place edits of the clone are swapped into the model at this
    place only, when the trace moves on, so they reach what this value feeds and nothing else.
    ``shared`` marks the stream at a place where the block keeps using the same tensor (the
    residual after the attention add is also the norm's input): an assignment is copied into
    that tensor, so it replaces the stream everywhere the block uses it, as an in-place edit does.
    ``join`` reads the value as several elements of this same boundary (each an ``At`` of this path and
    side naming its own ``index``, or ``arg`` / ``kwarg``) side by side along the last dimension, where
    the model passes the stream between its blocks in parts (Reformer's two halves, which only its final
    norm sees concatenated). The reader gets a new tensor, the parts joined (viewed without the padding,
    with ``count``): when the trace moves on, the model's parts are swapped for slices of the joined tensor,
    so in-place edits of the value, then or later in the trace, reach the model, as they do on a stream
    held as one tensor (gradients reach the joined tensor, not a view of it); an assignment replaces each
    part by its slice.
    """

    path: str
    side: str  # "input" | "output"
    index: int = 0
    arg: int = 0
    kwarg: str = "hidden_states"
    op: str = ""
    views: tuple[View, ...] = ()
    copy: bool = False
    shared: bool = False
    join: tuple[At, ...] = ()
    # the keywords for views (``SUGAR``), each a view's ``name``: read from the views once the location holds them, so they take no part in
    # comparing, hashing or printing a location beyond its views
    heads: bool = field(default=False, kw_only=True, compare=False, repr=False)
    unflatten: bool = field(default=False, kw_only=True, compare=False, repr=False)
    heads_first: bool = field(default=False, kw_only=True, compare=False, repr=False)
    prefix: int = field(default=0, kw_only=True, compare=False, repr=False)
    streams_first: bool = field(default=False, kw_only=True, compare=False, repr=False)
    count: str = field(default="", kw_only=True, compare=False, repr=False)
    served: ClassVar[Served]  # nnsight's eproperty for a value handed back to the model (set per location)

    def __post_init__(self):
        if self.side not in ("input", "output"):
            raise ValueError(f"side must be 'input' or 'output', not {self.side!r}")
        named = (kind.from_keyword(value) for kind in SUGAR if (value := getattr(self, kind.name)))
        views = chain((*self.views, *named))
        object.__setattr__(self, "views", views)
        for view in views:  # the keywords read what the views are, however they were given
            if type(view) in SUGAR:
                object.__setattr__(self, view.name, view.to_keyword())
        if self.join and (self.shared or self.copy or not all(view.joins for view in views)):
            raise ValueError("join reads a new tensor: it does not combine with per-head views, shared or copy")
        if any((part.path, part.side, part.op) != (self.path, self.side, self.op) or part._derived
               for part in self.join):
            raise ValueError("the parts of a join are plain elements of the same boundary")
        object.__setattr__(self, "served", Served(self.side))

    def describe(self) -> str:
        text = self.path or "<block>"
        if self.op:
            text += ".source." + ".source.".join(self.op.split("."))
        if self.side == "output":
            text += ".output" + (f"[{self.index}]" if self.index else "")
        else:
            text += ".input" + (f"[{self.arg}]" if self.arg else "")
        if self.join:
            parts = (f"[{part.index}]" if self.side == "output" else part.kwarg for part in self.join)
            text += f" ({', '.join(parts)} joined along the last dimension)"
        text += "".join(view.describe() for view in reversed(self.views))  # the value's own layout first
        if self.copy:
            text += " (a copy, swapped back: the block uses this tensor for more than this value)"
        if self.shared:
            text += " (the stream: an assignment replaces it everywhere the block uses it)"
        return text

    # -- the module and the envoy that serve it --------------------------------------------
    def module(self, block: torch.nn.Module) -> torch.nn.Module:
        return block.get_submodule(self.path) if self.path else block

    def envoy(self, block_envoy):
        envoy = envoy_at(block_envoy, self.path)
        for part in filter(None, self.op.split(".")):
            envoy = getattr(envoy.source, part)
        return envoy

    # -- reading and writing inside a trace -----------------------------------------------
    def element(self, raw):
        """This location's tensor in what the module (or operation) gives: an output, or ``(args, kwargs)``."""
        if self.join:
            return torch.cat([part.element(raw) for part in self.join], dim=-1)
        if self.side == "output":
            return raw[self.index] if isinstance(raw, (tuple, list)) else raw
        args, kwargs = raw
        return args[self.arg] if len(args) > self.arg else kwargs[self.kwarg]

    def _container(self, envoy):
        return envoy.output if self.side == "output" else envoy.inputs

    def _raw(self, envoy):
        return self.element(self._container(envoy))

    def _view_shape(self, block_envoy, shape, num_heads: int | None) -> tuple[int, ...]:
        """The value's shape, from the shape of the model's tensor."""
        shape = tuple(shape)
        try:
            for view in self.views:
                shape = view.shape(shape, block_envoy, num_heads)
        except ValueError as error:
            raise ValueError(f"{self.describe()}: {error}") from None
        return shape

    def _view(self, tensor, block_envoy, num_heads: int | None):
        self._view_shape(block_envoy, tensor.shape, num_heads)  # a tensor the views cannot read says why
        for view in self.views:
            tensor = view.view(tensor, block_envoy, num_heads)
        return tensor

    def _unview(self, value, tensor, block_envoy, num_heads: int | None):
        """The model's tensor (``tensor`` as the model gave it) remade from the value: the views undone, last first."""
        stages = [tensor]
        for view in self.views[:-1]:
            stages.append(view.view(stages[-1], block_envoy, num_heads))
        for view, stage in zip(reversed(self.views), reversed(stages)):
            value = view.unview(value, stage, block_envoy, num_heads)
        return value

    @property
    def _fresh(self) -> bool:
        """The value is a new tensor computed from the model's (a view's product), never the model's storage."""
        return any(view.fresh for view in self.views)

    @property
    def _derived(self) -> bool:
        """The reader gets a tensor the model does not hold itself: a view, or a copy."""
        return self.copy or bool(self.views) or bool(self.join)

    def read(self, block_envoy, num_heads: int | None, envoy=None):
        envoy = self.envoy(block_envoy) if envoy is None else envoy
        # a view needs handing back only for gradients (edits in place reach the model through the storage); a
        # copy, a join or a fresh tensor (a product) always
        if not (self.copy or self.join or self._fresh or (self._derived and torch.is_grad_enabled())):
            return self._view(self._raw(envoy), block_envoy, num_heads)
        # nnsight's write-back of a view: this location's eproperty serves the value and swaps the model's side
        # in when the trace next asks the model for anything (a read of it before then is the same tensor)
        return self.served.__get__(Read(self, envoy.path, block_envoy, num_heads))

    def _served_value(self, read: Read, raw):
        """The value from what the module gives (``raw``): the element, viewed (a clone first, for a copy)."""
        read.tensor = tensor = self.element(raw)
        return self._view(tensor.clone() if self.copy else tensor, read.block, read.heads)

    def _model_side(self, read: Read, value, raw):
        """What the model goes on with, derived from the reader's tensor, so gradients reach it and edits made to
        it in place are the model's (a copy hands on a copy of itself: the model may change what it is handed in
        place, and the reader's copy must not see that). A joined value views the joined tensor (padding
        included): the model goes on with slices of that tensor, so edits of the reader's value, now or later in
        the trace, are the model's."""
        if self.join:
            return self._replaced(raw, read.tensor)
        model_side = self._unview(value, read.tensor, read.block, read.heads)
        return self._replaced(raw, model_side.clone() if self.copy else model_side)

    def _replaced(self, raw, tensor):
        """``raw`` (an output, or ``(args, kwargs)``) with this location's tensor replaced by ``tensor`` (a joined
        value's parts by their slices of it). A named tuple stays one: the model reads its fields by name; a list
        (OpenAI GPT's blocks return one) is rebuilt as a list."""
        if self.join:
            start = 0
            for part in self.join:
                width = part.element(raw).shape[-1]
                raw = part._replaced(raw, tensor[..., start : start + width])
                start += width
            return raw
        if self.side == "output":
            if not isinstance(raw, (tuple, list)):
                return tensor
            items = (*raw[: self.index], tensor, *raw[self.index + 1 :])
            if isinstance(raw, list):
                return list(items)
            return type(raw)._make(items) if hasattr(raw, "_make") else items
        args, kwargs = raw
        if len(args) > self.arg:
            return (*args[: self.arg], tensor, *args[self.arg + 1 :]), kwargs
        return args, {**kwargs, self.kwarg: tensor}

    def write(self, block_envoy, value, num_heads: int | None, key: str, envoy=None) -> None:
        envoy = self.envoy(block_envoy) if envoy is None else envoy
        current = self._raw(envoy)
        expected = self._view_shape(block_envoy, current.shape, num_heads)
        if not isinstance(value, torch.Tensor):
            raise BadAssignment(f"'{key}' takes a torch.Tensor, got {type(value).__name__}.")
        if tuple(value.shape) != tuple(expected):
            raise BadAssignment(
                f"'{key}' has shape {list(expected)}; the assigned tensor has shape {list(value.shape)}. "
                "Assign a tensor of the same shape (edit in place with [...] to change a slice)."
            )
        if value.dtype != current.dtype:
            raise BadAssignment(
                f"'{key}' is {current.dtype}; the assigned tensor is {value.dtype}. "
                f"Convert it first, e.g. value.to({current.dtype})."
            )
        if value.device != current.device:
            raise BadAssignment(
                f"'{key}' is on {current.device}; the assigned tensor is on {value.device}. "
                f"Move it first, e.g. value.to('{current.device}')."
            )
        value = self._unview(value, current, block_envoy, num_heads)  # the other positions are the model's
        if self.shared:
            current.copy_(value)
        elif self.side == "output":
            envoy.output = self._replaced(envoy.output, value)
        else:
            envoy.inputs = self._replaced(envoy.inputs, value)


class Read:
    """One read of a location that hands its value back: what nnsight's eproperty reads it through (the envoy's
    ``path``), what its views need, and the model's tensor it was served (``tensor``)."""

    def __init__(self, at: At, path: str, block, heads: int | None):
        self.at, self.path, self.block, self.heads = at, path, block, heads
        self.tensor: torch.Tensor | None = None


def _serve(read: Read, raw):
    return read.at._served_value(read, raw)


def _hand_back(read: Read, value, raw):
    return read.at._model_side(read, value, raw)


class Served(eproperty):
    """nnsight's ``eproperty`` (its extension point for a view that writes back) at one side of a location: it
    serves the viewed value, and ``transform``s the reader's tensor back into the model's layout. One per location,
    so that a second read of the value before the write-back is the same tensor, and another location's is not."""

    def __init__(self, side: str):
        eproperty.__init__(self, key=side)
        eproperty.__call__(self, _serve)
        eproperty.transform(self, _hand_back)

    def __reduce__(self):
        return Served, (self.key,)


@sourced
@dataclass(frozen=True)
class SameAs:
    """The same location as another standard value of the block."""

    name: str


@sourced
@dataclass(frozen=True)
class Unavailable:
    """The value has no meaning on this block; ``reason`` says why."""

    reason: str


Location = At | SameAs | Unavailable


def output(path: str = "", index: int = 0, **view) -> At:
    return At(path, "output", index=index, **view)


def input(path: str = "", arg: int = 0, kwarg: str = "hidden_states", **view) -> At:  # noqa: A001
    return At(path, "input", arg=arg, kwarg=kwarg, **view)


# the views At takes a keyword for, each its ``name`` (``heads=True`` is ``Heads()``, ``prefix=3`` is ``Prefix(3)``)
SUGAR = (Heads, Unflatten, HeadsFirst, Prefix, StreamsFirst, Count)


def envoy_at(envoy, path: str):
    """The envoy of the module at ``path`` (native names, dotted) under ``envoy``."""
    from nnsight import Envoy

    for part in filter(None, path.split(".")):
        if part.isdigit():
            envoy = envoy[int(part)]
        else:  # a module named like something the envoy serves (a standard value) is mounted under nnsight's prefix
            served = inspect.isdatadescriptor(getattr(type(envoy), part, None))
            envoy = getattr(envoy, f"{Envoy.OVERLOAD_PREFIX}{part}" if served else part)
    return envoy
