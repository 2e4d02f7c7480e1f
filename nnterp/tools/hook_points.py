"""TransformerLens's hook points on a standardized model: each TransformerLens hook name, where nnterp reads it, in
forward order.

A name is one of a block's (``blocks.5.hook_resid_post``, ``blocks.5.attn.hook_z``) or the model's own
(``hook_embed``, ``hook_pos_embed``, ``ln_final.hook_scale``). Most are a standard value itself
(``spec.catalog.TRANSFORMERLENS_NAMES``), live: an edit reaches the model as an edit of the value does. The others
(``TRANSFORMERLENS_COMPUTED``) are read at a native module of the model (the activation's input, the query
projection's output), or computed from the live values of the pass (a norm's scale, each head's result): those
are read-only, and an edit of one is refused, naming the live value to edit instead. A name a family has no
meaning for is refused with the reason.

``points(model, names)`` resolves names (a name, a list, or a predicate over every name the model has) to
``Point`` objects; ``in_forward_order`` sorts them as the model computes them, so that nnsight, which reads a
pass's values in that order, reads them whatever order they were given in.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..spec import attention
from ..spec.catalog import ATTENTION_INTERNALS, BY_NAME, TRANSFORMERLENS_COMPUTED, TRANSFORMERLENS_NAMES
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.locations import At, Unavailable, envoy_at


class HookError(NNterpError, ValueError):
    """A TransformerLens hook name or hook that nnterp cannot serve as asked."""


# -- names -----------------------------------------------------------------------------------------------------


def _tail(key: str) -> str:
    """A table key (``"resid_pre"``, ``"attn.hook_z"``) as the end of a block's hook name."""
    return key if "." in key else f"hook_{key}"


BLOCK_HOOKS: tuple[str, ...] = tuple(dict.fromkeys([*map(_tail, TRANSFORMERLENS_NAMES), *TRANSFORMERLENS_COMPUTED]))
MODEL_HOOKS = ("hook_embed", "hook_pos_embed", "ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_in",
               "unembed.hook_out")

_LAYER_TYPES = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}
_ACT_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
                "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_OF_ATTENTION = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_OF_MLP = ("pre", "post", "mid", "pre_linear")


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """TransformerLens's full hook name from its shorthand: ``get_act_name("resid_post", 5)`` is
    ``"blocks.5.hook_resid_post"``, ``get_act_name("pattern", 2)`` ``"blocks.2.attn.hook_pattern"``,
    ``get_act_name("scale4ln1")`` ``"blocks.4.ln1.hook_scale"``, ``get_act_name("scale")``
    ``"ln_final.hook_scale"``; a full name is given back as it is. The same names as
    ``transformer_lens.utils.get_act_name`` gives."""
    if layer is None and layer_type is None and ("." in name or name.startswith("hook_")):
        return name
    packed = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)  # "k6", "scale4ln1": name, layer, layer type
    if packed is not None:
        name, layer, layer_type = packed.group(1), packed.group(2), packed.group(3)
    name = _ACT_ALIASES.get(name, name)
    if name in _OF_ATTENTION:
        layer_type = "attn"
    elif name in _OF_MLP:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPES:
        layer_type = _LAYER_TYPES[layer_type]
    full = (f"blocks.{layer}." if layer is not None else "") + (f"{layer_type}." if layer_type else "") + f"hook_{name}"
    if layer is None and name in ("scale", "normalized"):
        full = f"ln_final.{full}"
    return full


