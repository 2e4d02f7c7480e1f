"""Loading: a checkpoint's config, tokenizer and weights (or a model object given to wrap), checked before any
value is read, and the family spec that serves it."""

from __future__ import annotations

import copy
import os
import warnings

import transformers

from .. import proof
from ..families import BY_MODEL_TYPE, Family, family_of
from ..spec.errors import UnknownArchitecture


class Loaded:
    """What wrapping starts from: the model (weightless where ``lazy``), its tokenizer and family, the loading
    options nnsight builds a lazy model with, and the forward events of the validated miniature (or None)."""

    def __init__(self, model, tokenizer, family: Family, lazy: bool, kwargs: dict, validated):
        self.model, self.tokenizer, self.family, self.lazy = model, tokenizer, family, lazy
        self.kwargs, self.validated = kwargs, validated


def own_copy(tokenizer):
    """A copy of ``tokenizer`` whose settings (padding side, special tokens) change apart from the original's: its
    attributes and their containers copied, the vocabulary backend shared (a deep copy takes half a second)."""
    made = copy.copy(tokenizer)
    for key, value in vars(made).items():
        if isinstance(value, (dict, list, set)):
            setattr(made, key, copy.copy(value))
    return made


def load(cls: type, model, tokenizer, validate: bool, dispatch: bool, from_pretrained_kwargs: dict) -> Loaded:
    """The model to wrap, from a name or folder (validated before any weight) or a model object (checked)."""
    validated = None  # the forward events of the validated miniature
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        # a copy: nnsight sets the padding side and pad token on the model's tokenizer, and the user's may be shared
        tokenizer = own_copy(tokenizer)
    lazy = isinstance(model, (str, os.PathLike)) and not dispatch
    if isinstance(model, (str, os.PathLike)):
        config, architecture, tokenizer, validated = _prepare(cls, model, tokenizer, validate, from_pretrained_kwargs)
        family = family_of(config, architecture.__name__)
        if family.checkpoint_keys:  # the user's own key_mapping, if any, wins
            from_pretrained_kwargs = {"key_mapping": dict(family.checkpoint_keys), **from_pretrained_kwargs}
        if lazy and type(config) not in transformers.AutoModelForCausalLM._model_mapping:
            # an image-text config that loads as its text model (Inkling-2's): built, and loaded, from its text part
            from_pretrained_kwargs = {"config": config.get_text_config(), **from_pretrained_kwargs}
        if not lazy:
            model = _load_whole(architecture, model, family, from_pretrained_kwargs)
    elif from_pretrained_kwargs:
        raise TypeError(
            f"Unexpected keyword arguments {sorted(from_pretrained_kwargs)}: loading options apply only when "
            "the model is given by name or folder. Build the model with them, then wrap it."
        )
    elif isinstance(getattr(model, "_orig_mod", None), transformers.PreTrainedModel):
        raise TypeError(
            f"This is a torch.compile'd model ({type(model).__name__}); its forward is a compiled graph nnsight "
            "cannot intervene in. Wrap the model it compiled: StandardizedTransformer(compiled._orig_mod, ...).")
    elif not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"Expected a model name, a folder or a transformers PreTrainedModel, got {type(model).__name__}.")
    elif not model.can_generate():
        raise TypeError(
            f"{type(model).__name__} is not a causal language model (it has no language-model head to generate "
            "with): nnterp wraps the ...ForCausalLM class of a decoder. Load it with "
            "transformers.AutoModelForCausalLM, or pass the checkpoint's name or folder."
        )
    elif any(parameter.device.type == "meta" for parameter in model.parameters()):
        raise ValueError(
            "This model's weights are on the meta device (no weights), so it cannot be wrapped: nothing could load "
            "them. Load it by name or folder with StandardizedTransformer(name, dispatch=False) to build it "
            "without weights and load them on first use."
        )
    if tokenizer is None:  # as nnsight finds it: from the name or folder the model was loaded from
        source = getattr(model, "name_or_path", "") or ""
        if not source:
            raise ValueError("A model object needs its tokenizer: StandardizedTransformer(model, tokenizer=tok) (this "
                             "model has no name_or_path to load one from).")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
            if not tokenizer.vocab_size:  # transformers builds an empty one from a folder without tokenizer files
                raise ValueError("it holds no vocabulary")
        except (OSError, ValueError) as error:
            raise ValueError(f"No tokenizer could be loaded from the model's name_or_path {source!r} ({error}): pass "
                             "one with StandardizedTransformer(model, tokenizer=tok).") from None
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
    family = family_of(config, architecture.__name__) if lazy else family_of(model.config, type(model).__name__)
    if not lazy and not has_module(model, family.layers):  # another class of the type (an image-text one)
        raise UnknownArchitecture(
            f"{type(model).__name__} has no module '{family.layers}', where the {family.name} spec finds the "
            f"blocks of its causal LM ({', '.join(family.model_types)}). Load the checkpoint by name or folder "
            "(StandardizedTransformer(name)), which builds that causal LM, or wrap it.")
    if not lazy and model.training:  # nnsight does not; dropout would make every value random
        warnings.warn(f"The {type(model).__name__} given was in training mode: nnterp put it in eval mode, so that "
                      "dropout does not make every value random (model.train() undoes it).", UserWarning, stacklevel=4)
        model.eval()
    return Loaded(model, tokenizer, family, lazy, from_pretrained_kwargs, validated)


