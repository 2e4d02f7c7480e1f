"""Activation collection at scale: batched, written to disk as it goes, resumable, verified.

``collect(model, prompts, folder, values=["layer_output"])`` runs the prompts in batches and
writes each batch's activations to its own safetensors file, so memory stays flat whatever
the number of prompts. The manifest records every shard with its rows and checksum, and each
file is written whole or not at all (a temporary file, then a rename), so a rerun with the same
folder resumes after the last shard recorded, never duplicates a row, and a damaged collection
says what is missing. Several workers split one prompt list with ``shard=(rank, world)``: each
writes its own batches and its own manifest into the same folder. ``Collection(folder)`` reads
all of it back, in prompt order, memory-mapped: ``collection["layer_output", 1000:2000]`` reads
those rows only.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nnsight
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .catalog import BY_NAME
from .selection import forward_order, layer_indices, token_index, value_name

MANIFEST = "manifest.json"
WORKER_MANIFEST = re.compile(r"manifest-(\d+)-of-(\d+)\.json")
RECORD_EVERY_S = 1.0  # how often the manifest is rewritten while shards are written
FORMAT = 2  # 2: shards recorded with their rows and checksums (a manifest per worker since shard=)


class CollectionError(ValueError):
    """A collection folder that cannot be resumed or read as it is; the message says what to do."""


def collect(model, prompts: Sequence[str], folder: str | Path, values: Sequence[str] = ("layer_output",),
            layers=None, positions: str | int | Callable = "last", batch_size: int = 32,
            dtype: torch.dtype | None = None, progress: bool = True, remote: bool | str = False,
            shard: tuple[int, int] = (0, 1)) -> Collection:
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
    """
    if isinstance(prompts, str):
        raise TypeError("collect takes a list of prompts, not one string (it would collect one row per character): "
                        "pass [prompt].")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("collect needs at least one prompt.")
    rank, world = _worker(shard)
    folder = Path(folder)
    names = [value_name(v) for v in values]
    layers = layer_indices(model, layers)
    settings = {"prompts": len(prompts), "values": names, "layers": layers, "positions": _describe(positions),
                "batch_size": batch_size, "fingerprint": _fingerprint(prompts)}
    mine = list(range(0, len(prompts), batch_size))[rank::world]
    manifest = MANIFEST if world == 1 else f"manifest-{rank}-of-{world}.json"
    own, done = _resume(folder, settings, manifest, mine)
    todo = [start for start in mine if str(start) not in done]
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="collecting", unit="batch", disable=not progress)
    with _ShardWriter(folder, manifest, settings, own) as writer:
        for start in todo:
            tensors, ready = _to_host(_collect_batch(model, prompts[start:start + batch_size], names, layers,
                                                     positions, dtype, remote))
            writer.write(start, tensors, ready)  # written while the next batch runs
            bar.update()
    bar.close()
    return Collection(folder, verify=False)  # the shards were checked on resuming, or just written


def _worker(shard) -> tuple[int, int]:
    try:
        rank, world = (int(part) for part in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard is (rank, world), e.g. (0, 4) for the first of four workers; got {shard!r}.") from None
    if not 0 <= rank < world:
        raise ValueError(f"shard=({rank}, {world}): the rank counts workers from 0 to world - 1 = {world - 1}.")
    return rank, world


def _resume(folder: Path, settings: dict, manifest: str, mine: list[int]) -> tuple[dict, dict]:
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
    # a shard that is missing or damaged is collected again; one another worker wrote is not
    intact = {name: {start: shard for start, shard in saved["shards"].items() if _shard_problem(folder, shard) is None}
              for name, saved in manifests.items()}
    return intact.get(manifest, {}), {start: shard for shards in intact.values() for start, shard in shards.items()}


def _collect_batch(model, batch, names, layers, positions, dtype, remote=False) -> dict[str, torch.Tensor]:
    inputs = model.tokenizer(batch, return_tensors="pt", padding=True)  # tokenized once: the trace runs on it
    select = _selection(inputs, positions)
    read_layers = forward_order(layers)
    order = {layer: model.order(layer, aliases=True) for layer in read_layers}
    with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
        read = {}
        for layer in read_layers:
            for name in sorted(names, key=lambda n, layer=layer: order[layer][BY_NAME[n].key]):  # forward order
                read[(name, layer)] = model.read_value(layer, name)
        # the selection runs where the model does (remotely too): only the chosen rows come back
        tensors = nnsight.save({})
        for name in names:
            # each layer's rows selected on its own device (a model split across devices), then gathered on one
            chosen = {layer: read[(name, layer)][select.to(read[(name, layer)].device)].detach()
                      for layer in read_layers}
            device = chosen[layers[0]].device
            stacked = torch.stack([chosen[layer].to(device) for layer in layers], dim=1)  # [tokens, layers, ...]
            stacked = (stacked.to(dtype) if dtype else stacked).contiguous()
            tensors[name] = stacked.cpu() if remote else stacked  # locally, _to_host copies without blocking
        # nothing after the last value read is needed (no logits): the rest of the forward is not run
        tracer.stop()
    tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
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

    def __init__(self, folder: Path, manifest: str, settings: dict, shards: dict):
        self.folder, self.manifest, self.settings, self.shards = folder, manifest, settings, dict(shards)
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
        _write_manifest(self.folder / self.manifest, self.settings, self.shards)
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

    ``collection["layer_output", 1000:2000]`` (a slice, an int or a list of rows) reads only those
    rows, through memory-mapped shards, so a collection larger than memory reads by parts.
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
        if isinstance(key, tuple) and len(key) != 2:
            raise TypeError(f"index a collection as collection[value] or collection[value, rows], not {key!r}; "
                            "index the tensor it returns for the other dimensions.")
        value, rows = key if isinstance(key, tuple) else (key, slice(None))
        name = value_name(value)  # "mlp.mlp_output" and "mlp_output" name the same value
        if name not in self.values:
            raise KeyError(f"{value!r} was not collected here; this collection holds {', '.join(self.values)}.")
        try:
            row = operator.index(rows)  # one row (an int, a numpy or 0-d tensor integer)
        except TypeError:
            return self._read(name, self._positions(rows))
        return self._read(name, self._positions([row]))[0]

    def _positions(self, rows) -> torch.Tensor:
        if isinstance(rows, slice):
            return torch.arange(*rows.indices(self.rows))
        positions = torch.as_tensor(rows, dtype=torch.int64).flatten()
        if positions.numel() and not (-self.rows <= positions.min() and positions.max() < self.rows):
            raise IndexError(f"rows {rows} reach beyond this collection's {self.rows} rows.")
        return positions % max(self.rows, 1)

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
    def rows(self) -> int:
        return sum(shard["rows"] for shard in self._shards.values())

    def __repr__(self) -> str:
        status = "complete" if self.complete else f"incomplete: batches {self.missing} missing"
        return (f"Collection({str(self.folder)!r}: {self.rows} rows of {', '.join(self.values)} at layers "
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


def _write_manifest(path: Path, settings: dict, shards: dict) -> None:
    text = json.dumps({"format": FORMAT, "settings": settings, "shards": shards}, indent=1)
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
