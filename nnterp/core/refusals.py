"""A model that cannot run a tool says why at the tool's entry, before anything runs (StandardizedVLLM: one
prompt per invoke, logits at the last position only, inference only); a model that runs a tool its own way (each
prompt its own request on vLLM) hands the tool its own implementation."""

from __future__ import annotations


def refuse_unsupported(model, tool: str) -> None:
    """Raise the model's own error for ``tool`` where its class names one (``refuse_tool``); else nothing."""
    refuse = getattr(type(model), "refuse_tool", None)
    if refuse is not None:
        refuse(model, tool)


def own_tool(model, tool: str):
    """The model's own implementation of ``tool`` (a callable taking the tool's arguments after the model) where
    its class provides one (``tool_implementation``); else None."""
    provide = getattr(type(model), "tool_implementation", None)
    return provide(model, tool) if provide is not None else None
