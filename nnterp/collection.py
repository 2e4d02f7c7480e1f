"""Activation collection at scale: batched, written to disk as it goes, resumable, verified.

``collect(model, prompts, folder, values=["layer_output"])`` runs the prompts in batches and
writes each batch's activations to its own safetensors file, so memory stays flat whatever
the number of prompts. The manifest records every shard with its rows and checksum, and each
file is written whole or not at all (a temporary file, then a rename), so a rerun with the same
folder resumes after the last shard recorded, never duplicates a row, and a damaged collection
says what is missing. ``Collection(folder)`` reads it back as tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import nnsight
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .catalog import BY_NAME
from .selection import forward_order, layer_indices, token_index, value_name

MANIFEST = "manifest.json"
FORMAT = 2  # 2: shards recorded with their rows and checksums


class CollectionError(ValueError):
    """A collection folder that cannot be resumed or read as it is; the message says what to do."""


def collect(model, prompts: Sequence[str], folder: str | Path, values: Sequence[str] = ("layer_output",),
            layers=None, positions: str | int | Callable = "last", batch_size: int = 32,
            dtype: torch.dtype | None = None, progress: bool = True, remote: bool | str = False) -> Collection:
    """Collect ``values`` at ``layers`` for every prompt into ``folder``.

    ``positions``: ``"last"`` (each prompt's last token, ``[prompts, layers, ...]``), an int (each
    prompt's own token at that index; an error for a prompt too short), ``"all"`` (every real token,
    concatenated: ``[tokens, layers, ...]``, with ``Collection.offsets`` giving each prompt's rows),
    or a function ``(input_ids, attention_mask) -> bool mask [batch, seq]`` (the selected tokens,
    concatenated like ``"all"``). Padding is never collected, whichever side the tokenizer pads.
    ``layers`` come back in the order given. ``remote=True`` runs each batch on the remote model;
    only the selected rows travel back.
    """
    if isinstance(prompts, str):
        raise TypeError("collect takes a list of prompts, not one string (it would collect one row per character): "
                        "pass [prompt].")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("collect needs at least one prompt.")
    folder = Path(folder)
    names = [value_name(v) for v in values]
    layers = layer_indices(model, layers)
    settings = {"prompts": len(prompts), "values": names, "layers": layers, "positions": _describe(positions),
                "batch_size": batch_size, "fingerprint": _fingerprint(prompts)}
    shards = _resume(folder, settings)
    for start in tqdm(range(0, len(prompts), batch_size), desc="collecting", unit="batch", disable=not progress):
        if str(start) in shards:
            continue
        tensors = _collect_batch(model, prompts[start:start + batch_size], names, layers, positions, dtype, remote)
        name = f"batch-{start:09d}.safetensors"
        _write_atomically(folder / name, lambda path, tensors=tensors: save_file(tensors, path))
        shards[str(start)] = {"file": name, "rows": int(tensors[names[0]].shape[0]), "sha256": _sha256(folder / name)}
        _write_manifest(folder, settings, shards)  # after the shard: a kill between the two only redoes this batch
    return Collection(folder)


def _resume(folder: Path, settings: dict) -> dict:
    """The shards already recorded for these settings (none for a new folder); a clear error otherwise."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        leftovers = sorted(folder.glob("batch-*.safetensors")) if folder.is_dir() else []
        if leftovers:
            raise CollectionError(
                f"{folder} holds {len(leftovers)} shard file(s) but no {MANIFEST}, so which rows they hold is "
                "unknown. Delete the folder (or those files) to start over, or use another folder.")
        folder.mkdir(parents=True, exist_ok=True)
        return {}
    saved = _read_manifest(folder)
    if saved["settings"] != settings:
        raise CollectionError(f"{folder} holds a collection made with other settings ({saved['settings']}); use "
                              "another folder, or delete it to start over.")
    # a shard that is missing or damaged is collected again
    return {start: shard for start, shard in saved["shards"].items() if _shard_problem(folder, shard) is None}


def _collect_batch(model, batch, names, layers, positions, dtype, remote=False) -> dict[str, torch.Tensor]:
    inputs = model.tokenizer(batch, return_tensors="pt", padding=True)  # tokenized once: the trace runs on it
    select = _selection(inputs, positions)
    read_layers = forward_order(layers)
    order = {layer: model.order(layer) for layer in read_layers}
    with torch.no_grad(), model.trace(inputs, remote=remote):
        read = {}
        for layer in read_layers:
            for name in sorted(names, key=lambda n, layer=layer: order[layer][BY_NAME[n].key]):  # forward order
                read[(name, layer)] = model.read_value(layer, name)
        # the selection runs where the model does (remotely too): only the chosen rows come back
        tensors = nnsight.save({})
        for name in names:
            # each layer's rows selected on its own device (a model split across devices), then gathered
            chosen = {layer: read[(name, layer)][select.to(read[(name, layer)].device)].detach().cpu()
                      for layer in read_layers}
            stacked = torch.stack([chosen[layer] for layer in layers], dim=1)  # [tokens, layers, ...]
            tensors[name] = (stacked.to(dtype) if dtype else stacked).contiguous()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
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


class Collection:
    """A collection on disk, read back as tensors: ``collection["layer_output"]`` is ``[rows, layers, ...]``.

    Opening it checks every recorded shard (present, whole, unchanged); ``complete`` is true only
    when every batch is there, and ``missing`` lists the batches that are not.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        manifest = _read_manifest(self.folder)
        self.settings = manifest["settings"]
        self._shards = manifest["shards"]
        problems = {start: _shard_problem(self.folder, shard) for start, shard in self._shards.items()}
        damaged = {start: problem for start, problem in problems.items() if problem}
        if damaged:
            raise CollectionError(
                f"{self.folder}: " + "; ".join(f"batch {start}: {problem}" for start, problem in sorted(damaged.items()))
                + ". Run collect again with the same arguments to collect those batches again.")
        expected = {str(start) for start in range(0, self.settings["prompts"], self.settings["batch_size"])}
        self.missing = sorted(int(start) for start in expected - set(self._shards))
        self.complete = not self.missing

    def _files(self) -> list[Path]:
        return [self.folder / self._shards[start]["file"] for start in sorted(self._shards, key=int)]

    def __getitem__(self, value: str) -> torch.Tensor:
        name = value_name(value)  # "mlp.mlp_output" and "mlp_output" name the same value
        if name not in self.values:
            raise KeyError(f"{value!r} was not collected here; this collection holds {', '.join(self.values)}.")
        return torch.cat([load_file(path)[name] for path in self._files()])

    @property
    def offsets(self) -> torch.Tensor:
        """Row offsets of each prompt (``offsets[i]:offsets[i+1]`` are prompt i's tokens)."""
        counts = torch.cat([load_file(path)["_tokens_per_prompt"] for path in self._files()])
        return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    @property
    def values(self) -> list[str]:
        return list(self.settings["values"])

    @property
    def rows(self) -> int:
        return sum(shard["rows"] for shard in self._shards.values())

    def __repr__(self) -> str:
        status = "complete" if self.complete else f"incomplete: batches {self.missing} missing"
        return (f"Collection({str(self.folder)!r}: {self.rows} rows of {', '.join(self.values)} at layers "
                f"{self.settings['layers']}, positions {self.settings['positions']}, "
                f"{self.settings['prompts']} prompts; {status})")


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest["shards"], dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        manifest["settings"]["prompts"]  # noqa: B018 - present, or the manifest is not one of ours
        return manifest
    except FileNotFoundError:
        raise CollectionError(f"{folder} holds no collection ({MANIFEST} is missing).") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CollectionError(f"{path} is damaged ({type(error).__name__}: {error}). Delete the folder and collect "
                              "again, or use another folder.") from None


def _write_manifest(folder: Path, settings: dict, shards: dict) -> None:
    text = json.dumps({"format": FORMAT, "settings": settings, "shards": shards}, indent=1)
    _write_atomically(folder / MANIFEST, lambda path: Path(path).write_text(text))


def _write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Write to a temporary file beside ``path``, then rename it into place: readers see all of it or none."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(str(temporary))
    os.replace(temporary, path)


def _shard_problem(folder: Path, shard: dict) -> str | None:
    path = folder / shard["file"]
    if not path.is_file():
        return f"{shard['file']} is missing"
    if _sha256(path) != shard["sha256"]:
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
