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

The modules: ``runner`` (``collect``), ``shards`` (the shard writer and the manifests), ``reader``
(``Collection``), ``export`` (the ``datasets`` and SAELens layouts), ``provenance`` (who wrote the values).
"""

from .reader import Collection
from .runner import collect
from .shards import CollectionError

__all__ = ["Collection", "CollectionError", "collect"]
