"""TransformerLens's hook points on a standardized model: each TransformerLens hook name, where nnterp reads it, in
forward order.

A name is one of a block's (``blocks.5.hook_resid_post``, ``blocks.5.attn.hook_z``) or the model's own
(``hook_embed``, ``hook_pos_embed``, ``ln_final.hook_scale``). Most are a standard value itself
(``spec.catalog.TRANSFORMERLENS_NAMES``), live: an edit reaches the model as an edit of the value does. The others
(``TRANSFORMERLENS_COMPUTED``) are read at a native module of the model (the activation's input, the query
projection's output), or computed from the live values of the pass (a norm's scale, each head's result): those
are read-only, and an edit of one is refused, naming the live value to edit instead; TransformerLens's per-head copies
of the stream (``hook_q_input`` ...) are served by its door (``nnterp.compat.transformer_lens.split_inputs``). A name a
family has no meaning for is refused with the reason.

``points(model, names)`` resolves names (a name, a list, or a predicate over every name the model has) to
``Point`` objects; ``in_forward_order`` sorts them as the model computes them, so that nnsight, which reads a
pass's values in that order, reads them whatever order they were given in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..core import norms
from ..spec import attention
from ..spec.catalog import (
    ATTENTION_INTERNALS,
    BY_NAME,
    TRANSFORMERLENS_BRIDGE_ALIASES,
    TRANSFORMERLENS_COMPUTED,
    TRANSFORMERLENS_MODEL_HOOKS,
    TRANSFORMERLENS_NAMES,
    TRANSFORMERLENS_NORMS,
    transformerlens_tail,
)
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.locations import At, Unavailable, envoy_at


class HookError(NNterpError, ValueError):
    """A TransformerLens hook name or hook that nnterp cannot serve as asked."""


# -- names -----------------------------------------------------------------------------------------------------


BLOCK_HOOKS: tuple[str, ...] = tuple(dict.fromkeys([*map(transformerlens_tail, TRANSFORMERLENS_NAMES),
                                                    *TRANSFORMERLENS_COMPUTED]))
MODEL_HOOKS = TRANSFORMERLENS_MODEL_HOOKS

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


# the points a door serves itself, by their name in a block (TransformerLens's split attention inputs: registered by
# nnterp.compat.transformer_lens.split_inputs when it is imported), so that these tools import no door
DOOR_POINTS: dict[str, Callable] = {}


def split_name(name: str) -> tuple[int | None, str]:
    """``"blocks.5.attn.hook_z"`` -> ``(5, "attn.hook_z")``; ``"hook_embed"`` -> ``(None, "hook_embed")``."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if match is not None:
        return int(match.group(1)), match.group(2)
    return None, name


BRIDGE_ALIASES = TRANSFORMERLENS_BRIDGE_ALIASES


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
    if tail in DOOR_POINTS:  # TransformerLens's per-head copies of the stream: its door's
        return DOOR_POINTS[tail](model, name, layer, tail)
    if tail in ("hook_q_input", "hook_k_input", "hook_v_input"):
        raise _unavailable(model, name, "TransformerLens's split attention inputs are served by nnterp.HookedTransformer "
                                        "after model.set_use_split_qkv_input(True)")
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

def norm_form(module: nn.Module, what: str) -> tuple[bool, float]:
    """``(centred, eps)`` of a LayerNorm or an RMSNorm module (``nnterp.core.norms``); a clear error for another kind
    of norm."""
    if norms.norm_kind(module) is None:
        raise HookError(f"{what}: the norm is a {type(module).__name__}, not a LayerNorm or an RMSNorm, so its scale is "
                        "not TransformerLens's hook_scale.")
    try:
        return norms.norm_form(module)
    except ValueError as error:
        raise HookError(f"{what}: {error}.") from None


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
        value = TRANSFORMERLENS_NORMS[which]
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


__all__ = ["BLOCK_HOOKS", "MODEL_HOOKS", "ComputedPoint", "HookError", "NativePoint", "Point", "ScoresPoint",
           "StandardPoint", "get_act_name", "has_rotary", "hook_names", "in_forward_order", "is_hook_name", "norm_form",
           "point", "points", "position_table", "scale_and_normalized", "split_name", "standard_point"]
