"""The fused stream of vLLM's Llama-like blocks as a trace reads it: the sum of the block's two parts (hidden and
residual), handed back to the model as ``(0, stream)`` through nnsight's ``eproperty`` write-back, and the rules that
keep an in-place edit of it from being dropped (``StreamAt``, ``StreamTensor``)."""

from __future__ import annotations

import torch
from nnsight.intervention.eproperty import eproperty

from ..spec.errors import BadAssignment
from .places import Place


class StreamAt:
    """Host of the stream's eproperty at one boundary (nnsight reads ``"{path}.{key}"``): the block's output, or a
    fused norm's or the block's inputs, whose elements ``parts`` are the stream's two halves.

    The stream is handed on as ``(0, stream)``, spliced into the step's slab (a copy) at the trace's next request:
    an in-place edit of the tensor read after that would not reach the model. Two things keep that from being
    silent. A block's output and the next block's input are one tensor on transformers: read in the same step, the
    input is served as the very tensor the output read gave (``reuse``), so the edit reaches the model at the
    input's own hand-back. Any other edit after the hand-back is refused at the trace's next standard read
    (``handed``: the tensor's version when it was handed on)."""

    def __init__(self, path: str, side: str, parts: tuple[int, int], reuse=None):
        self.path, self.side, self.parts = path, side, parts
        self.reuse = reuse  # (mediator, occurrence, tensor): the previous block's output read, if any
        self.reused = False
        self.handed = None
        self.read = None  # (the stream tensor as read, its version then): unedited, it is handed back as it came
        self.label = ""  # the value's name, for the refusal

    def halves(self, raw) -> tuple[torch.Tensor, torch.Tensor | None]:
        items = raw if self.side == "output" else raw[0]
        first, second = self.parts
        return items[first], (items[second] if len(items) > second else None)

    def with_stream(self, raw, stream: torch.Tensor):
        """``raw`` with the stream replaced by ``stream``: ``(0, stream)`` (the next add gives ``stream`` exactly), or
        the first part alone where the second is None (block 0's inputs: no residual yet)."""
        first, second = self.parts
        items = list(raw if self.side == "output" else raw[0])
        if len(items) > second and items[second] is not None:
            items[first], items[second] = torch.zeros_like(stream), stream
        else:
            items[first] = stream
        return tuple(items) if self.side == "output" else (tuple(items), raw[1])


# the tensor methods that write into their first argument
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__iand__",
                     "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__ifloordiv__", "__imod__"})


class StreamTensor(torch.Tensor):
    """A fused stream as the trace reads it: a plain tensor, except that an in-place edit of it (or of a view of it)
    made after it was handed on to the model is refused on the spot, rather than dropped. Other operations give
    plain tensors; it travels (``save``) as a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        base = args[0] if args and isinstance(args[0], StreamTensor) else None
        host = getattr(base, "_nnterp_host", None)
        name = getattr(func, "__name__", "")
        if host is not None and host.handed is not None and (
                name in _WRITES or (name.endswith("_") and not name.startswith("_"))):
            raise _late_edit(host.label)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if host is not None and isinstance(out, torch.Tensor) and out is not base and \
                out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            out = _stream_tensor(out, host)  # a view of the stream: it writes into the stream
        return out

    def __reduce_ex__(self, protocol):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(self, torch.Tensor).__reduce_ex__(protocol)


def _stream_tensor(tensor: torch.Tensor, host) -> StreamTensor:
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.Tensor.as_subclass(tensor, StreamTensor)
    out._nnterp_host = host
    return out


def _late_edit(label: str) -> BadAssignment:
    return BadAssignment(
        f"{label} was edited in place after the trace read a later value: vLLM had already taken the stream on (its "
        f"fused residual is two tensors, added into a new one), so the edit would not reach the model, where on "
        f"transformers it would. Edit {label} before reading a later value (or read layers[i + 1].layer_input, the "
        "same tensor, and edit it there).")


def _stream_view(host: StreamAt, raw) -> torch.Tensor:
    if host.reuse is not None:
        mediator, occurrence, tensor = host.reuse
        if mediator.occurrence(f"{host.path}.{host.side}") == occurrence:  # the same step: the same tensor
            host.reused = True
            tensor._nnterp_host = host
            return tensor
    first, second = host.halves(raw)
    # a tensor of its own, made outside vLLM's inference mode so that it counts its in-place edits (``handed``)
    with torch.inference_mode(False):
        stream = _stream_tensor((first.clone() if second is None else first + second).unsqueeze(0), host)
    host.read = (stream, stream._version)
    return stream


def _stream_back(host: StreamAt, view: torch.Tensor, raw):
    with torch._C.DisableTorchFunctionSubclass():
        plain = torch.Tensor.as_subclass(view, torch.Tensor)
    host.handed = plain._version  # spliced into the slab now: a later in-place edit would not reach the model
    if host.read is not None and view is host.read[0] and plain._version == host.read[1]:
        return raw  # unedited: the model's own halves, which its next add sums to this very stream
    return host.with_stream(raw, plain.squeeze(0))


# per invoke (on its mediator): the streams read in the current step, (step, [(host, tensor, label)]), and the last
# block output read
STREAMS, LAST_OUTPUT = "_nnterp_streams", "_nnterp_last_stream_output"


def check_streams(mediator) -> None:
    """Refuse an in-place edit of a stream made after it was handed on (it would not reach the model)."""
    for host, view, label in getattr(mediator, STREAMS, (0, ()))[1]:
        if host.handed is not None and view._version != host.handed:
            raise _late_edit(label)


STREAM_OUTPUT = eproperty(key="output")(_stream_view).transform(_stream_back)
STREAM_INPUT = eproperty(key="input")(_stream_view).transform(_stream_back)


def read_stream(envoy, place: Place, name: str, location: str, mediator) -> torch.Tensor:
    """The stream at ``place``: the sum of its halves, or the tensor the previous block's output read gave."""
    path = location.rpartition(".")[0]
    between = place.path == ""
    layer = envoy._nnterp_layer
    last = getattr(mediator, LAST_OUTPUT, None) if between and place.side == "input" else None
    reuse = last[1:] if last is not None and last[0] == layer - 1 else None
    host = StreamAt(path, place.side, place.parts, (mediator, *reuse) if reuse else None)
    host.label = f"layers[{layer}].{name}"
    view = (STREAM_OUTPUT if place.side == "output" else STREAM_INPUT).__get__(host)
    step = mediator.occurrence(location)
    streams = getattr(mediator, STREAMS, None)
    if streams is None or streams[0] != step:  # a new step (a generated token's pass): the earlier ones are done
        streams = (step, [])
        setattr(mediator, STREAMS, streams)
    if host.reused:  # handed on by this read now: the output read's own hand-back no longer counts
        streams[1][:] = [entry for entry in streams[1] if entry[1] is not view]
    streams[1].append((host, view, host.label))
    if between and place.side == "output" and not envoy._nnterp_last:
        setattr(mediator, LAST_OUTPUT, (layer, step, view))
    return view
