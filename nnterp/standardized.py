"""StandardizedTransformer: one set of names and values on every decoder family."""

from __future__ import annotations

import dataclasses
import logging
import os
import textwrap
from dataclasses import dataclass

import torch
import transformers
from nnsight import Envoy
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.modeling.transformers import TransformersModel
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from . import attention, inputs, proof
from .catalog import BY_NAME, CATALOG, value_named
from .envoys import AttentionEnvoy, BlockEnvoy, BlockWithMLPEnvoy, LayersEnvoy, MLPEnvoy, Slot, SublayerEnvoy
from .errors import NNterpError, ReadoutUnavailable, RunNotChosen, UnknownArchitecture, ValueUnavailable
from .families import BY_MODEL_TYPE, Block, Family, family_of
from .locations import At, SameAs, Unavailable, leading_shape, token_count
from .selection import layer_ranges


@dataclass(frozen=True)
class Availability:
    """Where a value of one block is read, or why it has no meaning there."""

    location: str | None = None
    reason: str | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        return self.location if self.available else f"unavailable: {self.reason}"


class AvailabilityTable(dict):
    """``{value: Availability}``, printed as a table, one value an entry (a long reason wrapped at word breaks)."""

    def __repr__(self) -> str:
        width = max(map(len, self), default=0)
        return "\n".join(textwrap.fill(f"{key:<{width}}  {entry}", width=max(120, width + 60),
                                        subsequent_indent=" " * (width + 2), break_long_words=False,
                                        break_on_hyphens=False) for key, entry in self.items())

    __str__ = __repr__


def _prepare(name: str | os.PathLike, tokenizer, validate: bool, from_pretrained_kwargs: dict):
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
        events = proof.validate(config, architecture, tokenizer, StandardizedTransformer)
    return config, architecture, tokenizer, events


_OFFLINE_HINT = ("Pass a local folder, or a hub name with network access; offline, "
                 "nnterp.embedded.load_embedded() gives the embedded SmolLM2-135M.")


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


