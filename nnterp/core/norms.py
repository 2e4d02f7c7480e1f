"""A norm module's facts, declared in one place: its kind (a LayerNorm centres its input before scaling it, an RMSNorm
does not), its epsilon, and how it applies its weight (``weight``, or ``1 + weight``).

Read by TransformerLens's hook points (``hook_scale``, ``hook_normalized``) and ``cfg.normalization_type``, the graphs'
frozen norms and the vLLM readout. The kind and the epsilon are the module's class and attributes (torch's,
transformers' and vLLM's norm classes say them). The weight's layout is not in transformers' class names (Gemma's,
Qwen3-Next's and Qwen3.5's RMSNorms apply ``1 + weight``, Gemma-3n's its weight): the analyses measure it on the
module's own output (``nnterp.analysis.norms``). vLLM's norms run fused kernels and are read without being called:
there the class says it (``PLUS_ONE``). Plain functions over the module, tensors untouched: the vLLM backend imports
them inside its workers.
"""

from __future__ import annotations

from torch import nn

# the attribute a norm module keeps its epsilon in (torch's and transformers' eps / variance_epsilon, vLLM's
# variance_epsilon, ...)
EPSILON_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")
# vLLM's norm classes that apply ``1 + weight``, in float32, before casting back (its Gemma models' norms)
PLUS_ONE = ("GemmaRMSNorm",)
KINDS = ("layer_norm", "rms_norm")


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization module of any kind (torch's, or a class named a norm)."""
    return "Norm" in type(module).__name__ or isinstance(module, (nn.LayerNorm, nn.RMSNorm))


def norm_kind(module: nn.Module) -> str | None:
    """``"layer_norm"`` (centres, then scales), ``"rms_norm"`` (scales only), or None for another kind of module."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm) or ("LayerNorm" in name and "RMS" not in name):
        return "layer_norm"
    if isinstance(module, nn.RMSNorm) or "RMS" in name:
        return "rms_norm"
    return None


def norm_epsilon(module: nn.Module) -> float | None:
    """The epsilon the norm adds to the mean square (``EPSILON_NAMES``), or None where it declares none."""
    return next((getattr(module, key) for key in EPSILON_NAMES if isinstance(getattr(module, key, None), float)), None)


def norm_form(module: nn.Module) -> tuple[bool, float]:
    """``(centred, eps)`` of a LayerNorm or an RMSNorm module; a ``ValueError`` saying why for another module."""
    kind, eps = norm_kind(module), norm_epsilon(module)
    if kind is None:
        raise ValueError(f"the norm is a {type(module).__name__}, not a LayerNorm or an RMSNorm")
    if eps is None:
        raise ValueError(f"the norm ({type(module).__name__}) declares no epsilon ({', '.join(EPSILON_NAMES)})")
    return kind == "layer_norm", eps


def declared_offset(module: nn.Module) -> float:
    """What a vLLM norm adds to its weight: 1.0 for the classes of ``PLUS_ONE``, else 0.0."""
    return 1.0 if type(module).__name__ in PLUS_ONE else 0.0


__all__ = ["EPSILON_NAMES", "KINDS", "PLUS_ONE", "declared_offset", "is_norm", "norm_epsilon", "norm_form",
           "norm_kind"]