def has_module(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _prepare(cls: type, name: str | os.PathLike, tokenizer, validate: bool, from_pretrained_kwargs: dict):
    """Config, tokenizer and validation, before any weight: (config, architecture, tokenizer, validated events)."""
    local = os.path.isdir(name)
    if not local:
        _refuse_unreachable(str(name))
    try:
        # the config the model is built with: loading options that are config attributes override the folder's
        config, _ = transformers.AutoConfig.from_pretrained(name, return_unused_kwargs=True, **from_pretrained_kwargs)
    except OSError as error:
        if local:
            raise OSError(f"{str(name)!r} is a folder, but its config.json could not be read: {error}") from error
        raise OSError(
            f"Could not load {str(name)!r}: it is not a local folder holding a model, and the hub could not "
            f"provide it (no network, HF_HUB_OFFLINE set, or no such repository). {_OFFLINE_HINT} Cause: {error}"
        ) from error
    except ValueError as error:  # a config.json that is not valid JSON, or not a config
        raise OSError(f"The config of {str(name)!r} could not be read: {error}") from error
    if tokenizer is None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as error:
            raise OSError(
                f"No tokenizer could be loaded from {str(name)!r}"
                + (" (the folder holds no tokenizer files)" if local else "")
                + ": pass one with StandardizedTransformer(name, tokenizer=tokenizer_or_folder). "
                f"Cause: {type(error).__name__}: {error}"
            ) from error
    architecture = _architecture_of(config)
    family_of(config, architecture.__name__)
    events = None
    if validate:
        events = proof.validate(config, architecture, tokenizer, cls)
    return config, architecture, tokenizer, events


_OFFLINE_HINT = ("Pass a local folder, or a hub name with network access; offline, "
                 "nnterp.tools.embedded.load_embedded() gives the embedded SmolLM2-135M.")


def _refuse_unreachable(name: str) -> None:
    """A name that is no folder: a path that does not exist, or a hub name that cannot be fetched without network
    (said at once, where the hub client would retry for half a minute)."""
    if name.startswith(("/", "./", "../", "~")) or os.sep in name.strip(os.sep).replace("/", "", 1) or (
            os.path.exists(name)):
        raise OSError(f"No model folder at {name!r}: {'it is not a folder' if os.path.exists(name) else 'no such path'}"
                      ". Pass the folder that holds the model's config.json (or a hub name, org/model).")
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # offline: transformers reads the cache, or says it cannot, at once
    import socket

    try:
        socket.create_connection((constants.ENDPOINT.split("://")[-1].split("/")[0], 443), timeout=5).close()
    except OSError as error:
        raise OSError(f"Could not load {name!r}: it is not a local folder, and the hub cannot be reached ({error}). "
                      f"Set HF_HUB_OFFLINE=1 to read models already in the Hugging Face cache. {_OFFLINE_HINT}"
                      ) from None


def _architecture_of(config) -> type[transformers.PreTrainedModel]:
    mapping = transformers.AutoModelForCausalLM._model_mapping
    text_config = config.get_text_config()
    try:
        return mapping[type(config)]
    except KeyError:
        # an image-text type transformers builds no causal LM for, whose checkpoints load as their text model's
        # (Inkling-2's): served where a family lists the type
        if text_config is not config and type(text_config) in mapping and config.model_type in BY_MODEL_TYPE:
            return mapping[type(text_config)]
        raise UnknownArchitecture(
            f"transformers has no causal language model for {type(config).__name__} (model_type "
            f"{config.model_type!r}); nnterp covers decoder language models."
        ) from None


def _load_whole(architecture: type[transformers.PreTrainedModel], name, family: Family, kwargs: dict) -> transformers.PreTrainedModel:
    """The checkpoint's model, refused when the checkpoint holds none of a block's weights: they would all be random,
    and every value read from them noise (transformers only logs it). A few missing weights (a norm that a loading
    option added to the checkpoint's architecture) are left to transformers' warning."""
    model, info = architecture.from_pretrained(name, output_loading_info=True, **kwargs)
    prefixes = tuple(f"{path}." for path in family.block_lists)
    missing = {key for key in info.get("missing_keys", ()) if key.startswith(prefixes)}
    blocks: dict[str, set[str]] = {}
    for key, _ in model.named_parameters():
        for prefix in prefixes:
            if key.startswith(prefix):
                blocks.setdefault(prefix + key[len(prefix):].partition(".")[0], set()).add(key)
    if any(weights <= missing for weights in blocks.values()):
        raise ValueError(
            f"{len(missing)} weights of the blocks of {architecture.__name__} are not in the checkpoint {str(name)!r} "
            f"(e.g. {', '.join(sorted(missing)[:3])}), so they would be random. The checkpoint may keep them under "
            "other names: pass key_mapping={regex: replacement} to rename them as the model names them."
        )
    return model


# the module names every family gives (nnsight aliases of the native ones)
STANDARD_MODULES = ("model", "layers", "embed_tokens", "self_attn", "mlp", "ln_final", "lm_head")


def with_aliases(standard: dict, own: dict | None, cls: type) -> dict:
    """nnsight's ``rename``: the family's standard names (``standard``) and the user's own aliases (``own``, as
    nnsight's ``rename=`` takes them: ``{native name or path: alias or [aliases]}``), each native module reachable by
    all of them. An alias that is already a name of the model or its envoys (a standard module or value, a method)
    is refused, saying which: it would hide that name."""
    if not own:
        return standard
    if not isinstance(own, dict):
        raise TypeError(f"rename= takes a dict {{native name: alias}}, as nnsight's does; got {type(own).__name__}.")
    from ..spec.catalog import CATALOG
    from .envoys import AttentionEnvoy, BlockEnvoy, LayersEnvoy, MLPEnvoy

    values = {value.name for value in CATALOG}
    public = {name for owner in (cls, BlockEnvoy, AttentionEnvoy, MLPEnvoy, LayersEnvoy) for name in dir(owner)
              if not name.startswith("_")}
    merged = dict(standard)
    for native, aliases in own.items():
        for alias in [aliases] if isinstance(aliases, str) else list(aliases):
            name = alias.rpartition(".")[2]
            what = ("a standard module name" if name in STANDARD_MODULES else "a standard value" if name in values
                    else "a name the model or its envoys already have" if name in public else None)
            if what is not None:
                raise ValueError(f"rename={{{native!r}: {alias!r}}}: {name!r} is {what} in nnterp, so the alias "
                                 "would hide it. Choose another alias (the standard names are there already).")
            have = merged.get(native)
            merged[native] = [*([] if have is None else [have] if isinstance(have, str) else have), alias]
    return merged

