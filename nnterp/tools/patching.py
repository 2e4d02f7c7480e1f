"""Activation patching and attribution patching, written once for every family.

Activation patching runs the corrupted prompts with one piece of a standard value (one position of it, or one
head of ``attention_premix``) replaced by the clean run's, and scores each patched run with a metric; several
patched copies of the prompts run as the rows of one batch. Attribution patching is its linear approximation:
the metric's gradient at the corrupted run times the clean run's value minus the corrupted run's, from one
forward pass with gradients and one backward pass over the corrupted prompts, and one forward over the clean ones.

The prompts are one pair of strings, or a batch of pairs as TransformerLens's users write them: ``[batch, seq]``
token tensors, or lists of strings of one token length. A patch applies to every pair of the batch at once, and
the metric scores one patched run: it gets that run's logits ``[batch, seq, vocab]`` and returns one number (a
mean over the batch, as in TransformerLens's demos; a per-row metric such as ``logit_difference`` on one pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import nnsight
import torch
from tqdm.auto import tqdm

from ..core.tokens import tokenized
from ..spec.selection import forward_order, layer_indices, value_name
from . import hook_passes, hook_points
from .refusals import refuse_unsupported

PER_VALUE = {"position": None, "head": "attention_premix", "neuron": "mlp_neurons"}


def _value_for(per: str, value: str | None, kinds: Sequence[str]) -> str:
    """The value patched: ``value`` (default ``layer_output``) per position, the heads' or neurons' own value."""
    if per not in kinds:
        raise ValueError(f"per is one of {', '.join(map(repr, kinds))}, not {per!r}.")
    own = PER_VALUE[per]
    if own is None:
        return value_name("layer_output" if value is None else value)
    if value is not None and value_name(value) != own:
        raise ValueError(f"per={per!r} patches {own} (a {per}'s slice of it); value={value!r} has no {per}s: leave "
                         f"value out, or use per='position' to patch {value} at each position.")
    return own


NEEDS = ("a string, a list of strings of one token length, or a [batch, seq] tensor of token ids (a [seq] one is "
         "one prompt)")


def _tokens(model, prompt: str) -> torch.Tensor:
    """One prompt's ids ``[1, seq]``, as the model's traces tokenize it; on a ``HookedTransformer``, as its
    ``to_tokens`` does (a BOS first by default, as TransformerLens's)."""
    if getattr(model, "_nnterp_default_prepend_bos", None) is not None:
        return tokenized(model, prompt)[0]
    return model.tokenizer(prompt, return_tensors="pt").input_ids


def _token_rows(model, prompts, side: str, what: str) -> torch.Tensor:
    """``[batch, seq]`` token ids of ``prompts`` (a string, strings of one token length, or ids), unpadded."""
    if isinstance(prompts, str):
        return _tokens(model, prompts)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2) or prompts.dtype.is_floating_point or prompts.dtype == torch.bool:
            raise ValueError(f"{what}: the {side} prompts are a {prompts.dtype} tensor of shape "
                             f"{list(prompts.shape)}; they must be {NEEDS}.")
        return (prompts[None] if prompts.dim() == 1 else prompts).long()
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) for p in prompts):
        rows = [_tokens(model, p)[0] for p in prompts]
        lengths = [len(row) for row in rows]
        if len(set(lengths)) > 1:
            raise ValueError(f"{what} patches a position of every prompt at once, so the {side} prompts must have "
                             f"one token length, a [batch, seq] batch without padding; they have {lengths} tokens.")
        return torch.stack(rows)
    raise ValueError(f"{what}: the {side} prompts must be {NEEDS}, not {type(prompts).__name__}.")


