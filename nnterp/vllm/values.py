"""Reading and writing a standard value on vLLM, inside a trace: the place a family's value has in vLLM's code
(``nnterp.vllm.places``) read through nnsight's mediator at its native location, by pure tensor steps.

A value on vLLM's own code is the flat ``[tokens, width]`` slab of its invoke, viewed as ``[1, tokens, width]`` (a view:
in-place edits reach the model), then through the location's views; a product (``Times``, Llama 4's interleaved
halves) is handed back through the views' inverse when the trace moves on. The fused stream is the sum of its two
parts (``nnterp.vllm.stream``); the attention's scores are recomputed from the kernel's inputs
(``nnterp.vllm.attention``). On the Transformers backend, whose activations already have that layout, the core's
own ``At.read`` / ``At.write`` do it.
"""

from __future__ import annotations

import torch
from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import Mediator

from ..core.engine import ValueOutsideTrace
from ..core.loading import has_module
from ..spec.catalog import value_named
from ..spec.errors import BadAssignment, ValueUnavailable
from .attention import recomputed, refuse_write
from .places import FromKernel, FusedStream, Place, VLLMFamily
from .stream import StreamAt, check_streams, read_stream

ONE_PROMPT = ("vLLM runs one request per invoke: give each prompt its own `with tracer.invoke(prompt):` inside "
              "`with model.trace() as tracer:` (values are [1, tokens, width] per invoke)")


class CopyAt:
    """Host of the copy's eproperty: a tensor the block changes in place after it is read (``At.copy``)."""

    def __init__(self, path: str, place: Place):
        self.path, self.place = path, place


def _copy_view(host: CopyAt, raw) -> torch.Tensor:
    return _tensor_of(host.place, raw).clone().unsqueeze(0)


def _copy_back(host: CopyAt, view: torch.Tensor, raw):
    tensor = view.squeeze(0)
    return (tensor, *raw[1:]) if isinstance(raw, (tuple, list)) else tensor


COPY_OUTPUT = eproperty(key="output")(_copy_view).transform(_copy_back)


# -- reading and writing a standard value -------------------------------------------------------------------------

def _location(envoy, place: Place) -> str:
    base = envoy._nnterp_block_path + (f".{place.path}" if place.path else "")
    return f"{base}.{place.side}"


def _tensor_of(place: Place, raw) -> torch.Tensor:
    return place.element(raw)  # the At's own reading of an output (its element where a tuple) or input


