"""Activation collection at scale: batched, written to disk as it goes, resumable.

``collect(model, prompts, folder, values=["layer_output"])`` runs the prompts in batches and
writes each batch's activations to its own safetensors file, so memory stays flat whatever
the number of prompts. A rerun with the same folder skips the batches already written.
``Collection(folder)`` reads them back as tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import nnsight
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .catalog import BY_NAME
from .selection import layer_indices, value_name

MANIFEST = "manifest.json"


def collect(model, prompts: Sequence[str], folder: str | Path, values: Sequence[str] = ("layer_output",),
            layers=None, positions: str | int | Callable = "last", batch_size: int = 32,
            dtype: torch.dtype | None = None, progress: bool = True, remote: bool | str = False) -> Collection:
    """Collect ``values`` at ``layers`` for every prompt into ``folder``.

    ``positions``: ``"last"`` (the last token, ``[prompts, layers, ...]``), an int index, ``"all"``
    (every real token, concatenated: ``[tokens, layers, ...]``, with ``Collection.offsets`` giving
    each prompt's rows), or a function ``(input_ids, attention_mask) -> bool mask [batch, seq]``
    (the selected tokens, concatenated like ``"all"``). Batches are left-padded; padding is never
    collected. ``remote=True`` runs each batch on the remote model; only the selected rows travel back.
    """
    folder = Path(folder)
    names = [value_name(v) for v in values]
    layers = layer_indices(model, layers)
    settings = {"prompts": len(prompts), "values": names, "layers": layers, "positions": _describe(positions),
                "batch_size": batch_size, "fingerprint": _fingerprint(prompts)}
    manifest = folder / MANIFEST
    if manifest.is_file():
        saved = json.loads(manifest.read_text())
        if saved["settings"] != settings:
            raise ValueError(f"{folder} holds a collection made with other settings ({saved['settings']}); "
                             "use another folder, or delete it to start over.")
        done = set(saved["batches"])
    else:
        folder.mkdir(parents=True, exist_ok=True)
        done = set()
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="collecting", unit="batch", disable=not progress):
        if start in done:
            continue
        batch = list(prompts[start:start + batch_size])
        tensors = _collect_batch(model, batch, names, layers, positions, dtype, remote)
        save_file(tensors, folder / f"batch-{start:09d}.safetensors")
        done.add(start)
        manifest.write_text(json.dumps({"settings": settings, "batches": sorted(done)}))  # after the shard: resumable
    return Collection(folder)


def _collect_batch(model, batch, names, layers, positions, dtype, remote=False) -> dict[str, torch.Tensor]:
    inputs = model.tokenizer(batch, return_tensors="pt", padding=True)  # tokenized once: the trace runs on it
    select = _selection(inputs, positions)
    order = [model.order(layer) for layer in layers]
    with torch.no_grad(), model.trace(inputs, remote=remote):
        read = {}
        for layer, ranks in zip(layers, order):
            for name in sorted(names, key=lambda n: ranks[BY_NAME[n].key]):  # forward order within a block
                read[(name, layer)] = model.read_value(layer, name)
        # the selection runs where the model does (remotely too): only the chosen rows come back
        tensors = nnsight.save({})
        for name in names:
            # each layer's rows selected on its own device (a model split across devices), then gathered
            chosen = torch.stack([read[(name, layer)][select.to(read[(name, layer)].device)].detach().cpu()
                                  for layer in layers], dim=1)  # [tokens, layers, ...]
            tensors[name] = (chosen.to(dtype) if dtype else chosen).contiguous()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
    return tensors


def _selection(inputs, positions) -> torch.Tensor:
    """``[batch, seq]`` bool: the tokens to collect, never padding."""
    mask = inputs.attention_mask.bool()
    if positions == "last":
        select = torch.zeros_like(mask)
        select[:, -1] = True  # left padding: the last column is every prompt's last token
    elif isinstance(positions, int):
        select = torch.zeros_like(mask)
        lengths = mask.sum(dim=1)
        for row, length in enumerate(lengths.tolist()):  # index within the prompt's own tokens
            select[row, mask.shape[1] - length + (positions % length)] = True
    elif positions == "all":
        select = mask
    elif callable(positions):
        select = positions(inputs.input_ids, inputs.attention_mask).bool() & mask
    else:
        raise ValueError(f"positions is 'last', 'all', an int or a mask function, not {positions!r}.")
    return select


class Collection:
    """A collection on disk, read back as tensors: ``collection["layer_output"]`` is ``[rows, layers, ...]``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        manifest = json.loads((self.folder / MANIFEST).read_text())
        self.settings = manifest["settings"]
        self.complete = len(manifest["batches"]) == -(-self.settings["prompts"] // self.settings["batch_size"])

    def _shards(self) -> list[Path]:
        return sorted(self.folder.glob("batch-*.safetensors"))

    def __getitem__(self, value: str) -> torch.Tensor:
        name = value_name(value)  # "mlp.mlp_output" and "mlp_output" name the same value
        if name not in self.values:
            raise KeyError(f"{value!r} was not collected here; this collection holds {', '.join(self.values)}.")
        return torch.cat([load_file(shard)[name] for shard in self._shards()])

    @property
    def offsets(self) -> torch.Tensor:
        """Row offsets of each prompt (``offsets[i]:offsets[i+1]`` are prompt i's tokens)."""
        counts = torch.cat([load_file(shard)["_tokens_per_prompt"] for shard in self._shards()])
        return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    @property
    def values(self) -> list[str]:
        return list(self.settings["values"])


def _describe(positions) -> str:
    return positions if isinstance(positions, str) else (
        f"index {positions}" if isinstance(positions, int) else f"mask {getattr(positions, '__name__', 'fn')}")


def _fingerprint(prompts: Sequence[str]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]
