"""A collection on disk: its shards, each written whole or not at all, and the manifests that record them.

Each batch's activations are one safetensors file, written to a temporary file and renamed into place; a
worker's manifest records every shard with its rows, size and checksum, rewritten as shards land (at most once a
second) by ``ShardWriter``, which writes on a background thread while the next batch runs. ``resume`` reads what a
folder already holds, checked: the same settings, the same writer, shards intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..spec.errors import NNterpError
from .provenance import differences

MANIFEST = "manifest.json"
WORKER_MANIFEST = re.compile(r"manifest-(\d+)-of-(\d+)\.json")
RECORD_EVERY_S = 1.0  # how often the manifest is rewritten while shards are written
FEATURES = "features/"  # a dictionary's features are collected as "features/<name>"
FORMAT = 2  # 2: shards recorded with their rows and checksums (a manifest per worker since shard=; "writer" since)


class CollectionError(NNterpError, ValueError):
    """A collection folder that cannot be resumed or read as it is; the message says what to do."""


def manifest_paths(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("manifest*.json") if path.name == MANIFEST
                  or WORKER_MANIFEST.fullmatch(path.name))


def read_manifests(folder: Path) -> dict[str, dict]:
    """Every worker's manifest in ``folder``, by file name."""
    paths = manifest_paths(folder) if folder.is_dir() else []
    if not paths:
        raise CollectionError(f"{folder} holds no collection ({MANIFEST} is missing).")
    return {path.name: read_manifest(path) for path in paths}


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest["shards"], dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        manifest["settings"]["prompts"]  # noqa: B018 - present, or the manifest is not one of ours
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CollectionError(f"{path} is damaged ({type(error).__name__}: {error}). Delete the folder and collect "
                              "again, or use another folder.") from None


def write_manifest(path: Path, settings: dict, shards: dict, writer: dict) -> None:
    text = json.dumps({"format": FORMAT, "settings": settings, "writer": writer, "shards": shards}, indent=1)
    write_atomically(path, lambda temporary: Path(temporary).write_text(text))


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Write to a temporary file beside ``path``, then rename it into place: readers see all of it or none."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(str(temporary))
    os.replace(temporary, path)


def shard_file(start: int) -> str:
    return f"batch-{start:09d}.safetensors"


def shard_problem(folder: Path, shard: dict, checksum: bool = True) -> str | None:
    path = folder / shard["file"]
    if not path.is_file():
        return f"{shard['file']} is missing"
    if shard.get("bytes", path.stat().st_size) != path.stat().st_size:  # shards written before sizes were recorded
        return f"{shard['file']} is damaged (its size differs from the one recorded)"
    if checksum and sha256(path) != shard["sha256"]:
        return f"{shard['file']} is damaged (its checksum differs from the one recorded)"
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resume(folder: Path, settings: dict, writer: dict, manifest: str, mine: list[int]) -> tuple[dict, dict]:
    """(this worker's shards, every worker's shards) already recorded and intact; a clear error otherwise."""
    if not folder.is_dir() or not manifest_paths(folder):
        # only this worker's own batch files count: another worker may be writing its first shard right now
        leftovers = [start for start in mine if (folder / shard_file(start)).is_file()]
        if leftovers:
            raise CollectionError(
                f"{folder} holds {len(leftovers)} shard file(s) but no {MANIFEST}, so which rows they hold is "
                "unknown. Delete the folder (or those files) to start over, or use another folder.")
        folder.mkdir(parents=True, exist_ok=True)
        return {}, {}
    manifests = read_manifests(folder)
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
        differing = differences(writer, saved["writer"], "this run", "the folder")
        if differing:
            raise CollectionError(
                f"{folder}/{name} was written by another writer: {'; '.join(differing)}. Its rows and this run's "
                "would not be the same values: use a new folder for this run, or delete this one to start over.")
    # a shard that is missing or damaged is collected again; one another worker wrote is not
    intact = {name: {start: shard for start, shard in saved["shards"].items() if shard_problem(folder, shard) is None}
              for name, saved in manifests.items()}
    return intact.get(manifest, {}), {start: shard for shards in intact.values() for start, shard in shards.items()}


def to_host(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
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


class ShardWriter:
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
        name = shard_file(start)
        write_atomically(self.folder / name, lambda path: save_file(tensors, path))
        first = next(iter(tensors))
        self.shards[str(start)] = {"file": name, "rows": int(tensors[first].shape[0]),
                                   "bytes": (self.folder / name).stat().st_size, "sha256": sha256(self.folder / name)}
        self._unrecorded += 1
        if time.monotonic() - self._recorded_at >= RECORD_EVERY_S:
            self._record()

    def _record(self) -> None:
        """Record the shards written so far (after them: a kill in between only redoes their batches)."""
        write_manifest(self.folder / self.manifest, self.settings, self.shards, self.writer)
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

    def __enter__(self) -> ShardWriter:
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
