"""The residual identity, checked per block, and the proof of a family spec on a miniature of a config.

``check_identity(model)`` recomputes every block's output from its values with the family's formula;
``validate(config, architecture, tokenizer)`` proves a family spec before any weight is loaded (what
loading does by default). The work is done in ``nnterp.proof``, part of the core.
"""

from __future__ import annotations

from .. import proof
from ..proof import (
    IDENTITY_TERMS,
    IdentityResult,
    ValidationError,
    check_identity,
    identity_of,
    problems_of,
    read_blocks,
    validation_key,
)
from ..proof.miniature import build_miniature
from .standardized import StandardizedTransformer


def validate(config, architecture: type, tokenizer, use_cache: bool = True) -> dict[tuple[str, str], int]:
    """Prove the family spec of ``architecture`` with ``config`` on a miniature; raise ``ValidationError`` if it fails.

    Returns the order module inputs and outputs fire in (by module name), which ``order(i)`` uses.
    """
    return proof.validate(config, architecture, tokenizer, StandardizedTransformer, use_cache)


__all__ = ["IDENTITY_TERMS", "IdentityResult", "ValidationError", "build_miniature", "check_identity", "identity_of",
           "problems_of", "read_blocks", "validate", "validation_key"]
