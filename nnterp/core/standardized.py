"""StandardizedTransformer: one set of names and values on every decoder family.

The class wires nnterp's envoys onto the model's blocks and holds what the engine reads; each concern is a
module of its own, mixed in: loading (``loading``), placing and binding the values (``engine``), their forward
order and availability (``order``), the readout (``readout``), the attention values (``attention_values``),
remote execution (``remote``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import transformers
from nnsight.modeling.transformers import TransformersModel

from .. import proof
from ..families import Family
from ..spec import attention
from ..spec.locations import At
from . import inputs
from .attention_values import AttentionValues
from .engine import Slot, Values, envoy_at
from .envoys import AttentionEnvoy, BlockEnvoy, BlockWithMLPEnvoy, LayersEnvoy, MLPEnvoy, SublayerEnvoy
from .loading import has_module, load, with_aliases
from .order import Availability, AvailabilityTable, ValueOrder, forward_events, summary
from .readout import Readout
from .remote import RemoteExecution
from .structure import StackedLayers, global_of, heads_per_layer, schedule_of

__all__ = ["StandardizedTransformer", "Availability", "AvailabilityTable", "schedule_of", "heads_per_layer",
           "forward_events"]


class StandardizedTransformer(Values, ValueOrder, Readout, AttentionValues, RemoteExecution,
                              TransformersModel):
    """A causal LM whose blocks expose the standard values under the standard names.

    ``StandardizedTransformer("org/name" or "/local/folder", **from_pretrained_kwargs)`` loads a
    model and its tokenizer; ``StandardizedTransformer(model, tokenizer=tok)`` wraps one that is
    already built (without ``tokenizer``, it is loaded from the model's ``name_or_path``). Either way
    the model is put in eval mode. ``rename={native name: alias}`` adds aliases of your own, as
    nnsight's does, beside the standard names (an alias that would hide one is refused).

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

    # The keywords of an older API, translated: ``translate(model, tokenizer, validate, attention_values, dispatch,
    # from_pretrained_kwargs)`` returns them in today's terms and ``after(model)``, run once the model is wrapped.
    # The core takes its own keywords only; nnterp.compat.legacy.install sets nnterp 1.x's (the core imports no compat)
    _nnterp_arguments: Callable[..., tuple] | None = None
    # The names of an older API, resolved on lookup where the class and the module tree have none (never set on the
    # class, so they are not its surface): ``{name: property or function}``, each read with the model.
    # nnterp.compat.legacy.install sets nnterp 1.x's
    _nnterp_fallback: dict | None = None
    # Names another door serves, which this class does not: ``{name: why, and where it is}``, said where the module
    # tree has no such name either (nnterp.compat.transformer_lens sets TransformerLens's and SAELens's)
    _nnterp_refused: dict[str, str] | None = None

    def __init__(self, model: str | os.PathLike | transformers.PreTrainedModel, tokenizer=None, *, validate: bool = True,
                 attention_values: bool = False, dispatch: bool = True, **from_pretrained_kwargs):
        after = None
        translate = StandardizedTransformer._nnterp_arguments
        if translate is not None:  # an older API's keywords, in today's terms
            model, tokenizer, validate, attention_values, dispatch, from_pretrained_kwargs, after = translate(
                model, tokenizer, validate, attention_values, dispatch, from_pretrained_kwargs)
        own_aliases = from_pretrained_kwargs.pop("rename", None)  # the user's own, as nnsight takes them
        loaded = load(StandardizedTransformer, model, tokenizer, validate, dispatch, from_pretrained_kwargs)
        model, tokenizer, family, lazy, validated = (loaded.model, loaded.tokenizer, loaded.family, loaded.lazy,
                                                     loaded.validated)
        # explicit base calls throughout: the class travels by value to remote servers, where a
        # zero-argument super() has no __class__ cell
        TransformersModel.__init__(
            self,
            model,
            tokenizer=tokenizer,
            task="text-generation",
            rename=with_aliases(family.rename(), own_aliases, StandardizedTransformer),
            envoys={pattern: envoy for blocks in family.block_lists for pattern, envoy in {
                blocks: LayersEnvoy,
                f"{blocks}.*": BlockEnvoy if family.mlp else BlockWithMLPEnvoy,
                **({f"{blocks}.*.{family.attention}": AttentionEnvoy} if family.attention else {}),
                **({f"{blocks}.*.{family.mlp}": SublayerEnvoy if family.mlp == family.attention else MLPEnvoy}
                   if family.mlp else {}),
            }.items()},
            **({"dispatch": False, **loaded.kwargs} if lazy else {}),
        )
        model = self._module  # lazy: the weightless model that stands in until the first trace
        self._nnterp_class = StandardizedTransformer  # the class the proofs wrap their miniatures in
        self._nnterp_family = family
        # the native path of each block; where the blocks are in several lists (stacks), ``model.layers`` is all of
        # them in order, a list of their envoys
        self._nnterp_block_paths = tuple(f"{path}.{i}" for path in family.block_lists
                                         for i in range(len(model.get_submodule(path))))
        if family.stacks:
            self.__dict__["layers"] = StackedLayers([envoy_at(self, path) for path in self._nnterp_block_paths])
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
        self._nnterp_slots = tuple(Slot(self, i) for i in range(len(self.layers)))
        self._nnterp_run_slots: dict[tuple[int, int], Slot] = {}
        self._place_values()
        for block, slot in zip(self.layers, self._nnterp_slots):
            i = slot.layer
            block._nnterp_slot = slot
            # a block without an MLP (a recurrent one), or without attention (a hybrid's other blocks), has no such
            # sublayer: `mlp` / `self_attn` say why (StandardEnvoy); where a hybrid's other token mixer is natively
            # named `self_attn` (Kimi-Linear's linear attention), the values of `self_attn` say why
            if isinstance(self._nnterp_structure[i].resolve("mlp_output"), At) or (
                    family.mlp and family.mlp != family.attention and has_module(block._module, family.mlp)):
                # a module at the MLP's path whose values are unavailable (LongCat-Flash's shortcut): they say why
                block.mlp._nnterp_slot = slot
            if isinstance(self._nnterp_structure[i].resolve("attention_output"), At) or has_module(
                    block._module, "self_attn"):
                block.self_attn._nnterp_slot = slot
        if validate and not validated:
            validated = proof.validate(model.config, type(model), tokenizer, StandardizedTransformer)
        # from the validated miniature (same architecture, same names) when there is one
        self._forward_events = validated or forward_events(model)
        if attention_values:
            self.enable_attention_values()
        if after is not None:
            after(self)

    def __repr__(self) -> str:
        """The model's own module tree (standard aliases shown as ``alias/native``), then the standard names."""
        return summary(self)

    def __getattr__(self, name: str):
        fallback = StandardizedTransformer._nnterp_fallback
        if fallback is not None and name in fallback:  # an older API's name, as if it were the class's
            return fallback[name].__get__(self, type(self))
        family = self.__dict__.get("_nnterp_family")
        if name == "ln_final" and family is not None and family.ln_final is None:
            raise AttributeError(f"{family.name} has no final norm: its head reads the last block's output directly, "
                                 "so model.ln_final does not exist (model.project_on_vocab(h) is model.lm_head("
                                 f"{f'model.{family.head_input}(h)' if family.head_input else 'h'})).")
        try:
            return TransformersModel.__getattr__(self, name)  # explicit: the class travels by value
        except AttributeError:
            refused = StandardizedTransformer._nnterp_refused
            if refused is not None and name in refused:
                raise AttributeError(refused[name]) from None
            raise

    def __setattr__(self, name: str, value) -> None:
        fallback = StandardizedTransformer._nnterp_fallback
        if fallback is not None and getattr(fallback.get(name), "fset", None) is not None:  # an older API's setter
            fallback[name].__set__(self, value)
            return
        TransformersModel.__setattr__(self, name, value)  # explicit: the class travels by value

    # -- model-level names --------------------------------------------------------------
    @property
    def family(self) -> Family:
        """The family spec this model's values are read by (module paths, block specs)."""
        return self._nnterp_family

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
    def num_heads(self) -> int | None:
        """The config's number of attention heads (the global one, where layers have their own: ``num_heads_of``;
        None on a model without attention)."""
        return global_of(self._nnterp_text_config, "num_attention_heads")

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """``(layer, run)`` of every block call in one forward pass, in the order the model makes them: each block
        once (run 0), except where a section of blocks runs several times (a looped model)."""
        return self._nnterp_schedule

    def runs_of(self, layer: int) -> int:
        """How many times block ``layer`` runs in each forward pass (1 except in a looped section)."""
        return self._nnterp_runs[layer % self.num_layers]

    def num_heads_of(self, layer: int) -> int | None:
        """The number of attention heads of block ``layer`` (the views per head split by it; None on a block of a
        model without attention)."""
        return self._nnterp_heads[layer]

    @property
    def vocab_size(self) -> int:
        """The text config's vocabulary size, which the head projects onto."""
        return self._nnterp_text_config.vocab_size

    def dispatch(self) -> None:
        """Load the weights of a model built with ``dispatch=False`` (the first trace does it too)."""
        if self.dispatched:
            return
        TransformersModel.dispatch(self)
        self._module.eval()
        self._unbind()  # the envoys now stand for the loaded modules

    def head_outputs(self, layer: int) -> torch.Tensor:
        """Inside a trace: each head's contribution through the output projection ``[batch, seq, heads, out]``."""
        return attention.head_outputs(self, layer)

    def scale_heads(self, layer: int, heads, factor: float = 0.0) -> None:
        """Inside a trace: multiply the output of ``heads`` of block ``layer`` by ``factor`` (0 ablates them)."""
        attention.scale_heads(self, layer, heads, factor)

    def _batch_size(self, *args, **kwargs) -> int:
        inputs.refuse_empty(args)
        return TransformersModel._batch_size(self, *args, **kwargs)

    def _batch(self, invokes: list, fn) -> tuple:
        """The batched forward input, refused in one line where the model could not run it."""
        batched = TransformersModel._batch(self, invokes, fn)
        if isinstance(batched, tuple) and len(batched) == 2 and isinstance(batched[1], dict):
            inputs.check_batch(self._module, batched[1], self._nnterp_position_limit)
        return batched
