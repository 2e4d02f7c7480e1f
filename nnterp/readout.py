"""The readout: logits from a stream tensor, as the model reads its last block's output (a mixin of
``StandardizedTransformer``)."""

from __future__ import annotations

import torch

from .engine import WrappedModel
from .errors import ReadoutUnavailable


class Readout:
    """The model's logits, and ``project_on_vocab``: the final norm and head, with what the model does around them."""

    @property
    def logits(self: WrappedModel) -> torch.Tensor:
        """The model's output logits, ``[batch, seq, vocab]`` (inside a trace)."""
        return self.output.logits

    @property
    def next_token_probs(self: WrappedModel) -> torch.Tensor:
        """The softmax of the last position's logits, ``[batch, vocab]`` (inside a trace)."""
        return self.logits[:, -1].softmax(dim=-1)

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
