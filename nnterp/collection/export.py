"""A collection exported to other layouts: a Hugging Face ``datasets.Dataset`` (``Collection.to_dataset``) and
SAELens's cached activations (``Collection.to_saelens``), each built shard by shard, so memory stays flat."""

from __future__ import annotations

import hashlib
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from ..dictionaries import transformerlens_hook, transformerlens_site
from ..spec.selection import value_name
from .shards import CollectionError


def to_dataset(collection, values: Sequence[str] | None = None, cache_dir: str | Path | None = None):
    """``Collection.to_dataset``'s work."""
    try:
        import datasets
    except ImportError:
        raise ImportError("Collection.to_dataset needs the datasets package: pip install 'nnterp[datasets]' "
                          "(or pip install datasets).") from None
    names = [value_name(v) for v in ([values] if isinstance(values, str) else values or collection.values)]
    for name in names:
        if name not in collection.values:
            raise KeyError(f"{name!r} was not collected here; this collection holds {', '.join(collection.values)}.")
    features = {"prompt": datasets.Value("int64")}
    for name in names:
        sample = collection[name, :0]
        shape = tuple(sample.shape[1:])
        dtype = torch.float32 if sample.dtype == torch.bfloat16 else sample.dtype
        array = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}[len(shape)]
        features[name] = array(shape=shape, dtype=str(dtype).removeprefix("torch."))
    return datasets.Dataset.from_generator(
        _dataset_rows, features=datasets.Features(features), cache_dir=str(cache_dir) if cache_dir else None,
        gen_kwargs={"shards": tuple(zip(collection._starts, map(str, collection._files))), "names": tuple(names),
                    "contents": _contents(collection)})


def _contents(collection) -> str:
    """One hash of every shard's checksum: what the dataset cache keys on, besides the folder."""
    return hashlib.sha256(" ".join(shard["sha256"] for shard in collection._ordered).encode()).hexdigest()


def to_saelens(collection, folder: str | Path, hook_names: Sequence[str] | None = None,
               context_size: int | None = None):
    """``Collection.to_saelens``'s work."""
    try:
        import datasets
    except ImportError:
        raise ImportError("Collection.to_saelens needs the datasets package: pip install 'nnterp[datasets]' "
                          "(or pip install datasets).") from None
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not an empty folder: SAELens's activations folder holds one dataset. "
                              "Pass a new folder (or delete this one).")
    if not collection.complete:
        raise CollectionError(f"{collection.folder} is incomplete (batches {collection.missing} missing): run collect "
                              "again with the same arguments to finish it before exporting it.")
    columns = saelens_columns(collection, hook_names)
    with safe_open(collection._files[0], "pt") as file:
        if "_token_ids" not in file.keys():
            raise CollectionError(f"{collection.folder} does not hold the rows' token ids (it was collected by an "
                                  "earlier nnterp), which SAELens's layout has: collect it again into a new folder.")
    counts = collection.offsets.diff()
    if context_size is None:
        lengths = counts.unique().tolist()
        if len(lengths) != 1:
            raise ValueError(f"The prompts have from {min(lengths)} to {max(lengths)} collected tokens, and an "
                             "example of SAELens's layout has context_size of them: pass context_size=N to pack "
                             "the rows into contexts of N tokens.")
        context_size = lengths[0]
    if context_size < 1 or collection.rows < context_size:
        raise ValueError(f"context_size={context_size}: the collection's {collection.rows} rows fill no context of "
                         "that many tokens.")
    left = collection.rows % context_size
    if left:
        warnings.warn(f"to_saelens: the last {left} of {collection.rows} rows fill no context of {context_size} "
                      "tokens and are left out.", stacklevel=3)
    features = {"token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)}
    for hook, (name, layer) in columns.items():
        sample = _saelens_view(collection[name, :0][:, layer])
        dtype = torch.float32 if sample.dtype == torch.bfloat16 else sample.dtype
        features[hook] = datasets.Array2D(shape=(context_size, sample.shape[-1]),
                                          dtype=str(dtype).removeprefix("torch."))
    features = datasets.Features({hook: features[hook] for hook in columns} | {"token_ids": features["token_ids"]})
    with tempfile.TemporaryDirectory(prefix="nnterp-saelens-") as cache:  # the generator's Arrow, then copied
        dataset = datasets.Dataset.from_generator(
            _saelens_rows, features=features, cache_dir=cache,
            gen_kwargs={"files": tuple(map(str, collection._files)), "columns": tuple(columns.items()),
                        "context_size": context_size})
        dataset.save_to_disk(str(folder))
        del dataset
    return datasets.load_from_disk(str(folder))


def saelens_columns(collection, hook_names) -> dict[str, tuple[str, int]]:
    layers = collection.settings["layers"]
    if hook_names is None:
        columns = {}
        for name in collection.values:
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
        if name not in collection.values or layer not in layers:
            raise KeyError(f"{hook} is layers[{layer}].{name}, which was not collected here (values "
                           f"{', '.join(collection.values)} at layers {layers}).")
        columns[hook] = name, layers.index(layer)
    return columns


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
