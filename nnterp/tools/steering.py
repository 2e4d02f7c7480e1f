"""Steering written once for every family: ``add_to`` inside a trace, ``steered_generate``, and the steering plan
that ``run_with_cache`` and ``collect`` apply in the same pass as their readout.

Everything here reads and writes standard values (``layer_output`` by default, any value of the catalog by name),
so it means the same thing on every family.
"""

from __future__ import annotations

from collections.abc import Mapping

import nnsight
import torch
from nnsight.modeling.transformers import TransformersModel  # its generate: nnsight's tracer on any subclass

from ..core import edits
from ..core.edits import Positions
from ..core.readout import pass_attention_mask
from ..spec.catalog import BY_NAME
from ..spec.fingerprint import tensor_digest
from ..spec.selection import forward_order, layer_indices, token_index, value_name
from .refusals import own_tool, refuse_unsupported


def add_to(model, layers, vector: torch.Tensor, value: str = "layer_output", factor: float = 1.0,
           positions: Positions = None, batch: Positions = None) -> None:
    """Inside a trace: add ``factor * vector`` in place to ``value`` at ``layers``, ``positions`` and ``batch`` rows.

    ``vector`` has the value's last dimension (``hidden_size`` for the stream and the contributions).
    ``positions`` are each prompt's own tokens (``0`` its first, ``-1`` its last, a list or a slice of
    them), whichever side the tokenizer pads, found through the batch's attention mask; a position
    beyond a prompt's tokens is an error. ``batch`` indexes the rows of the batch. ``None``: all.
    With ``positions``, the first ``add_to`` of a forward pass comes before the trace reads any value
    of the pass: it reads the mask from the model's inputs, which come first.
    """
    if positions is None:
        return edits.add_to(model, layers, vector, value, factor, None, batch)
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        raise TypeError("add_to's positions are token positions (ints or a slice), not a boolean mask.")
    mask = _attention_mask(model)
    groups = None
    for layer in forward_order(layer_indices(model, layers)):
        if groups is None:  # the same for every layer: each row's columns in this forward pass
            groups = _own_columns(mask, positions, batch, model.read_value(layer, value_name(value)).shape[1])
        for columns, rows in groups:
            edits.add_to(model, layer, vector, value, factor, columns, rows)


def _attention_mask(model) -> torch.Tensor | None:
    """Inside a trace: the batch's ``[batch, seq]`` attention mask (None: no padding), read once per forward pass
    (``readout.pass_attention_mask``), so a later ``add_to`` of the pass reuses it."""
    mask = pass_attention_mask(model, "add_to(..., positions=...)", "call add_to before reading any value of the pass")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"add_to(..., positions=...) needs the batch's [batch, seq] attention mask to find each "
                         f"prompt's own tokens; this trace's attention mask has shape {tuple(mask.shape)}.")
    return mask


def _own_columns(mask, positions, batch, seq: int) -> list[tuple[Positions, Positions]]:
    """``[(columns, rows)]``: the columns of the value (``seq`` long) holding each row's own tokens ``positions``,
    rows with the same columns together. A generation step with a cache holds the mask's last ``seq`` columns."""
    if mask is None:  # no padding: the value's columns are the prompts' own positions
        return [(positions, batch)]
    mask = mask.detach().bool().cpu()
    rows = torch.arange(mask.shape[0])[slice(None) if batch is None else batch].reshape(-1)
    selected = mask[rows]
    if isinstance(positions, slice):  # each row's own tokens in the slice
        columns = [own.nonzero().flatten()[positions].tolist() for own in selected]
    else:
        try:
            wanted = [token_index(selected, int(p)) for p in torch.as_tensor(positions).reshape(-1).tolist()]
        except IndexError as error:  # token_index counts the selected rows
            raise IndexError(str(error) if batch is None else f"{str(error)[:-1]}, counting the prompts among the rows "
                             f"batch={batch} selects.") from None
        columns = torch.stack(wanted, dim=1).tolist()
    offset = mask.shape[1] - seq
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, own in zip(rows.tolist(), columns):
        if own and min(own) < offset:
            raise IndexError(f"Position {positions} of prompt {row} is not in this forward pass, which runs only the "
                             f"last {seq} of its {mask.shape[1]} tokens (a generation step with a cache).")
        if own:
            groups.setdefault(tuple(c - offset for c in own), []).append(row)
    if batch is None and len(groups) == 1 and len(next(iter(groups.values()))) == mask.shape[0]:
        return [(list(next(iter(groups))), None)]  # every row alike (no padding): one edit of the whole batch
    return [(list(columns), rows) for columns, rows in groups.items()]