def _prompt_ids(model, clean, corrupted, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupted prompts as ``[batch, seq]`` token ids of one shape."""
    clean_ids, corrupted_ids = (_token_rows(model, p, side, what) for p, side in ((clean, "clean"),
                                                                                  (corrupted, "corrupted")))
    if clean_ids.shape[1] != corrupted_ids.shape[1]:
        raise ValueError(f"{what} needs prompts of one length: the clean prompts have {clean_ids.shape[1]} tokens, "
                         f"the corrupted ones {corrupted_ids.shape[1]} ([batch, seq] {list(clean_ids.shape)} and "
                         f"{list(corrupted_ids.shape)}).")
    if clean_ids.shape[0] != corrupted_ids.shape[0]:
        raise ValueError(f"{what} pairs each clean prompt with a corrupted one: [batch, seq] tensors of one shape, "
                         f"not {list(clean_ids.shape)} and {list(corrupted_ids.shape)}.")
    return clean_ids, corrupted_ids


def _one_number(score, batch: int, what: str, run: str = "one patched run's") -> torch.Tensor:
    """A metric's score of one run of the batch, as a float32 0-d tensor, or a clear error naming the shape."""
    score = torch.as_tensor(score)
    if score.numel() != 1:
        rows = "one prompt pair's" if batch == 1 else f"the {batch} prompt pairs'"
        raise ValueError(f"{what}: the metric gets {run} logits, [{batch}, seq, vocab] for {rows} rows, "
                         f"and must return one number; it gave shape {list(score.shape)}. Reduce over the batch "
                         "(e.g. .mean() of each pair's logit difference), as TransformerLens's metrics do.")
    return score.detach().float().cpu().reshape(())


def _heads(sources: dict[int, torch.Tensor]) -> int:
    counts = {int(source.shape[-2]) for source in sources.values()}
    if len(counts) != 1:
        raise ValueError(f"Per-head patching returns one column per head, and these blocks have different numbers of "
                         f"heads ({sorted(counts)}): patch the blocks of each count in a call of their own (layers=).")
    return counts.pop()


def activation_patching(model, clean, corrupted, metric: Callable[[torch.Tensor], torch.Tensor],
                        value: str | None = None, layers=None, positions: Sequence[int] | None = None,
                        remote: bool | str = False, progress: bool = True, *, per: str = "position",
                        batch_size: int | None = None) -> torch.Tensor:
    """Patch ``value`` (default ``layer_output``) from the clean run into the corrupted one, one piece at a time,
    and return ``metric`` of each patched run.

    ``clean`` and ``corrupted`` are one pair of prompts (two strings) or a batch of pairs: ``[batch, seq]`` token
    tensors of one shape, or lists of strings of one token length (no padding: a position is a token of every
    prompt). Each patch applies to every pair at once, and ``metric`` gets that patched run's logits
    ``[batch, seq, vocab]`` and returns one number: a mean over the batch, as TransformerLens's metrics are
    (``lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()``), or on one pair a per-row metric
    (``logit_difference``, ``target_probability``).

    ``per="position"``: one (layer, position) at a time, ``[layers, positions]``. ``per="head"``: one head of
    ``attention_premix`` (the heads' outputs before the output projection) at a time, at every position at once
    (``[layers, heads]``) or at each of ``positions`` (``[layers, positions, heads]``).

    Each patched run is ``batch`` rows of a batch of copies of the corrupted prompts. ``batch_size`` patched runs
    per forward pass, their patches taken in order across layers; ``None``: one pass per layer, a run for each of
    its patches. Every run is the same forward pass as a run of its own, so the numbers agree up to the last bits
    of the dtype: a CPU's matrix products can round differently with the number of rows (another kernel for
    fewer than about 16 token rows, another split over threads), as can multi-query attention (GPT-BigCode) at
    one row.
    """
    refuse_unsupported(model, "activation_patching")
    name = _value_for(per, value, ("position", "head"))
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size is a number of patched runs per forward pass (1 or more) or None, not "
                         f"{batch_size!r}.")
    layers = layer_indices(model, layers)
    clean_ids, corrupted_ids = _prompt_ids(model, clean, corrupted, "Activation patching")
    pairs = clean_ids.shape[0]
    every_position = positions is None
    positions = list(range(clean_ids.shape[1])) if every_position else list(positions)
    hooks = model_hooks(model)
    if hooks and remote:
        raise TypeError("activation_patching(remote=True) on a model with TransformerLens hooks (add_hook): the hooks "
                        "run here only. Remove them (model.reset_hooks()) or patch locally.")
    if hooks:  # the model's hooks run in the clean pass too, as in TransformerLens's run_with_cache
        sources = _hooked_pass(model, clean_ids, hooks, {layer: [] for layer in layers}, name, None)[1]
    else:
        with torch.no_grad(), model.trace(clean_ids, remote=remote) as tracer:
            sources = nnsight.save({layer: model.read_value(layer, name) for layer in forward_order(layers)})
            tracer.stop()  # nothing past the last layer read is needed
    # each patch: (its cell of the result, its layer, its index into the value after the batch row)
    if per == "head":
        heads = range(_heads(sources))
        at = [slice(None)] if every_position else positions
        shape = (len(layers), len(heads)) if every_position else (len(layers), len(positions), len(heads))
        patches = [(layer, (position, head)) for layer in layers for position in at for head in heads]
    else:
        shape = (len(layers), len(positions))
        patches = [(layer, (position,)) for layer in layers for position in positions]
    if batch_size is None:  # one pass per layer asked
        per_pass = len(patches) // len(layers)
    else:
        per_pass = batch_size
    passes = [range(start, min(start + per_pass, len(patches))) for start in range(0, len(patches), per_pass)]
    effects = torch.empty(len(patches))
    for cells in tqdm(passes, desc="patching", unit="pass", disable=not progress or len(passes) < 2):
        edits: dict[int, list[tuple[int, tuple]]] = {}
        for run, cell in enumerate(cells):
            layer, index = patches[cell]
            edits.setdefault(layer, []).append((slice(run * pairs, (run + 1) * pairs), index))
        if hooks:
            logits = _hooked_pass(model, corrupted_ids.repeat(len(cells), 1), hooks, edits, name, sources)[0]
            scores = [metric(logits[run * pairs:(run + 1) * pairs]) for run in range(len(cells))]
        else:
            with torch.no_grad(), model.trace(corrupted_ids.repeat(len(cells), 1), remote=remote):
                for layer in forward_order(list(edits)):
                    target, source = model.read_value(layer, name), sources[layer]
                    for rows, index in edits[layer]:
                        target[(rows, *index)] = source[(slice(None), *index)]
                logits = model.logits
                scores = nnsight.save([metric(logits[run * pairs:(run + 1) * pairs]) for run in range(len(cells))])
        for cell, score in zip(cells, scores):
            effects[cell] = _one_number(score, pairs, "activation_patching")
    return effects.view(shape)


