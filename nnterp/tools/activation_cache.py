"""Many standard values of one forward pass, kept in memory: ``logits, cache = model.run_with_cache(prompts)``.

``cache["layer_output", 5]`` is one block's value, ``cache["layer_output"]`` the value of every
cached block stacked ``[layers, ...]``. The values are read with the engine's ``read_value`` in
forward order, inside one trace, so ``remote=True`` runs it on the remote model. The cache also
holds what the analyses need (``nnterp.analysis``): the identity's extra terms of each block and the
final norm's input and output, from which the norms' scales of the pass are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import nnsight
import numpy as np
import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.modeling.transformers import TransformersModel  # its generate: nnsight's tracer on any subclass

from .. import analysis
from ..spec.catalog import BY_NAME
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.locations import At
from ..spec.selection import forward_order, layer_indices, layer_ranges, value_name
from . import hook_points
from .cache_methods import CacheMethods
from .hook_points import StandardPoint, get_act_name, is_hook_name, split_name
from .pass_arguments import (  # noqa: F401 - imported from here by the TransformerLens methods
    FOREIGN_ARGUMENTS,
    RETURN_TYPES,
    _batch,
    _inputs,
    _one_prompt,
    _refuse_foreign_arguments,
    _returned,
    lm_loss,
)
from .refusals import refuse_unsupported
from .steering import apply_steering, check_new_tokens, prepare_steering, refuse_right_padding, steering_plan


class ActivationCache(CacheMethods):
    """The values of one forward pass, by ``(name, layer)``.

    ``cache[name, layer]``: one block's value (a negative layer counts from the model's end).
    ``cache[name]``: every cached block's value stacked on a new first dimension, ``[layers, ...]``,
    in the order of ``cache.layers``. A name may be ``"mlp_output"`` or ``"mlp.mlp_output"``.
    A value that has no meaning on the block raises the model's ``ValueUnavailable``, with its reason.

    Beside the values: ``cache["ln_final_input"]`` and ``cache["ln_final_output"]``, the final norm's input (the
    stream it reads) and output; ``cache["ln_final_scale"]``, ``cache["attention_norm_scale", i]`` and
    ``cache["mlp_norm_scale", i]``, the scale ``[batch, seq, 1]`` each norm divided by in the pass
    (TransformerLens's ``hook_scale``); ``cache["extra.<name>", i]``, a term of block i's identity that is no
    standard value (Falcon-H1's ``mamba``). On a routed mixture of experts (with names=None, on a forward pass):
    ``cache["expert_indices", i]`` and ``cache["expert_weights", i]`` ``[batch, seq, k]``, the experts the router
    chose for each token and its weights for them, as the experts apply them (TransformerLens's
    ``hook_expert_indices`` / ``hook_expert_weights``), ``cache["expert_input", i]`` and ``cache["expert_output", i]``,
    what the experts read and gave. ``cache["pattern", i]`` is ``attention_probabilities`` (TransformerLens's
    ``hook_pattern``), served with the attention values on (``attention_values=True``). The analysis methods are
    TransformerLens's (``nnterp.analysis``).
    """

    def __init__(self, values: dict[tuple[str, int], torch.Tensor], names: list[str], layers: list[int],
                 unavailable: dict[tuple[str, int], ValueUnavailable], num_layers: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor, model=None,
                 readout: dict[str, torch.Tensor] | None = None, prompt_length: int | None = None,
                 steered: tuple[str, ...] = (), hooks: dict[str, torch.Tensor] | None = None,
                 hook_names: list[str] | None = None, batch_removed: bool = False):
        self._values, self._unavailable = values, unavailable
        # a cache made with names_filter: TransformerLens's names it holds, in forward order, and the tensors of those
        # that are no standard value (read at a native module or computed in the pass)
        self._hooks, self.hook_names = hooks or {}, hook_names
        self.batch_removed = batch_removed  # remove_batch_dim=True: every tensor is given without its batch dimension
        self.names, self.layers, self.num_layers = names, layers, num_layers
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.model, self._readout = model, readout or {}
        # a generation's cache: the prompt's columns, then one per step after the first (run_with_cache)
        self.prompt_length = input_ids.shape[1] if prompt_length is None else prompt_length
        self.steered = steered  # where the pass was steered (run_with_cache(steer=...)): "layers[5].layer_output"

    @property
    def steps(self) -> int:
        """The forward passes the values come from: 1, or a generation's steps (step 0 the prompt)."""
        return self.input_ids.shape[1] - self.prompt_length + 1

    def step_positions(self, step: int) -> slice:
        """The positions (along seq) that generation step ``step`` ran: the prompt's for step 0, one after."""
        if isinstance(step, bool) or not isinstance(step, int) or not -self.steps <= step < self.steps:
            raise IndexError(f"Step {step!r} is not in this cache, which holds {self.steps} step(s), 0 the prompt.")
        step %= self.steps
        return slice(0, self.prompt_length) if step == 0 else slice(self.prompt_length + step - 1,
                                                                    self.prompt_length + step)

    def __getitem__(self, key) -> torch.Tensor:
        name, layer, layer_type = key if isinstance(key, tuple) and len(key) == 3 else (
            *(key if isinstance(key, tuple) and len(key) == 2 else (key, None)), None)
        if not isinstance(name, str):
            raise TypeError(f"Index a cache with a value name, or (name, layer): cache['layer_output', 5], not {key!r}.")
        layer = _as_layer(layer)
        if layer_type is not None or not _is_standard(name):  # TransformerLens's names: cache["resid_post", 5]
            if isinstance(layer, int) and not isinstance(layer, bool) and -self.num_layers <= layer < 0:
                layer %= self.num_layers  # cache["resid_post", -1]: the last block's
            full = get_act_name(name, layer, layer_type) if layer is not None or layer_type else get_act_name(name)
            if is_hook_name(full):
                return self._without_batch(self._hook(full), stacked=False)
        return self._without_batch(self._standard(name, layer), stacked=layer is None and (
            name.rpartition(".")[2] in BY_NAME or name.startswith("extra.") or name in SCALES))

    def _without_batch(self, tensor: torch.Tensor, stacked: bool) -> torch.Tensor:
        if not self.batch_removed:
            return tensor
        return tensor[:, 0] if stacked else tensor[0]

    def _hook(self, name: str) -> torch.Tensor:
        """The tensor of TransformerLens's hook ``name`` (``"blocks.5.hook_resid_post"``): the standard value it is,
        one read in the pass (a cache made with ``names_filter``), or one computed from the cached values (a norm's
        scale and normalized input, each head's result)."""
        if name in self._hooks:
            return self._hooks[name]
        layer, tail = split_name(name)
        if layer is not None:
            layer = self._layer(layer)
        point = hook_points.point(self.model, name)  # a name the family has no value for says why
        if isinstance(point, StandardPoint):
            return self._standard(point.value, layer)
        if isinstance(point, hook_points.ScoresPoint):  # TransformerLens's masked entries: -inf
            return point.masked(self._standard("attention_scores", layer))
        which = tail.partition(".")[0]
        try:
            if tail.endswith("hook_scale"):
                norm = analysis.frozen_norm(self, layer, mlp_input=which == "ln2")
                return norm.scale.to(self._stream_for(which, layer).dtype)
            if tail.endswith("hook_normalized"):
                norm, x = analysis.frozen_norm(self, layer, mlp_input=which == "ln2"), self._stream_for(which, layer)
                centred = x.float() - x.float().mean(-1, keepdim=True) if norm.centred else x.float()
                return (centred / norm.scale).to(x.dtype)
            if tail == "attn.hook_result":
                return analysis.stacks.head_results(self, layer).movedim(0, 2).to(self["attention_premix", layer].dtype)
        except KeyError as error:
            raise KeyError(f"{name} is computed from values this cache does not hold ({error}): run_with_cache(..., "
                           f"names_filter=[{name!r}]) reads it.") from None
        raise KeyError(f"{name} is not in this cache: it is read in the pass at a module no standard value names; "
                       f"run_with_cache(..., names_filter=[{name!r}]) reads it.")

    def _stream_for(self, which: str, layer: int | None) -> torch.Tensor:
        """The stream a norm reads: the final norm's input, or block ``layer``'s stream before its attention (ln1) or
        MLP (ln2) norm."""
        if which == "ln_final":
            return self["ln_final_input"]
        if which == "ln2" and isinstance(self.model.block_spec(layer).resolve("layer_mid"), At):
            return self["layer_mid", layer]
        return self["layer_input", layer]

    def _standard(self, name: str, layer) -> torch.Tensor:
        if name in READOUT or name in SCALES or name.startswith("extra."):
            return self._beside(name, layer)
        if name in analysis.ROUTING:
            return self._routing(name, layer)
        name = value_name(ALIASES.get(name, name))
        if name not in self.names and not any(key[0] == name for key in self._unavailable):
            raise KeyError(f"{name!r} was not cached: this cache holds {', '.join(self.names)}. Pass it in "
                           "run_with_cache(..., names=[...]), or names=None for every available value.")
        if layer is None:
            return self._stacked(name)
        return self._one(name, self._layer(layer))

    def _beside(self, name: str, layer) -> torch.Tensor:
        """The entries beside the values: the final norm's input, output and scale, the block norms' scales, and
        the identity's extra terms."""
        if name in READOUT:
            if layer is not None:
                raise TypeError(f"{name!r} is the model's, not a block's: cache[{name!r}].")
            if name == "ln_final_scale":
                norm = analysis.frozen_norm(self, None)
                if norm is None:
                    raise KeyError(f"{self.model.family.name} has no final norm: its head reads the last block's output.")
                return norm.scale
            if name not in self._readout:
                raise KeyError(f"{name!r} is not in this cache: the model has no final norm, or the cache was not made "
                               "by run_with_cache.")
            return self._readout[name]
        if layer is None:
            return torch.stack([self._beside(name, i) for i in self.layers])
        layer = self._layer(layer)
        if name in SCALES:
            return analysis.frozen_norm(self, layer, mlp_input=name == "mlp_norm_scale").scale
        if (name, layer) not in self._values:
            extras = [f"extra.{term}" for term in self.model.block_spec(layer).extra]
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: block {layer}'s identity has "
                           f"{', '.join(extras) or 'no extra terms'}, which run_with_cache caches with names=None.")
        return self._values[(name, layer)]

    def _routing(self, name: str, layer) -> torch.Tensor:
        """What a routed block's experts received and gave (``analysis.ROUTING``), ``[batch, seq, ...]``: the router's
        choice as the experts apply it, read at their input."""
        if layer is None:
            return torch.stack([self._routing(name, i) for i in self.layers])
        layer = self._layer(layer)
        if (name, layer) not in self._values:
            analysis.experts_of(self.model, layer, f"cache[{name!r}, {layer}]")  # the reason, where there are none
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: run_with_cache caches what a routed "
                           "block's experts receive with names=None, on a forward pass (not over a generation).")
        flat = self._values[(name, layer)]  # the experts read the tokens flattened, [batch * seq, ...]
        batch, seq = self.input_ids.shape
        if flat.shape[0] != batch * seq:
            raise ValueError(f"{name!r} of layer {layer} holds {flat.shape[0]} tokens, not the pass's {batch} x {seq}.")
        return flat.view(batch, seq, *flat.shape[1:])

    def _layer(self, layer) -> int:
        layer = _as_layer(layer)
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"The layer of cache[name, layer] is an int, not {layer!r}.")
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers.")
        layer %= self.num_layers
        if layer not in self.layers:
            raise KeyError(f"Layer {layer} was not cached: this cache holds layers {layer_ranges(sorted(self.layers))}.")
        return layer

    def _one(self, name: str, layer: int) -> torch.Tensor:
        if (name, layer) in self._unavailable:
            error = self._unavailable[(name, layer)]
            raise ValueUnavailable(error.key, error.family, error.reason)
        return self._values[(name, layer)]

    def _stacked(self, name: str) -> torch.Tensor:
        missing = [layer for layer in self.layers if (name, layer) in self._unavailable]
        if missing:
            error = self._unavailable[(name, missing[0])]
            partly = len(missing) < len(self.layers)
            raise ValueUnavailable(error.key, error.family, error.reason + (
                f" (at layers {layer_ranges(sorted(missing))}: read the layers that have it one at a time, "
                f"cache[{name!r}, layer])" if partly else ""))
        tensors = [self._values[(name, layer)] for layer in self.layers]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"{name!r} has different shapes across the cached layers ({sorted(shapes)}), so it "
                             f"cannot be stacked: read one layer at a time, cache[{name!r}, layer].")
        return torch.stack([t.to(tensors[0].device) for t in tensors])

    # -- TransformerLens's analyses (nnterp.analysis) ------------------------------------------------

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The stream as each block receives it, then as the final norm reads it (``nnterp.analysis``)."""
        return analysis.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """The stream at ``layer`` as what each block added to it, summing to it exactly (``nnterp.analysis``)."""
        return analysis.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)

    def recompose_resid(self, residual_stack: torch.Tensor, layer: int | None = None,
                        mlp_input: bool = False) -> torch.Tensor:
        """The rows of ``decompose_resid(layer, mlp_input)`` added in the family's order: the stream, bit for bit."""
        return analysis.recompose(self, residual_stack, layer, mlp_input)

    def stack_head_results(self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Every attention head's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def stack_neuron_results(self, layer: int | None, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False):
        """Every MLP neuron's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_neuron_results(self, layer, pos_slice, neuron_slice, return_labels, incl_remainder,
                                             apply_ln)

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                          incl_bias: bool = False, labels=None):
        """A stack through a norm frozen at its scale of the pass, as many rows; its bias one more with ``incl_bias``
        (``nnterp.analysis``)."""
        return analysis.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                          has_batch_dim, recompute_ln, incl_bias, labels)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True, incl_bias: bool = False, labels=None,
                    before_logits_transform: bool = False):
        """Direct logit attribution, one value per row; the biases' term as rows of its own with ``incl_bias``
        (``nnterp.analysis``)."""
        return analysis.logit_attrs(self, residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice,
                                    has_batch_dim, incl_bias, labels, before_logits_transform)

    def keys(self) -> list:
        """The ``(name, layer)`` pairs that hold a value, by layer, then in the catalog's order; for a cache made
        with ``names_filter``, TransformerLens's names it holds, in forward order."""
        if self.hook_names is not None:
            return list(self.hook_names)
        return [(name, layer) for layer in self.layers for name in self.names if (name, layer) in self._values]

    def __contains__(self, key) -> bool:
        """Whether ``cache[key]`` gives a tensor: a ``(name, layer)`` pair or TransformerLens's name it holds."""
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and _is_standard(key[0]):
            try:
                return (value_name(key[0]), self._layer(key[1])) in self._values
            except (ValueError, TypeError, IndexError, KeyError):
                return False
        if self.hook_names is not None and isinstance(key, str):
            return key in self.hook_names
        try:
            self[key]
        except (KeyError, ValueError, TypeError, IndexError, AttributeError, NNterpError):
            return False
        return True

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        batch, seq = self.input_ids.shape
        generated = f", over {self.steps} generation steps ({seq} positions)" if self.steps > 1 else ""
        return (f"ActivationCache({len(self)} tensors: {', '.join(self.names)} at layers "
                f"{layer_ranges(sorted(self.layers))}; {batch} prompt(s) of {self.prompt_length} tokens{generated})")


def run_with_cache(model, prompts: str | Sequence[str] | torch.Tensor, names: str | Iterable[str] | None = None,
                   layers: int | Iterable[int] | None = None, remote: bool | str = False, *,
                   names_filter=None, remove_batch_dim: bool = False, stop_at_layer: int | None = None,
                   return_type: str | None = "logits", prepend_bos: bool | None = None,
                   padding_side: str | None = None, max_new_tokens: int | None = None, steer=None, **generate_kwargs
                   ) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass: ``(logits, cache)`` with the standard values ``names`` of blocks ``layers``.

    ``prompts``: a string, a list of strings (padded as the model's traces pad them; the cache's
    ``attention_mask`` marks the real tokens) or token ids ``[batch, seq]``. ``names=None`` caches
    every value each block has (the attention internals while they are on,
    ``model.enable_attention_values()``) and the extra terms of each block's identity; a value named
    explicitly that a block lacks raises the model's ``ValueUnavailable`` before anything runs. The final
    norm's input and output are cached too. Runs without gradients.

    ``max_new_tokens=N`` generates instead (greedy unless ``generate_kwargs`` say otherwise, exactly ``N``
    steps: ``min_new_tokens`` is set to ``N``) and returns ``(ids, cache)``: the token ids ``[batch, prompt + N]``,
    prompt included, and the values over the sequence the model ran, ``[batch, prompt + N - 1, ...]``: the
    prompt's positions from step 0, then the one new position of each later step (the last token generated is
    never run). ``cache.input_ids`` is that sequence; ``cache.step_positions(k)`` the positions step ``k`` ran.
    A batch generates left-padded (a right-padded one is refused). The values inside the attention (queries to
    probabilities) are not cached over generation: a step's keys and values span the earlier steps' positions too.

    ``steer``: steering vectors added in the same pass, a dict of ``steered_generate``'s steering arguments
    (``{"layers": 5, "vector": v, "factor": 4.0, "scope": "generated"}``) or a list of them. A steered value is
    cached as steered (what the rest of the model reads); a value read before it, as it was.

    TransformerLens's arguments: ``names_filter`` (a hook name, a list of them, or a predicate over hook names:
    ``lambda name: name.endswith("hook_z")``) caches those hook points instead, under their names
    (``cache["blocks.0.attn.hook_z"]``, ``cache["z", 0]``; ``cache.keys()`` lists them), with ``names`` standard
    values beside them if given; the attention values are turned on for the call where a name needs them.
    ``stop_at_layer=k`` caches only what comes before block ``k`` and returns the stream entering it instead of
    the logits (the pass still runs to its end). ``return_type``: ``"logits"``, ``"loss"`` (the mean next-token
    loss over the real tokens), ``"both"`` (``(logits, loss)``) or None. ``remove_batch_dim=True``: one prompt, every
    tensor of the cache given without its batch dimension (the returned logits keep it, as TransformerLens's do). ``prepend_bos``: strings tokenized with (True) or without (False) a
    BOS token first (``model.to_tokens``); None, as the model's tokenizer does (``model.cfg.default_prepend_bos``);
    ``padding_side`` pads a batch of strings on that side (None: the tokenizer's).
    Hooks of ``with model.hooks(...)`` apply to the pass, and the cache holds the values they leave.
    """
    refuse_unsupported(model, "run_with_cache")
    _refuse_foreign_arguments(generate_kwargs, max_new_tokens is not None)
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type is one of {', '.join(map(repr, RETURN_TYPES))}, not {return_type!r}.")
    context_hooks = list(getattr(model, "_nnterp_context_hooks", ()))
    hooked = (names_filter is not None or stop_at_layer is not None or context_hooks
              or (getattr(model, "_nnterp_hook_cache", False) and max_new_tokens is None))
    if max_new_tokens is not None and (hooked or return_type != "logits" or remove_batch_dim):
        raise TypeError("run_with_cache(..., max_new_tokens=N) generates: names_filter, stop_at_layer, return_type, "
                        "remove_batch_dim and the hooks of model.hooks(...) apply to a forward pass only.")
    if hooked:
        if remote or steer is not None:
            raise TypeError("names_filter, stop_at_layer and model.hooks(...) run the pass here, with TransformerLens's "
                            "hook points: leave out remote= and steer= (or cache standard values with names=).")
        return _run_hooked(model, prompts, names, layers, names_filter, context_hooks, stop_at_layer, return_type,
                           prepend_bos, padding_side, remove_batch_dim)
    logits, cache = _run_with_cache(model, prompts, names, layers, remote, max_new_tokens=max_new_tokens, steer=steer,
                                    prepend_bos=prepend_bos, padding_side=padding_side, **generate_kwargs)
    if remove_batch_dim:
        _one_prompt(cache.input_ids)
        cache.batch_removed = True
    if max_new_tokens is not None:
        return logits, cache
    return _returned(model, logits, cache.input_ids, cache.attention_mask, return_type), cache


def _run_with_cache(model, prompts, names, layers, remote, *, max_new_tokens, steer, prepend_bos, padding_side,
                    **generate_kwargs):
    explicit = names is not None
    names = list(BY_NAME) if names is None else [value_name(n) for n in ([names] if isinstance(names, str) else names)]
    names = [name for name in BY_NAME if name in names]  # the catalog's order, each once
    layers = layer_indices(model, layers)
    generating = max_new_tokens is not None
    if generating:
        check_new_tokens(max_new_tokens, "run_with_cache")
    elif generate_kwargs:
        raise TypeError(f"run_with_cache got {', '.join(sorted(generate_kwargs))}: generation settings, and it "
                        "generates only with max_new_tokens=N.")
    inputs = _inputs(model, prompts, prepend_bos, padding_side)
    if generating:
        refuse_right_padding(model, inputs, "run_with_cache(..., max_new_tokens=...)")
    steering = steering_plan(model, steer, max_new_tokens)
    plan, unavailable = {}, {}
    for layer in forward_order(layers):
        here = []
        for name in names:
            try:
                model.location(layer, name)
                if generating and name in OVER_CACHED_POSITIONS:
                    raise ValueUnavailable(BY_NAME[name].key, model.family.name, NOT_OVER_GENERATION)
            except ValueUnavailable as error:
                if explicit:
                    error.add_note(f"run_with_cache was asked for it at layer {layer}: leave it out, choose layers "
                                   "that have it, or pass names=None to cache what each layer has.")
                    raise
                unavailable[(name, layer)] = error
                continue
            here.append(name)
        keys = {BY_NAME[name].key: name for name in here}
        # forward order; the identity's extra terms too when every value is cached
        plan[layer] = [(keys.get(key, key), location) for _, key, location in model.timeline(layer)
                       if key in keys or (not explicit and key.startswith("extra."))]
    passes = _with_steering(model, plan, steering)
    steered = tuple(dict.fromkeys(f"layers[{at}].{name}" for at, name in steering))
    if not (explicit or generating):
        passes = {layer: _with_routing(model, layer, events) for layer, events in passes.items()}
    final_norm = model.family.ln_final is not None
    if not generating:
        with torch.no_grad(), model.trace(inputs, remote=remote):
            prepare_steering(model, steering, 0)
            values, readout = _read_pass(model, passes, 0, final_norm, bool(steering))
            values, readout = nnsight.save(values), nnsight.save(readout)
            logits = nnsight.save(model.logits.detach())
        names = [name for name in names if any((name, layer) in values for layer in layers)]  # those it holds
        return logits, ActivationCache(values, names, list(dict.fromkeys(layers)), unavailable, model.num_layers,
                                       inputs["input_ids"], inputs["attention_mask"], model, readout,
                                       steered=steered)
    generate_kwargs.setdefault("do_sample", False)  # greedy: reproducible, and the RNG is left as it was
    generate_kwargs["min_new_tokens"] = max_new_tokens  # every step is reached
    with torch.no_grad(), TransformersModel.generate(model, inputs, max_new_tokens=max_new_tokens, remote=remote,
                                         **generate_kwargs) as tracer:
        steps = nnsight.save([])
        for step in tracer.iter[0:max_new_tokens]:
            prepare_steering(model, steering, step)
            steps.append(_read_pass(model, passes, step, final_norm, bool(steering)))
        ids = nnsight.save(tracer.result)
    ids = ids.cpu()
    prompt = inputs["input_ids"].shape[1]
    values = {key: _over_steps([values[key] for values, _ in steps], key, prompt) for key in steps[0][0]}
    readout = {key: _over_steps([readout[key] for _, readout in steps], key, prompt) for key in steps[0][1]}
    ran = ids[:, :-1]  # the last token generated is never run
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(ran[:, prompt:])], dim=1)
    names = [name for name in names if any((name, layer) in values for layer in layers)]
    return ids, ActivationCache(values, names, list(dict.fromkeys(layers)), unavailable, model.num_layers, ran, mask,
                                model, readout, prompt_length=prompt, steered=steered)


# the attention values that span the positions of earlier steps (its KV cache) in a generation step
OVER_CACHED_POSITIONS = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
NOT_OVER_GENERATION = ("run_with_cache(..., max_new_tokens=...) does not cache it: in a generation step the attention "
                       "reads the keys and values of earlier steps from its cache, so its internals span another "
                       "number of positions at each step. Read them step by step in a model.generate trace with "
                       "tracer.iter")


def _with_steering(model, plan: dict, steering: dict) -> dict[int, list[tuple[str, object]]]:
    """Each block's reads in forward order with its steering placed just before the read of the value it steers:
    ``{layer: [(name, location) | ("steer", (name, steerings))]}``, the steered blocks included."""
    if not steering:
        return plan
    passes = {}
    for layer in forward_order([*plan, *(layer for layer, _ in steering)]):
        reads = {name: location for name, location in plan.get(layer, [])}
        steered = {BY_NAME[name].key: (name, steerings) for (at, name), steerings in steering.items() if at == layer}
        events = []
        for _, key, _ in model.timeline(layer):
            if key in steered:
                events.append(("steer", steered[key]))
            name = key if key.startswith("extra.") else key.rpartition(".")[2]
            if name in reads:
                events.append((name, reads[name]))
        passes[layer] = events
    return passes


def _with_routing(model, layer: int, events: list) -> list:
    """A routed block's reads with what its experts receive and give (``analysis.ROUTING``, read at their input and
    output) just before the first read at or after ``mlp_output``, which holds their output, or at the output of a
    module that holds the experts (LongCat-Flash's shortcut, read before the block's later pairs); as they are
    elsewhere."""
    try:
        path, _, locations = analysis.experts_of(model, layer, "run_with_cache")
    except analysis.AnalysisUnavailable:  # a dense block, or experts whose place is not known: nothing to read
        return events
    later = ("mlp_output", "layer_output")

    def after_the_experts(name, where) -> bool:
        holds_them = isinstance(where, At) and where.side == "output" and f"{path}.".startswith(f"{where.path}.")
        return name in later or (name == "steer" and where[0] in later) or holds_them

    at = next((k for k, (name, where) in enumerate(events) if after_the_experts(name, where)), len(events))
    return [*events[:at], *locations.items(), *events[at:]]


def _read_pass(model, passes: dict, step: int, final_norm: bool, copy: bool
               ) -> tuple[dict[tuple[str, int], torch.Tensor], dict[str, torch.Tensor]]:
    """Inside a trace, one forward pass: ``({(name, layer): value}, final norm's input and output)``, with the
    pass's steering applied on the way (``copy``: each value copied when read, as a later in-place add would
    change it)."""
    values = {}
    for layer, events in passes.items():
        for name, location in events:
            if name == "steer":
                apply_steering(model, layer, *location, step)
                continue
            value = (model.read_at(layer, location, name) if name.startswith("extra.") or name in ROUTING
                     else model.read_value(layer, name)).detach()  # detached: a server may run with autograd on
            values[(name, layer)] = value.clone() if copy else value
    return values, (_final_norm(model) if final_norm else {})


def _over_steps(tensors: list[torch.Tensor], key, prompt: int) -> torch.Tensor:
    """One value over a generation, ``[batch, prompt + steps - 1, ...]``: step 0's prompt positions, then each later
    step's one position."""
    for step, tensor in enumerate(tensors):
        if tensor.dim() < 2 or tensor.shape[1] != (prompt if step == 0 else 1):
            raise ValueError(f"{key!r} has shape {tuple(tensor.shape)} at generation step {step}, not [batch, "
                             f"{prompt if step == 0 else 1}, ...] (the positions the step ran), so it cannot be "
                             "joined over the generation: leave it out of names.")
    return torch.cat([t.to(tensors[0].device) for t in tensors], dim=1)


def _final_norm(model) -> dict[str, torch.Tensor]:
    """Inside a trace, after the blocks: the final norm's input and output, at its call after them (a model may norm
    its embeddings with the same module first: NanoChat)."""
    mediator = Mediator.current("run_with_cache's final norm")
    norm, pinned = model.ln_final, mediator.iteration
    mediator.iteration = mediator.occurrence(f"{norm.path}.input")  # its next call, whichever it is in the pass
    try:
        return {"ln_final_input": norm.input.detach(), "ln_final_output": norm.output.detach()}
    finally:
        mediator.iteration = pinned


def _run_hooked(model, prompts, names, layers, names_filter, context_hooks, stop_at_layer, return_type, prepend_bos,
                padding_side, remove_batch_dim):
    """The pass with TransformerLens's hook points: those ``names_filter`` chooses (and ``names``'s standard values),
    cached under their names; the hooks of ``model.hooks(...)`` called on theirs."""
    stop = None if stop_at_layer is None else hook_points.stop_block(model, stop_at_layer)
    every = names_filter is None and names is None  # every standard value (and on a HookedTransformer every hook)
    hook_cache = getattr(model, "_nnterp_hook_cache", False)
    if every:
        names = list(BY_NAME)
        if hook_cache:
            names_filter = lambda name: True  # noqa: E731 - TransformerLens's default: every hook point
    chosen = [] if names_filter is None else hook_points.points(model, names_filter, None if layers is None else
                                                                  layer_indices(model, layers))
    # the attention internals: with every value, where they are on (on a HookedTransformer, on for the call)
    standard = _standard_points(model, names, layers, explicit=not every, internals=hook_cache or not every)
    chosen = [point for point in chosen if hook_points.before_stop(point, stop)]
    standard = [point for point in standard if hook_points.before_stop(point, stop)]
    plan = hook_points.Plan()
    for point in [*chosen, *standard]:
        plan.add(point, keep=True)
    for point, fn in hook_points.hooked_points(model, context_hooks):
        if hook_points.before_stop(point, stop):  # TransformerLens never calls the hooks past the stop
            plan.add(point, fn)
    residual = None
    if stop is not None:  # the stream entering block `stop` (the last block's output after them)
        residual = (_standard_point(model, "layer_input", stop) if stop < model.num_layers
                    else _standard_point(model, "layer_output", model.num_layers - 1))
        plan.add(residual)
    inputs = _inputs(model, prompts, prepend_bos, padding_side)
    if remove_batch_dim:
        _one_prompt(inputs["input_ids"])
    if model.family.ln_final is not None and stop is None:  # what the analyses read: the final norm's input and output
        plan.add(_ReadoutPoint(model), keep=True)
    with hook_points.attention_for(model, plan.needs_attention), torch.no_grad(), model.trace(inputs):
        kept = nnsight.save(plan.run(model, inputs["input_ids"].shape[0]))
        if residual is not None:
            stream = nnsight.save(residual.read(model).detach())
        elif return_type is not None:
            logits = nnsight.save(model.logits.detach())
    readout = kept.pop(_ReadoutPoint.name, {})
    held = [point for point in plan.ordered() if point.name in kept]
    values = {(point.value, point.layer): kept[point.name] for point in held if isinstance(point, StandardPoint)}
    hooks = {point.name: kept[point.name] for point in held if not isinstance(point, StandardPoint)}
    cached_layers = sorted({layer for _, layer in values} | {p.layer for p in held if p.layer is not None})
    cache = ActivationCache(values, [name for name in BY_NAME if any(key[0] == name for key in values)],
                            cached_layers or list(range(model.num_layers)), {}, model.num_layers,
                            inputs["input_ids"], inputs["attention_mask"], model, readout, hooks=hooks,
                            hook_names=[point.name for point in held if point in chosen],
                            batch_removed=remove_batch_dim)
    if residual is not None:
        return stream, cache
    if return_type is None:
        return None, cache
    return _returned(model, logits, inputs["input_ids"], inputs["attention_mask"], return_type), cache


class _ReadoutPoint(hook_points.Point):
    """The final norm's input and output (``_final_norm``), read after the blocks, before the head."""

    name = "_nnterp_readout"

    def __init__(self, model):
        hook_points.Point.__init__(self, self.name, None, (model._event_index(model.family.lm_head, "input",
                                                                              "the head"), -1))

    def read(self, model):
        return _final_norm(model)


_standard_point = hook_points.standard_point


def _standard_points(model, names, layers, explicit: bool, internals: bool) -> list[StandardPoint]:
    """``names``'s standard values at ``layers`` as points: an explicit name a block lacks raises the reason, and
    every value (names given by the model's default) is taken where the block has it; ``internals``: the attention
    internals too where they are off (turned on for the call)."""
    if names is None:
        return []
    names = [value_name(n) for n in ([names] if isinstance(names, str) else names)]
    chosen = []
    for layer in forward_order(layer_indices(model, layers)):
        for name in names:
            try:
                model.location(layer, name)
            except ValueUnavailable:
                if internals and name in OVER_CACHED_POSITIONS:  # on for the call where the family has them
                    try:
                        chosen.append(_standard_point(model, name, layer))
                        continue
                    except ValueUnavailable:
                        pass
                if explicit:
                    raise
                continue
            chosen.append(_standard_point(model, name, layer))
    return chosen


READOUT = ("ln_final_input", "ln_final_output", "ln_final_scale")
ROUTING = analysis.ROUTING  # a plain tuple: the trace's code ships it, not the analysis module
# TransformerLens's names of a cache's entries that are standard values under other names
ALIASES = {"pattern": "attention_probabilities", "hook_pattern": "attention_probabilities",
           "attn.hook_pattern": "attention_probabilities"}
SCALES = ("attention_norm_scale", "mlp_norm_scale")


def _is_standard(name: str) -> bool:
    """Whether a cache key names a standard value or an entry beside them (else it is read as TransformerLens's)."""
    return (name in READOUT or name in SCALES or name in ALIASES or name in ROUTING or name.startswith("extra.")
            or name.rpartition(".")[2] in BY_NAME)


def _as_layer(layer):
    """A layer given as a NumPy integer or a 0-d integer tensor, as an int (anything else as it is)."""
    if isinstance(layer, np.integer):
        return int(layer)
    if isinstance(layer, torch.Tensor) and layer.dim() == 0 and not layer.is_floating_point() and (
            layer.dtype != torch.bool):
        return int(layer)
    return layer

__all__ = ["ActivationCache", "run_with_cache"]