class StandardizedTransformer(TransformersModel):
    """A causal LM whose blocks expose the standard values under the standard names.

    ``StandardizedTransformer("org/name" or "/local/folder", **from_pretrained_kwargs)`` loads a
    model and its tokenizer; ``StandardizedTransformer(model, tokenizer=tok)`` wraps one that is
    already built. Either way the model is put in eval mode.

    ``validate=True`` (the default) proves the family spec on a miniature of the model's config
    (same classes, tiny sizes, random weights; never this model's weights) before the values are
    trusted, once per architecture and config shape; it raises ``ValidationError`` if it fails.

    ``attention_values=True`` serves the values inside the attention (queries, keys, values,
    scores, probabilities) by running transformers' eager attention instead of the model's (sdpa
    by default) and reading them inside it; ``enable_attention_values()`` does it later.

    Every value is read at a native module path of the unmodified model (or an operation inside
    one), with pure tensor steps, so the same trace runs remotely: ``model.trace(..., remote=True)``
    sends a request keyed as the plain ``TransformersModel`` of the checkpoint, which is what
    NDIF hosts, and ships the standard names with it.
    """

    def __init__(self, model: str | os.PathLike | transformers.PreTrainedModel, tokenizer=None, *, validate: bool = True,
                 attention_values: bool = False, dispatch: bool = True, **from_pretrained_kwargs):
        validated = None  # the forward events of the validated miniature
        lazy = isinstance(model, (str, os.PathLike)) and not dispatch
        if isinstance(model, (str, os.PathLike)):
            config, architecture, tokenizer, validated = _prepare(model, tokenizer, validate, from_pretrained_kwargs)
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
        if tokenizer is None:
            raise ValueError("A model object needs its tokenizer: StandardizedTransformer(model, tokenizer=tok).")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
        family = family_of(config, architecture.__name__) if lazy else family_of(model.config, type(model).__name__)
        if not lazy and not _has_module(model, family.layers):  # another class of the type (an image-text one)
            raise UnknownArchitecture(
                f"{type(model).__name__} has no module '{family.layers}', where the {family.name} spec finds the "
                f"blocks of its causal LM ({', '.join(family.model_types)}). Load the checkpoint by name or folder "
                "(StandardizedTransformer(name)), which builds that causal LM, or wrap it.")
        if not lazy:
            model.eval()  # nnsight does not; dropout would make every value random
        # explicit base calls throughout: the class travels by value to remote servers, where a
        # zero-argument super() has no __class__ cell
        TransformersModel.__init__(
            self,
            model,
            tokenizer=tokenizer,
            task="text-generation",
            rename=family.rename(),
            envoys={pattern: envoy for blocks in family.block_lists for pattern, envoy in {
                blocks: LayersEnvoy,
                f"{blocks}.*": BlockEnvoy if family.mlp else BlockWithMLPEnvoy,
                **({f"{blocks}.*.{family.attention}": AttentionEnvoy} if family.attention else {}),
                **({f"{blocks}.*.{family.mlp}": SublayerEnvoy if family.mlp == family.attention else MLPEnvoy}
                   if family.mlp else {}),
            }.items()},
            **({"dispatch": False, **from_pretrained_kwargs} if lazy else {}),
        )
        model = self._module  # lazy: the weightless model that stands in until the first trace
        self._nnterp_family = family
        # the native path of each block; where the blocks are in several lists (stacks), ``model.layers`` is all of
        # them in order, a list of their envoys
        self._nnterp_block_paths = tuple(f"{path}.{i}" for path in family.block_lists
                                         for i in range(len(model.get_submodule(path))))
        if family.stacks:
            self.__dict__["layers"] = StackedLayers([self._envoy_at(path) for path in self._nnterp_block_paths])
        self._nnterp_text_config = model.config.get_text_config()
        self._nnterp_position_limit = inputs.position_limit(model)
        self._nnterp_warned_hooks: set = set()  # the user's own hooks on the model, warned about once each
        self._nnterp_structure = tuple(family.block(self._nnterp_text_config, i) for i in range(len(self.layers)))
        self._nnterp_attention_on = False
        self._nnterp_validate = validate
        # read on every value: kept, per block (a heterogeneous config's layers may have their own head counts; None
        # on a model without attention: a recurrent one)
        self._nnterp_heads = heads_per_layer(family, self._nnterp_text_config, len(self.layers))
        # the block calls of a pass, and how many times each block runs (read on every value of a looped model)
        self._nnterp_schedule, self._nnterp_runs = schedule_of(family, self._nnterp_text_config, len(self.layers))
        self._place_values()
        for i, block in enumerate(self.layers):
            slot = Slot(self, i)
            block._nnterp_slot = slot
            # a block without an MLP (a recurrent one), or without attention (a hybrid's other blocks), has no such
            # sublayer: `mlp` / `self_attn` say why (StandardEnvoy); where a hybrid's other token mixer is natively
            # named `self_attn` (Kimi-Linear's linear attention), the values of `self_attn` say why
            if isinstance(self._nnterp_structure[i].resolve("mlp_output"), At) or (
                    family.mlp and family.mlp != family.attention and _has_module(block._module, family.mlp)):
                # a module at the MLP's path whose values are unavailable (LongCat-Flash's shortcut): they say why
                block.mlp._nnterp_slot = slot
            if isinstance(self._nnterp_structure[i].resolve("attention_output"), At) or _has_module(
                    block._module, "self_attn"):
                block.self_attn._nnterp_slot = slot
        # values read without positions the model prepends to the tokens (CPM-Ant): a cached pass has none
        self._nnterp_prefixed = bool(self._view_in_use("prefix"))
        # a block that flattens the stream (OPT) needs [batch, seq] of each pass, read before its values
        self._nnterp_flattens = bool(self._view_in_use("unflatten"))
        # a model that pads the stream after the tokens (Reformer) passes its blocks how many positions are tokens:
        # the keyword argument, read from a block's input before the block's first value in a pass
        self._nnterp_counted = self._view_in_use("count") or ""
        if validate and not validated:
            validated = proof.validate(model.config, type(model), tokenizer, StandardizedTransformer)
        # from the validated miniature (same architecture, same names) when there is one
        self._forward_events = validated or forward_events(model)
        if attention_values:
            self.enable_attention_values()

    def _view_in_use(self, view: str):
        """The view ``view`` of ``At`` (``"prefix"``, ``"unflatten"``, ``"count"``) as the first value of some block that
        is read through it sets it; None where no value is."""
        return next((getattr(location, view) for block in self._nnterp_blocks for location in block.values.values()
                     if isinstance(location, At) and getattr(location, view)), None)

    def __repr__(self) -> str:
        """The model's own module tree (standard aliases shown as ``alias/native``), then the standard names."""
        aliases = self._aliases
        self._aliases = {alias: path for alias, path in aliases.items() if "." not in path}  # mounts: listed below
        try:
            tree = TransformersModel.__repr__(self)
        finally:
            self._aliases = aliases
        family = self.family
        lines = [tree, "",
                 f"Standard names ({family.name} family, {self.num_layers} blocks):",
                 f"  model.layers[i] = {' then '.join(f'{path}[i]' for path in family.block_lists)}",
                 f"  model.embed_tokens = {family.embed_tokens},  model.ln_final = "
                 f"{family.ln_final or 'none (the head reads the last block output)'},  "
                 f"model.lm_head = {family.lm_head}"
                 + (f" (reading {family.head_input}'s output)" if family.head_input else "")
                 + (f" (then {family.vocab_projection}, the projection on the vocabulary)" if family.vocab_projection else "")]
        groups: dict[tuple, list[int]] = {}
        for i in range(self.num_layers):
            table = self.availability(i)
            available = tuple(self.order(i))
            unavailable = tuple(key for key, entry in table.items() if not entry.available)
            groups.setdefault((available, unavailable), []).append(i)
        for (available, unavailable), layers in groups.items():
            which = "every block" if len(groups) == 1 else f"blocks {layer_ranges(layers)}"
            lines.append(f"  {which}, in forward order: {', '.join(available)}")
            if unavailable:
                lines.append(f"    unavailable (model.availability({layers[0]}) says why): {', '.join(unavailable)}")
        return "\n".join(lines)

    def __getattr__(self, name: str):
        family = self.__dict__.get("_nnterp_family")
        if name == "ln_final" and family is not None and family.ln_final is None:
            raise AttributeError(f"{family.name} has no final norm: its head reads the last block's output directly, "
                                 "so model.ln_final does not exist (model.project_on_vocab(h) is model.lm_head("
                                 f"{f'model.{family.head_input}(h)' if family.head_input else 'h'})).")
        return TransformersModel.__getattr__(self, name)  # explicit: the class travels by value

    # -- model-level names --------------------------------------------------------------
    @property
    def family(self) -> Family:
        """The family spec this model's values are read by (module paths, block specs)."""
        return self._nnterp_family

    @property
    def logits(self) -> torch.Tensor:
        """The model's output logits, ``[batch, seq, vocab]`` (inside a trace)."""
        return self.output.logits

    @property
    def next_token_probs(self) -> torch.Tensor:
        """The softmax of the last position's logits, ``[batch, vocab]`` (inside a trace)."""
        return self.logits[:, -1].softmax(dim=-1)

    @property
    def num_layers(self) -> int:
        """The number of blocks, len(model.layers) (a looped model's blocks once each; schedule lists the calls)."""
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream (the text config's hidden_size): the last dimension of layer_input,
        layer_output and the contributions."""
        return self._nnterp_text_config.hidden_size

    @property
    def num_heads(self) -> int:
        """The config's number of attention heads (the global one, where layers have their own: ``num_heads_of``;
        None on a model without attention)."""
        return _global(self._nnterp_text_config, "num_attention_heads")

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """``(layer, run)`` of every block call in one forward pass, in the order the model makes them: each block
        once (run 0), except where a section of blocks runs several times (a looped model)."""
        return self._nnterp_schedule

    def runs_of(self, layer: int) -> int:
        """How many times block ``layer`` runs in each forward pass (1 except in a looped section)."""
        return self._nnterp_runs[layer % self.num_layers]

    def run_slot(self, layer: int, run: int) -> Slot:
        """The slot of run ``run`` of block ``layer``; an ``IndexError`` names the runs the block has."""
        runs = self.runs_of(layer)
        if not 0 <= run < runs:
            raise IndexError(f"Run {run} is out of range: layers[{layer}] runs {runs} time{'s' * (runs > 1)} in each "
                             f"forward pass (runs 0 to {runs - 1}).")
        return Slot(self, layer % self.num_layers, run)

    def num_heads_of(self, layer: int) -> int:
        """The number of attention heads of block ``layer`` (the views per head split by it)."""
        return self._nnterp_heads[layer]

    @property
    def vocab_size(self) -> int:
        """The text config's vocabulary size, which the head projects onto."""
        return self._nnterp_text_config.vocab_size

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a stream tensor, read out as the model reads its last block's output.

        The family's final norm and head, with what the model does around them (collapsing
        parallel streams first, softcapping or scaling the logits after). On the last block's
        ``layer_output`` it gives the model's own logits.
        """
        family = self.family
        self.refuse_unreadable_stream()
        if family.stream_readout:
            hidden = self._module.get_submodule(family.stream_readout)(hidden)
        if family.ln_final is None:  # no final norm: the head reads the last block's output (OpenAI GPT)
            normed = hidden
        else:
            norm_weight = getattr(self.ln_final._module, "weight", None)
            if family.before_final_norm:
                hidden = family.before_final_norm(hidden, self._module)
            elif norm_weight is not None and hidden.dtype != norm_weight.dtype:
                hidden = hidden.to(norm_weight.dtype)  # a float32 stream (ZAYA) is cast for the norm
            normed = self.ln_final(hidden)
        if family.head_input:  # a projection between the norm and the head (OPT's project_out)
            normed = self._module.get_submodule(family.head_input)(normed)
        if family.head_input_transform:
            normed = family.head_input_transform(normed, self._module.config)
        head_weight = getattr(self.lm_head._module, "weight", None)
        if head_weight is not None and normed.dtype != head_weight.dtype:
            normed = normed.to(head_weight.dtype)  # a float32 stream normed in float32 (Mamba's): cast for the head
        logits = self.lm_head(normed)
        if family.vocab_projection:
            logits = self._module.get_submodule(family.vocab_projection)(logits)
        if family.logits_transform:
            logits = family.logits_transform(logits, self._module.config)
        return logits

    def refuse_unreadable_stream(self) -> None:
        """Raise ``ReadoutUnavailable`` where the family has no readout of one stream (``project_on_vocab``, the lens)."""
        if self.family.readout_unavailable:
            raise ReadoutUnavailable(f"project_on_vocab and the logit lens are unavailable on {self.family.name}: "
                                     f"{self.family.readout_unavailable}.")

    def dispatch(self) -> None:
        """Load the weights of a model built with ``dispatch=False`` (the first trace does it too)."""
        if self.dispatched:
            return
        TransformersModel.dispatch(self)
        self._module.eval()
        self._nnterp_resolved.clear()  # the envoys now stand for the loaded modules

    # -- remote execution ---------------------------------------------------------------------
    def _remoteable_class(self) -> type:
        """Requests name the plain ``TransformersModel`` of the checkpoint: what remote servers host."""
        return TransformersModel

    def _remote_backend(self, remote, blocking, job_id, verbose):
        """Ship nnterp's code with the request (by value): the server has only torch, transformers and nnsight."""
        import nnsight

        nnsight.register(__name__.partition(".")[0])
        return TransformersModel._remote_backend(self, remote, blocking, job_id, verbose)

    # -- the values inside the attention -----------------------------------------------------
    def enable_attention_values(self) -> None:
        """Serve queries, keys, values, scores and probabilities: this wrapper's traces run transformers'
        eager attention (slower than sdpa). The model itself is left as it is: another wrapper of it, or
        the bare model, runs its own implementation."""
        where = self.family.attention_of(self._nnterp_text_config)
        if isinstance(where, Unavailable):
            raise ValueUnavailable("self_attn.attention_probabilities", self.family.name, where.reason)
        if self._nnterp_validate:  # proven on a miniature like the other values, once per architecture (cached)
            try:
                proof.validate(self._module.config, type(self._module), self.tokenizer, StandardizedTransformer,
                               attention=True)
            except proof.ValidationError as error:
                raise ValueUnavailable(
                    "self_attn.attention_probabilities", self.family.name,
                    f"this architecture's eager attention does not compute them where the {self.family.name} spec "
                    f"reads them (the other values are proven and available). The proof said: {error}") from None
        self._nnterp_attention_on = True
        self._place_values()

    def disable_attention_values(self) -> None:
        """Back to the model's own attention implementation in this wrapper's traces."""
        self._nnterp_attention_on = False
        self._place_values()

    def interleave(self, fn, *args, **kwargs):
        """Every trace of this wrapper runs with eager attention while the attention values are on, and
        hands the model back with the implementation it had."""
        if not self.dispatched and detect_fake_mode() is None:  # the weights first: dispatch swaps the module
            self.dispatch()
        if detect_fake_mode() is None:
            inputs.refuse_meta(self._module)
            inputs.warn_foreign_hooks(self._module, self._nnterp_warned_hooks)
        own = attention.implementation_of(self._module)
        if not self._nnterp_attention_on or own == attention.IMPLEMENTATION:
            return TransformersModel.interleave(self, fn, *args, **kwargs)
        attention.set_implementation(self._module, attention.IMPLEMENTATION)
        try:
            return TransformersModel.interleave(self, fn, *args, **kwargs)
        finally:
            attention.set_implementation(self._module, own)

    def _batch_size(self, *args, **kwargs) -> int:
        inputs.refuse_empty(args)
        return TransformersModel._batch_size(self, *args, **kwargs)

    def _batch(self, invokes: list, fn) -> tuple:
        """The batched forward input, refused in one line where the model could not run it."""
        batched = TransformersModel._batch(self, invokes, fn)
        if isinstance(batched, tuple) and len(batched) == 2 and isinstance(batched[1], dict):
            inputs.check_batch(self._module, batched[1], self._nnterp_position_limit)
        return batched

    def _remoteable_get_env(self) -> dict:
        """The environment a remote request carries: eager attention while the attention values are on."""
        env = TransformersModel._remoteable_get_env(self)
        if self._nnterp_attention_on:
            # the server switches through transformers, which refuses a class with an attention of its own code
            # (a multimodal model's vision tower): say so before sending a request bound to fail
            can_switch = getattr(type(self._module), "_can_set_attn_implementation", lambda: True)
            # a model that runs its own eager code already (BLOOM, MPT, GPT-Neo) needs no switch
            if attention.implementation_of(self._module) != attention.IMPLEMENTATION and not can_switch():
                raise ValueError(
                    f"The attention values cannot run remotely on {type(self._module).__name__}: the server switches "
                    "a model to eager attention through transformers, which refuses this class (part of it computes "
                    "attention in its own code). Call model.disable_attention_values() for remote traces; every "
                    "other value runs remotely."
                )
            env["attn_implementation"] = attention.IMPLEMENTATION
        return env

    def _place_values(self) -> None:
        """Every block's values (the attention internals as they are on or off), and the modules read
        through ``.source``, which each pass instruments before its first value (``_begin_pass``)."""
        where = attention.internal_locations(self.family, self._nnterp_text_config, self._nnterp_attention_on)
        self._nnterp_resolved: dict[tuple[int, str], tuple] = {}
        # a block that places the internals itself (unavailable: a hybrid's block without attention) keeps them;
        # where it reads them elsewhere (Gemma-3n's shared keys, read as copies), only while they are on
        off = {name for name, location in where.items() if isinstance(location, Unavailable)}
        self._nnterp_blocks = tuple(dataclasses.replace(block, values={**where, **{
            name: location for name, location in block.values.items() if not (name in off and isinstance(location, At))
        }}) for block in self._nnterp_structure)
        self._nnterp_sourced = sorted({self.block_path(i, location.path)
                                       for i, block in enumerate(self._nnterp_blocks)
                                       for location in (*block.values.values(), *block.extra.values())
                                       if isinstance(location, At) and location.op})

    def head_outputs(self, layer: int) -> torch.Tensor:
        """Inside a trace: each head's contribution through the output projection ``[batch, seq, heads, out]``."""
        return attention.head_outputs(self, layer)

    def scale_heads(self, layer: int, heads, factor: float = 0.0) -> None:
        """Inside a trace: multiply the output of ``heads`` of block ``layer`` by ``factor`` (0 ablates them)."""
        attention.scale_heads(self, layer, heads, factor)

    # -- per-block values ---------------------------------------------------------------
    def block_spec(self, layer: int) -> Block:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers (0 to {self.num_layers - 1}).")
        return self._nnterp_blocks[layer]

    def block_path(self, layer: int, path: str = "") -> str:
        """The native module name of ``path`` (relative to block ``layer``) in the HF model."""
        return ".".join(filter(None, (self._nnterp_block_paths[layer % self.num_layers], path)))

    def location(self, layer: int, name: str) -> At:
        """Where value ``name`` of block ``layer`` is read; ``ValueUnavailable`` where it has no meaning."""
        value = value_named(name)
        location = self.block_spec(layer).resolve(value.name)
        if isinstance(location, Unavailable):
            raise ValueUnavailable(value.key, self.family.name, location.reason)
        return location

    def read_value(self, layer: int, name: str, run: int | None = None) -> torch.Tensor:
        """Inside a trace: value ``name`` of block ``layer`` (what ``model.layers[layer].<name>`` gives), at run
        ``run`` of a block that runs several times per pass (``model.layers[layer].run(run).<name>``)."""
        location, key, block, envoy, plain = self._resolved(layer, name)
        self._begin_pass(block)
        pinned = self._pin_run(layer, run, key, location, block)
        try:
            if plain:  # the module's own tensor, no view or copy: what raw nnsight reads, as directly
                return location._raw(envoy)
            return location.read(block, self._nnterp_heads[layer], envoy)
        except OutOfOrderError as error:
            raise self._out_of_order(layer, key, error) from None
        finally:
            _unpin(pinned)

    def _pin_run(self, layer: int, run: int | None, key: str, location: At, block) -> Mediator | None:
        """Bind the requests that follow to run ``run`` of block ``layer`` until ``_unpin`` (nnsight binds a request
        to a module's first call unless the mediator is pinned to a later occurrence, which ``tracer.iter`` does per
        generation step); the mediator pinned, or None. (Plain calls, not a context manager: the class travels by
        value to remote servers as source, without its decorators.)"""
        runs = self.runs_of(layer)
        if run is None and runs > 1:
            raise RunNotChosen(
                f"layers[{layer}] runs {runs} times in each forward pass of {self.family.name} (a looped section), so "
                f"'{key}' has a value per run: read one with model.layers[{layer}].run(k).{key}, k from 0 to "
                f"{runs - 1} (model.schedule lists the block calls in forward order).")
        if not run:  # the first run: nnsight's own binding
            return None
        self.run_slot(layer, run)  # an out-of-range run says so
        mediator = Mediator.current("a standard value")
        if mediator.iteration != 0:
            raise NNterpError(
                f"layers[{layer}].run({run}).{key}: the runs of a looped block are read in a trace, or in the first "
                "step of a generation (tracer.iter[0]); a later step's runs cannot be told apart from the earlier "
                "steps' calls.")
        where = f"{location.envoy(block).path}.{location.side}"
        if mediator.occurrence(where) > run:  # pinned, nnsight would wait for a call that never comes
            raise OutOfOrderError(f"'{where}.i{run}' was requested but the model already ran past it")
        mediator.iteration = run
        return mediator

    def _resolved(self, layer: int, name: str) -> tuple[At, str, Envoy, Envoy | None, bool]:
        """(location, key, block envoy, module envoy, plain) of a value of a block, resolved once per model (a
        value's place is fixed until the attention values are turned on or off), so that a read walks no path;
        an unavailable value raises every time. An operation inside a forward is looked up on each read:
        ``.source`` is instrumented per pass. ``plain``: the module's own tensor, with no view or copy."""
        found = self._nnterp_resolved.get((layer, name))
        if found is None:
            location = self.location(layer, name)
            block = self.layers[layer]
            envoy = None if location.op else location.envoy(block)
            plain = envoy is not None and not location._derived
            found = self._nnterp_resolved[(layer, name)] = (location, value_named(name).key, block, envoy, plain)
        return found

    def read_at(self, layer: int, location: At, key: str | None = None, run: int | None = None) -> torch.Tensor:
        """Inside a trace: the tensor at ``location`` of block ``layer`` (at run ``run`` of a looped block)."""
        block = self.layers[layer]
        self._begin_pass(block)
        pinned = self._pin_run(layer, run, key or location.describe(), location, block)
        try:
            return location.read(block, self._nnterp_heads[layer])
        except OutOfOrderError as error:
            raise self._out_of_order(layer, key or location.describe(), error) from None
        finally:
            _unpin(pinned)

    def _out_of_order(self, layer: int, key: str, error: Exception) -> OutOfOrderError:
        """nnsight's error, in the standard names: which value, and the order to read a block's values in."""
        return OutOfOrderError(
            f"layers[{layer % self.num_layers}].{key} was requested, but the model already ran past it: read a "
            f"block's values in forward order (model.order({layer}) lists them) and the blocks in order. ({error})"
        )

    def _begin_pass(self, block) -> None:
        """Before the first value of a forward pass (per invoke and generation step): instrument the modules
        read through ``.source`` (nnsight instruments a module when it is first asked, for the calls that
        start after that: a fresh server model included), and read ``[batch, seq]`` where a block flattens
        the stream, or how many of its positions are tokens where the model pads it."""
        if self._nnterp_sourced:
            mediator = Mediator.current("a standard value")
            if not mediator.__dict__.get("_nnterp_sourced"):
                for path in self._nnterp_sourced:
                    self._envoy_at(path).source  # noqa: B018 - the access instruments the module
                mediator._nnterp_sourced = True
        if self._nnterp_flattens:
            leading_shape(block)
        if self._nnterp_counted:
            token_count(block, self._nnterp_counted)
        if self._nnterp_prefixed:
            self._refuse_a_cached_pass()

    def _refuse_a_cached_pass(self) -> None:
        """A model that prepends positions to the tokens (CPM-Ant) does so fully only on a pass without a cache:
        given a filled one, its stream holds other positions, which the values' view cannot tell apart. Read from
        the model's own inputs, the first event of each pass (per invoke and generation step)."""
        mediator = Mediator.current("a standard value")
        checked = mediator.__dict__.setdefault("_nnterp_uncached", set())
        if mediator.iteration in checked:
            return
        _, kwargs = self.inputs
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and getattr(cache, "get_seq_length", lambda: 0)() > 0:
            raise ValueError(
                f"{self.family.name} prepends its prompt positions to the stream in full only on a pass without a "
                "cache, so the values of a pass given a filled one (a generation's later steps too) cannot be told "
                "apart from them: trace the whole sequence without past_key_values."
            )
        checked.add(mediator.iteration)

    def _envoy_at(self, path: str):
        envoy = self
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def write_value(self, layer: int, name: str, value: torch.Tensor, run: int | None = None) -> None:
        """Inside a trace: replace value ``name`` of block ``layer`` (``model.layers[layer].<name> = value``), at
        run ``run`` of a block that runs several times per pass."""
        location, key, block, envoy, _ = self._resolved(layer, name)
        self._begin_pass(block)
        pinned = self._pin_run(layer, run, key, location, block)
        try:
            location.write(block, value, self._nnterp_heads[layer], key, envoy)
        except OutOfOrderError as error:
            raise self._out_of_order(layer, key, error) from None
        finally:
            _unpin(pinned)

    def availability(self, layer: int) -> dict[str, Availability]:
        """Every standard value of block ``layer``: where it is read, or why it is unavailable."""
        block = self.block_spec(layer)
        result = AvailabilityTable()
        for value in CATALOG:
            location = block.resolve(value.name)
            if isinstance(location, Unavailable):
                result[value.key] = Availability(reason=location.reason)
            else:
                result[value.key] = Availability(location=location.describe())
        return result

    def order(self, layer: int, aliases: bool = False) -> dict[str, int]:
        """Forward-order ranks of block ``layer``'s available values; equal ranks share a location.

        Read a block's values in this order within one trace: reading one after a later one
        raises nnsight's ``OutOfOrderError``. ``mixer_output`` is listed where it is not simply
        the attention's output (a hybrid's blocks without attention); ``aliases=True`` lists it
        on every block.
        """
        alias = isinstance(self.block_spec(layer).values.get("mixer_output"), SameAs)
        events = {key: event for event, key, _ in self.timeline(layer)
                  if not key.startswith("extra.") and (aliases or not (alias and key == "mixer_output"))}
        ranks = {event: rank for rank, event in enumerate(sorted(set(events.values())))}
        return {key: ranks[event] for key, event in events.items()}

    def timeline(self, layer: int) -> list[tuple[tuple[int, int], str, At]]:
        """(event, key, location) of every available value and identity extra of a block, in forward order."""
        block = self.block_spec(layer)
        located = [(value.key, block.resolve(value.name)) for value in CATALOG]
        located += [(f"extra.{name}", location) for name, location in block.extra.items()]
        located = [(key, location) for key, location in located if isinstance(location, At)]
        # module boundaries are ordered by the recorded forward pass; an operation inside a forward
        # (read through .source) comes right after the last module-boundary value the catalog puts before it
        events = {key: (self._event_index(self.block_path(layer, location.path), location.side, key), 0)
                  for key, location in located if not location.op}
        rank = {key: BY_NAME[key.rpartition(".")[2]].rank for key, _ in located if not key.startswith("extra.")}
        block_input = (self._event_index(self.block_path(layer), "input", "layer_input"), 0)
        # and after its module is called (Falcon-H1 runs its Mamba between the norm and the attention). Operations
        # of equal rank at different places (Falcon-H1's scaled attention output, then the sum that is its mixer's
        # output) follow the catalog's order; values read at one operation share its event.
        places: dict[tuple[str, str, str], int] = {}
        for key, location in located:
            if location.op:
                called = self._forward_events.get((self.block_path(layer, location.path), "input"), -1)
                before = [events[k] for k in events if k in rank and rank[k] < rank[key]]
                place = places.setdefault((location.path, location.op, location.side), len(places))
                events[key] = (max(max(before, default=block_input)[0], called), 1 + rank[key], place)
        return sorted(((events[key], key, location) for key, location in located), key=lambda item: item[0])

    def _event_index(self, name: str, side: str, key: str) -> int:
        index = self._forward_events.get((name, side))
        if index is None:
            raise NNterpError(
                f"The module where '{key}' is read never ran in a forward pass of this {self.family.name} "
                "model: the family spec does not match it. Please report this with the model's config."
            )
        return index


