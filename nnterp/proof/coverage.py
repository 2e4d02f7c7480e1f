"""Which causal language models of transformers nnterp serves, and why each other one is not: the census.

Every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is either served (a family spec lists it,
and the tests prove that spec on the type's miniature) or listed in ``EXCLUDED`` with a category
and the reason (the table is ``nnterp/families/unserved.py``, where ``family_of`` reads it to refuse
a type). A type that transformers adds is neither until someone reads its blocks: the census test
fails until it is served or classified there. The Coverage page is generated from this table.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..families import BY_MODEL_TYPE
from ..families.unserved import CATEGORIES, EXCLUDED, SINCE, WHERE_SERVED, why_not_served


def served_types() -> list[str]:
    """Every model type a family spec serves now (``register_family``'s included), sorted."""
    return sorted(BY_MODEL_TYPE)


def unclassified(model_types: Iterable[str], served: Iterable[str]) -> list[str]:
    """The model types that are neither served nor classified in ``EXCLUDED``, sorted."""
    known = set(served) | set(EXCLUDED)
    return sorted(set(model_types) - known)


def causal_lm_types() -> list[str]:
    """Every causal-LM model type of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


__all__ = ["CATEGORIES", "EXCLUDED", "SINCE", "WHERE_SERVED", "causal_lm_types", "served_types", "unclassified", "why_not_served"]
