"""Views: the pure tensor steps between the tensor a module gives and a standard value, each a class of one protocol.

A location (``nnterp.spec.locations.At``) holds the views it is read through (``At.views``); they apply in the order
of their ``rank`` (the positions that are tokens, then the shape, then the layout), each on what the one before gave,
and a view declares which views it does not combine with (``excludes``, ``joins``). Each view says:

- ``shape(shape, block, heads)``: the value's shape, from the shape of the tensor the view is given;
- ``view(tensor, block, heads)``: the value, of the same storage where a view can be (edits in place are then the
  model's);
- ``unview(value, tensor, block, heads)``: the tensor the view was given (``tensor``), remade from an edited or
  assigned ``value``;
- ``describe()``: how the view reads, for ``availability`` and the docs (a location's read last view first);
- ``prepare(block, model)``: what a forward pass reads before the first value of a block, where the view needs
  something the block's input holds (``prepares``: whether it has anything to do);
- ``fresh``: whether the value is a new tensor, not the model's storage (a product): it is then always handed back
  to the model when the trace moves on (``unview``), so that edits made to it in place reach the model.

``block`` is the block's envoy, ``heads`` its number of attention heads. Everything here runs inside traces, also
on a server where nnterp is not installed: plain classes with hand-written methods, and nnsight's own objects.
"""

from __future__ import annotations

import math
import operator

import torch


