"""StandardizedTransformer: one set of names and values on every decoder family."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from nnsight.modeling.transformers import TransformersModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .catalog import BY_NAME, CATALOG
from .envoys import AttentionEnvoy, BlockEnvoy, BlockWithMLPEnvoy, MLPEnvoy, Slot
from .errors import NNterpError, ValueUnavailable
from .families import Block, Family, family_of
from .locations import At, Unavailable, record_leading_shape


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


def _load(name: str | os.PathLike, tokenizer, from_pretrained_kwargs: dict):
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **from_pretrained_kwargs)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as error:
        raise OSError(
            f"Could not load {str(name)!r}: it is not a local folder holding a model, and the hub could not "
            "provide it (no network, HF_HUB_OFFLINE set, or no such repository). Pass a local folder, or a hub "
            f"name with network access. Cause: {error}"
        ) from error
    return model, tokenizer


class StandardizedTransformer(TransformersModel):
    """A causal LM whose blocks expose the standard values under the standard names.

    ``StandardizedTransformer("org/name" or "/local/folder", **from_pretrained_kwargs)`` loads a
    model and its tokenizer; ``StandardizedTransformer(model, tokenizer=tok)`` wraps one that is
    already built. Either way the model is put in eval mode.
    """

    def __init__(self, model: str | os.PathLike | PreTrainedModel, tokenizer=None, **from_pretrained_kwargs):
        if isinstance(model, (str, os.PathLike)):
            model, tokenizer = _load(model, tokenizer, from_pretrained_kwargs)
        elif from_pretrained_kwargs:
            raise TypeError(
                f"Unexpected keyword arguments {sorted(from_pretrained_kwargs)}: loading options apply only when "
                "the model is given by name or folder. Build the model with them, then wrap it."
            )
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"Expected a model name, a folder or a transformers PreTrainedModel, got {type(model).__name__}.")
        if tokenizer is None:
            raise ValueError("A model object needs its tokenizer: StandardizedTransformer(model, tokenizer=tok).")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        family = family_of(model.config, type(model).__name__)
        model.eval()  # nnsight does not; dropout would make every value random
        super().__init__(
            model,
            tokenizer=tokenizer,
            task="text-generation",
            rename=family.rename(),
            envoys={
                f"{family.layers}.*": BlockEnvoy if family.mlp else BlockWithMLPEnvoy,
                f"{family.layers}.*.{family.attention}": AttentionEnvoy,
                **({f"{family.layers}.*.{family.mlp}": MLPEnvoy} if family.mlp else {}),
            },
        )
        self._nnterp_family = family
        self._nnterp_text_config = model.config.get_text_config()
        self._nnterp_blocks = tuple(family.block(self._nnterp_text_config, i) for i in range(len(self.layers)))
        for i, block in enumerate(self.layers):
            slot = Slot(self, i)
            block._nnterp_slot = slot
            block.self_attn._nnterp_slot = slot
            block.mlp._nnterp_slot = slot
            if any(isinstance(loc, At) and loc.unflatten for loc in self._nnterp_blocks[i].values.values()):
                block._module.register_forward_pre_hook(record_leading_shape, with_kwargs=True)
        self._forward_events = self._record_forward_events()

    # -- model-level names --------------------------------------------------------------
    @property
    def family(self) -> Family:
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
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self._nnterp_text_config.hidden_size

    @property
    def num_heads(self) -> int:
        return self._nnterp_text_config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self._nnterp_text_config.vocab_size

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a stream tensor: the family's final norm, then its head."""
        return self.lm_head(self.ln_final(hidden))

    # -- per-block values ---------------------------------------------------------------
    def block_spec(self, layer: int) -> Block:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers (0 to {self.num_layers - 1}).")
        return self._nnterp_blocks[layer]

    def _location(self, layer: int, name: str) -> At:
        location = self.block_spec(layer).resolve(name)
        if isinstance(location, Unavailable):
            raise ValueUnavailable(BY_NAME[name].key, self.family.name, location.reason)
        return location

    def _read_value(self, layer: int, name: str):
        return self._location(layer, name).read(self.layers[layer], self.num_heads)

    def _write_value(self, layer: int, name: str, value) -> None:
        self._location(layer, name).write(self.layers[layer], value, self.num_heads, BY_NAME[name].key)

    def availability(self, layer: int) -> dict[str, Availability]:
        """Every standard value of block ``layer``: where it is read, or why it is unavailable."""
        block = self.block_spec(layer)
        result = {}
        for value in CATALOG:
            location = block.resolve(value.name)
            if isinstance(location, Unavailable):
                result[value.key] = Availability(reason=location.reason)
            else:
                result[value.key] = Availability(location=location.describe())
        return result

    def order(self, layer: int) -> dict[str, int]:
        """Forward-order ranks of block ``layer``'s available values; equal ranks share a location.

        Read a block's values in this order within one trace: reading one after a later one
        raises nnsight's ``OutOfOrderError``.
        """
        events = {key: event for event, key, _ in self._timeline(layer) if not key.startswith("extra.")}
        ranks = {event: rank for rank, event in enumerate(sorted(set(events.values())))}
        return {key: ranks[event] for key, event in events.items()}

    def _timeline(self, layer: int) -> list[tuple[int, str, At]]:
        """(event index, key, location) of every available value and identity extra, in forward order."""
        block = self.block_spec(layer)
        module = self.layers[layer]._module
        located = [(value.key, block.resolve(value.name)) for value in CATALOG]
        located += [(f"extra.{name}", location) for name, location in block.extra.items()]
        timeline = [
            (self._event_index(location.module(module), location.side, key), key, location)
            for key, location in located
            if isinstance(location, At)
        ]
        return sorted(timeline, key=lambda item: item[0])

    def _event_index(self, module: torch.nn.Module, side: str, key: str) -> int:
        index = self._forward_events.get((id(module), side))
        if index is None:
            raise NNterpError(
                f"The module where '{key}' is read never ran in a forward pass of this {self.family.name} "
                "model: the family spec does not match it. Please report this with the model's config."
            )
        return index

    def _record_forward_events(self) -> dict[tuple[int, str], int]:
        """The order module inputs and outputs fire in one forward pass (first call of each).

        Run once at construction, outside any trace, on fake tensors: no compute and no memory,
        whatever the model's size.
        """
        events: dict[tuple[int, str], int] = {}

        def record(module, side):
            events.setdefault((id(module), side), len(events))

        handles = []
        for block in self.layers:
            for module in block._module.modules():
                handles.append(module.register_forward_pre_hook(lambda m, *_: record(m, "input")))
                handles.append(module.register_forward_hook(lambda m, *_: record(m, "output")))
        try:
            device = next(self._module.parameters()).device
            ids = torch.zeros(1, 2, dtype=torch.long, device=device)
            fake_log = logging.getLogger("torch._subclasses.fake_tensor")
            level, fake_log.level = fake_log.level, logging.CRITICAL
            try:
                with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
                    self._module(input_ids=ids)
            except Exception:  # an op without a fake kernel (grouped_mm in float32): two real tokens
                events.clear()
                with torch.no_grad():
                    self._module(input_ids=ids)
            finally:
                fake_log.level = level
        finally:
            for handle in handles:
                handle.remove()
        return events
