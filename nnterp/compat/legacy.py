"""nnterp 1.x names on ``StandardizedTransformer``, kept working: each warns once per call site with a
``DeprecationWarning`` naming the new spelling.

``LegacyNames`` holds the 1.x names of the model, written against its public API, and ``legacy_arguments``
translates 1.x constructor arguments; ``install`` gives both to the model class, from outside the core. The 1.x
module paths (``nnterp.nnsight_utils``, ``nnterp.rename_utils``, ``nnterp.utils``, ``nnterp.display``,
``nnterp.prompt_utils``, the 1.x names in ``nnterp.interventions``) build on it. Where 1.x was wrong,
the correct value is kept (``docs/migrating.md`` lists the differences).
"""

from __future__ import annotations

import os
import re
import warnings

import torch

from ..core.edits import skip_layers as _skip_layers
from ..core.loading import STANDARD_MODULES


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is nnterp 1.x's spelling: use {new}.", DeprecationWarning, stacklevel=stacklevel)


class ValueList:
    """One standard value across the blocks, indexed by layer (1.x ``layers_output[i]``): read, assign, iterate."""

    def __init__(self, model, name: str):
        self._model, self._name = model, name

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, layer: int):
        return self._model.read_value(layer, self._name)

    def __setitem__(self, layer: int, value) -> None:
        self._model.write_value(layer, self._name, value)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class AttentionProbabilities(ValueList):
    """1.x ``model.attention_probabilities[i]``: the standard ``attention_probabilities``, with 1.x's switches."""

    def __init__(self, model):
        ValueList.__init__(self, model, "attention_probabilities")

    @property
    def enabled(self) -> bool:
        return self._model._nnterp_attention_on

    def enable(self) -> None:
        self._model.enable_attention_values()

    def disable(self) -> None:
        self._model.disable_attention_values()

    def print_source(self, layer: int = 0, allow_dispatch: bool = True) -> None:
        """Where the probabilities are read (1.x printed the hooked source)."""
        print(self._model.availability(layer)["self_attn.attention_probabilities"])

    def check_source(self, *args, **kwargs) -> None:
        """1.x checked its hook by hand; the location is proven at load on a miniature of the config."""


class ModuleList:
    """1.x ``attentions[i]`` / ``mlps[i]``: the sublayer envoys by layer."""

    def __init__(self, model, owner: str):
        self._model, self._owner = model, owner

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, layer: int):
        return getattr(self._model.layers[layer], self._owner)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class AttentionInputs(ModuleList):
    """1.x ``attentions_input[i]``: what the attention module is called with (its hidden states)."""

    def __init__(self, model):
        ModuleList.__init__(self, model, "self_attn")

    def __getitem__(self, layer: int):
        return ModuleList.__getitem__(self, layer).input

    def __setitem__(self, layer: int, value) -> None:
        ModuleList.__getitem__(self, layer).input = value


