"""nnterp 1.x's ``nnterp.rename_utils``: the rename dict and the config readers, kept for code that imports them.

nnterp 2 places modules and values with one family spec per architecture, proven on a miniature of
the config; ``get_rename_dict()`` gives the union of those specs' aliases, for plain nnsight models.
A ``RenameConfig`` is taken where its names are what the spec places (a warning says to drop it), and
refused where they contradict it (docs: Migrating from 1.x).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

from .legacy import _config_value, backbone_norm, deprecated

# 1.x's config readers, kept under their 1.x module path: the 1.x layer, which checks a RenameConfig's keys with
# them, holds them
from .legacy import default_attn_head_config_keys as default_attn_head_config_keys
from .legacy import default_hidden_size_config_keys as default_hidden_size_config_keys
from .legacy import default_vocab_size_config_keys as default_vocab_size_config_keys
from .legacy import text_config as text_config


class RenamingError(Exception):
    """The modules of a model could not be given the standard names."""


class AttnProbFunction(ABC):
    """1.x's locator of the attention probabilities; nnterp 2 reads them where each family spec says."""

    @abstractmethod
    def get_attention_prob_source(self, attention_module, return_module_source: bool = False):
        ...

    def __call__(self, attention_module, return_module_source: bool = False):
        return self.get_attention_prob_source(attention_module, return_module_source)


@dataclass
class RenameConfig:
    """1.x's custom names for an architecture: taken where they name what the family spec places, refused where
    they contradict it."""

    attn_name: str | list[str] | None = None
    mlp_name: str | list[str] | None = None
    ln_final_name: str | list[str] | None = None
    lm_head_name: str | list[str] | None = None
    model_name: str | list[str] | None = None
    layers_name: str | list[str] | None = None
    attn_prob_source: AttnProbFunction | None = None
    ignore_mlp: bool | None = None
    ignore_attn: bool | None = None
    attn_head_config_key: str | list[str] | int | None = None
    hidden_size_config_key: str | list[str] | int | None = None
    vocab_size_config_key: str | list[str] | int | None = None


class IOType(Enum):
    INPUT = "input"
    OUTPUT = "output"


def get_rename_dict(rename_config: RenameConfig | None = None) -> dict[str, str | list[str]]:
    """nnsight ``rename=`` aliases giving every covered family the standard module names (and ``rename_config``'s)."""
    from ..families import FAMILIES

    deprecated("get_rename_dict()", "nnterp.families.family_of(config).rename()")
    names: dict[str, str | list[str]] = {}
    if rename_config is not None:
        for alias, value in (("model", rename_config.model_name), ("layers", rename_config.layers_name),
                             ("self_attn", rename_config.attn_name), ("mlp", rename_config.mlp_name),
                             ("ln_final", rename_config.ln_final_name), ("lm_head", rename_config.lm_head_name)):
            for native in [value] if isinstance(value, str) else (value or []):
                names[native] = alias
    for family in FAMILIES:
        rename = family.rename()
        found = backbone_norm(family)
        if found and rename.get(found[1]) == "ln_final":  # also on the backbone, as 1.x named it: model.model.ln_final
            rename[found[1]] = ["ln_final", f"{found[0]}.ln_final"]
        for native, alias in rename.items():
            names.setdefault(native, alias)
    return names


def get_ignores(model, rename_config: RenameConfig | None = None) -> list[str]:
    """The standard sublayer modules a model's blocks lack (``"mlp"`` on OPT, whose MLP is ``fc1``/``fc2`` in the
    block; ``"attention"`` on a recurrent model), and those a ``rename_config`` says to ignore."""
    from ..families import family_of

    deprecated("get_ignores(model)", "model.availability(i) (where each value is read, or why it is unavailable)")
    family = getattr(model, "_nnterp_family", None)  # a StandardizedTransformer's own (per-config) spec
    if family is None:
        module = getattr(model, "_module", model)  # a plain nnsight model's, or the transformers model
        family = family_of(module.config, type(module).__name__)
    ignores = [name for name, native in (("mlp", family.mlp), ("attention", family.attention)) if native is None]
    if rename_config is not None:
        ignores += [name for name, flag in (("mlp", rename_config.ignore_mlp), ("attention", rename_config.ignore_attn))
                    if flag and name not in ignores]
    return ignores


def get_num_attention_heads(model, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    deprecated("get_num_attention_heads(model)", "model.num_heads")
    return _config_value(model, ["n_heads", "num_attention_heads", "n_head", "num_heads"],
                         rename_config and rename_config.attn_head_config_key, raise_error, "attention head")


def get_hidden_size(model, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    deprecated("get_hidden_size(model)", "model.hidden_size")
    return _config_value(model, ["hidden_size", "d_model", "n_embd"],
                         rename_config and rename_config.hidden_size_config_key, raise_error, "hidden size")


def get_vocab_size(model, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    deprecated("get_vocab_size(model)", "model.vocab_size")
    return _config_value(model, ["vocab_size", "n_vocab"], rename_config and rename_config.vocab_size_config_key,
                         raise_error, "vocabulary size")


def check_model_renaming(std_model, *args, **kwargs) -> None:
    """1.x checked the renamed modules at load; nnterp 2 proves each family spec on a miniature (``validate``)."""
    deprecated("check_model_renaming(model)", "nnterp.core.validation.check_identity(model)")
    from ..proof import check_identity

    failed = [str(result) for result in check_identity(std_model) if not result.exact]
    if failed:
        raise RenamingError("; ".join(failed))


MODEL_NAMES = ["transformer", "gpt_neox", "decoder", "language_model"]


def expand_path_with_model(paths: list[str]) -> list[str]:
    """1.x: each ``model.``-prefixed path also under every backbone name."""
    return paths + [path.replace("model.", f"model.{backbone}.") for backbone in MODEL_NAMES
                    for path in paths if path.startswith("model.")]


def _probabilities_source(attention_module, return_module_source: bool = False):
    """The operation whose input is the attention pattern, in the module's eager attention (as the specs read it)."""
    from ..spec.attention import STANDARD

    call = getattr(attention_module.source, STANDARD.call)
    return call.source if return_module_source else getattr(call.source, STANDARD.probabilities)


# 1.x's per-family locators: one place in every family that uses transformers' attention interface
default_attention_prob_source = gpt2_attention_prob_source = gptj_attention_prob_source = _probabilities_source


def bloom_attention_prob_source(attention_module, return_module_source: bool = False):
    """BLOOM's own attention code: the operation whose output is the pattern (the spec's place)."""
    from ..families import BY_MODEL_TYPE

    place = dict((name, op) for name, op, *_ in BY_MODEL_TYPE["bloom"].attention_internals.places)
    source = attention_module.source
    return source if return_module_source else getattr(source, place["attention_probabilities"])


def __getattr__(name: str):
    """1.x's accessor classes: today's per-layer lists."""
    from . import legacy

    if name == "LayerAccessor":
        return legacy.ValueList
    if name == "AttentionProbabilitiesAccessor":
        return legacy.AttentionProbabilities
    raise AttributeError(f"module 'nnterp.rename_utils' has no attribute {name!r}")
