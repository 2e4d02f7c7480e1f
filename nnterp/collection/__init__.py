"""Activation collection at scale: batched, written to disk as it goes, resumable, verified.

``collect(model, prompts, folder, values=["layer_output"])`` runs the prompts in batches and
writes each batch's activations to its own safetensors file, so memory stays flat whatever
the number of prompts. The manifest records every shard with its rows and checksum, and each
file is written whole or not at all (a temporary file, then a rename), so a rerun with the same
folder resumes after the last shard recorded, never duplicates a row, and a damaged collection
says what is missing. Several workers split one prompt list with ``shard=(rank, world)``: each
writes its own batches and its own manifest into the same folder. The manifest also records who
wrote the values (the model's class, config and a checksum of its weights, the dtype, a mask
function's code): a resume or a worker whose writer differs is refused, so rows of two models never
mix. ``Collection(folder)`` reads all of it back, in prompt order, memory-mapped:
``collection["layer_output", 1000:2000]`` reads those rows only.

``collect(..., dictionaries=[sae])`` also collects each dictionary's feature activations at its site, read back
as ``collection["features/layers.5.layer_output"]`` (``[rows, d_sae]``); the manifest records a digest of each
dictionary's weights, so a resume with another dictionary is refused too. ``Collection.to_saelens(folder)`` writes
the rows in SAELens's cached-activations layout (a Hugging Face ``datasets`` folder, one ``Array2D(context_size,
d_in)`` column per TransformerLens hook name and ``token_ids``), which SAELens's ``ActivationsStore`` trains from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import re
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nnsight
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..dictionaries import TENSORS, Dictionary, transformerlens_hook, transformerlens_site
from ..dictionaries.splicing import _flat, place
from ..spec.catalog import BY_NAME
from ..spec.selection import layer_indices, token_index, value_name
from ..tools.activation_cache import OVER_CACHED_POSITIONS
from ..tools.interventions import (
    apply_steering,
    check_new_tokens,
    prepare_steering,
    refuse_right_padding,
    steering_identity,
    steering_plan,
)

MANIFEST = "manifest.json"
WORKER_MANIFEST = re.compile(r"manifest-(\d+)-of-(\d+)\.json")
RECORD_EVERY_S = 1.0  # how often the manifest is rewritten while shards are written
FEATURES = "features/"  # a dictionary's features are collected as "features/<name>"
FORMAT = 2  # 2: shards recorded with their rows and checksums (a manifest per worker since shard=; "writer" since)
SAMPLED = 64  # values of each weight tensor in the weights' checksum: evenly spaced, exact bytes


class CollectionError(ValueError):
    """A collection folder that cannot be resumed or read as it is; the message says what to do."""


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
    settings = {"prompts": len(prompts), "values": names, "layers": layers, "positions": _describe(positions),
                "batch_size": batch_size, "fingerprint": _fingerprint(prompts)}
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
    if not remote and not model.dispatched:
        model.dispatch()  # the first trace would: the weights' checksum needs them
    writer_identity = _writer(model, positions, dtype, remote)
    if features:
        writer_identity["dictionaries"] = {name: dictionary_digest(d) for name, (d, _) in features.items()}
    own, done = _resume(folder, settings, writer_identity, manifest, mine)
    todo = [start for start in mine if str(start) not in done]
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="collecting", unit="batch", disable=not progress)
    with _ShardWriter(folder, manifest, settings, writer_identity, own) as writer:
        for start in todo:
            tensors, ready = _to_host(_collect_batch(model, prompts[start:start + batch_size], names, layers,
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


def dictionary_digest(dictionary: Dictionary) -> str:
    """A digest of what makes a dictionary's features: its activation and every byte of its tensors."""
    digest = hashlib.sha256(repr((dictionary.activation, dictionary.k, dictionary.normalize)).encode())
    for name in TENSORS:
        tensor = getattr(dictionary, name)
        digest.update(f"{name} {None if tensor is None else (str(tensor.dtype), tuple(tensor.shape))}".encode())
        if tensor is not None:
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def _worker(shard) -> tuple[int, int]:
    try:
        rank, world = (int(part) for part in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard is (rank, world), e.g. (0, 4) for the first of four workers; got {shard!r}.") from None
    if not 0 <= rank < world:
        raise ValueError(f"shard=({rank}, {world}): the rank counts workers from 0 to world - 1 = {world - 1}.")
    return rank, world


def _resume(folder: Path, settings: dict, writer: dict, manifest: str, mine: list[int]) -> tuple[dict, dict]:
    """(this worker's shards, every worker's shards) already recorded and intact; a clear error otherwise."""
    if not folder.is_dir() or not _manifest_paths(folder):
        # only this worker's own batch files count: another worker may be writing its first shard right now
        leftovers = [start for start in mine if (folder / _shard_file(start)).is_file()]
        if leftovers:
            raise CollectionError(
                f"{folder} holds {len(leftovers)} shard file(s) but no {MANIFEST}, so which rows they hold is "
                "unknown. Delete the folder (or those files) to start over, or use another folder.")
        folder.mkdir(parents=True, exist_ok=True)
        return {}, {}
    manifests = _read_manifests(folder)
    for saved in manifests.values():
        if saved["settings"] != settings:
            raise CollectionError(f"{folder} holds a collection made with other settings ({saved['settings']}); use "
                                  "another folder, or delete it to start over.")
    for name, saved in manifests.items():
        if "writer" not in saved:
            raise CollectionError(
                f"{folder}/{name} does not record who wrote its values (it was written by an earlier nnterp), so this "
                "run cannot be checked to write the same ones (model, dtype, mask function). Collection(folder) "
                "reads it as it is; to collect, use a new folder, or delete this one to start over.")
        differences = _differences(writer, saved["writer"], "this run", "the folder")
        if differences:
            raise CollectionError(
                f"{folder}/{name} was written by another writer: {'; '.join(differences)}. Its rows and this run's "
                "would not be the same values: use a new folder for this run, or delete this one to start over.")
    # a shard that is missing or damaged is collected again; one another worker wrote is not
    intact = {name: {start: shard for start, shard in saved["shards"].items() if _shard_problem(folder, shard) is None}
              for name, saved in manifests.items()}
    return intact.get(manifest, {}), {start: shard for shards in intact.values() for start, shard in shards.items()}


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
            tensors[name] = stacked.cpu() if remote else stacked  # locally, _to_host copies without blocking
        for name, (dictionary, (layer, value)) in features.items():
            hidden = _flat(read[(value, layer)], dictionary.d_in, (layer, value))
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
    order = {layer: model.order(layer, aliases=True) for layer in {layer for layer, _ in [*sites, *steering]}}
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
    with torch.no_grad(), model.generate(inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
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
        hidden = torch.cat([_flat(step[(value, layer)], dictionary.d_in, (layer, value)) for step in steps], dim=1)
        encoded = dictionary.encode(hidden[chosen])
        tensors[name] = (encoded.to(dtype) if dtype else encoded).contiguous()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
    tensors["_token_ids"] = stepped[select].to(torch.int64)  # each row's own token
    return tensors


def _to_host(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """The tensors in host memory, and on CUDA the event that marks when their copies have landed.

    CUDA tensors are copied into pinned buffers without blocking, so the copies overlap the next
    batch; the writer waits on the event before reading them. PyTorch caches pinned blocks, so
    after the first batches a buffer costs no new page-locked allocation.
    """
    cuda = [t.device for t in tensors.values() if t.is_cuda]
    if not cuda:
        return {name: t.cpu() for name, t in tensors.items()}, None
    host = {}
    for name, t in tensors.items():
        if t.is_cuda:
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[name].copy_(t, non_blocking=True)
        else:
            host[name] = t
    return host, torch.cuda.current_stream(cuda[0]).record_event()


class _ShardWriter:
    """Writes shards on a background thread, so that writing one batch overlaps the next forward.

    One write at a time and in order; ``write`` first waits for the previous one, so memory holds
    at most two batches. A write that fails is raised as a ``CollectionError`` on the next call.
    Each shard is written atomically and recorded in the manifest after it is whole, at most once
    a second (the manifest grows with the batches: rewriting it for each would cost the square of
    their number) and always on the way out; a kill redoes at most the last second's batches.
    """

    def __init__(self, folder: Path, manifest: str, settings: dict, writer: dict, shards: dict):
        self.folder, self.manifest, self.settings, self.writer = folder, manifest, settings, writer
        self.shards = dict(shards)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nnterp-shard-writer")
        self._pending: tuple[int, Future] | None = None
        self._unrecorded, self._recorded_at = 0, float("-inf")

    def write(self, start: int, tensors: dict[str, torch.Tensor], ready) -> None:
        self._wait()
        self._pending = (start, self._thread.submit(self._write, start, tensors, ready))

    def _write(self, start, tensors, ready) -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies have landed
        name = _shard_file(start)
        _write_atomically(self.folder / name, lambda path: save_file(tensors, path))
        first = next(iter(tensors))
        self.shards[str(start)] = {"file": name, "rows": int(tensors[first].shape[0]),
                                   "bytes": (self.folder / name).stat().st_size, "sha256": _sha256(self.folder / name)}
        self._unrecorded += 1
        if time.monotonic() - self._recorded_at >= RECORD_EVERY_S:
            self._record()

    def _record(self) -> None:
        """Record the shards written so far (after them: a kill in between only redoes their batches)."""
        _write_manifest(self.folder / self.manifest, self.settings, self.shards, self.writer)
        self._unrecorded, self._recorded_at = 0, time.monotonic()

    def _wait(self) -> None:
        if self._pending is None:
            return
        (start, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as error:  # an interrupt passes through as it is
            raise CollectionError(
                f"writing batch {start} to {self.folder} failed ({type(error).__name__}: {error}). The batches "
                "written before it are kept: fix the cause, then run collect again with the same arguments to "
                "resume.") from error

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, error_type, *_) -> None:
        try:
            self._wait()  # the batch already computed is written, whatever stopped the loop
        except BaseException:
            if error_type is None:
                raise  # else the error that stopped the loop is the one to report
        finally:
            self._thread.shutdown()
            if self._unrecorded:
                self._record()


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


class Collection:
    """A collection on disk, read back as tensors: ``collection["layer_output"]`` is ``[rows, layers, ...]``.

    ``collection["layer_output", 1000:2000]`` (a slice, an int, row numbers or a boolean mask, by
    NumPy's rules) reads only those rows, through memory-mapped shards, so a collection larger than
    memory reads by parts. The rows of writers that differ (model, dtype, mask function) are refused,
    never merged or cast; ``writer`` is what the manifest records of them.
    Opening it checks every recorded shard (present, whole, unchanged) of every worker; ``complete``
    is true only when every batch is there, and ``missing`` lists the batches that are not.
    ``verify=False`` checks that each shard is there and of its recorded size, without reading it
    for its checksum: for a large collection already checked once.
    """

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        manifests = _read_manifests(self.folder)
        settings = [saved["settings"] for saved in manifests.values()]
        if any(other != settings[0] for other in settings[1:]):
            raise CollectionError(
                f"{self.folder} holds manifests of different collections ({', '.join(manifests)}): the workers were "
                "not given the same arguments. Keep the manifests (and shards) of one collection per folder.")
        self.settings = settings[0]
        writers = {name: saved.get("writer") for name, saved in manifests.items()}
        first = next(iter(writers))
        for name, writer in writers.items():
            differences = _differences(writers[first], writer, first, name)
            if differences:
                raise CollectionError(
                    f"{self.folder} holds the rows of different writers ({'; '.join(differences)}): they are not the "
                    "same values and are never merged. Keep one writer's manifests (and shards) per folder, or "
                    "collect again into a new folder.")
        self.writer = writers[first]  # who wrote the values (None: an earlier nnterp, which did not record it)
        self._shards = {start: shard for saved in manifests.values() for start, shard in saved["shards"].items()}
        problems = {start: _shard_problem(self.folder, shard, verify) for start, shard in self._shards.items()}
        damaged = {start: problem for start, problem in problems.items() if problem}
        if damaged:
            raise CollectionError(
                f"{self.folder}: " + "; ".join(f"batch {start}: {problem}" for start, problem in sorted(damaged.items()))
                + ". Run collect again with the same arguments to collect those batches again.")
        expected = {str(start) for start in range(0, self.settings["prompts"], self.settings["batch_size"])}
        self.missing = sorted(int(start) for start in expected - set(self._shards))
        self.complete = not self.missing
        self._starts = sorted(int(start) for start in self._shards)  # each shard's first prompt, in prompt order
        self._ordered = [self._shards[str(start)] for start in self._starts]
        self._files = [self.folder / shard["file"] for shard in self._ordered]
        self._first_rows = torch.tensor([0] + [shard["rows"] for shard in self._ordered]).cumsum(0)  # shard i: [i]:[i+1]

    def __getitem__(self, key) -> torch.Tensor:
        """``collection[value, rows]`` is ``collection[value][rows]``, by NumPy's rules, reading only those rows.

        ``rows``: an int (the row, squeezed), a slice (empty when it selects nothing, negative steps too),
        integers in a list, tensor or array (their shape first: ``[33]`` gives ``[1, ...]``), or a boolean
        mask of one entry per row. Negative indices count from the end; beyond the rows is an IndexError.
        """
        if isinstance(key, tuple) and len(key) != 2:
            raise TypeError(f"index a collection as collection[value] or collection[value, rows], not {key!r}; "
                            "index the tensor it returns for the other dimensions.")
        value, rows = key if isinstance(key, tuple) else (key, slice(None))
        if isinstance(value, str) and value.startswith(FEATURES):
            if value not in self.features:
                raise KeyError(f"{value!r} was not collected here; this collection holds the features "
                               f"{', '.join(self.features) or 'of no dictionary'}.")
            name = value
        else:
            name = value_name(value)  # "mlp.mlp_output" and "mlp_output" name the same value
            if name not in self.values:
                raise KeyError(f"{value!r} was not collected here; this collection holds "
                               f"{', '.join(self.values + self.features)}.")
        if rows is Ellipsis:
            rows = slice(None)
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.rows)  # Python's own rules: out of range clips, empty is empty
            return self._read(name, start + step * torch.arange(len(range(start, stop, step))))
        index = self._index(rows)
        read = self._read(name, index.reshape(-1))
        return read.reshape(*index.shape, *read.shape[1:])  # a 0-d index: the row itself

    def _index(self, rows) -> torch.Tensor:
        """Rows as an int64 tensor of the index's own shape, negatives counted from the end, checked."""
        if isinstance(rows, (bool, np.bool_)) or (isinstance(rows, (torch.Tensor, np.ndarray)) and rows.ndim == 0
                                                  and rows.dtype in (torch.bool, np.bool_)):
            raise TypeError("a bool is not a row index: pass row numbers, or a boolean mask of one entry per row.")
        if isinstance(rows, tuple):  # NumPy reads a tuple as one index per dimension
            raise TypeError(f"rows {rows!r} are a tuple, which NumPy reads as one index per dimension: pass the row "
                            "numbers as a list, and index the tensor returned for the other dimensions.")
        if not isinstance(rows, (torch.Tensor, np.ndarray, list, range)):
            try:
                rows = operator.index(rows)  # an int, a numpy integer
            except TypeError:
                raise TypeError(f"rows are an int, a slice, row numbers (a list, tensor or array) or a boolean mask, "
                                f"not {type(rows).__name__}.") from None
        if isinstance(rows, (list, range)) and not len(rows):
            return torch.zeros(0, dtype=torch.int64)  # as in NumPy: no row numbers, no rows (not a float index)
        try:
            index = torch.as_tensor(rows, device="cpu")
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"rows {rows!r} are not row numbers or a boolean mask ({error}).") from None
        if index.dtype == torch.bool:
            if index.shape != (self.rows,):
                raise IndexError(f"a boolean mask of rows has one entry per row, {self.rows} here; this one has shape "
                                 f"{tuple(index.shape)}.")
            return index.nonzero().reshape(-1)
        if index.dtype.is_floating_point or index.dtype.is_complex:
            raise IndexError(f"row indices are integers (or a boolean mask), not {index.dtype}.")
        index = index.to(torch.int64)
        outside = index[(index < -self.rows) | (index >= self.rows)]
        if outside.numel():
            raise IndexError(f"rows {outside.unique().tolist()[:5]} reach beyond this collection's {self.rows} rows "
                             f"(row numbers go from -{self.rows} to {self.rows - 1}).")
        return index % max(self.rows, 1)

    def _read(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """The rows at ``positions``, read shard by shard from the memory-mapped files into one tensor."""
        if not self._files:
            raise CollectionError(f"{self.folder} holds no shard yet: run collect to collect its batches.")
        with safe_open(self._files[0], "pt") as file:
            empty = file.get_slice(name)[0:0]  # the dtype and row shape
        out = torch.empty((len(positions), *empty.shape[1:]), dtype=empty.dtype)
        shard_of = torch.searchsorted(self._first_rows, positions, right=True) - 1
        done = 0
        for shard, count in zip(*(t.tolist() for t in torch.unique_consecutive(shard_of, return_counts=True))):
            wanted = positions[done:done + count] - self._first_rows[shard]
            low, high = int(wanted.min()), int(wanted.max()) + 1
            with safe_open(self._files[shard], "pt") as file:
                block = file.get_slice(name)[low:high]  # only these bytes of the file are read
            if block.dtype != out.dtype:  # shards of two writers (an earlier nnterp did not record them)
                raise CollectionError(
                    f"{self._files[shard].name} holds {name} as {block.dtype}, {self._files[0].name} as {out.dtype}: "
                    "the folder mixes the shards of writers of different dtypes, which are never cast into one. "
                    "Collect again into a new folder.")
            contiguous = high - low == count and bool((wanted[1:] > wanted[:-1]).all())
            out[done:done + count] = block if contiguous else block[wanted - low]
            done += count
        return out

    @property
    def offsets(self) -> torch.Tensor:
        """Row offsets of each prompt (``offsets[i]:offsets[i+1]`` are prompt i's tokens)."""
        counts = [self._read_whole(path, "_tokens_per_prompt") for path in self._files]
        return torch.cat([torch.zeros(1, dtype=torch.int64), *counts]).cumsum(0)

    @staticmethod
    def _read_whole(path: Path, name: str) -> torch.Tensor:
        with safe_open(path, "pt") as file:
            return file.get_tensor(name)

    def to_dataset(self, values: Sequence[str] | None = None, cache_dir: str | Path | None = None):
        """The collection as a Hugging Face ``datasets.Dataset`` (Arrow, on disk), one row per collected row.

        One column per value (``[layers, ...]`` arrays; bfloat16 is widened to float32, which Arrow
        lacks) and ``prompt``, the index of the row's prompt. Built shard by shard, so memory stays flat.
        """
        try:
            import datasets
        except ImportError:
            raise ImportError("Collection.to_dataset needs the datasets package: pip install 'nnterp[datasets]' "
                              "(or pip install datasets).") from None
        names = [value_name(v) for v in ([values] if isinstance(values, str) else values or self.values)]
        for name in names:
            if name not in self.values:
                raise KeyError(f"{name!r} was not collected here; this collection holds {', '.join(self.values)}.")
        features = {"prompt": datasets.Value("int64")}
        for name in names:
            sample = self[name, :0]
            shape = tuple(sample.shape[1:])
            dtype = torch.float32 if sample.dtype == torch.bfloat16 else sample.dtype
            array = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}[len(shape)]
            features[name] = array(shape=shape, dtype=str(dtype).removeprefix("torch."))
        return datasets.Dataset.from_generator(
            _dataset_rows, features=datasets.Features(features), cache_dir=str(cache_dir) if cache_dir else None,
            gen_kwargs={"shards": tuple(zip(self._starts, map(str, self._files))), "names": tuple(names),
                        "contents": self._contents()})

    def _contents(self) -> str:
        """One hash of every shard's checksum: what the dataset cache keys on, besides the folder."""
        return hashlib.sha256(" ".join(shard["sha256"] for shard in self._ordered).encode()).hexdigest()

    @property
    def values(self) -> list[str]:
        return list(self.settings["values"])

    @property
    def features(self) -> list[str]:
        """The names of the dictionaries' features collected here (``"features/layers.5.layer_output"``)."""
        return list(self.settings.get("features", {}))

    def to_saelens(self, folder: str | Path, hook_names: Sequence[str] | None = None,
                   context_size: int | None = None):
        """Write the collection in SAELens's cached-activations layout; returns the ``datasets.Dataset``.

        The layout of SAELens's ``CacheActivationsRunner``: a Hugging Face ``datasets`` folder
        (``save_to_disk``) with one ``Array2D(shape=(context_size, d_in))`` column per TransformerLens hook
        name and ``token_ids`` (``Sequence(int32, length=context_size)``), one example per context, which
        SAELens's ``ActivationsStore`` reads (``cached_activations_path=folder``, ``hook_name``, ``context_size``,
        ``d_in`` as written). ``hook_names`` (``["blocks.5.hook_resid_post", ...]``) picks the values and
        layers to write, translated by the dictionaries' table (``site_table()``); by default every collected
        value at every layer. Each example is ``context_size`` consecutive rows, in prompt order: by default
        one prompt's tokens (every prompt must then have as many); with ``context_size`` given, the rows are
        packed into contexts of that many (a prompt may span two), and the last rows that fill no context
        are left out, with a warning. bfloat16 is widened to float32, which Arrow lacks.
        """
        try:
            import datasets
        except ImportError:
            raise ImportError("Collection.to_saelens needs the datasets package: pip install 'nnterp[datasets]' "
                              "(or pip install datasets).") from None
        folder = Path(folder)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise FileExistsError(f"{folder} is not an empty folder: SAELens's activations folder holds one dataset. "
                                  "Pass a new folder (or delete this one).")
        if not self.complete:
            raise CollectionError(f"{self.folder} is incomplete (batches {self.missing} missing): run collect again "
                                  "with the same arguments to finish it before exporting it.")
        columns = self._saelens_columns(hook_names)
        with safe_open(self._files[0], "pt") as file:
            if "_token_ids" not in file.keys():
                raise CollectionError(f"{self.folder} does not hold the rows' token ids (it was collected by an "
                                      "earlier nnterp), which SAELens's layout has: collect it again into a new folder.")
        counts = self.offsets.diff()
        if context_size is None:
            lengths = counts.unique().tolist()
            if len(lengths) != 1:
                raise ValueError(f"The prompts have from {min(lengths)} to {max(lengths)} collected tokens, and an "
                                 "example of SAELens's layout has context_size of them: pass context_size=N to pack "
                                 "the rows into contexts of N tokens.")
            context_size = lengths[0]
        if context_size < 1 or self.rows < context_size:
            raise ValueError(f"context_size={context_size}: the collection's {self.rows} rows fill no context of that "
                             "many tokens.")
        left = self.rows % context_size
        if left:
            warnings.warn(f"to_saelens: the last {left} of {self.rows} rows fill no context of {context_size} "
                          "tokens and are left out.", stacklevel=2)
        features = {"token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)}
        for hook, (name, layer) in columns.items():
            sample = _saelens_view(self[name, :0][:, layer])
            dtype = torch.float32 if sample.dtype == torch.bfloat16 else sample.dtype
            features[hook] = datasets.Array2D(shape=(context_size, sample.shape[-1]),
                                              dtype=str(dtype).removeprefix("torch."))
        features = datasets.Features({hook: features[hook] for hook in columns} | {"token_ids": features["token_ids"]})
        with tempfile.TemporaryDirectory(prefix="nnterp-saelens-") as cache:  # the generator's Arrow, then copied
            dataset = datasets.Dataset.from_generator(
                _saelens_rows, features=features, cache_dir=cache,
                gen_kwargs={"files": tuple(map(str, self._files)), "columns": tuple(columns.items()),
                            "context_size": context_size})
            dataset.save_to_disk(str(folder))
            del dataset
        return datasets.load_from_disk(str(folder))

    def _saelens_columns(self, hook_names) -> dict[str, tuple[str, int]]:
        """``{hook name: (value, index among the collected layers)}``."""
        layers = self.settings["layers"]
        if hook_names is None:
            columns = {}
            for name in self.values:
                for layer in dict.fromkeys(layers):
                    hook = transformerlens_hook(layer, name)
                    if hook is None:
                        raise ValueError(f"{name} has no TransformerLens hook name (site_table() lists them), so SAELens "
                                         "cannot name its column: pass hook_names=[...] for the values to write.")
                    columns[hook] = name, layers.index(layer)
            return columns
        hook_names = [hook_names] if isinstance(hook_names, str) else list(hook_names)
        if not hook_names:
            raise ValueError("hook_names is empty: name at least one hook, e.g. 'blocks.5.hook_resid_post'.")
        columns = {}
        for hook in hook_names:
            site, reason = transformerlens_site(hook)
            if site is None:
                raise ValueError(f"{hook!r} names no standard value: {reason}.")
            layer, name = site
            if name not in self.values or layer not in layers:
                raise KeyError(f"{hook} is layers[{layer}].{name}, which was not collected here (values "
                               f"{', '.join(self.values)} at layers {layers}).")
            columns[hook] = name, layers.index(layer)
        return columns

    @property
    def rows(self) -> int:
        return sum(shard["rows"] for shard in self._shards.values())

    def __repr__(self) -> str:
        status = "complete" if self.complete else f"incomplete: batches {self.missing} missing"
        return (f"Collection({str(self.folder)!r}: {self.rows} rows of {', '.join(self.values + self.features)} at layers "
                f"{self.settings['layers']}, positions {self.settings['positions']}, "
                f"{self.settings['prompts']} prompts; {status})")


def _dataset_rows(shards: tuple[tuple[int, str], ...], names: tuple[str, ...], contents: str):
    """One example per collected row, shard by shard (``contents`` names the shards' contents, for the cache)."""
    for first_prompt, path in shards:
        with safe_open(path, "pt") as file:
            columns = {name: file.get_tensor(name) for name in names}
            counts = file.get_tensor("_tokens_per_prompt")
        prompts = torch.repeat_interleave(torch.arange(first_prompt, first_prompt + len(counts)), counts)
        columns = {name: (t.float() if t.dtype == torch.bfloat16 else t).numpy() for name, t in columns.items()}
        for row, index in enumerate(prompts.tolist()):
            yield {"prompt": index, **{name: column[row] for name, column in columns.items()}}


def _saelens_view(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` as the ``[rows, d_in]`` SAELens reads: per-head values flattened (its ``hook_z`` reshaping)."""
    return tensor.flatten(1) if tensor.dim() > 2 else tensor


def _saelens_rows(files: tuple[str, ...], columns: tuple[tuple[str, tuple[str, int]], ...], context_size: int):
    """One example per ``context_size`` consecutive rows, shard by shard; the rows of a context not yet full are
    carried to the next shard."""
    carried: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, "pt") as file:
            read = {"token_ids": file.get_tensor("_token_ids").to(torch.int32)}
            whole = {name: file.get_tensor(name) for name in {name for _, (name, _) in columns}}
        for hook, (name, layer) in columns:
            column = _saelens_view(whole[name][:, layer])
            read[hook] = column.float() if column.dtype == torch.bfloat16 else column
        read = {key: torch.cat([carried[key], tensor]) if key in carried else tensor for key, tensor in read.items()}
        full = len(read["token_ids"]) // context_size * context_size
        carried = {key: tensor[full:] for key, tensor in read.items()}
        arrays = {key: tensor[:full].reshape(-1, context_size, *tensor.shape[1:]).numpy() for key, tensor in read.items()}
        for example in range(full // context_size):
            yield {key: array[example] for key, array in arrays.items()}


def _manifest_paths(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("manifest*.json") if path.name == MANIFEST
                  or WORKER_MANIFEST.fullmatch(path.name))


def _read_manifests(folder: Path) -> dict[str, dict]:
    """Every worker's manifest in ``folder``, by file name."""
    paths = _manifest_paths(folder) if folder.is_dir() else []
    if not paths:
        raise CollectionError(f"{folder} holds no collection ({MANIFEST} is missing).")
    return {path.name: _read_manifest(path) for path in paths}


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest["shards"], dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        manifest["settings"]["prompts"]  # noqa: B018 - present, or the manifest is not one of ours
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CollectionError(f"{path} is damaged ({type(error).__name__}: {error}). Delete the folder and collect "
                              "again, or use another folder.") from None


def _write_manifest(path: Path, settings: dict, shards: dict, writer: dict) -> None:
    text = json.dumps({"format": FORMAT, "settings": settings, "writer": writer, "shards": shards}, indent=1)
    _write_atomically(path, lambda temporary: Path(temporary).write_text(text))


def _write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Write to a temporary file beside ``path``, then rename it into place: readers see all of it or none."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(str(temporary))
    os.replace(temporary, path)


def _shard_file(start: int) -> str:
    return f"batch-{start:09d}.safetensors"


def _shard_problem(folder: Path, shard: dict, checksum: bool = True) -> str | None:
    path = folder / shard["file"]
    if not path.is_file():
        return f"{shard['file']} is missing"
    if shard.get("bytes", path.stat().st_size) != path.stat().st_size:  # shards written before sizes were recorded
        return f"{shard['file']} is damaged (its size differs from the one recorded)"
    if checksum and _sha256(path) != shard["sha256"]:
        return f"{shard['file']} is damaged (its checksum differs from the one recorded)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(positions) -> str:
    return positions if isinstance(positions, str) else (
        f"index {positions}" if isinstance(positions, int) else f"mask {getattr(positions, '__name__', 'fn')}")


def _fingerprint(prompts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


# -- who wrote the values --------------------------------------------------------------------------

VOLATILE_CONFIG = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}  # not the model (dtype: weights)
WRITER_FIELDS = {"model": "the model's class", "config": "the model's config", "weights": "the model's weights",
                 "dtype": "the dtype of the values", "mask": "the positions mask function (its code or the values it reads)",
                 "dictionaries": "the dictionaries whose features are collected (a digest of their weights)"}


def _writer(model, positions, dtype, remote) -> dict:
    """What makes the values: a resume, or another worker, must have the same to add rows to a folder."""
    module = model._module
    kind = type(module)
    if remote:  # the server's weights are the checkpoint's, whatever this copy holds
        weights = f"remote {model.repo_id}@{getattr(model, 'revision', None) or 'main'}"
    else:
        weights = _weights_digest(module)
    return {"model": f"{kind.__module__}.{kind.__qualname__}",
            "config": _digest(json.dumps(_without(json.loads(module.config.to_json_string(use_diff=False))),
                                         sort_keys=True)),
            "weights": weights, "dtype": str(dtype or module.dtype),
            "mask": _mask_identity(positions) if callable(positions) else None}


def _differences(ours: dict | None, theirs: dict | None, here: str, there: str) -> list[str]:
    """What differs between two writers, in words; ``None`` is a manifest that records no writer."""
    if ours is None or theirs is None:
        return [] if ours is theirs else [f"{there if theirs is None else here} records no writer"]
    shown = {"model", "dtype"}  # the others are digests: naming them says enough
    order = [*WRITER_FIELDS, *sorted((set(ours) | set(theirs)) - set(WRITER_FIELDS))]  # a later nnterp's fields last
    return [WRITER_FIELDS.get(field, field) + (f" ({ours.get(field)} in {here}, {theirs.get(field)} in {there})"
                                               if field in shown else "")
            for field in order if ours.get(field) != theirs.get(field)]


def _without(config):
    """A config without what differs between two copies of the same model (where it was loaded from, ...)."""
    if isinstance(config, dict):
        return {key: _without(value) for key, value in config.items() if key not in VOLATILE_CONFIG}
    return [_without(value) for value in config] if isinstance(config, list) else config


def _weights_digest(module: torch.nn.Module) -> str:
    """A checksum of ``SAMPLED`` evenly spaced values of every weight: exact bytes, the same on every device."""
    digest = hashlib.sha256()
    buffers = [(f"{prefix}.{name}" if prefix else name, buffer) for prefix, owner in module.named_modules()
               for name, buffer in owner._buffers.items()
               if buffer is not None and name not in owner._non_persistent_buffers_set]
    for name, tensor in [*module.named_parameters(), *buffers]:
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        if tensor.device.type == "meta" or not tensor.numel():  # offloaded: not here to read
            continue
        flat = tensor.detach().reshape(-1)
        count = min(flat.numel(), SAMPLED)
        picked = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)  # integer steps: no rounding
        digest.update(flat[picked.to(flat.device)].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def _mask_identity(function) -> str:
    """A digest that tells two mask functions apart across processes: code by its bytecode and constants, data by
    its contents.

    A function of the mask's own module is its code, its defaults, its closure's values and the values of
    the globals it names; one of another module (a library's) is its name; a torch module is its
    weights' checksum. Any other object is its type and repr (a repr holding an address differs
    between processes: a resume with it is refused, never wrongly accepted).
    """
    home, seen = getattr(function, "__module__", None), set()

    def cell_contents(cell):
        try:
            return describe(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            return "empty cell"

    def describe(value):
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return value
        if isinstance(value, (tuple, list)):
            return type(value).__name__, tuple(map(describe, value))
        if isinstance(value, (set, frozenset)):
            return "set", tuple(sorted(repr(describe(item)) for item in value))
        if isinstance(value, dict):
            return "dict", tuple(sorted((repr(describe(k)), repr(describe(v))) for k, v in value.items()))
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return "tensor", str(value.dtype), tuple(value.shape), _digest(data)
        if isinstance(value, np.ndarray):
            return "array", value.dtype.str, value.shape, _digest(np.ascontiguousarray(value).tobytes())
        if isinstance(value, types.CodeType):
            return ("code", value.co_code, describe(value.co_consts), value.co_names, value.co_varnames,
                    value.co_freevars, value.co_argcount, value.co_kwonlyargcount)
        named = (types.ModuleType, type, types.BuiltinFunctionType)
        if isinstance(value, named) or (isinstance(value, types.FunctionType) and value.__module__ != home):
            return type(value).__name__, getattr(value, "__module__", None), getattr(value, "__qualname__", value.__name__)
        if id(value) in seen:  # a function that names itself
            return "again", getattr(value, "__qualname__", type(value).__qualname__)
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            code, defined = value.__code__, value.__globals__
            return ("function", describe(code), describe(value.__defaults__), describe(value.__kwdefaults__),
                    tuple(map(cell_contents, value.__closure__ or ())),
                    tuple((name, describe(defined[name])) for name in sorted(_names(code)) if name in defined))
        if isinstance(value, types.MethodType):
            return "method", describe(value.__func__), describe(value.__self__)
        if isinstance(value, functools.partial):
            return "partial", describe(value.func), describe(value.args), describe(value.keywords)
        if isinstance(value, torch.nn.Module):  # a module read by the mask: its weights' checksum, not all of them
            return "module", describe(type(value)), _weights_digest(value)
        if value is function or value is getattr(function, "__self__", None):  # the mask's own object: its data
            call = type(value).__call__ if value is function else None
            return "data", describe(type(value)), describe(call), describe(getattr(value, "__dict__", None))
        return "object", describe(type(value)), repr(value)

    return _digest(repr(describe(function)))


def _names(code: types.CodeType) -> set[str]:
    """Every name ``code`` and the functions inside it look up (globals among them)."""
    return set(code.co_names).union(*(_names(const) for const in code.co_consts if isinstance(const, types.CodeType)))


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:24]