class StackedLayers(list):
    """``model.layers`` where the blocks are in several lists (stacks): their envoys, in order. ``_module`` lists
    their modules (a plain list: nothing is added to the model)."""

    @property
    def _module(self) -> list[torch.nn.Module]:
        return [envoy._module for envoy in self]

    def __getitem__(self, key):
        if isinstance(key, int) and not -len(self) <= key < len(self):
            raise IndexError(f"Layer {key} is out of range: the model has {len(self)} layers (0 to {len(self) - 1}).")
        return list.__getitem__(self, key)


def _unpin(mediator: Mediator | None) -> None:
    """Back to nnsight's own binding, each request to a module's first call (``_pin_run``)."""
    if mediator is not None:
        mediator.iteration = 0


def schedule_of(family: Family, config, num_layers: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """``(layer, run)`` of each block call of a forward pass, in order (``Family.schedule``), and each block's number
    of runs."""
    order = family.schedule(config) if family.schedule else range(num_layers)
    runs = [0] * num_layers
    calls = []
    for layer in order:
        calls.append((layer, runs[layer]))
        runs[layer] += 1
    return tuple(calls), tuple(runs)


def _has_module(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _global(config, name: str):
    """``config.<name>``, the global value where the config's layers override it (a heterogeneous config)."""
    if getattr(config, "is_heterogeneous", False):
        return config._getattr_without_heterogeneous_validation(name, None)
    return getattr(config, name, None)


def heads_per_layer(family: Family, config, num_layers: int) -> tuple[int, ...]:
    """Each block's number of attention heads: the family's count per block, the config's list per layer or a
    heterogeneous config's layer's own, else the config's."""
    if family.heads:
        return tuple(family.heads(config, i) for i in range(num_layers))
    listed = getattr(config, "num_attention_heads_per_layer", None)  # Laguna
    if isinstance(listed, (list, tuple)) and len(listed) == num_layers:
        return tuple(listed)
    if "num_attention_heads" in (getattr(config, "per_layer_attributes", None) or ()):
        return tuple(config.per_layer_config[i].num_attention_heads for i in range(num_layers))
    return (getattr(config, "num_attention_heads", None),) * num_layers  # None: a recurrent model


SMALL_ENOUGH_TO_RUN = 200_000_000  # parameters: a real two-token forward is cheaper than a fake one


def forward_events(model: torch.nn.Module) -> dict[tuple[str, str], int]:
    """The order module inputs and outputs fire in a forward pass (first call of each), by module name.

    The order depends on the architecture, not the weights: a small model runs two real tokens,
    a large one runs on fake tensors (no compute, no memory).
    """
    events: dict[tuple[str, str], int] = {}

    def recorder(name: str, side: str):
        def hook(*_):  # returns None: the hook must not replace the module's inputs or output
            events.setdefault((name, side), len(events))
        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(recorder(name, "input")))
        handles.append(module.register_forward_hook(recorder(name, "output")))
    parameters = list(model.parameters())
    ids = torch.zeros(1, 2, dtype=torch.long, device=parameters[0].device)
    small = sum(p.numel() for p in parameters) < SMALL_ENOUGH_TO_RUN and parameters[0].device.type != "meta"
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    try:
        if not small:
            fake_log.level = logging.CRITICAL
            try:
                with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
                    model(input_ids=ids)
                return events
            except Exception:  # an op without a fake kernel (grouped_mm in float32): run it for real
                events.clear()
        with torch.no_grad():
            model(input_ids=ids)
        return events
    finally:
        fake_log.level = level
        for handle in handles:
            handle.remove()
