"""The tools' entry check: ``nnterp.core.refusals`` (in the core, so that the core's and the dictionaries' tools
ask it too)."""

from ..core.refusals import own_tool, refuse_unsupported

__all__ = ["own_tool", "refuse_unsupported"]
