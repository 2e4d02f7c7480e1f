"""The values inside the attention (queries, keys, values, scores, probabilities), served by running
transformers' eager attention in this wrapper's traces (a mixin of ``StandardizedTransformer``)."""

from __future__ import annotations

from nnsight.modeling.transformers import TransformersModel
from torch._guards import detect_fake_mode

from .. import proof
from ..spec import attention
from ..spec.errors import ValueUnavailable
from ..spec.locations import Unavailable
from . import inputs
from .engine import WrappedModel


class AttentionValues:
    """Turning the attention values on and off, and the traces that run eager attention while they are on."""

    def enable_attention_values(self: WrappedModel) -> None:
        """Serve queries, keys, values, scores and probabilities: this wrapper's traces run transformers'
        eager attention (slower than sdpa). The model itself is left as it is: another wrapper of it, or
        the bare model, runs its own implementation."""
        where = self.family.attention_of(self._nnterp_text_config)
        if isinstance(where, Unavailable):
            raise ValueUnavailable("self_attn.attention_probabilities", self.family.name, where.reason)
        if self._nnterp_validate:  # proven on a miniature like the other values, once per architecture (cached)
            try:
                proof.validate(self._module.config, type(self._module), self.tokenizer, self._nnterp_class,
                               attention=True)
            except proof.ValidationError as error:
                raise ValueUnavailable(
                    "self_attn.attention_probabilities", self.family.name,
                    f"this architecture's eager attention does not compute them where the {self.family.name} spec "
                    f"reads them (the other values are proven and available). The proof said: {error}") from None
        self._nnterp_attention_on = True
        self._place_values()

    def disable_attention_values(self: WrappedModel) -> None:
        """Back to the model's own attention implementation in this wrapper's traces."""
        self._nnterp_attention_on = False
        self._place_values()

    def interleave(self: WrappedModel, fn, *args, **kwargs):
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
