"""A model that cannot run a tool says why at the tool's entry, before anything runs (StandardizedVLLM: one
prompt per invoke, logits at the last position only, inference only)."""

from __future__ import annotations


def refuse_unsupported(model, tool: str) -> None:
    """Raise the model's own error for ``tool`` where its class names one (``refuse_tool``); else nothing."""
    refuse = getattr(type(model), "refuse_tool", None)
    if refuse is not None:
        refuse(model, tool)
