"""Running a pass into a cache: ``logits, cache = model.run_with_cache(prompts)``.

The values are read with the engine's ``read_value`` in forward order, inside one trace, so ``remote=True`` runs it
on the remote model; with TransformerLens's arguments (``names_filter``, ``stop_at_layer``, hooks) the hook points
are read instead (``_run_hooked``). The cache also holds what the analyses need (``nnterp.analysis``): the
identity's extra terms of each block and the final norm's input and output, from which the norms' scales of the pass
are read. The cache object is ``nnterp.tools.cache.ActivationCache`` (also importable from here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import nnsight
import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.modeling.transformers import TransformersModel  # its generate: nnsight's tracer on any subclass

from .. import analysis
from ..spec.catalog import BY_NAME
from ..spec.errors import ValueUnavailable
from ..spec.locations import At
from ..spec.selection import forward_order, layer_indices, value_name
from . import hook_passes, hook_points
from .cache import ROUTING, ActivationCache
from .hook_points import StandardPoint
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
from .refusals import own_tool, refuse_unsupported
from .steering import apply_steering, check_new_tokens, prepare_steering, refuse_right_padding, steering_plan


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
    own = own_tool(model, "run_with_cache")
    if own is not None:  # the model runs it its own way (each prompt its own request on vLLM)
        return own(prompts, names, layers, remote, names_filter=names_filter, remove_batch_dim=remove_batch_dim,
                   stop_at_layer=stop_at_layer, return_type=return_type, prepend_bos=prepend_bos,
                   padding_side=padding_side, max_new_tokens=max_new_tokens, steer=steer, **generate_kwargs)
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
    output) just before the first read at or after ``mlp_output_before_norm``, which holds their output, or at the output of a
    module that holds the experts (LongCat-Flash's shortcut, read before the block's later pairs); as they are
    elsewhere."""
    try:
        path, _, locations = analysis.experts_of(model, layer, "run_with_cache")
    except analysis.AnalysisUnavailable:  # a dense block, or experts whose place is not known: nothing to read
        return events
    later = ("mlp_output_before_norm", "mlp_output", "layer_output")

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
    stop = None if stop_at_layer is None else hook_passes.stop_block(model, stop_at_layer)
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
    chosen = [point for point in chosen if hook_passes.before_stop(point, stop)]
    standard = [point for point in standard if hook_passes.before_stop(point, stop)]
    plan = hook_passes.Plan()
    for point in [*chosen, *standard]:
        plan.add(point, keep=True)
    for point, fn in hook_passes.hooked_points(model, context_hooks):
        if hook_passes.before_stop(point, stop):  # TransformerLens never calls the hooks past the stop
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
    with hook_passes.attention_for(model, plan.needs_attention), torch.no_grad(), model.trace(inputs):
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


__all__ = ["ActivationCache", "run_with_cache"]
