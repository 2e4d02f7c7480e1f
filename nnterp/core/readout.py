"""The readout: logits from a stream tensor, as the model reads its last block's output (a mixin of
``StandardizedTransformer``)."""

from __future__ import annotations

import warnings

import torch
from nnsight.intervention.interleaver import Mediator

from ..spec.errors import NNterpError, ReadoutUnavailable
from ..spec.selection import token_index
from .engine import WrappedModel


class InputsPassed(NNterpError, ValueError):
    """The forward pass has run past the model's inputs: its attention mask can no longer be read."""


def pass_attention_mask(model, what: str, remedy: str) -> torch.Tensor | None:
    """Inside a trace: the batch's attention mask (None where the trace gives none), from the model's inputs.

    Read once per forward pass and kept on nnsight's mediator (one per invoke and trace), as
    ``views.leading_shape`` keeps a block's shape, so a later reader of the pass reuses it. A pass
    is the occurrence of the model's output a request made now asks for: the same through a generation
    step's pin and its relaxing after the step's first value. Raises ``InputsPassed`` (``what`` finds
    the mask, ``remedy`` says what to do) where the pass has already run past its inputs, since nnsight
    reads in forward order and would wait for the next pass's.
    """
    mediator = Mediator.current(what)
    masks = mediator.__dict__.setdefault("_nnterp_attention_mask", {})
    key = mediator.wanted(f"{model.path}.output")
    if key not in masks:
        if mediator.occurrence(f"{model.path}.input") > key:
            raise InputsPassed(f"{what} finds each prompt's own tokens through the batch's attention mask, read from "
                               f"the model's inputs, and this forward pass has already run past them: {remedy}.")
        masks[key] = model.inputs[1].get("attention_mask")
    return masks[key]


class Readout:
    """The model's logits, and ``project_on_vocab``: the final norm and head, with what the model does around them."""

    @property
    def logits(self: WrappedModel) -> torch.Tensor:
        """The model's output logits, ``[batch, seq, vocab]`` (inside a trace)."""
        return self.output.logits

    @property
    def next_token_probs(self: WrappedModel) -> torch.Tensor:
        """The softmax of the logits at each prompt's own last token, ``[batch, vocab]`` (inside a trace), whichever
        side the batch pads.

        Each prompt's last token is found through the batch's attention mask, read from the model's inputs as
        ``add_to``'s positions are. A trace that reads a value of the pass first has gone past those inputs (unless
        an ``add_to`` with positions read the mask before): then the last column is read, each prompt's last token
        unless the batch pads on the right, where it is a pad for the shorter prompts and a warning says so.
        """
        try:
            mask = pass_attention_mask(self, "model.next_token_probs", "it reads the last column")
        except InputsPassed:
            mask = None
            if getattr(self.tokenizer, "padding_side", None) == "right" and self.logits.shape[0] > 1:
                warnings.warn("model.next_token_probs reads the last column of the logits, a pad for the shorter "
                              "prompts of a batch the tokenizer pads on the right (padding_side='right'): the trace "
                              "read a value of this pass before it, past the model's inputs, where the attention "
                              "mask that finds each prompt's last token is read. Read next_token_probs in a trace "
                              "of its own, or pad on the left (model.tokenizer.padding_side = 'left').", stacklevel=2)
        logits = self.logits
        if mask is None or mask.dim() != 2:
            return logits[:, -1].softmax(dim=-1)
        # the logits cover the mask's last columns (a generation step with a cache runs only its new token)
        last = token_index(mask, -1) - (mask.shape[1] - logits.shape[1])
        return logits[torch.arange(logits.shape[0]), last.to(logits.device)].softmax(dim=-1)

    def project_on_vocab(self: WrappedModel, hidden: torch.Tensor) -> torch.Tensor:
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

    def refuse_unreadable_stream(self: WrappedModel) -> None:
        """Raise ``ReadoutUnavailable`` where the family has no readout of one stream (``project_on_vocab``, the lens)."""
        if self.family.readout_unavailable:
            raise ReadoutUnavailable(f"project_on_vocab and the logit lens are unavailable on {self.family.name}: "
                                     f"{self.family.readout_unavailable}.")
