"""Who wrote a collection's values and with which settings: what a resume, or another worker, must match.

The writer is the model (its class, config and a checksum of sampled weights), the dtype of the values, a mask
function and the dictionaries whose features are collected, each by its fingerprint (``nnterp.spec.fingerprint``),
so rows of two writers are told apart across processes and never mix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from ..dictionaries import TENSORS, Dictionary
from ..spec.fingerprint import digest, fingerprint, weights_digest

VOLATILE_CONFIG = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}  # not the model (dtype: weights)
WRITER_FIELDS = {"model": "the model's class", "config": "the model's config", "weights": "the model's weights",
                 "dtype": "the dtype of the values", "mask": "the positions mask function (its code or the values it reads)",
                 "dictionaries": "the dictionaries whose features are collected (a digest of their weights)"}


def writer(model, positions, dtype, remote) -> dict:
    """What makes the values: a resume, or another worker, must have the same to add rows to a folder."""
    module = model._module
    kind = type(module)
    if remote:  # the server's weights are the checkpoint's, whatever this copy holds
        weights = f"remote {model.repo_id}@{getattr(model, 'revision', None) or 'main'}"
    else:
        weights = weights_digest(module)
    config = _without(json.loads(module.config.to_json_string(use_diff=False)))
    return {"model": f"{kind.__module__}.{kind.__qualname__}", "config": digest(json.dumps(config, sort_keys=True)),
            "weights": weights, "dtype": str(dtype or module.dtype),
            "mask": mask_identity(positions) if callable(positions) else None}


def mask_identity(function) -> str:
    """A positions mask function's fingerprint: a function of its own module is its code, defaults, closure and the
    values of the globals it reads; a function of another module (a library's) is its name."""
    return fingerprint(function, home=getattr(function, "__module__", None))


def dictionary_digest(dictionary: Dictionary) -> str:
    """A digest of what makes a dictionary's features: its activation and every byte of its tensors."""
    tensors = {name: getattr(dictionary, name) for name in TENSORS}
    return fingerprint((dictionary.activation, dictionary.k, dictionary.normalize, tensors))


def differences(ours: dict | None, theirs: dict | None, here: str, there: str) -> list[str]:
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


def positions_label(positions) -> str:
    """``positions`` as the settings record it (a mask function by name: the writer records its fingerprint)."""
    return positions if isinstance(positions, str) else (
        f"index {positions}" if isinstance(positions, int) else f"mask {getattr(positions, '__name__', 'fn')}")


def prompts_digest(prompts: Sequence[str]) -> str:
    """The prompts' digest in the settings, streamed prompt by prompt (a million prompts never make one string)."""
    hashed = hashlib.sha256()
    for prompt in prompts:
        hashed.update(prompt.encode())
        hashed.update(b"\0")
    return hashed.hexdigest()[:16]