def steered_generate(model, prompts, layers, vector: torch.Tensor, *, value: str = "layer_output",
                     factor: float = 1.0, scope: str | range = "all", positions: Positions = None,
                     batch: Positions = None, max_new_tokens: int = 20, remote: bool | str = False,
                     **generate_kwargs) -> torch.Tensor:
    """Generate with a steering vector added during an explicit ``scope`` of the generation.

    ``scope`` is ``"prompt"`` (the forward pass over the prompt only), ``"generated"`` (every
    generated step, not the prompt), ``"all"`` (both), or a ``range`` of step numbers (step 0
    is the prompt, step k the k-th generated token). ``positions`` apply to the prompt step, as
    each prompt's own tokens (``add_to``'s); a generated step steers its one new position. A
    right-padded batch is refused: its shorter prompts would continue after their padding. The
    generation runs exactly ``max_new_tokens`` steps (``min_new_tokens`` is set to it) so that
    every scope is reached.
    The arguments after ``prompts`` are ``add_to``'s: ``layers``, ``vector``, then by name
    ``value``, ``factor``, ``positions``, ``batch``. Returns the token ids, prompt included.
    """
    refuse_unsupported(model, "steered_generate")
    own = own_tool(model, "steered_generate")
    if own is not None:
        return own(prompts, layers, vector, value=value, factor=factor, scope=scope, positions=positions,
                   batch=batch, max_new_tokens=max_new_tokens, remote=remote, **generate_kwargs)
    if isinstance(layers, torch.Tensor) and layers.is_floating_point() and not isinstance(vector, torch.Tensor):
        raise TypeError("steered_generate(model, prompts, layers, vector, ...): the layers come before the vector, "
                        "as in add_to(model, layers, vector); the call passed the vector first.")
    check_new_tokens(max_new_tokens, "steered_generate")
    plan = steering_plan(model, {"layers": layers, "vector": vector, "value": value, "factor": factor, "scope": scope,
                                 "positions": positions, "batch": batch}, max_new_tokens)
    refuse_right_padding(model, prompts, "steered_generate")
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs["min_new_tokens"] = max_new_tokens
    with torch.no_grad(), TransformersModel.generate(model, prompts, max_new_tokens=max_new_tokens, remote=remote,
                                         **generate_kwargs) as tracer:
        for step in tracer.iter[0:max_new_tokens]:
            for (layer, name), steerings in plan.items():  # in forward order
                apply_steering(model, layer, name, steerings, step)
        ids = nnsight.save(tracer.result)
    return ids


# -- steering in the same pass as a readout (run_with_cache, collect) ------------------------------

STEERING_KEYS = ("layers", "vector", "value", "factor", "scope", "positions", "batch")