def _viewed(envoy, place: Place, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
    """The flat slab of this invoke as ``[1, tokens, ...]`` (the backend's step), then through the location's views
    (per head: the core's ``Heads``; the keys and values per key-value head), views of the same storage, but for a
    ``fresh`` view's product (``Times``: Granite's contributions as the stream receives them)."""
    value = tensor.unsqueeze(0)
    for view in place.views:
        value = view.view(value, *_view_args(envoy, name))
    return value


def _view_args(envoy, name: str) -> tuple:  # the block's envoy (a Times view's factor is the block's), the heads
    heads = envoy._nnterp_kernel["kv_heads"] if name in KV else envoy._nnterp_heads
    return envoy.__dict__.get("_nnterp_block", envoy), heads


def _unviewed(envoy, place: Place, tensor: torch.Tensor, value: torch.Tensor, name: str) -> torch.Tensor:
    """The module's tensor (``tensor``'s layout) remade from the value ``value``, read through ``place``'s views from
    ``tensor``: each view's ``unview``, last first (a ``Times`` view divides the edited elements by its factor)."""
    stages = [tensor.unsqueeze(0)]
    for view in place.views:
        stages.append(view.view(stages[-1], *_view_args(envoy, name)))
    for view, before in zip(reversed(place.views), reversed(stages[:-1])):
        value = view.unview(value, before, *_view_args(envoy, name))
    return value.reshape(tensor.shape)


def is_fresh(place: Place) -> bool:
    """Whether the value is a product of the module's tensor (a ``fresh`` view), not a view of its storage."""
    return any(view.fresh for view in place.views)


class FreshAt:
    """Host of a product's eproperty (``is_fresh``): handed back through the views' ``unview`` as the trace moves on."""

    def __init__(self, path: str, place: Place, envoy, name: str):
        self.path, self.place, self.envoy, self.name = path, place, envoy, name


def _fresh_view(host: FreshAt, raw) -> torch.Tensor:
    return _viewed(host.envoy, host.place, _tensor_of(host.place, raw), host.name)


def _fresh_back(host: FreshAt, value: torch.Tensor, raw):
    return _rebuilt(host.place, raw, _unviewed(host.envoy, host.place, _tensor_of(host.place, raw), value, host.name))


# one per element and views: nnsight answers a read with the write-back waiting on the same eproperty (the queries'
# for the keys, the gate's half for the up projection's)
FRESH: dict[tuple, eproperty] = {}


def fresh_property(place: Place) -> eproperty:
    """The eproperty that serves ``place``'s product and hands it back: one per element of a boundary and views."""
    key = (place.side, place.arg if place.side == "input" else place.index, place.views)
    if key not in FRESH:
        FRESH[key] = eproperty(key=place.side)(_fresh_view).transform(_fresh_back)
    return FRESH[key]


def _rebuilt(place: Place, raw, tensor: torch.Tensor):
    """The module's output, or its ``(args, kwargs)``, with the place's element replaced by ``tensor``."""
    if place.side == "input":
        args, kwargs = raw
        if len(args) > place.arg:
            return (*args[: place.arg], tensor, *args[place.arg + 1:]), kwargs
        return args, {**kwargs, place.kwarg: tensor}
    if isinstance(raw, (tuple, list)):
        return (*raw[:place.index], tensor, *raw[place.index + 1:])
    return tensor


KV = ("keys", "values")  # per key-value head (fewer than the query heads with grouped-query attention)


def place_of(envoy, name: str) -> Place:
    family: VLLMFamily = envoy._nnterp_family
    place = family.values.get(name)
    if place is None:
        raise family.refusal(name)
    if place.path and not has_module(_block_of(envoy)._module, place.path):  # a mixture's dense block: no router
        raise ValueUnavailable(value_named(name).key, f"{family.name} (vLLM)",
                               f"block {envoy._nnterp_layer} has no {place.path} in vLLM's model (a mixture's dense "
                               "blocks have no router)")
    return place


def _block_of(envoy):
    """The block envoy ``envoy`` (a block, or its attention or MLP: a child of it) belongs to, which the core's
    locations are relative to."""
    return envoy if envoy.path == envoy._nnterp_block_path else envoy.parent


def _inside_a_trace() -> bool:
    try:
        Mediator.current("a standard value")
    except ValueError:
        return False
    return True


def read_value(envoy, name: str) -> torch.Tensor:
    """Inside a trace: the value ``name`` of the block ``envoy`` belongs to, ``[1, tokens, ...]`` (live). Outside
    one: where it is read (its tensor exists only inside a trace; ``hasattr`` tells availability everywhere)."""
    place = place_of(envoy, name)
    if not _inside_a_trace():
        return ValueOutsideTrace(f"layers[{envoy._nnterp_layer}]", value_named(name).key, place.describe())
    location = _location(envoy, place)
    mediator = Mediator.current(location)
    check_streams(mediator)
    if envoy._nnterp_family.batched:  # transformers' own modules, [1, tokens, ...]: read as the core reads them
        return place.read(_block_of(envoy), envoy._nnterp_heads)
    if isinstance(place, FusedStream):
        return read_stream(envoy, place, name, location, mediator)
    if isinstance(place, FromKernel):
        return recomputed(envoy, name, location, mediator)
    if place.copy:
        return COPY_OUTPUT.__get__(CopyAt(location.rpartition(".")[0], place))
    if is_fresh(place):
        fresh = fresh_property(place)
        return fresh.__get__(FreshAt(location.rpartition(".")[0], place, envoy, name))
    return _viewed(envoy, place, _tensor_of(place, Mediator.value(location)), name)


def write_value(envoy, name: str, value) -> None:
    """Inside a trace: replace the value ``name`` (``[1, tokens, ...]``, the shape it is read with)."""
    place = place_of(envoy, name)
    if isinstance(place, FromKernel):
        refuse_write(value_named(name).key)
    location = _location(envoy, place)
    check_streams(Mediator.current(location))
    if envoy._nnterp_family.batched:  # as the core writes a value on transformers' modules
        place.write(_block_of(envoy), value, envoy._nnterp_heads, value_named(name).key)
        return
    raw = Mediator.value(location)
    fused = isinstance(place, FusedStream)
    stream = StreamAt("", place.side, place.parts) if fused else None
    if fused:
        first, second = stream.halves(raw)
        current = first
    else:
        current = _tensor_of(place, raw)
    expected = tuple(_viewed(envoy, place, current, name).shape)
    key = value_named(name).key
    if not isinstance(value, torch.Tensor):
        raise BadAssignment(f"'{key}' takes a torch.Tensor, got {type(value).__name__}.")
    if tuple(value.shape) != expected:
        raise BadAssignment(f"'{key}' has shape {list(expected)} on this invoke; the assigned tensor has shape "
                            f"{list(value.shape)}. {ONE_PROMPT}.")
    if value.dtype != current.dtype or value.device != current.device:
        raise BadAssignment(f"'{key}' is {current.dtype} on {current.device}; the assigned tensor is {value.dtype} "
                            f"on {value.device}: convert it first (value.to(...)).")
    flat = _unviewed(envoy, place, current, value, name) if is_fresh(place) else value.reshape(current.shape)
    if fused:
        Mediator.swap(location, stream.with_stream(raw, flat))
    elif place.shared:
        current.copy_(flat)
    else:
        Mediator.swap(location, _rebuilt(place, raw, flat))
