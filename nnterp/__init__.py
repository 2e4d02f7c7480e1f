"""nnterp: the same names and values on every decoder family, as live nnsight tensors."""

from .analysis import AnalysisUnavailable
from .collection import Collection, CollectionError, collect
from .compat import legacy as _legacy
from .compat import paths as _paths
from .compat.transformer_lens import HookedTransformer
from .compat.transformer_lens.factored import FactoredMatrix
from .core.allocator import tune_allocator
from .core.edits import skip_layers
from .core.inference import infer_family
from .core.inputs import BadInput
from .core.registry import RegistrationError, register_family, unregister_family
from .core.standardized import Availability, StandardizedTransformer
from .core.tokens import AnswerToken, test_prompt, to_str_tokens, visible
from .dictionaries import Dictionary, DictionaryError, load_dictionary, site_table
from .dictionaries.splicing import Splice, splice, top_activations
from .graphs import Graph, attribution_graph, load_transcoders, prune_graph
from .spec.catalog import CATALOG, Value
from .spec.errors import (
    BadAssignment,
    NNterpError,
    ReadoutUnavailable,
    RunNotChosen,
    UnknownArchitecture,
    UnsupportedConfig,
    ValueUnavailable,
)
from .tools.activation_cache import ActivationCache, run_with_cache
from .tools.lens import logit_lens, top_tokens
from .tools.metrics import logit_difference, target_probability
from .tools.patching import activation_patching, attribution_patching
from .tools.patchscope import patchscope_lens
from .tools.prompts import Prompt, first_tokens, run_prompts
from .tools.steering import add_to, steered_generate
from .tools.tuned_lens import TunedLens, load_tuned_lens
from .version import __version__

_paths.install()  # the module paths of before the packages (nnterp.lens, nnterp.nnsight_utils, ...)
# nnterp 1.x's names (found on lookup, not set on the class) and constructor arguments (the core has neither)
_legacy.install(StandardizedTransformer)
# TransformerLens's and SAELens's names are HookedTransformer's own (nnterp.compat.transformer_lens)
HookedSAETransformer = HookedTransformer  # SAELens's name of the same door: its run_with_saes and the rest

__all__ = [
    "__version__",
    "ActivationCache",
    "AnalysisUnavailable",
    "BadInput",
    "CollectionError",
    "HookedTransformer",
    "HookedSAETransformer",
    "FactoredMatrix",
    "Dictionary",
    "DictionaryError",
    "Graph",
    "attribution_graph",
    "load_transcoders",
    "prune_graph",
    "Splice",
    "load_dictionary",
    "site_table",
    "splice",
    "top_activations",
    "TunedLens",
    "load_tuned_lens",
    "AnswerToken",
    "CATALOG",
    "Collection",
    "Prompt",
    "activation_patching",
    "add_to",
    "attribution_patching",
    "collect",
    "first_tokens",
    "infer_family",
    "logit_difference",
    "logit_lens",
    "patchscope_lens",
    "register_family",
    "run_prompts",
    "run_with_cache",
    "skip_layers",
    "steered_generate",
    "target_probability",
    "test_prompt",
    "to_str_tokens",
    "top_tokens",
    "tune_allocator",
    "visible",
    "Availability",
    "BadAssignment",
    "NNterpError",
    "RegistrationError",
    "StandardizedTransformer",
    "UnknownArchitecture",
    "UnsupportedConfig",
    "unregister_family",
    "Value",
    "ReadoutUnavailable",
    "RunNotChosen",
    "ValueUnavailable",
]

# conveniences as methods (the core class imports no tool): model.run_with_cache(...), model.to_str_tokens(...), ...
for _tool in (run_with_cache, to_str_tokens, test_prompt):
    setattr(StandardizedTransformer, _tool.__name__, _tool)
del _tool


def __getattr__(name: str):
    """1.x's top-level names, from their 1.x modules, and StandardizedVLLM (vLLM is an extra: imported on first use)."""
    if name == "StandardizedVLLM":
        from .vllm import StandardizedVLLM

        return StandardizedVLLM
    if name == "ModuleAccessor":
        from .compat.nnsight_utils import ModuleAccessor

        return ModuleAccessor
    if name == "get_rename_dict":
        from .compat.rename_utils import get_rename_dict

        return get_rename_dict
    raise AttributeError(f"module 'nnterp' has no attribute {name!r}")
