"""The census: every causal-LM type of the installed transformers is served, or classified with a reason."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nnterp.families import BY_MODEL_TYPE, FAMILIES, SAME_BLOCKS
from nnterp.proof.coverage import CATEGORIES, EXCLUDED, unclassified

from ..families.test_cpmant import CASES as PROMPT_PREFIX_CASES
from ..families.test_families import CASES
from ..families.test_gemma3n import CASES as GEMMA3N_CASES
from ..families.test_gemma4_dbrx_modernbert_inkling import CASES as NOTYET_CASES
from ..families.test_hybrids import CASES as HYBRID_CASES
from ..families.test_hybrids import IMAGE_TEXT
from ..families.test_inkling2 import CASES as INKLING2_CASES
from ..families.test_longcat_flash import CASES as DUAL_PAIR_CASES
from ..families.test_looped import CASES as LOOPED_CASES
from ..families.test_minimax import CASES as MINIMAX_CASES
from ..families.test_multimodal import CASES as MULTIMODAL_CASES
from ..families.test_multimodal import TEXT_TYPES
from ..families.test_openai_gpt import CASES as OPENAI_GPT_CASES
from ..families.test_qwen4_exp_streams import SERVED as STREAM_TYPES
from ..families.test_recurrent import CASES as RECURRENT_CASES
from ..families.test_reformer import CASES as REFORMER_CASES
from ..families.test_topology import CASES as TOPOLOGY_CASES


def test_every_causal_lm_type_is_served_or_classified():
    types = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    served = types & set(BY_MODEL_TYPE)
    missing = unclassified(types, served)
    assert not missing, f"transformers has causal-LM types nnterp neither serves nor classifies: {missing}. " \
                        "Read their blocks; serve them (nnterp/families/) or classify them in nnterp/families/unserved.py."
    assert not served & set(EXCLUDED), f"served and excluded at once: {sorted(served & set(EXCLUDED))}"
    assert set(EXCLUDED) <= types, f"classified types transformers no longer has: {sorted(set(EXCLUDED) - types)}"
    assert all(category in CATEGORIES and len(reason) > 10 for category, reason in EXCLUDED.values())
    assert {category for category, _ in EXCLUDED.values()} == set(CATEGORIES)  # no empty category


def test_a_type_nobody_has_read_fails_the_census():
    types = [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "brand_new_decoder"]
    assert unclassified(types, BY_MODEL_TYPE) == ["brand_new_decoder"]


def test_every_served_type_is_proven_on_its_miniature_by_the_suite():
    """Served means tested: each type is a case of the family matrix (test_families.py, its own tiny config, against
    hooks), of test_hybrids.py (the same for hybrids, and their image-text configs) or of test_more_types.py (its
    default config's miniature, against hooks)."""
    cased = {config().model_type for config, *_ in CASES.values()}
    cased |= {model_type for model_type, *_ in HYBRID_CASES.values()} | {t for pair in IMAGE_TEXT for t in pair}
    cased |= set(STREAM_TYPES)
    cased |= {model_type for model_type, *_ in MULTIMODAL_CASES.values()} | set(TEXT_TYPES.values())  # test_multimodal.py
    cased |= set(TOPOLOGY_CASES)  # tests/families/test_topology.py: its cases are named by model type
    cased |= {model_type for model_type, *_ in NOTYET_CASES.values()}  # test_notyet.py
    cased |= {model_type for model_type, *_ in RECURRENT_CASES.values()}  # test_recurrent.py
    cased |= {model_type for model_type, *_ in DUAL_PAIR_CASES.values()}  # tests/families/test_longcat_flash.py
    cased |= {model_type for model_type, *_ in PROMPT_PREFIX_CASES.values()}  # test_prompt_prefix.py
    cased |= {model_type for model_type, *_ in LOOPED_CASES.values()}  # test_looped.py
    cased |= {model_type for model_type, *_ in GEMMA3N_CASES.values()}  # test_gemma3n.py
    cased |= {model_type for model_type, *_ in INKLING2_CASES.values()}  # test_inkling2.py
    cased |= {model_type for model_type, *_ in REFORMER_CASES.values()}  # test_reformer.py
    cased |= {model_type for model_type, *_ in OPENAI_GPT_CASES.values()}  # test_openai_gpt.py
    cased |= {model_type for model_type, *_ in MINIMAX_CASES.values()}  # test_minimax.py
    more = {t for types in SAME_BLOCKS.values() for t in types}
    assert {t for family in FAMILIES for t in family.model_types} == cased | more
    assert all(t in CONFIG_MAPPING for t in cased | more)



def test_the_families_are_one_sorted_tuple_and_each_type_has_one_spec():
    from nnterp.families import FAMILIES

    names = [family.name for family in FAMILIES]
    assert len(set(names)) == len(names)
    claims = [model_type for family in FAMILIES for model_type in family.model_types]
    assert len(set(claims)) == len(claims), sorted({t for t in claims if claims.count(t) > 1})
