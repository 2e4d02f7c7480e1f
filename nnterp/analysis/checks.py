"""How an analysis refuses: ``AnalysisUnavailable`` with the reason, ``NonFiniteValues`` where the pass's values are
at fault, and how far a recomputation in float32 may be from what the model computed."""

from __future__ import annotations

import torch

from ..spec.errors import NNterpError


class AnalysisUnavailable(NNterpError, ValueError):
    """An analysis that would not be exact on this family or this cache; the message says why."""


def _refuse(model, what: str, reason: str):
    raise AnalysisUnavailable(f"{what} is unavailable on {model.family.name}: {reason}.")


class NonFiniteValues(NNterpError, ValueError):
    """The pass holds NaN or infinite values where an analysis reads it: the values are at fault, not the family."""


def _why_not_exact(cache, what: str, reads: list[tuple[str, torch.Tensor]], where: str) -> None:
    """Before blaming the family for ``where`` not being what its identity computes: raise ``NonFiniteValues`` naming
    the first value of ``reads`` (``(label, tensor [batch, seq, ...])``) with a NaN or infinity, and the prompt and
    position; ``AnalysisUnavailable`` naming the steering where the cache's pass was steered. Returns otherwise."""
    for label, tensor in reads:
        bad = ~torch.isfinite(tensor)
        if bad.any():
            prompt, position = bad.nonzero()[0].tolist()[:2]
            value = tensor[prompt, position][bad[prompt, position]].flatten()[0].item()
            raise NonFiniteValues(
                f"{what}: in this pass, {label} is {value} at prompt {prompt}, position {position}, so {where} cannot be "
                "checked against the blocks' identities. The values are not finite (the pass overflowed, or an input "
                "or an edit brought the NaN), not the model's structure; find where it first appears with "
                "cache[name, layer].isfinite().all(-1).")
    steered = getattr(cache, "steered", ())
    if steered:
        raise AnalysisUnavailable(
            f"{what} is unavailable on this cache: its pass was steered at {', '.join(steered)} (run_with_cache(..., "
            f"steer=...)) and a steered value is cached as steered, so {where} is not what the cached values add up "
            "to; decompose a cache of the unsteered pass.")


def _tolerance(dtype: torch.dtype) -> float:
    """How far a recomputation in float32 may be from what the model computed in ``dtype``, relative to its size."""
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 3e-2


def _far(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The relative difference of ``a`` and ``b`` where it exceeds the tolerance of ``dtype``; None where close."""
    if not a.numel():
        return None
    a, b = a.float(), b.float()
    difference = (a - b).abs().max().item() / max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return None if difference <= _tolerance(dtype) else difference  # a NaN is far
