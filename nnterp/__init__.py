"""nnterp: the same names and values on every decoder family, as live nnsight tensors."""

from . import legacy  # noqa: E402  (the 1.x names, installed onto the class)
from .catalog import CATALOG, Value
from .collection import Collection, collect
from .errors import BadAssignment, NNterpError, UnknownArchitecture, UnsupportedConfig, ValueUnavailable
from .inference import infer_family
from .interventions import (
                            activation_patching,
                            add_to,
                            logit_difference,
                            patchscope_lens,
                            skip_layers,
                            steered_generate,
                            target_probability,
)
from .lens import logit_lens, top_tokens
from .prompts import Prompt, first_tokens, run_prompts
from .registry import RegistrationError, register_family, unregister_family
from .standardized import Availability, StandardizedTransformer
from .version import __version__

__all__ = [
    "__version__",
    "CATALOG",
    "Collection",
    "Prompt",
    "activation_patching",
    "add_to",
    "collect",
    "first_tokens",
    "infer_family",
    "logit_difference",
    "logit_lens",
    "patchscope_lens",
    "register_family",
    "run_prompts",
    "skip_layers",
    "steered_generate",
    "target_probability",
    "top_tokens",
    "Availability",
    "BadAssignment",
    "NNterpError",
    "RegistrationError",
    "StandardizedTransformer",
    "UnknownArchitecture",
    "UnsupportedConfig",
    "unregister_family",
    "Value",
    "ValueUnavailable",
]

legacy.install(StandardizedTransformer)


def __getattr__(name: str):
    """1.x's top-level names, from their 1.x modules (imported on first use)."""
    if name == "ModuleAccessor":
        from .nnsight_utils import ModuleAccessor

        return ModuleAccessor
    if name == "get_rename_dict":
        from .rename_utils import get_rename_dict

        return get_rename_dict
    raise AttributeError(f"module 'nnterp' has no attribute {name!r}")
