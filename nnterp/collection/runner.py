"""``collect``: the prompts run in batches, each batch's rows selected where the model runs and handed to the
shard writer while the next batch runs (the package's docstring tells the whole: ``nnterp.collection``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import nnsight
import torch
from nnsight.modeling.transformers import TransformersModel  # its generate: nnsight's tracer on any subclass
from tqdm.auto import tqdm

from ..dictionaries import Dictionary
from ..dictionaries.splicing import flatten_heads, place
from ..spec.catalog import BY_NAME
from ..spec.selection import layer_indices, token_index, value_name
from ..tools.activation_cache import OVER_CACHED_POSITIONS
from ..tools.refusals import refuse_unsupported
from ..tools.steering import (
    apply_steering,
    check_new_tokens,
    prepare_steering,
    refuse_right_padding,
    steering_identity,
    steering_plan,
)
from . import provenance
from .provenance import dictionary_digest, positions_label, prompts_digest
from .reader import Collection
from .shards import FEATURES, MANIFEST, ShardWriter, resume, to_host


def collect(model, prompts: Sequence[str], folder: str | Path, values: Sequence[str] = ("layer_output",),
            layers=None, positions: str | int | Callable = "last", batch_size: int = 32,
            dtype: torch.dtype | None = None, progress: bool = True, remote: bool | str = False,
            shard: tuple[int, int] = (0, 1), dictionaries=None, max_new_tokens: int | None = None,
            steer=None) -> Collection:
    """Collect ``values`` at ``layers`` for every prompt into ``folder``.

    ``positions``: ``"last"`` (each prompt's last token, ``[prompts, layers, ...]``), an int (each
    prompt's own token at that index; an error for a prompt too short), ``"all"`` (every real token,
    concatenated: ``[tokens, layers, ...]``, with ``Collection.offsets`` giving each prompt's rows),
    or a function ``(input_ids, attention_mask) -> bool mask [batch, seq]`` (the selected tokens,
    concatenated like ``"all"``). Padding is never collected, whichever side the tokenizer pads.
    ``layers`` come back in the order given. ``remote=True`` runs each batch on the remote model;
    only the selected rows travel back. ``shard=(rank, world)``: this worker collects batches
    ``rank, rank + world, ...`` of the same prompt list; ``world`` workers given the same arguments
    and folder together make the whole collection, read back by ``Collection(folder)`` as one.

    ``dictionaries`` (a list of ``Dictionary``, or ``{name: dictionary}``) collects each one's feature
    activations at its own site (whatever ``layers`` and ``values`` are; ``values=[]`` collects features only),
    at the same rows: ``collection["features/layers.5.layer_output"]`` (a list's, named by its site) or
    ``collection["features/<name>"]``, ``[rows, d_sae]``, in the dictionary's dtype (``dtype`` if given).

    A folder's rows come from one writer: the manifest records the model (class, config, a checksum
    of sampled weight values), the dtype of the values and a mask function's code and the values it
    reads, and a digest of each dictionary's weights. A rerun or a worker whose writer differs is refused (``CollectionError``, naming what
    differs), and so is one onto a folder of an earlier nnterp that did not record its writer.

    ``max_new_tokens=N`` collects over a greedy generation of ``N`` tokens instead: one row per step, the values
    at the position the step ran last (the prompt's last token at step 0, then generated token ``k`` at step
    ``k``), those that predict generated tokens 1 to ``N``. ``positions`` count those steps: ``"last"`` the last
    step, an int a step (``0`` the prompt's last token, ``-1`` the last), ``"all"`` every step, a function
    ``(input_ids, attention_mask)`` of the stepped tokens ``[batch, N]`` a mask of them. A batch generates
    left-padded (a right-padded one is refused). ``steer``: steering vectors added in the same pass (with or
    without generation), as ``run_with_cache``'s ``steer``; the manifest records them, so a resume with other
    vectors is refused.
    """
    refuse_unsupported(model, "collect")
    if isinstance(prompts, str):
        raise TypeError("collect takes a list of prompts, not one string (it would collect one row per character): "
                        "pass [prompt].")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("collect needs at least one prompt.")
    rank, world = _worker(shard)
    folder = Path(folder)
    names = [value_name(v) for v in ([values] if isinstance(values, str) else values)]
    layers = layer_indices(model, layers)
    features = _features(model, dictionaries)
    if not names and not features:
        raise ValueError("collect has nothing to collect: give values, or dictionaries whose features to collect.")
    settings = {"prompts": len(prompts), "values": names, "layers": layers, "positions": positions_label(positions),
                "batch_size": batch_size, "fingerprint": prompts_digest(prompts)}
    if max_new_tokens is not None:  # only then, as features: a folder collected without resumes as it did
        check_new_tokens(max_new_tokens, "collect")
        _generated_steps(positions, max_new_tokens)  # a step the generation never runs: refused now
        refused = sorted(set(names) & set(OVER_CACHED_POSITIONS))
        if refused:
            raise ValueError(f"collect(..., max_new_tokens=...) does not collect {', '.join(refused)}: in a "
                             "generation step the attention reads the keys and values of earlier steps from its "
                             "cache, so its internals span another number of positions at each step.")
        settings["max_new_tokens"] = max_new_tokens
    steering = steering_plan(model, steer, max_new_tokens)
    if steering:
        settings["steer"] = steering_identity(steering)
    if features:  # only then: a folder collected without dictionaries resumes as it did
        settings["features"] = {name: list(site) for name, (_, site) in features.items()}
    mine = list(range(0, len(prompts), batch_size))[rank::world]
    manifest = MANIFEST if world == 1 else f"manifest-{rank}-of-{world}.json"
    # a model that reads its batches its own way (each prompt its own request on vLLM) says first what it cannot do
    own_reader = model.collect_reader(features, max_new_tokens, steering, remote) if hasattr(
        type(model), "collect_reader") else None
    if own_reader is None and not remote and not model.dispatched:
        model.dispatch()  # the first trace would: the weights' checksum needs them
    writer_identity = (model.collection_writer(positions, dtype) if own_reader is not None else
                       provenance.writer(model, positions, dtype, remote))
    read_batch = own_reader or functools.partial(_collect_batch, model)
    if features:
        writer_identity["dictionaries"] = {name: dictionary_digest(d) for name, (d, _) in features.items()}
    own, done = resume(folder, settings, writer_identity, manifest, mine)
    todo = [start for start in mine if str(start) not in done]
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="collecting", unit="batch", disable=not progress)
    with ShardWriter(folder, manifest, settings, writer_identity, own) as writer:
        for start in todo:
            tensors, ready = to_host(read_batch(prompts[start:start + batch_size], names, layers,
                                                     positions, dtype, remote, features, max_new_tokens, steering))
            writer.write(start, tensors, ready)  # written while the next batch runs
            bar.update()
    bar.close()
    return Collection(folder, verify=False)  # the shards were checked on resuming, or just written


def _features(model, dictionaries) -> dict[str, tuple[Dictionary, tuple[int, str]]]:
    """``{"features/<name>": (dictionary, site)}``, each site checked on the model (``splicing.place``)."""
    if not dictionaries:
        return {}
    named = dictionaries if isinstance(dictionaries, dict) else None
    if isinstance(dictionaries, Dictionary):
        raise TypeError("dictionaries is a list of dictionaries (or {name: dictionary}): pass [dictionary].")
    features = {}
    for key, dictionary in (named or dict(enumerate(dictionaries))).items():
        if not isinstance(dictionary, Dictionary):
            raise TypeError(f"dictionaries holds Dictionary objects (nnterp.load_dictionary), not "
                            f"{type(dictionary).__name__}.")
        site = place(model, dictionary, "site")
        name = FEATURES + (str(key) if named else f"layers.{site[0]}.{site[1]}")
        if name in features:
            raise ValueError(f"Two dictionaries read layers[{site[0]}].{site[1]}: name them, "
                             "dictionaries={'name': dictionary, ...}, to collect both.")
        features[name] = dictionary, site
    return features


def _worker(shard) -> tuple[int, int]:
    try:
        rank, world = (int(part) for part in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard is (rank, world), e.g. (0, 4) for the first of four workers; got {shard!r}.") from None
    if not 0 <= rank < world:
        raise ValueError(f"shard=({rank}, {world}): the rank counts workers from 0 to world - 1 = {world - 1}.")
    return rank, world


def _collect_batch(model, batch, names, layers, positions, dtype, remote=False, features=None, max_new_tokens=None,
                   steering=None) -> dict[str, torch.Tensor]:
    features = features or {}
    inputs = model.tokenizer(batch, return_tensors="pt", padding=True)  # tokenized once: the trace runs on it
    events = _events(model, names, layers, features, steering or {})
    if max_new_tokens is not None:
        return _collect_generated(model, inputs, events, names, layers, positions, dtype, remote, features,
                                  max_new_tokens, steering or {})
    select = _selection(inputs, positions)
    with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
        prepare_steering(model, steering or {}, 0)
        read = _read_sites(model, events, 0)  # in forward order, steered on the way
        # the selection runs where the model does (remotely too): only the chosen rows come back
        tensors = nnsight.save({})
        for name in names:
            # each layer's rows selected on its own device (a model split across devices), then gathered on one
            chosen = {layer: read[(name, layer)][select.to(read[(name, layer)].device)].detach()
                      for layer in set(layers)}
            device = chosen[layers[0]].device
            stacked = torch.stack([chosen[layer].to(device) for layer in layers], dim=1)  # [tokens, layers, ...]
            stacked = (stacked.to(dtype) if dtype else stacked).contiguous()
            tensors[name] = stacked.cpu() if remote else stacked  # locally, to_host copies without blocking
        for name, (dictionary, (layer, value)) in features.items():
            hidden = flatten_heads(read[(value, layer)], dictionary.d_in, (layer, value))
            encoded = dictionary.encode(hidden[select.to(hidden.device)].detach())  # the chosen rows only
            encoded = (encoded.to(dtype) if dtype else encoded).contiguous()
            tensors[name] = encoded.cpu() if remote else encoded
        # nothing after the last value read is needed (no logits): the rest of the forward is not run
        tracer.stop()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
    tensors["_token_ids"] = inputs.input_ids[select].to(torch.int64)  # each row's token (SAELens's token_ids)
    return tensors


def _events(model, names, layers, features, steering) -> list[tuple]:
    """The values to read and the steering to apply, in forward order (a steering just before the read of the
    value it steers): ``[("read", name, layer) | ("steer", name, layer, steerings)]``."""
    sites = {(layer, name) for layer in layers for name in names} | {site for _, site in features.values()}
    order = {layer: model.order(layer, aliases=True, where_present=True) for layer in {layer for layer, _ in [*sites, *steering]}}
    events = [((layer, order[layer][BY_NAME[name].key], 1), ("read", name, layer)) for layer, name in sites]
    events += [((layer, order[layer][BY_NAME[name].key], 0), ("steer", name, layer, steerings))
               for (layer, name), steerings in steering.items()]
    return [event for _, event in sorted(events, key=lambda pair: pair[0])]


def _read_sites(model, events, step: int) -> dict[tuple[str, int], torch.Tensor]:
    """Inside a trace: ``{(name, layer): value}`` of ``_events``' reads, their steering applied on the way."""
    read = {}
    for event in events:
        if event[0] == "steer":
            apply_steering(model, event[2], event[1], event[3], step)
        else:
            read[(event[1], event[2])] = model.read_value(event[2], event[1])
    return read


def _generated_steps(positions, max_new_tokens: int) -> range | list[int]:
    """The generation steps whose rows ``positions`` may select (a mask function: all, chosen after the run)."""
    if positions == "last":
        return [max_new_tokens - 1]
    if isinstance(positions, int) and not isinstance(positions, bool):
        if not -max_new_tokens <= positions < max_new_tokens:
            raise IndexError(f"positions={positions} counts the steps of a generation of {max_new_tokens} tokens "
                             f"(0 to {max_new_tokens - 1}, or -{max_new_tokens} to -1).")
        return [positions % max_new_tokens]
    if positions == "all" or callable(positions):
        return range(max_new_tokens)
    raise ValueError(f"positions is 'last', 'all', an int or a mask function, not {positions!r}.")


def _collect_generated(model, inputs, events, names, layers, positions, dtype, remote, features, max_new_tokens,
                       steering) -> dict[str, torch.Tensor]:
    """One batch over a greedy generation: each step's values at the position it ran last, the rows
    ``positions`` selects among the steps."""
    refuse_right_padding(model, inputs, "collect(..., max_new_tokens=...)")
    wanted, prompt = _generated_steps(positions, max_new_tokens), inputs.input_ids.shape[1]
    with torch.no_grad(), TransformersModel.generate(model, inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         do_sample=False, remote=remote) as tracer:
        steps = nnsight.save([])
        for step in tracer.iter[0:max_new_tokens]:
            prepare_steering(model, steering, step)
            read = _read_sites(model, [e for e in events if e[0] == "steer" or step in wanted], step)
            if step in wanted:
                for key, value in read.items():  # left-padded: the last column is every row's last token
                    if value.dim() < 2 or value.shape[1] != (prompt if step == 0 else 1):
                        raise ValueError(f"{key[0]} of layer {key[1]} has shape {tuple(value.shape)} at generation "
                                         f"step {step}, not [batch, positions the step ran, ...]: it cannot be "
                                         "collected over a generation.")
                steps.append({key: value[:, -1:].detach().cpu() for key, value in read.items()})
        ids = nnsight.save(tracer.result)
    ids = ids.cpu()
    stepped = ids[:, prompt - 1:prompt - 1 + max_new_tokens]  # each step's last token: it predicts the next one
    if callable(positions):
        select = positions(stepped, torch.ones_like(stepped)).bool()
    else:
        select = torch.zeros_like(stepped, dtype=torch.bool)
        select[:, list(wanted)] = True
    chosen = select[:, list(wanted)]  # the rows among the steps read
    tensors = {}
    for name in names:
        per_layer = [torch.cat([step[(name, layer)] for step in steps], dim=1) for layer in layers]
        stacked = torch.stack(per_layer, dim=2)[chosen]  # [batch, steps, layers, ...] -> [tokens, layers, ...]
        tensors[name] = (stacked.to(dtype) if dtype else stacked).contiguous()
    for name, (dictionary, (layer, value)) in features.items():
        hidden = torch.cat([flatten_heads(step[(value, layer)], dictionary.d_in, (layer, value)) for step in steps], dim=1)
        encoded = dictionary.encode(hidden[chosen])
        tensors[name] = (encoded.to(dtype) if dtype else encoded).contiguous()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
    tensors["_token_ids"] = stepped[select].to(torch.int64)  # each row's own token
    return tensors


def _selection(inputs, positions) -> torch.Tensor:
    """``[batch, seq]`` bool: the tokens to collect, never padding."""
    mask = inputs.attention_mask.bool()
    if positions == "last" or isinstance(positions, int):
        select = torch.zeros_like(mask)
        select[torch.arange(mask.shape[0]), token_index(mask, -1 if positions == "last" else positions)] = True
    elif positions == "all":
        select = mask
    elif callable(positions):
        select = positions(inputs.input_ids, inputs.attention_mask).bool() & mask
    else:
        raise ValueError(f"positions is 'last', 'all', an int or a mask function, not {positions!r}.")
    return select
