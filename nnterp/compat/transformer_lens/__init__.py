"""TransformerLens code on nnterp: ``HookedTransformer``, a ``StandardizedTransformer`` with TransformerLens's
loading, calling and generation, and TransformerLens's hooks, tokens, config and weights (``METHODS``,
``config.PROPERTIES``) and SAELens's ``run_with_saes`` and the rest (``saes.METHODS``) as its methods. The core class
has none of them: TransformerLens code loads through ``HookedTransformer.from_pretrained``.

The hook names and the standard values they are: ``nnterp.spec.catalog.TRANSFORMERLENS_NAMES`` (and
``TRANSFORMERLENS_COMPUTED``, those computed from the pass), served by ``nnterp.tools.hook_points``.
"""

from __future__ import annotations

from ...core import tokens
from ...core.standardized import StandardizedTransformer
from . import config, saes
from .factored import FactoredMatrix
from .hooked_module import HookedRootModule, HookPoint
from .hooks import SWITCHES, add_hook, add_perma_hook, hooks, loss_fn, loss_per_token, reset_hooks, run_with_hooks
from .model import HookedTransformer
from .split_inputs import set_use_split_qkv_input

METHODS = {
    "run_with_hooks": run_with_hooks, "hooks": hooks, "loss_per_token": loss_per_token, "loss_fn": loss_fn,
    "add_hook": add_hook, "add_perma_hook": add_perma_hook, "reset_hooks": reset_hooks, **SWITCHES,
    "set_use_split_qkv_input": set_use_split_qkv_input,
    "to_tokens": tokens.to_tokens, "to_string": tokens.to_string, "to_single_token": tokens.to_single_token,
    "get_token_position": tokens.get_token_position,
}


def install(cls) -> None:
    """Give ``cls`` TransformerLens's methods and attributes (``METHODS``, ``config.PROPERTIES``) and SAELens's
    (``saes.METHODS``). A name the class already has stays its own."""
    for name, value in {**METHODS, **config.PROPERTIES}.items():
        if not hasattr(cls, name):
            setattr(cls, name, value)
    saes.install(cls)


install(HookedTransformer)  # the door's own class; StandardizedTransformer has none of these names, and says where
StandardizedTransformer._nnterp_refused = {
    name: (f"model.{name} is {'SAELens' if name in saes.METHODS or name == 'acts_to_saes' else 'TransformerLens'}'s "
           "name, served by nnterp.HookedTransformer (nnterp.HookedSAETransformer): load with HookedTransformer."
           "from_pretrained(name), or wrap this model's transformers model with HookedTransformer.from_pretrained("
           "name, hf_model=model._module, tokenizer=model.tokenizer). A StandardizedTransformer has nnterp's names: "
           "the standard values, model.trace, the tools (nnterp.run_with_cache, nnterp.splice, ...).")
    for name in (*METHODS, *config.PROPERTIES, *saes.METHODS, "acts_to_saes")}

__all__ = ["FactoredMatrix", "HookPoint", "HookedRootModule", "HookedTransformer", "install"]