def steering_plan(model, steer, max_new_tokens: int | None) -> dict[tuple[int, str], list[tuple]]:
    """``steer=`` of ``run_with_cache`` and ``collect``, checked before anything runs.

    ``steer`` is one steering, a dict of ``steered_generate``'s steering arguments (``layers`` and ``vector``,
    and optionally ``value``, ``factor``, ``scope``, ``positions``, ``batch``), or a list of them. Returns
    ``{(layer, value): [(steps, vector, factor, positions, batch)]}`` in forward order: the steps (0 the prompt;
    ``{0}`` without generation, ``max_new_tokens=None``) at which each vector is added to the value.
    """
    if steer is None:
        return {}
    steerings = [steer] if isinstance(steer, Mapping) else list(steer)
    plan: dict[tuple[int, str], list[tuple]] = {}
    for steering in steerings:
        if not isinstance(steering, Mapping):
            raise TypeError(f"steer is a dict of steering arguments, e.g. {{'layers': 5, 'vector': v, 'factor': 4.0}}, "
                            f"or a list of them; not {type(steering).__name__}.")
        unknown = sorted(set(steering) - set(STEERING_KEYS))
        missing = [key for key in ("layers", "vector") if key not in steering]
        if unknown or missing:
            raise TypeError(f"A steering is a dict with 'layers' and 'vector', and optionally 'value', 'factor', "
                            f"'scope', 'positions', 'batch' (steered_generate's arguments): "
                            f"{f'unknown {unknown}' if unknown else f'missing {missing}'}.")
        vector = steering["vector"]
        if not isinstance(vector, torch.Tensor) or not vector.is_floating_point():
            raise TypeError(f"A steering's vector is a floating-point tensor, not {type(vector).__name__}.")
        scope = steering.get("scope", "all")
        if max_new_tokens is None:  # one forward pass: step 0 only
            if scope not in ("all", "prompt") and scope != range(0, 1):
                raise ValueError(f"scope={scope!r} steers generated steps, and this call generates nothing: pass "
                                 "max_new_tokens=N to generate, or leave scope out.")
            steps = {0}
        else:
            steps = _scope_steps(scope, max_new_tokens)
        name = value_name(steering.get("value", "layer_output"))
        positions = steering.get("positions")
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
            raise TypeError("A steering's positions are token positions (ints or a slice), not a boolean mask.")
        for layer in layer_indices(model, steering["layers"]):
            model.location(layer, name)  # unavailable on the block: refused before anything runs
            plan.setdefault((layer, name), []).append(
                (steps, vector, steering.get("factor", 1.0), positions, steering.get("batch")))
    order = {layer: model.order(layer, aliases=True, where_present=True) for layer, _ in plan}
    return dict(sorted(plan.items(), key=lambda item: (item[0][0], order[item[0][0]][BY_NAME[item[0][1]].key])))


def prepare_steering(model, plan: dict, step: int) -> None:
    """Inside a trace, first in a pass that reads values before it steers: read the attention mask the
    positions of step 0's steering are found with (``add_to`` reads it from the model's inputs, which come first)."""
    if step == 0 and any(positions is not None for steerings in plan.values() for _, _, _, positions, _ in steerings):
        _attention_mask(model)


def apply_steering(model, layer: int, name: str, steerings: list[tuple], step: int) -> None:
    """Inside a trace at generation step ``step``: ``steering_plan``'s additions to value ``name`` of block ``layer``,
    before the value is read (an in-place add: a read of the same value afterwards sees it steered)."""
    for steps, vector, factor, positions, batch in steerings:
        if step in steps:  # positions are the prompt's tokens: a generated step has its one new position
            add_to(model, layer, vector, name, factor, positions if step == 0 else None, batch)


def steering_identity(plan: dict) -> list:
    """What a steering plan adds, as JSON data (each vector's fingerprint): a collection's settings record it."""
    return [[layer, name, sorted(steps), tensor_digest(vector), float(factor), repr(positions), repr(batch)]
            for (layer, name), steerings in plan.items() for steps, vector, factor, positions, batch in steerings]


def check_new_tokens(max_new_tokens, caller: str) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{caller}: max_new_tokens is the number of tokens to generate, an int of at least 1; "
                         f"got {max_new_tokens!r}.")


def refuse_right_padding(model, prompts, caller: str = "steered_generate") -> None:
    """A batch whose shorter prompts end in padding would generate after it: refused."""
    mask = prompts.get("attention_mask") if isinstance(prompts, Mapping) else None
    if mask is None and isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts):
        mask = model.tokenizer(list(prompts), return_tensors="pt", padding=True).attention_mask
    if mask is not None and not bool(torch.as_tensor(mask)[:, -1].all()):
        raise ValueError(f"{caller}: this batch of prompts is right-padded, so its shorter prompts would "
                         "continue after their padding. Pad on the left (model.tokenizer.padding_side = 'left', "
                         "nnsight's default for decoders) or generate one prompt at a time.")


def _scope_steps(scope: str | range, max_new_tokens: int) -> set[int]:
    every = range(max_new_tokens)
    named = {"prompt": range(0, 1), "generated": range(1, max_new_tokens), "all": every}
    if isinstance(scope, range):
        outside = sorted(set(scope) - set(every))
        if outside:
            raise ValueError(f"scope {scope} asks for steps {outside}, which a generation of {max_new_tokens} new "
                             f"tokens never runs (steps 0 to {max_new_tokens - 1}; step 0 is the prompt).")
        return set(scope)
    if scope not in named:
        raise ValueError(f"scope is 'prompt', 'generated', 'all' or a range of steps, not {scope!r}.")
    return set(named[scope])
