"""A collection read back from its folder: ``Collection(folder)``, memory-mapped, in prompt order, checked."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..spec.selection import value_name
from . import export
from .provenance import differences
from .shards import FEATURES, CollectionError, read_manifests, shard_problem


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
        manifests = read_manifests(self.folder)
        settings = [saved["settings"] for saved in manifests.values()]
        if any(other != settings[0] for other in settings[1:]):
            raise CollectionError(
                f"{self.folder} holds manifests of different collections ({', '.join(manifests)}): the workers were "
                "not given the same arguments. Keep the manifests (and shards) of one collection per folder.")
        self.settings = settings[0]
        writers = {name: saved.get("writer") for name, saved in manifests.items()}
        first = next(iter(writers))
        for name, writer in writers.items():
            differing = differences(writers[first], writer, first, name)
            if differing:
                raise CollectionError(
                    f"{self.folder} holds the rows of different writers ({'; '.join(differing)}): they are not the "
                    "same values and are never merged. Keep one writer's manifests (and shards) per folder, or "
                    "collect again into a new folder.")
        self.writer = writers[first]  # who wrote the values (None: an earlier nnterp, which did not record it)
        self._shards = {start: shard for saved in manifests.values() for start, shard in saved["shards"].items()}
        problems = {start: shard_problem(self.folder, shard, verify) for start, shard in self._shards.items()}
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
        return export.to_dataset(self, values, cache_dir)

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
        return export.to_saelens(self, folder, hook_names, context_size)

    @property
    def rows(self) -> int:
        return sum(shard["rows"] for shard in self._shards.values())

    def __repr__(self) -> str:
        status = "complete" if self.complete else f"incomplete: batches {self.missing} missing"
        return (f"Collection({str(self.folder)!r}: {self.rows} rows of {', '.join(self.values + self.features)} at layers "
                f"{self.settings['layers']}, positions {self.settings['positions']}, "
                f"{self.settings['prompts']} prompts; {status})")