def model_hooks(model) -> list:
    """The TransformerLens hooks a ``HookedTransformer`` holds (``add_hook``, ``with model.hooks(...)``): its patching
    runs them in every pass, as TransformerLens's patching (``run_with_hooks``, ``run_with_cache``) does."""
    if not getattr(model, "_nnterp_hook_cache", False):
        return []
    return list(getattr(model, "_nnterp_context_hooks", ()))


def _hooked_pass(model, ids: torch.Tensor, hooks: list, edits: dict, name: str, sources: dict | None):
    """One pass with the model's hooks and the patches ``edits`` (``{layer: [(rows, index)]}``, from ``sources``),
    every read in forward order: ``(logits, {layer: value})``, the values after the hooks and patches."""
    plan = hook_passes.Plan()
    for point, fn in hook_passes.hooked_points(model, hooks):
        plan.add(point, fn)
    for layer, patches in edits.items():
        point = hook_points.standard_point(model, name, layer)

        def patch(value, hook, layer=layer, patches=patches):
            for rows, index in patches:
                value[(rows, *index)] = sources[layer][(slice(None), *index)]

        plan.add(point, patch if patches else None, keep=True)
    with torch.no_grad(), hook_passes.attention_for(model, plan.needs_attention), model.trace(ids):
        kept = nnsight.save(plan.run(model, ids.shape[0]))
        logits = nnsight.save(model.logits)
    return logits, {layer: kept[hook_points.standard_point(model, name, layer).name] for layer in edits}


def attribution_patching(model, clean, corrupted, metric: Callable[[torch.Tensor], torch.Tensor],
                         value: str | None = None, per: str = "position", layers=None,
                         remote: bool | str = False) -> torch.Tensor:
    """The linear approximation of ``activation_patching``: the gradient of ``metric`` at the corrupted run times
    the clean run's value minus the corrupted run's, summed over the batch of prompt pairs (the prompts and the
    metric as ``activation_patching`` takes them: one number for the batch), ``[layers, positions]`` summed over
    the value's other dimensions (``per="position"``, ``value`` default ``layer_output``), per head of
    ``attention_premix`` ``[layers, positions, heads]`` (``per="head"``) or per neuron of ``mlp_neurons``
    ``[layers, positions, neurons]`` (``per="neuron"``). Sum over positions (``.sum(1)``) to approximate
    patching a head at every position at once, as ``activation_patching(..., per="head")`` does.

    One forward pass over the clean prompts; one forward with gradients and one backward over the corrupted
    prompts, which computes the gradients of the values only (the weights' are neither computed nor kept).
    The products are computed in float32.
    """
    refuse_unsupported(model, "attribution_patching")
    name = _value_for(per, value, tuple(PER_VALUE))
    layers = layer_indices(model, layers)
    clean_ids, corrupted_ids = _prompt_ids(model, clean, corrupted, "Attribution patching")
    order = forward_order(layers)
    with torch.no_grad(), model.trace(clean_ids, remote=remote) as tracer:
        sources = nnsight.save({layer: model.read_value(layer, name) for layer in order})
        tracer.stop()
    with torch.enable_grad(), model.trace(corrupted_ids, remote=remote):
        values = [model.read_value(layer, name) for layer in order]
        score = metric(model.logits)
        if torch.as_tensor(score).numel() != 1:  # before the backward: nothing to differentiate otherwise
            _one_number(score, corrupted_ids.shape[0], "attribution_patching", "the corrupted run's")
        score = score.sum()
        grads = nnsight.save({})
        with score.backward(inputs=values):  # the values' gradients only, not the weights'
            for layer, read in reversed(list(zip(order, values))):  # backward computes them last layer first
                grads[layer] = read.grad
        targets = nnsight.save({layer: read.detach() for layer, read in zip(order, values)})
    rows = []
    for layer in layers:
        product = (sources[layer].float().cpu() - targets[layer].float().cpu()) * grads[layer].float().cpu()
        product = product.sum(0)  # [seq, ...]: over the batch, as a patch applies to every pair
        rows.append(product.flatten(1).sum(-1) if per == "position" else product.sum(-1) if per == "head" else product)
    return torch.stack(rows)
