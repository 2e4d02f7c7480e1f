"""Which analyses a cache's model serves, as each decides (``refusal``): the family pages list it."""

from __future__ import annotations

import torch

from .attribution import logit_attrs
from .checks import AnalysisUnavailable
from .decomposition import decompose_resid
from .reading import stream_at
from .stacks import stack_head_results, stack_neuron_results

SERVED = ("decompose_resid", "stack_head_results", "stack_neuron_results", "logit_attrs")


def refusal(cache, analysis: str) -> str | None:
    """Why ``analysis`` (one of ``SERVED``) is refused on this cache's model, ``AnalysisUnavailable``'s reason, or
    None where it is served: the analysis runs on the cache as a call would (``logit_attrs`` of the stream the final
    norm reads, a stack of one row, on token 0), so this is its own decision. The family pages list it."""
    calls = {"decompose_resid": lambda: decompose_resid(cache),
             "stack_head_results": lambda: stack_head_results(cache),
             "stack_neuron_results": lambda: stack_neuron_results(cache, None),
             "logit_attrs": lambda: logit_attrs(cache, stream_at(cache, cache.model.num_layers)[None],
                                                torch.tensor(0))}
    if analysis not in calls:
        raise ValueError(f"refusal: the analysis is one of {', '.join(SERVED)}, not {analysis!r}.")
    try:
        calls[analysis]()
    except AnalysisUnavailable as error:  # "{what} is unavailable on {family}: {reason}."
        head, _, reason = str(error).partition(": ")
        what = head.split(" is unavailable on ")[0]
        return (reason if what == analysis else f"{what}: {reason}").removesuffix(".")
    return None