def split_name(name: str) -> tuple[int | None, str]:
    """``"blocks.5.attn.hook_z"`` -> ``(5, "attn.hook_z")``; ``"hook_embed"`` -> ``(None, "hook_embed")``."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if match is not None:
        return int(match.group(1)), match.group(2)
    return None, name


# TransformerBridge's names of a block's input and output (``get_act_name("in", 5)``: ``blocks.5.hook_in``)
BRIDGE_ALIASES = {"hook_in": "hook_resid_pre", "hook_out": "hook_resid_post"}


def is_hook_name(name) -> bool:
    """Whether ``name`` is a TransformerLens hook name nnterp knows (of a block or of the model)."""
    if not isinstance(name, str):
        return False
    layer, tail = split_name(name)
    return tail in BLOCK_HOOKS or tail in BRIDGE_ALIASES if layer is not None else tail in MODEL_HOOKS


def unknown_name(name) -> HookError:
    return HookError(
        f"{name!r} is not a TransformerLens hook name nnterp serves. A block's are blocks.<layer>.<name>, with "
        f"<name> one of {', '.join(BLOCK_HOOKS)}; the model's are {', '.join(MODEL_HOOKS)} "
        "(nnterp.utils.get_act_name('resid_post', 5) spells them).")


def hook_names(model, layers: Iterable[int] | None = None) -> list[str]:
    """Every TransformerLens hook name of ``model`` (its blocks ``layers``, all by default), whether or not the family
    has a value for it: ``points`` says which it has."""
    layers = range(model.num_layers) if layers is None else layers
    return [*MODEL_HOOKS[:2], *(f"blocks.{i}.{tail}" for i in layers for tail in BLOCK_HOOKS), *MODEL_HOOKS[2:]]


# -- the points ------------------------------------------------------------------------------------------------


class Point:
    """One hook point of a model: its TransformerLens ``name``, its block (``layer``, None for the model's own), its
    place in the forward pass (``event``), and how it is read inside a trace. ``read_only``: computed from the pass,
    not a tensor the model holds."""

    read_only = False
    needs_attention = False  # read inside the eager attention (model.enable_attention_values())
    per_batch = False  # the model holds one row for the whole batch (the position embeddings): given one per prompt

    def __init__(self, name: str, layer: int | None, event: tuple):
        self.name, self.layer, self.event = name, layer, event

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def read(self, model) -> torch.Tensor:
        raise NotImplementedError

    def write(self, model, value: torch.Tensor) -> None:
        raise NotImplementedError

    def refuse_edit(self) -> HookError:
        return HookError(f"A hook edited {self.name}, which nnterp computes from the pass ({self.how}); it is not a "
                         f"tensor the model holds, so the edit could not reach the model. Edit {self.live} instead.")


class StandardPoint(Point):
    """A standard value itself: read and written as ``model.layers[i].<value>`` is."""

    def __init__(self, name: str, layer: int, event: tuple, value: str):
        Point.__init__(self, name, layer, event)
        self.value = value
        self.needs_attention = value in ATTENTION_INTERNALS

    def read(self, model):
        return model.read_value(self.layer, self.value)

    def write(self, model, value):
        model.write_value(self.layer, self.value, value)


class ScoresPoint(Point):
    """TransformerLens's ``attn.hook_attn_scores``: the attention scores with the masked entries ``-inf``, as
    TransformerLens masks them (transformers adds its dtype's lowest value instead). The reader gets that copy, and
    an edit is written back with the ``-inf`` entries as the model's own mask value again, so that the model's
    softmax (a padding query's row all masked included) runs as it does unhooked."""

    copy = True
    needs_attention = True

    def __init__(self, scores: StandardPoint):
        Point.__init__(self, scores.name, scores.layer, scores.event)
        self.scores = scores

    @staticmethod
    def masked(scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(scores <= torch.finfo(scores.dtype).min / 2, float("-inf"))

    def read(self, model):
        return self.masked(self.scores.read(model))

    def write(self, model, value):
        self.scores.write(model, value.masked_fill(value.isneginf(), torch.finfo(value.dtype).min))


class NativePoint(Point):
    """A module boundary of the model that no standard value names (the activation's input, a projection's output,
    the embeddings), read as nnsight reads it: ``path``'s ``side``, seen through ``view`` and written back through
    ``unview``. ``copy``: the reader gets a copy, assigned back at this place only (TransformerLens's
    ``hook_mlp_in``, a copy of the stream that only the MLP's norm reads)."""

    def __init__(self, name: str, layer: int | None, event: tuple, path: str, side: str,
                 view: Callable | None = None, unview: Callable | None = None, copy: bool = False):
        Point.__init__(self, name, layer, event)
        self.path, self.side, self.view, self.unview, self.copy = path, side, view, unview, copy

    def read(self, model):
        envoy = envoy_at(model, self.path)
        tensor = envoy.output if self.side == "output" else envoy.input
        if isinstance(tensor, tuple):
            tensor = tensor[0]
        tensor = tensor.clone() if self.copy else tensor
        return self.view(tensor) if self.view else tensor

    def write(self, model, value):
        envoy = envoy_at(model, self.path)
        value = self.unview(value) if self.unview else value
        if self.side == "output":
            envoy.output = value
        else:
            envoy.input = value


class ComputedPoint(Point):
    """A tensor TransformerLens records that the model never holds, computed from live values of the pass by
    ``compute(model)``: read-only. ``how`` says what it is, ``live`` which live value to edit instead."""

    read_only = True

    def __init__(self, name: str, layer: int | None, event: tuple, compute: Callable, how: str, live: str):
        Point.__init__(self, name, layer, event)
        self.compute, self.how, self.live = compute, how, live

    def read(self, model):
        return self.compute(model)

    def write(self, model, value):
        raise self.refuse_edit()


def in_forward_order(points: list[Point]) -> list[Point]:
    """The points in the order the model computes them (a stable sort: those at one place keep their order)."""
    return sorted(points, key=lambda point: point.event)


def points(model, names, layers: Iterable[int] | None = None) -> list[Point]:
    """The points of ``names``: a hook name, a list of them, or a predicate over hook names (every name of the model
    it accepts, among those the family has: a name without meaning there is left out). A name given explicitly
    that the family has no value for raises ``ValueUnavailable`` with the reason; an unknown name, ``HookError``."""
    if callable(names):
        chosen = []
        for name in hook_names(model, layers):
            if names(name):
                try:
                    chosen.append(point(model, name))
                except ValueUnavailable:
                    continue
        return chosen
    names = [names] if isinstance(names, str) else list(names)
    return [point(model, name) for name in names]


def point(model, name: str) -> Point:
    """The point of one hook name (a full name, or one ``get_act_name`` spells)."""
    if not isinstance(name, str):
        raise HookError(f"A hook name is a string or a predicate over names, not {name!r}.")
    name = get_act_name(name)
    layer, tail = split_name(name)
    if layer is None:
        if tail not in MODEL_HOOKS:
            raise unknown_name(name)
        return _model_point(model, name)
    if tail not in BLOCK_HOOKS and tail not in BRIDGE_ALIASES:
        raise unknown_name(name)
    if not layer < model.num_layers:
        raise IndexError(f"{name}: the model has {model.num_layers} blocks (0 to {model.num_layers - 1}).")
    if tail in BRIDGE_ALIASES:  # the same point, under the name it was asked by (hook.name, the cache's key)
        aliased = _block_point(model, f"blocks.{layer}.{BRIDGE_ALIASES[tail]}", layer, BRIDGE_ALIASES[tail])
        aliased.name = name
        return aliased
    return _block_point(model, name, layer, tail)


def _unavailable(model, name: str, reason: str) -> ValueUnavailable:
    return ValueUnavailable(name, model.family.name, reason)


def _event(model, path: str, side: str, name: str, after: int = 0) -> tuple:
    return (model._event_index(path, side, name), after)


def _standard(model, name: str, layer: int, value: str) -> StandardPoint:
    """The point of a standard value; unavailable where the block has none (the attention internals count as
    available where the family has them: they are turned on for the call)."""
    key = BY_NAME[value].key
    location = model.block_spec(layer).resolve(value)
    if isinstance(location, Unavailable):
        if location != attention.OFF:  # no meaning on this block (not merely off)
            raise _unavailable(model, name, f"TransformerLens's {name} is nnterp's {key} here: {location.reason}")
        where = model.family.attention_of(model._nnterp_text_config)
        if isinstance(where, Unavailable):
            raise _unavailable(model, name, where.reason)
        # its place with the internals on: inside the attention, after the module is called
        module = model.block_path(layer, model.family.attention)
        return StandardPoint(name, layer, (model._event_index(module, "input", name), 1 + BY_NAME[value].rank), value)
    event = next(event for event, at, _ in model.timeline(layer) if at == key)
    return StandardPoint(name, layer, event, value)


def standard_point(model, value: str, layer: int) -> StandardPoint:
    """The point of block ``layer``'s standard value ``value`` (named ``layers[i].<value>`` in a plan)."""
    return _standard(model, f"layers[{layer}].{BY_NAME[value].key}", layer, value)


def _block_point(model, name: str, layer: int, tail: str) -> Point:
    rotary = has_rotary(model)
    if tail in ("attn.hook_q", "attn.hook_k"):
        standard = "queries" if tail == "attn.hook_q" else "keys"
        return _before_rotary(model, name, layer, tail) if rotary else _standard(model, name, layer, standard)
    if tail in ("attn.hook_rot_q", "attn.hook_rot_k"):
        if not rotary:
            raise _unavailable(model, name, f"{model.family.name} has no rotary embeddings: the queries and keys "
                                            "are hook_q and hook_k")
        return _standard(model, name, layer, TRANSFORMERLENS_NAMES[tail])
    if tail.endswith(("hook_scale", "hook_normalized")):
        return _norm_point(model, name, layer, tail)
    if tail == "attn.hook_result":
        return _result_point(model, name, layer)
    if tail == "mlp.hook_pre":
        return _activation_input(model, name, layer)
    if tail == "mlp.hook_pre_linear":
        mlp = model.layers[layer]._module.get_submodule(model.family.mlp) if model.family.mlp else None
        if not (isinstance(getattr(mlp, "up_proj", None), nn.Linear) and hasattr(mlp, "gate_proj")):
            raise _unavailable(model, name, "TransformerLens's hook_pre_linear is a gated MLP's up projection, and "
                                            "this block's MLP has no gate and up projections")
        full = model.block_path(layer, f"{model.family.mlp}.up_proj")
        return NativePoint(name, layer, _event(model, full, "output", name), full, "output")
    if tail == "hook_mlp_in":
        return _mlp_in(model, name, layer)
    if tail == "attn.hook_attn_scores":
        return ScoresPoint(_standard(model, name, layer, "attention_scores"))
    key = tail.removeprefix("hook_") if tail.startswith("hook_") else tail
    return _standard(model, name, layer, TRANSFORMERLENS_NAMES[key])


def has_rotary(model) -> bool:
    """Whether the model rotates its queries and keys (a rotary embedding module anywhere in it)."""
    return any("Rotary" in type(module).__name__ for module in model._module.modules())


def _plain_module_output(model, layer: int, value: str) -> str | None:
    """The native path (from the block) of the module whose whole output ``value`` is, or None."""
    location = model.block_spec(layer).resolve(value)
    if isinstance(location, At) and location.side == "output" and not location.op and not location.views:
        return location.path
    return None


def _before_rotary(model, name: str, layer: int, tail: str) -> Point:
    """The queries (keys) before the rotary embedding: the projection's output per head, where the attention
    projects them with a module of their own (before a query or key norm too, where TransformerLens records them:
    Qwen3, OLMo-2)."""
    which = "q" if tail == "attn.hook_q" else "k"
    attention = model.family.attention
    module = model.layers[layer]._module.get_submodule(attention) if attention else None
    projection = getattr(module, f"{which}_proj", None)
    if not isinstance(projection, nn.Linear):
        raise _unavailable(model, name, "TransformerLens records it before the rotary embedding, and on this "
                                        f"family the {'queries' if which == 'q' else 'keys'} before it are no module's "
                                        f"output; attn.hook_rot_{which} is the {'queries' if which == 'q' else 'keys'} "
                                        "after it")
    head_dim = _head_dim(model)
    path = model.block_path(layer, f"{attention}.{which}_proj")
    # the projections run first in the attention's forward, before any operation the internals are read at
    event = (model._event_index(model.block_path(layer, attention), "input", name), 1)
    return NativePoint(name, layer, event, path, "output", view=lambda t: t.unflatten(-1, (-1, head_dim)),
                       unview=lambda t: t.flatten(-2))


def _head_dim(model) -> int:
    config = model._nnterp_text_config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _activation_input(model, name: str, layer: int) -> Point:
    path = _plain_module_output(model, layer, "mlp_activation")
    if path is None:
        raise _unavailable(model, name, "TransformerLens's hook_pre is the input of the MLP's activation function, "
                                        "and on this block the activation is no module of its own")
    full = model.block_path(layer, path)
    return NativePoint(name, layer, _event(model, full, "input", name), full, "input")


def _mlp_in(model, name: str, layer: int) -> Point:
    """TransformerLens's ``hook_mlp_in``: a copy of the stream after the attention's add that only the MLP's norm
    reads (an edit reaches the MLP, not the stream)."""
    path = _plain_module_output(model, layer, "mlp_norm_output")
    if path is None or isinstance(model.block_spec(layer).resolve("layer_mid"), Unavailable):
        raise _unavailable(model, name, "TransformerLens's hook_mlp_in is the stream after the attention's add as "
                                        "the MLP's norm reads it, and this block has no such norm reading it")
    full = model.block_path(layer, path)
    return NativePoint(name, layer, _event(model, full, "input", name), full, "input", copy=True)


# -- norms: TransformerLens's hook_scale and hook_normalized -----------------------------------------------------

EPSILON_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


def norm_form(module: nn.Module, what: str) -> tuple[bool, float]:
    """``(centred, eps)`` of a LayerNorm or an RMSNorm module; a clear error for another kind of norm."""
    kind = type(module).__name__
    if isinstance(module, nn.LayerNorm) or ("LayerNorm" in kind and "RMS" not in kind):
        centred = True
    elif "RMS" in kind or isinstance(module, nn.RMSNorm):
        centred = False
    else:
        raise HookError(f"{what}: the norm is a {kind}, not a LayerNorm or an RMSNorm, so its scale is not "
                        "TransformerLens's hook_scale.")
    eps = next((getattr(module, key) for key in EPSILON_NAMES if isinstance(getattr(module, key, None), float)), None)
    if eps is None:
        raise HookError(f"{what}: the norm ({kind}) declares no epsilon ({', '.join(EPSILON_NAMES)}).")
    return centred, eps


def scale_and_normalized(x: torch.Tensor, centred: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TransformerLens's ``(hook_scale, hook_normalized)`` of a norm's input: ``sqrt(mean(x^2) + eps)`` of the
    (centred) input, ``[..., 1]``, and the input divided by it, computed in float32, in ``x``'s dtype."""
    x32 = x.float()
    if centred:
        x32 = x32 - x32.mean(-1, keepdim=True)
    scale = (x32.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return scale.to(x.dtype), (x32 / scale).to(x.dtype)


def _norm_point(model, name: str, layer: int | None, tail: str) -> Point:
    which = tail.partition(".")[0]  # ln1, ln2, ln_final
    if which == "ln_final":
        if model.family.ln_final is None:
            raise _unavailable(model, name, f"{model.family.name} has no final norm")
        path, live = model.family.ln_final, "model.ln_final.input"
    else:
        value = "attention_norm_output" if which == "ln1" else "mlp_norm_output"
        relative = _plain_module_output(model, layer, value)
        if relative is None:
            raise _unavailable(model, name, f"TransformerLens's {which} is the norm whose output is {value}, and on "
                                            "this block that is no norm module's output")
        path, live = model.block_path(layer, relative), "the stream the norm reads (hook_resid_pre / hook_resid_mid)"
    module = model._module.get_submodule(path)
    centred, eps = norm_form(module, name)
    index = 0 if tail.endswith("hook_scale") else 1

    def compute(model):
        x = envoy_at(model, path).input
        return scale_and_normalized(x, centred, eps)[index]

    how = TRANSFORMERLENS_COMPUTED.get(tail, "the final norm's " + tail.rpartition("_")[2])
    # TransformerLens's order: the scale, then the input divided by it (after hook_mlp_in, which the norm reads)
    return ComputedPoint(name, layer, _event(model, path, "input", name, after=index), compute, how, live)


def _result_point(model, name: str, layer: int) -> Point:
    premix = _standard(model, name, layer, "attention_premix")

    def compute(model):
        return model.head_outputs(layer)

    return ComputedPoint(name, layer, premix.event, compute, TRANSFORMERLENS_COMPUTED["attn.hook_result"],
                         f"blocks.{layer}.attn.hook_z (each head's output before the projection)")


# -- the model's own points -----------------------------------------------------------------------------------


def position_table(model) -> str | None:
    """The native path of the model's learned position embeddings (GPT-2's ``transformer.wpe``), or None where
    positions are not looked up in a table of exactly the context's length (rotary, ALiBi, an offset table)."""
    config = model._nnterp_text_config
    limit = next((getattr(config, key) for key in ("n_positions", "max_position_embeddings")
                  if isinstance(getattr(config, key, None), int)), None)
    tokens = model._module.get_input_embeddings()
    for path, module in model._module.named_modules():
        if isinstance(module, nn.Embedding) and module is not tokens and module.num_embeddings == limit:
            return path
    return None


def _model_point(model, name: str) -> Point:
    if name == "hook_embed":
        path = model.family.embed_tokens
        return NativePoint(name, None, _event(model, path, "output", name), path, "output")
    if name == "hook_pos_embed":
        path = position_table(model)
        if path is None:
            raise _unavailable(model, name, f"{model.family.name} has no learned position embeddings (a table "
                                            "added to the token embeddings)")
        # TransformerLens adds them broadcast to the batch, [batch, pos, d_model]: a copy per prompt, written back
        point = NativePoint(name, None, _event(model, path, "output", name), path, "output", copy=True)
        point.per_batch = True
        return point
    if name.startswith("unembed."):  # the head's input (the final norm's output) and its output, the logits
        path, side = model.family.lm_head, "input" if name == "unembed.hook_in" else "output"
        return NativePoint(name, None, _event(model, path, side, name), path, side)
    return _norm_point(model, name, None, name)





# -- hooks: TransformerLens's functions called on the points, in one pass ----------------------------------------


class HookContext:
    """What a hook function is called with beside the tensor (TransformerLens's ``HookPoint``): ``hook.name`` the hook
    name, ``hook.layer()`` its block, ``hook.ctx`` a dictionary the function may keep things in (kept from pass to
    pass until ``model.reset_hooks()``)."""

    def __init__(self, name: str, layer: int | None):
        self.name, self._layer, self.ctx = name, layer, {}

    def layer(self) -> int:
        if self._layer is None:
            raise ValueError(f"{self.name} is the model's own hook point, not a block's: it has no layer.")
        return self._layer

    def __repr__(self) -> str:
        return f"HookContext({self.name!r})"


def hooked_points(model, hooks) -> list[tuple[Point, Callable]]:
    """``[(name or predicate, fn)]`` as ``[(point, fn)]``: a predicate is every hook name of the model it accepts."""
    pairs = []
    for entry in hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
            raise HookError(f"A hook is a pair (name or predicate over names, fn(tensor, hook)), not {entry!r}.")
        names, fn = entry
        pairs.extend((point, fn) for point in points(model, names))
    return pairs


def apply(model, point: Point, value: torch.Tensor, fns: list[Callable]) -> torch.Tensor:
    """Inside a trace: call each of ``fns`` as ``fn(tensor, hook)`` on ``point``'s value, in order, each on what the
    one before left; a returned tensor replaces the value (written to the model once, after them), None keeps the
    tensor (edited in place, it reaches the model as an edit of the value does). A computed point refuses an edit."""
    if not fns:
        return value
    context = HookContext(point.name, point.layer)
    # TransformerLens keeps a hook point's ctx from pass to pass, until the hooks are reset with clear_contexts
    context.ctx = model.__dict__.setdefault("_nnterp_hook_contexts", {}).setdefault(point.name, {})
    before = value.clone() if point.read_only else None
    current = value
    for fn in fns:
        result = fn(current, context)
        if result is not None and result is not current:
            if not isinstance(result, torch.Tensor):
                raise HookError(f"A hook on {point.name} returned {type(result).__name__}: a hook returns a tensor "
                                "(which replaces the value) or None (the value kept, edited in place or not).")
            current = result
    if point.read_only:
        if not (torch.equal(value, before) and (current is value or torch.equal(current, before))):
            raise point.refuse_edit()
        return value
    if current is not value or getattr(point, "copy", False):  # a copy's in-place edit reaches the model written back
        point.write(model, current)
    return current


class Plan:
    """The reads of one pass: each point once, in forward order, with the hook functions to call on it and whether
    its value (after them) is kept."""

    def __init__(self):
        self._points: dict[str, Point] = {}
        self._fns: dict[str, list[Callable]] = {}
        self._kept: dict[str, bool] = {}

    def add(self, point: Point, fn: Callable | None = None, keep: bool = False) -> None:
        self._points.setdefault(point.name, point)
        self._fns.setdefault(point.name, [])
        if fn is not None:
            self._fns[point.name].append(fn)
        self._kept[point.name] = self._kept.get(point.name, False) or keep

    @property
    def needs_attention(self) -> bool:
        return any(point.needs_attention for point in self._points.values())

    def ordered(self) -> list[Point]:
        return in_forward_order(list(self._points.values()))

    def run(self, model, batch: int | None = None) -> dict[str, torch.Tensor]:
        """Inside a trace: every point read in forward order, its hooks applied; the kept values, detached. ``batch``:
        the pass's number of prompts, to which a value the model holds once for all (``per_batch``) is expanded."""
        kept = {}
        for point in self.ordered():
            value = point.read(model)
            if point.per_batch and batch is not None:
                value = value.expand(batch, *value.shape[1:]).clone()
            value = apply(model, point, value, self._fns[point.name])
            if self._kept[point.name]:
                kept[point.name] = value.detach() if isinstance(value, torch.Tensor) else value
        return kept


@contextlib.contextmanager
def attention_for(model, needed: bool):
    """``with attention_for(model, needed):`` the attention values on inside the block where ``needed`` (eager
    attention), and as they were after it."""
    turn_on = needed and not model._nnterp_attention_on
    if turn_on:
        model.enable_attention_values()
    try:
        yield model
    finally:
        if turn_on:
            model.disable_attention_values()


__all__ = ["BLOCK_HOOKS", "MODEL_HOOKS", "ComputedPoint", "HookContext", "HookError", "NativePoint", "Plan", "Point", "ScoresPoint",
           "StandardPoint", "apply", "attention_for", "before_stop", "get_act_name", "has_rotary", "hook_names", "hooked_points",
           "in_forward_order", "is_hook_name", "norm_form", "point", "points", "position_table",
           "scale_and_normalized", "split_name", "standard_point"]


def before_stop(point: Point, stop: int | None) -> bool:
    """Whether ``point`` runs before block ``stop`` (TransformerLens's ``stop_at_layer``: the hooks past it are never
    called): a block's before ``stop``, and the embeddings."""
    if stop is None:
        return True
    return point.layer < stop if point.layer is not None else point.name in ("hook_embed", "hook_pos_embed")


def stop_block(model, stop_at_layer: int) -> int:
    """TransformerLens's ``stop_at_layer`` as the block the pass stops before (``num_layers``: after the last),
    refused unless it is a block index from ``-num_layers`` to ``num_layers``."""
    if isinstance(stop_at_layer, bool) or not isinstance(stop_at_layer, int) or not (
            -model.num_layers <= stop_at_layer <= model.num_layers):
        raise ValueError(f"stop_at_layer is a block index from {-model.num_layers} to {model.num_layers}, "
                         f"not {stop_at_layer!r}.")
    return stop_at_layer % model.num_layers if stop_at_layer < model.num_layers else model.num_layers