class LegacyNames:
    """nnterp 1.x's names on the model, each an adapter over today's API that warns with the new spelling (found by
    ``StandardizedTransformer``'s lookup, where ``install`` puts them; plain methods and explicit calls)."""

    @property
    def _model(self):
        """1.x name: the transformers model itself, ``model._module``. A read-only property, never in the instance's
        ``__dict__``: pickling and copying the model leave it out."""
        deprecated("model._model", "model._module")
        return self._module

    @property
    def layers_input(self) -> ValueList:
        """1.x name: ``layers_input[i]`` is the standard ``layer_input``."""
        deprecated("model.layers_input[i]", "model.layers[i].layer_input")
        return ValueList(self, "layer_input")

    @property
    def layers_output(self) -> ValueList:
        """1.x name: ``layers_output[i]`` is the standard ``layer_output``."""
        deprecated("model.layers_output[i]", "model.layers[i].layer_output")
        return ValueList(self, "layer_output")

    @property
    def attentions_output(self) -> ValueList:
        """1.x name: ``attentions_output[i]`` is the standard ``attention_output``."""
        deprecated("model.attentions_output[i]", "model.layers[i].self_attn.attention_output")
        return ValueList(self, "attention_output")

    @property
    def mlps_input(self) -> ValueList:
        """1.x name: ``mlps_input[i]`` is the standard ``mlp_input``."""
        deprecated("model.mlps_input[i]", "model.layers[i].mlp_input")
        return ValueList(self, "mlp_input")

    @property
    def mlps_output(self) -> ValueList:
        """1.x name: ``mlps_output[i]`` is the standard ``mlp_output``."""
        deprecated("model.mlps_output[i]", "model.layers[i].mlp.mlp_output")
        return ValueList(self, "mlp_output")

    @property
    def attention_probabilities(self) -> AttentionProbabilities:
        deprecated("model.attention_probabilities[i]", "model.layers[i].self_attn.attention_probabilities")
        return AttentionProbabilities(self)

    @property
    def attentions(self) -> ModuleList:
        deprecated("model.attentions[i]", "model.layers[i].self_attn")
        return ModuleList(self, "self_attn")

    @property
    def mlps(self) -> ModuleList:
        deprecated("model.mlps[i]", "model.layers[i].mlp")
        return ModuleList(self, "mlp")

    @property
    def attentions_input(self) -> AttentionInputs:
        deprecated("model.attentions_input[i]", "model.layers[i].self_attn.input (or attention_norm_output)")
        return AttentionInputs(self)

    @property
    def token_embeddings(self):
        deprecated("model.token_embeddings", "model.embed_tokens.output")
        return self.embed_tokens.output

    @token_embeddings.setter
    def token_embeddings(self, value) -> None:
        deprecated("model.token_embeddings", "model.embed_tokens.output")
        self.embed_tokens.output = value

    @property
    def input_ids(self):
        deprecated("model.input_ids", "model.inputs[1]['input_ids']")
        return self.inputs[1]["input_ids"]

    @property
    def attention_mask(self):
        deprecated("model.attention_mask", "model.inputs[1]['attention_mask']")
        return self.inputs[1]["attention_mask"]

    @property
    def input_size(self):
        deprecated("model.input_size", "model.inputs[1]['input_ids'].shape")
        return self.inputs[1]["input_ids"].shape

    @property
    def attn_probs_available(self) -> bool:
        deprecated("model.attn_probs_available", "model.availability(i)['self_attn.attention_probabilities']")
        return self._nnterp_attention_on

    @property
    def add_prefix_false_tokenizer(self):
        """The tokenizer without a prefix space (1.x used it for first tokens); the model's own one otherwise."""
        deprecated("model.add_prefix_false_tokenizer", "nnterp.first_tokens(model.tokenizer, word)")
        from transformers import AutoTokenizer

        cached = self.__dict__.get("_nnterp_no_prefix_tokenizer")
        if cached is None:
            try:
                cached = AutoTokenizer.from_pretrained(self.tokenizer.name_or_path, add_prefix_space=False)
            except (OSError, ValueError, TypeError):
                cached = self.tokenizer
            self.__dict__["_nnterp_no_prefix_tokenizer"] = cached
        return cached

    def get_topk_closest_tokens(self, hidden_state: torch.Tensor, k: int = 5) -> dict[str, float] | list[dict[str, float]]:
        """The ``k`` most likely tokens of a stream vector (``[hidden]`` or ``[batch, hidden]``) through the readout."""
        deprecated("model.get_topk_closest_tokens(h)", "nnterp.top_tokens(model, model.project_on_vocab(h).softmax(-1))")
        if hidden_state.shape[-1] != self.hidden_size:
            raise ValueError(f"Hidden state shape {tuple(hidden_state.shape)} does not match model hidden size "
                             f"{self.hidden_size}.")
        probs = self.project_on_vocab(hidden_state).softmax(-1)
        top = probs.topk(k, dim=-1)
        if probs.dim() == 1:
            return self.probs_to_dict(top.indices, top.values)
        return [self.probs_to_dict(indices, values) for indices, values in zip(top.indices, top.values)]

    def probs_to_dict(self, tokens: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
        return {token: float(p) for token, p in zip(self.tokenizer.convert_ids_to_tokens(tokens), probs.detach())}

    def detect_layer_output_type(self) -> None:
        """1.x needed this before skipping layers; the family spec knows each block's output type."""

    def steer(self, layers, steering_vector: torch.Tensor, factor: float = 1.0, positions=None, token_positions=None,
              batch_index=None, value: str = "layer_output") -> None:
        """Inside a trace: add ``factor * steering_vector`` to ``value`` at ``layers`` (``positions`` is 1.x's name)."""
        if positions is not None and token_positions is not None:
            raise ValueError("Cannot specify both positions and token_positions: pass token_positions only (positions "
                             "is its deprecated 1.x name).")
        # one warning per call, as in 1.x (which warned only for positions=)
        if positions is not None:
            deprecated("model.steer(..., positions=...)", "nnterp.add_to(model, layers, vector, value, factor, "
                       "positions, batch) (steer's own name for it was token_positions)")
            token_positions = positions
        else:
            deprecated("model.steer(layers, vector, factor, token_positions, batch_index)",
                       "nnterp.add_to(model, layers, vector, value, factor, positions, batch)")
        from ..core.edits import add_to

        add_to(self, layers, steering_vector, value, factor, token_positions, batch_index)

    def skip_layers(self, start: int, end: int | None = None, skip_with: torch.Tensor | None = None,
                    layer_returns_tuple: bool | None = None) -> None:
        """Inside a trace: blocks ``start`` to ``end`` (inclusive) hand on ``skip_with`` (default: block ``start``'s
        input)."""
        deprecated("model.skip_layers(start, end, skip_with)", "nnterp.skip_layers(model, start, end, stream)")
        _skip_layers(self, start, end, skip_with)

    def skip_layer(self, layer: int, skip_with: torch.Tensor | None = None) -> None:
        deprecated("model.skip_layer(layer, skip_with)", "nnterp.skip_layers(model, layer, layer, stream)")
        _skip_layers(self, layer, layer, skip_with)


steer = LegacyNames.steer  # 1.x's nnterp.interventions.steer calls it as a function: steer(model, layers, ...)


# 1.x's rename options, by the standard name each gave: RenameConfig's fields, and the constructor options of
# nnterp before 1.0 (1.x's own error messages still named them)
RENAME_FIELDS = {"model_name": "model", "layers_name": "layers", "attn_name": "self_attn", "mlp_name": "mlp",
                 "ln_final_name": "ln_final", "lm_head_name": "lm_head"}
RENAME_OPTIONS = {"model_rename": "model", "layers_rename": "layers", "attn_rename": "self_attn",
                  "mlp_rename": "mlp", "ln_final_rename": "ln_final", "lm_head_rename": "lm_head"}
# RenameConfig's config keys, by the model attribute they set
CONFIG_KEYS = {"attn_head_config_key": "num_heads", "hidden_size_config_key": "hidden_size",
               "vocab_size_config_key": "vocab_size"}


# 1.x's config readers (``nnterp.rename_utils`` names them too)
def default_attn_head_config_keys() -> list[str]:
    return ["n_heads", "num_attention_heads", "n_head", "num_heads"]


def default_hidden_size_config_keys() -> list[str]:
    return ["hidden_size", "d_model", "n_embd"]


def default_vocab_size_config_keys() -> list[str]:
    return ["vocab_size", "n_vocab"]


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_value(model, keys: list[str], custom, raise_error: bool, what: str):
    if isinstance(custom, int):
        return custom
    keys = keys + ([custom] if isinstance(custom, str) else list(custom or []))
    config = text_config(model)
    for key in keys:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    if raise_error:
        raise ValueError(f"No {what} config key ({', '.join(keys)}) found in {type(config).__name__}")
    return None


def _names(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def pop_renames(kwargs: dict) -> tuple[list[tuple[str, str, str]], object]:
    """Take 1.x's rename options out of ``kwargs``: ``(option as written, native name, standard name)`` for each
    name they give, and the ``RenameConfig`` (or None)."""
    claims = [(f"{option}={name!r}", name, alias) for option, alias in RENAME_OPTIONS.items()
              for name in _names(kwargs.pop(option, None))]
    config = kwargs.pop("rename_config", None)
    if config is not None:
        claims += [(f"RenameConfig({field}={name!r})", name, alias) for field, alias in RENAME_FIELDS.items()
                   for name in _names(getattr(config, field))]
    # rename= as 1.x took it gives a standard name; any other alias is the user's own, as nnsight takes it (left in
    # kwargs for the core, which adds it beside the standard names)
    own: dict = {}
    for native, aliases in (kwargs.pop("rename", None) or {}).items():
        for alias in _names(aliases):
            if alias.rpartition(".")[2] in STANDARD_MODULES:
                claims.append((f"rename={{{native!r}: {alias!r}}}", native, alias))
            else:
                own.setdefault(native, []).append(alias)
    if own:
        kwargs["rename"] = own
    return claims, config


def _blocks(root: torch.nn.Module, family) -> list[str]:
    return [f"{blocks}.{i}" for blocks in family.block_lists for i in range(len(root.get_submodule(blocks)))]


def _placed(root: torch.nn.Module, family, alias: str) -> dict[str, torch.nn.Module]:
    """Where ``family`` places the standard module ``alias`` in ``root``, by path."""
    def at(path):
        try:
            return {path: root.get_submodule(path)} if path else {}
        except AttributeError:
            return {}

    if alias in ("self_attn", "mlp"):
        native = family.attention if alias == "self_attn" else family.mlp
        classes = tuple(key for key, names in family.rename().items() if isinstance(key, type)
                        and alias in _names(names))
        found = {}
        for block in _blocks(root, family):
            if native and family.attention != family.mlp:  # one native name for both: placed by class
                found.update(at(f"{block}.{native}"))
            found.update({f"{block}.{name}": sub for name, sub in root.get_submodule(block).named_children()
                          if isinstance(sub, classes)})
        return found
    if alias == "layers":
        return {path: module for blocks in family.block_lists for path, module in at(blocks).items()}
    backbone = family.layers.rpartition(".")[0].partition(".")[0]
    return at({"model": backbone, "embed_tokens": family.embed_tokens, "ln_final": family.ln_final,
               "lm_head": family.lm_head}[alias])


def _resolve(root: torch.nn.Module, family, name: str, alias: str) -> dict[str, torch.nn.Module]:
    """What a 1.x rename key named as ``alias``, by path: ``name`` (dotted, ``*`` for any child) from where the
    alias is read (each block for a sublayer; the model, its backbone and the module's parent otherwise), as
    nnsight binds a key wherever it resolves."""
    if alias in ("self_attn", "mlp"):
        hosts = _blocks(root, family)
    else:
        backbone = family.layers.rpartition(".")[0].partition(".")[0]
        hosts = dict.fromkeys(["", backbone, *(path.rpartition(".")[0] for path in _placed(root, family, alias))])
    found = {}
    for host in hosts:
        reached = [(host, root.get_submodule(host))]
        for part in name.split("."):
            reached = [(f"{at}.{child}".lstrip("."), sub) for at, here in reached
                       for child, sub in here.named_children() if part in ("*", child)]
        found.update(reached)
    return found


def _where(paths) -> str:
    """Paths, one per block list: ``model.layers.*.self_attn``."""
    return ", ".join(dict.fromkeys(re.sub(r"\.\d+(\.|$)", r".*\1", path) for path in paths)) or "nowhere"


def check_renames(root: torch.nn.Module, family, claims, config, validate: bool = True, model=None,
                  own_aliases: bool = False, stacklevel: int = 4) -> None:
    """Accept 1.x's rename options where they name what ``family`` places (a warning says to drop them); refuse
    one that contradicts it. A name that matches no module is refused, or ignored with a warning where the
    model is not validated (``check_renaming=False``: 1.x ignored it too). ``own_aliases``: let names
    other than the standard ones through (a plain nnsight model takes them). ``stacklevel``: the user's call, two
    frames above the caller (its caller's caller) by default."""

    def refuse(what: str):
        raise TypeError(f"{what}. Modules are placed by the {family.name} family spec, proven on a miniature of "
                        "the config: drop the option, or add a spec for your architecture (docs: Migrating from 1.x).")

    if config is not None and config.attn_prob_source is not None:
        refuse("RenameConfig(attn_prob_source=) is not taken: the attention probabilities are read where the spec "
               "says (model.availability(i) shows where)")
    accepted = []
    for option, native, alias in claims:  # option: as the user wrote it
        alias = alias.rpartition(".")[2]  # nnsight's dotted alias names its host: the standard name is the last part
        if alias not in STANDARD_MODULES:
            if own_aliases:
                continue
            refuse(f"{option} gives {native!r} your own name {alias!r}: StandardizedTransformer takes only the "
                   f"standard names ({', '.join(STANDARD_MODULES)}); read the module by its native name, or wrap the "
                   "model with nnsight.LanguageModel(..., rename=...)")
        named, placed = _resolve(root, family, native, alias), _placed(root, family, alias)
        where = _where(placed)
        other = [path for path, module in named.items() if not any(module is p for p in placed.values())]
        if other:
            refuse(f"{option} names {_where(other)} as {alias}, but the spec places {alias} at {where}: the two "
                   "contradict")
        if named:
            accepted.append((option, f"nothing (the {family.name} spec places {alias} there)"))
        elif validate:
            refuse(f"{option} names no module of this {type(root).__name__} where {alias} is read (the spec places "
                   f"{alias} at {where})")
        else:  # check_renaming=False: 1.x ignored a name that matched nothing
            accepted.append((option, f"nothing (it names no module of this model, so it is ignored; the spec "
                                     f"places {alias} at {where})"))
    for field, attribute in CONFIG_KEYS.items():
        custom = None if config is None else getattr(config, field)
        if custom is None:
            continue
        defaults = {"num_heads": default_attn_head_config_keys, "hidden_size": default_hidden_size_config_keys,
                    "vocab_size": default_vocab_size_config_keys}[attribute]()
        given = _config_value(root, defaults, custom, False, attribute)  # what 1.x read
        expected = (getattr(model, attribute) if model is not None
                    else _config_value(root, defaults, None, False, attribute))
        if expected is not None and given != expected:
            refuse(f"RenameConfig({field}={custom!r}) gives {attribute} {given}, but the model's is {expected}")
        accepted.append((f"RenameConfig({field}={custom!r})", f"model.{attribute}"))
    for flag in ("ignore_mlp", "ignore_attn"):
        if config is not None and getattr(config, flag):
            accepted.append((f"RenameConfig({flag}=True)", "nothing (the spec knows which modules a block has)"))
    if config is not None and not any(old.startswith("RenameConfig(") for old, _ in accepted):
        accepted.append(("rename_config=RenameConfig()", "nothing (a family spec places the modules)"))
    for old, new in accepted:
        deprecated(old, new, stacklevel=stacklevel)


def translate_options(kwargs: dict) -> dict:
    """1.x ``StandardizedTransformer`` options, in today's terms (a warning names each new spelling, at the call
    of the constructor that calls ``legacy_arguments``)."""
    kwargs = dict(kwargs)
    if "enable_attention_probs" in kwargs:
        deprecated("enable_attention_probs=", "attention_values=", stacklevel=5)
        kwargs["attention_values"] = kwargs.pop("enable_attention_probs")
    if "check_renaming" in kwargs:
        deprecated("check_renaming=", "validate= (the spec is proven on a miniature of the config)", stacklevel=5)
        kwargs["validate"] = kwargs.pop("check_renaming")
    if "allow_dispatch" in kwargs:
        deprecated("allow_dispatch=", "dispatch= (validation never loads the weights)", stacklevel=5)
        kwargs.pop("allow_dispatch")
    if kwargs.pop("remote", False):
        deprecated("StandardizedTransformer(..., remote=True)", "dispatch=False, then trace(..., remote=True)",
                   stacklevel=5)
        kwargs["dispatch"] = False
    for option in ("check_attn_probs_with_trace", "allow_multimodal"):
        if option in kwargs:
            deprecated(f"{option}=", "nothing (it has no effect)", stacklevel=5)
            kwargs.pop(option)
    tokenizer_kwargs = kwargs.pop("tokenizer_kwargs", None)
    if tokenizer_kwargs:
        deprecated("tokenizer_kwargs=", "tokenizer=AutoTokenizer.from_pretrained(name, **kwargs)", stacklevel=5)
        if kwargs.get("tokenizer") is None and isinstance(kwargs.get("model"), (str, os.PathLike)):
            from transformers import AutoTokenizer

            kwargs["tokenizer"] = AutoTokenizer.from_pretrained(kwargs["model"], **tokenizer_kwargs)
    return kwargs


def backbone_norm(family) -> tuple[str, str] | None:
    """``(backbone, final norm)`` native paths where the final norm is in the backbone (1.x also named it there:
    ``model.model.ln_final``)."""
    backbone = family.layers.rpartition(".")[0].partition(".")[0]
    if backbone and family.ln_final and family.ln_final.startswith(f"{backbone}."):
        return backbone, family.ln_final
    return None


def name_norm_on_backbone(model) -> None:
    """``model.model.ln_final``: the final norm, also named on the backbone as 1.x's rename dict did."""
    found = backbone_norm(model.family)
    if found is None:
        return
    backbone = model.__dict__.get("model")  # the backbone's envoy, under its standard name
    if backbone is None or backbone.__dict__.get("ln_final") is model.ln_final:
        return
    if "ln_final" in backbone.__dict__ or hasattr(type(backbone), "ln_final") or hasattr(backbone._module, "ln_final"):
        return  # never shadow a name the backbone has
    object.__setattr__(backbone, "ln_final", model.ln_final)  # as nnsight binds an alias: the same envoy
    backbone._aliases["ln_final"] = found[1][len(found[0]) + 1:]


def legacy_arguments(model, tokenizer, validate: bool, attention_values: bool, dispatch: bool, options: dict):
    """1.x constructor arguments in today's terms, for ``StandardizedTransformer.__init__``: ``(model, tokenizer,
    validate, attention_values, dispatch, from_pretrained_kwargs, after)``; ``after(wrapper)``, called once the
    model is wrapped, checks the 1.x rename options that need it and applies 1.x's ``padding_side``."""
    from transformers import PreTrainedModel

    options = dict(options)
    padding_side = (options.get("tokenizer_kwargs") or {}).get("padding_side")
    claims, config = pop_renames(options)
    options = translate_options({"model": model, "tokenizer": tokenizer, "validate": validate,
                                 "attention_values": attention_values, "dispatch": dispatch, **options})
    model, tokenizer = options.pop("model"), options.pop("tokenizer")
    validate, attention_values, dispatch = options.pop("validate"), options.pop("attention_values"), options.pop("dispatch")
    if (claims or config is not None) and isinstance(model, PreTrainedModel):  # checked before wrapping
        from ..families import family_of

        check_renames(model, family_of(model.config, type(model).__name__), claims, config, validate, stacklevel=5)
        claims, config = [], None

    def after(wrapper) -> None:
        if claims or config is not None:  # a name or folder: checked on the model it loaded
            check_renames(wrapper._module, wrapper.family, claims, config, validate, wrapper, stacklevel=5)
        name_norm_on_backbone(wrapper)
        if padding_side:  # nnsight sets left padding on the tokenizer it is given; 1.x's option wins
            wrapper.tokenizer.padding_side = padding_side

    return model, tokenizer, validate, attention_values, dispatch, options, after


def install(cls) -> None:
    """Give the model class the 1.x names (``LegacyNames``, through the class's ``_nnterp_fallback``: looked up where
    the class and the module tree have no such name, never set on the class) and constructor arguments
    (``legacy_arguments``, through ``_nnterp_arguments``), from outside the core (called by ``nnterp/__init__.py``).
    A name the class already has, its own or a base's, stays the standard one."""
    cls._nnterp_fallback = {name: value for name, value in vars(LegacyNames).items()
                            if not name.startswith("__") and not hasattr(cls, name)}
    cls._nnterp_arguments = staticmethod(legacy_arguments)
