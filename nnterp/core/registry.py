"""The public registry: a user's own family spec, proven on a miniature before it is served.

``register_family(spec)`` adds a ``Family`` (see ``nnterp.families``: the same data every built-in
family is) for its model types, once the same proof that guards every model at load holds on a
miniature of its config: every module path resolves, every value has its shape, every block's
identity is exact, and no value sits where another tensor of the right shape lives. A spec that
fails is refused with the problems named, and nothing is registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PretrainedConfig, PreTrainedTokenizerFast

from .. import families, proof
from ..families import Family
from ..proof import ValidationError
from ..spec.errors import NNterpError

if TYPE_CHECKING:  # transformers' model classes load on first use (seconds), not at import nnterp
    from transformers import PreTrainedModel

# model type -> the family it had before register_family (None: it was not served)
_BEFORE: dict[str, Family | None] = {}


class RegistrationError(NNterpError, ValueError):
    """A family spec that cannot be registered as given (not a proof failure: see ``ValidationError``)."""


def register_family(family: Family, config: PretrainedConfig | None = None, architecture: type | None = None, *,
                    replace: bool = False) -> Family:
    """Serve ``family`` for its ``model_types``, once it is proven on a miniature of ``config``.

    ``config`` defaults to ``family.tiny_config()``; its ``model_type`` must be one of the family's.
    ``architecture`` is the causal-LM class to build the miniature with, by default the one
    transformers maps the config to (``AutoModelForCausalLM``). A model type already served is
    refused unless ``replace=True``. Raises ``ValidationError`` naming every problem when the spec
    does not hold; the registry is then unchanged. Returns the family.
    """
    if not isinstance(family, Family):
        raise RegistrationError(f"register_family takes a nnterp.families.Family, got {type(family).__name__}.")
    if not family.model_types or not all(isinstance(t, str) and t for t in family.model_types):
        raise RegistrationError(f"The {family.name} spec names no model type: set Family(model_types=('my_type',)), "
                                "the config's model_type.")
    taken = {t: families.BY_MODEL_TYPE[t].name for t in family.model_types if t in families.BY_MODEL_TYPE}
    if taken and not replace:
        raise RegistrationError(
            f"Already served: {', '.join(f'{t!r} (by {name})' for t, name in taken.items())}. Pass replace=True to "
            "serve them with this spec instead (unregister_family(model_type) brings the previous one back).")
    config = config if config is not None else family.tiny_config()
    if config.model_type not in family.model_types:
        raise RegistrationError(
            f"The config's model_type is {config.model_type!r}, which the {family.name} spec does not list "
            f"(model_types={family.model_types}): models of this config would never find the spec.")
    architecture = architecture or _causal_lm_class(config, family)
    problems, _ = proof.prove(config, architecture, _placeholder_tokenizer(), _wrapper(), family=family)
    if problems:
        raise ValidationError(
            f"The {family.name} spec was not registered: it does not hold on {architecture.__name__} (checked on a "
            "miniature of its config):\n  " + "\n  ".join(problems)
            + "\nFix the locations named above (module paths are relative to a block, from the ...ForCausalLM root "
              "for layers, embed_tokens, ln_final and lm_head) and register it again.")
    for model_type in family.model_types:
        _BEFORE.setdefault(model_type, families.BY_MODEL_TYPE.get(model_type))
        families.BY_MODEL_TYPE[model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Undo ``register_family`` for ``model_type``: the family that served it before (if any) serves it again."""
    if model_type not in _BEFORE:
        raise RegistrationError(f"{model_type!r} was not registered with register_family; registered: "
                                f"{sorted(_BEFORE) or 'none'}.")
    _restore({model_type: _BEFORE.pop(model_type)})


def _restore(before: dict[str, Family | None]) -> None:
    for model_type, family in before.items():
        if family is None:
            families.BY_MODEL_TYPE.pop(model_type, None)
        else:
            families.BY_MODEL_TYPE[model_type] = family


def _causal_lm_class(config: PretrainedConfig, family: Family) -> type[PreTrainedModel]:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise RegistrationError(
            f"transformers maps no causal-LM class to {type(config).__name__}: pass the class to build, "
            f"register_family({family.name!r} spec, config, architecture=MyForCausalLM), or register it with "
            "AutoModelForCausalLM.register(MyConfig, MyForCausalLM) first.") from None


def _placeholder_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: the proof feeds token ids, never text, but a wrapped model carries one."""
    from tokenizers import Tokenizer, models

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>")),
                                   unk_token="<unk>")


def _wrapper():
    from .standardized import StandardizedTransformer

    return StandardizedTransformer


__all__ = ["RegistrationError", "register_family", "unregister_family"]
