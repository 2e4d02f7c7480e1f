"""nnterp: the same names and values on every decoder family, as live nnsight tensors."""

from .catalog import CATALOG, Value
from .collection import Collection, collect
from .errors import BadAssignment, NNterpError, UnknownArchitecture, UnsupportedConfig, ValueUnavailable
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
    "logit_difference",
    "logit_lens",
    "patchscope_lens",
    "run_prompts",
    "skip_layers",
    "steered_generate",
    "target_probability",
    "top_tokens",
    "Availability",
    "BadAssignment",
    "NNterpError",
    "StandardizedTransformer",
    "UnknownArchitecture",
    "UnsupportedConfig",
    "Value",
    "ValueUnavailable",
]