class View:
    """A pure tensor step between a module's tensor and a standard value (see the module's docstring).

    A view declares its name and its place itself: ``name``, how messages call it (for the views ``At`` takes a
    keyword for, ``locations.SUGAR``, that keyword); ``rank``, where it applies in a location's chain (lower first);
    ``excludes``, the views defined before it that it does not combine with (``why`` says why); ``joins``, whether it
    combines with a joined value (``At.join``, which reads a new tensor)."""

    name = "view"
    rank = 0
    excludes: tuple[type[View], ...] = ()
    why = ""
    joins = True
    prepares = False
    fresh = False

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, *sorted(vars(self).items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    # a view that ``At`` takes a keyword for (``locations.SUGAR``): from the keyword's value, and back to it
    @classmethod
    def from_keyword(cls, value) -> View:
        return cls()

    def to_keyword(self):
        return True

    def shape(self, shape: tuple[int, ...], block, heads: int | None) -> tuple[int, ...]:
        return shape

    def view(self, tensor: torch.Tensor, block, heads: int | None) -> torch.Tensor:
        return tensor

    def unview(self, value: torch.Tensor, tensor: torch.Tensor, block, heads: int | None) -> torch.Tensor:
        return value

    def describe(self) -> str:
        return ""

    def prepare(self, block, model) -> None:
        return None


def chain(views) -> tuple[View, ...]:
    """``views`` in the order they apply (by ``rank``), each once: a ValueError says why two do not combine."""
    ordered = tuple(sorted(dict.fromkeys(views), key=operator.attrgetter("rank")))
    for view in ordered:
        for other in ordered:
            if type(other) is type(view) and other is not view:
                raise ValueError(f"a location has one {view.name} view: {view!r} and {other!r} differ")
            if isinstance(other, view.excludes):
                raise ValueError(f"{view.name} {view.why}: it does not combine with {other.name}")
    return ordered


class _Reshaped(View):
    """A view of the same storage in another shape (``shape``); a value handed back takes the model's shape again
    (a copy only where the value is not contiguous, as an assigned one may be)."""

    def view(self, tensor, block, heads):
        return tensor.view(self.shape(tensor.shape, block, heads))

    def unview(self, value, tensor, block, heads):
        return value.reshape(tensor.shape)


class Unflatten(_Reshaped):
    """A tensor the block flattened to ``[batch * seq, features]``, as ``[batch, seq, features]`` (``[batch, seq]``
    read from the block's input in the same pass, before its first value: ``leading_shape``)."""

    name = "unflatten"
    rank = 30
    joins = False
    prepares = True

    def shape(self, shape, block, heads):
        return (*leading_shape(block), shape[-1])

    def describe(self) -> str:
        return " (flattened by the block; viewed as [batch, seq, ...])"

    def prepare(self, block, model) -> None:
        leading_shape(block)


class Heads(_Reshaped):
    """The last dimension (or the dimensions after ``[batch, seq]``) as ``[num_heads, head_dim]``."""

    name = "heads"
    rank = 40
    joins = False

    def shape(self, shape, block, heads):
        width = math.prod(shape[2:])
        return (*shape[:2], heads, width // heads)

    def describe(self) -> str:
        return " (viewed per head)"


class HeadWidth(_Reshaped):
    """The last dimension as ``[heads, width]``, by a head's ``width`` (a norm over a projection's whole output,
    ``[batch, seq, heads * width]``, read per head: the key-value heads of a key projection too)."""

    name = "head_width"
    rank = 40
    joins = False

    def __init__(self, width: int):
        self.width = width

    def shape(self, shape, block, heads):
        return (*shape[:-1], shape[-1] // self.width, self.width)

    def describe(self) -> str:
        return f" (viewed per head of width {self.width})"


class Half(View):
    """One half of the last dimension: ``which`` 0 the first, 1 the second (a fused gate-and-up projection's output,
    ``[gate | up]``, read as the gate's or the up projection's part). A slice, handed back with the other half kept."""

    name = "half"
    rank = 70
    fresh = True  # handed back through ``unview``, which puts the other half back beside it

    def __init__(self, which: int):
        self.which = which

    def shape(self, shape, block, heads):
        return (*shape[:-1], shape[-1] // 2)

    def view(self, tensor, block, heads):
        width = tensor.shape[-1] // 2
        return tensor[..., self.which * width: (self.which + 1) * width]

    def unview(self, value, tensor, block, heads):
        width = tensor.shape[-1] // 2
        parts = (value, tensor[..., width:]) if self.which == 0 else (tensor[..., :width], value)
        return torch.cat(parts, dim=-1)

    def describe(self) -> str:
        return " (its first half: the gate's)" if self.which == 0 else " (its second half: the up projection's)"


class HeadsFirst(View):
    """``[batch, heads, seq, dim]`` as ``[batch, seq, heads, dim]``: a transposed view of the same storage."""

    name = "heads_first"
    rank = 60
    joins = False

    def shape(self, shape, block, heads):
        return (shape[0], shape[2], shape[1], *shape[3:])

    def view(self, tensor, block, heads):
        return tensor.transpose(1, 2)

    def unview(self, value, tensor, block, heads):
        return value.transpose(1, 2)

    def describe(self) -> str:
        return " (viewed as [batch, seq, heads, dim])"


class Prefix(View):
    """``[batch, seq, ...]`` without the first ``positions`` positions, which the model prepends to the tokens (a
    learned prompt, CPM-Ant's): a slice of the same storage, so an edit in place is an edit of those positions of
    the model's tensor; an assignment replaces them, the prepended positions left as the model made them."""

    name = "prefix"
    rank = 10
    excludes = (Unflatten, HeadsFirst)  # their model's tensor has no sequence axis second
    why = "views [batch, seq, ...]"
    prepares = True

    def __init__(self, positions: int):
        self.positions = positions

    @classmethod
    def from_keyword(cls, value) -> View:
        return cls(value)

    def to_keyword(self):
        return self.positions

    def shape(self, shape, block, heads):
        if len(shape) < 3 or shape[1] <= self.positions:
            raise ValueError(f"the model's tensor {list(shape)} has no positions after the {self.positions} it "
                             "prepends (a pass that does not prepend them: a generation step)")
        return (shape[0], shape[1] - self.positions, *shape[2:])

    def view(self, tensor, block, heads):
        return tensor[:, self.positions :]

    def unview(self, value, tensor, block, heads):
        return torch.cat((tensor[:, : self.positions], value), dim=1)

    def describe(self) -> str:
        return f" (without the {self.positions} positions the model prepends to the tokens)"

    def prepare(self, block, model) -> None:
        """A model prepends the positions fully only on a pass without a cache: given a filled one, its stream holds
        other positions, which the view cannot tell apart. Read from the model's own inputs, the first event of each
        pass (per invoke and generation step)."""
        from nnsight.intervention.interleaver import Mediator

        mediator = Mediator.current("a standard value")
        checked = mediator.__dict__.setdefault("_nnterp_uncached", set())
        if mediator.iteration in checked:
            return
        _, kwargs = model.inputs
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise ValueError(
                f"{model.family.name} prepends its prompt positions to the stream in full only on a pass without a "
                "cache, so the values of a pass given a filled one (a generation's later steps too) cannot be told "
                "apart from them: trace the whole sequence without past_key_values."
            )
        checked.add(mediator.iteration)


class Count(View):
    """``[batch, seq, ...]`` without the padding the model adds after the tokens (it pads the stream to a multiple
    of a chunk length, as Reformer does): its first positions, as many as the block's keyword argument ``kwarg``
    says are tokens, read from the block's input before the block's first value, once per pass (``token_count``)."""

    name = "count"
    rank = 20
    excludes = (Prefix, Unflatten, HeadsFirst)
    why = "views [batch, seq, ...] without trailing padding"
    prepares = True

    def __init__(self, kwarg: str):
        self.kwarg = kwarg

    @classmethod
    def from_keyword(cls, value) -> View:
        return cls(value)

    def to_keyword(self):
        return self.kwarg

    def shape(self, shape, block, heads):
        return (shape[0], token_count(block, self.kwarg), *shape[2:])

    def view(self, tensor, block, heads):
        return tensor[:, : token_count(block, self.kwarg)]

    def unview(self, value, tensor, block, heads):
        return torch.cat((value, tensor[:, value.shape[1] :]), dim=1) if value.shape[1] < tensor.shape[1] else value

    def describe(self) -> str:
        return f" (its first {self.kwarg} positions: without the padding the model adds after the tokens)"

    def prepare(self, block, model) -> None:
        token_count(block, self.kwarg)


class StreamsFirst(View):
    """A stream the model stacks as ``[streams, batch, seq, hidden]`` (Gemma-3n's AltUp) as ``[batch, seq, streams,
    hidden]``, the layout of other parallel streams: a permuted view of the same storage, and an assignment permuted
    back."""

    name = "streams_first"
    rank = 50
    excludes = (Prefix, Unflatten, HeadsFirst, Heads)
    why = "views a whole stacked stream"

    def shape(self, shape, block, heads):
        return (*shape[1:3], shape[0], *shape[3:])

    def view(self, tensor, block, heads):
        return tensor.movedim(0, 2)

    def unview(self, value, tensor, block, heads):
        return value.movedim(2, 0)

    def describe(self) -> str:
        return " (the model's [streams, batch, seq, hidden], viewed as [batch, seq, streams, hidden])"


class Times(View):
    """A sublayer's output as the stream receives it, where the block's code multiplies it by a factor after the
    module (Granite's ``residual_multiplier``): ``attribute`` names that factor on the block module. The product is
    at no module boundary, so the value is computed as the block computes it (the same operation, bit for bit) and
    handed back divided by the factor where it was edited: the model's own multiplication then gives the stream the
    edited value (within one rounding), as a plain hook on the module's output that divides the edited product by
    the factor would; elements left as they were hand back the module's own."""

    name = "times"
    rank = 70
    fresh = True

    def __init__(self, attribute: str):
        self.attribute = attribute

    def view(self, tensor, block, heads):
        return tensor * getattr(block, self.attribute)

    def unview(self, value, tensor, block, heads):
        """The module's tensor where the value is the product still (undoing a product is not always the same
        float), the value divided by the factor where it was edited; a gradient reaches every element of the value
        (the difference added to the module's tensor is zero)."""
        factor = getattr(block, self.attribute)
        divided = value / factor
        kept = tensor
        if divided.requires_grad:
            kept = tensor.detach() + (divided - divided.detach()).nan_to_num(0.0)
        return torch.where(value == tensor * factor, kept, divided)

    def describe(self) -> str:
        return f" (times the block's {self.attribute}, as the block adds it to the stream)"


def leading_shape(block_envoy) -> tuple[int, ...]:
    """``[batch, seq]`` of the stream in this forward pass, read from the block's input once per visit of the block.

    Kept on nnsight's mediator (one per invoke and trace), per visit, so later values of the visit reuse it
    instead of asking for an input the model already ran past. A visit is the occurrence of the block's output a
    request made now asks for (``visit``): the same for every value of the block in one pass, through a generation
    step's pin and its relaxing after the step's first value.
    """
    from nnsight.intervention.interleaver import Mediator

    mediator = Mediator.current("the stream's [batch, seq]")
    shapes = mediator.__dict__.setdefault("_nnterp_leading_shape", {})
    key = visit(mediator, block_envoy)
    if key not in shapes:
        args, kwargs = block_envoy.inputs
        hidden = args[0] if args else kwargs["hidden_states"]
        shapes[key] = tuple(hidden.shape[:-1])
    return shapes[key]


def visit(mediator, block_envoy) -> tuple[str, int]:
    """(the block, which of its calls): the occurrence of the block's output a request made now asks for. Keyed by
    it, what a block's values share in one call (its [batch, seq]) is read once per call: a generation step, or a
    run of a looped block."""
    return block_envoy.path, mediator.wanted(f"{block_envoy.path}.output")


def token_count(block_envoy, kwarg: str) -> int:
    """How many positions of the stream are tokens in this forward pass, where the model pads it after them: the
    block's keyword argument ``kwarg``, read from the block's input before its first value and kept per visit of the
    block. A visit is the occurrence of the block's output that a request made now asks for: the same for every
    value of the block in one pass, through a generation step's pin and its relaxing after the first value."""
    from nnsight.intervention.interleaver import Mediator

    mediator = Mediator.current("the stream's token count")
    counts = mediator.__dict__.setdefault("_nnterp_token_count", {})
    key = visit(mediator, block_envoy)
    if key not in counts:
        counts[key] = int(block_envoy.inputs[1][kwarg])
    return counts[key]
