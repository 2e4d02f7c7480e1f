"""The census: every causal-LM type of the installed transformers is served, or classified with a reason."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nnterp.families import BY_MODEL_TYPE, FAMILIES, SAME_BLOCKS
from nnterp.proof.coverage import CATEGORIES, EXCLUDED, SINCE, unclassified

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
    gone = set(EXCLUDED) - types - set(SINCE)  # a type of a newer transformers is classified ahead of it
    assert not gone, f"classified types transformers no longer has: {sorted(gone)}"
    assert set(SINCE) <= set(EXCLUDED) | set(BY_MODEL_TYPE), "a newer transformers' type listed in SINCE is neither"
    assert all(category in CATEGORIES and len(reason) > 10 for category, reason in EXCLUDED.values())
    assert {category for category, _ in EXCLUDED.values()} == set(CATEGORIES)  # no empty category


def test_a_type_nobody_has_read_fails_the_census():
    types = [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "brand_new_decoder"]
    assert unclassified(types, BY_MODEL_TYPE) == ["brand_new_decoder"]


def test_the_types_of_the_newer_transformers_are_known_on_any_version():
    """transformers 5.25's four new causal-LM types: two served by an existing spec (tests/families/test_more_types.py
    proves them against hooks where 5.25 is installed), two classified with their reason; on 5.24 they are simply
    absent, and the census still holds (test above)."""
    assert BY_MODEL_TYPE["param2moe"].name == "DeepSeek-V3" and BY_MODEL_TYPE["minicpm5_moe"].name == "Mixtral"
    assert EXCLUDED["ergo"][0] == EXCLUDED["kolibri1_1"][0] == "not yet served"
    assert unclassified([*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *SINCE], BY_MODEL_TYPE) == []


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
    assert all(t in CONFIG_MAPPING or t in SINCE for t in cased | more)



def test_the_families_are_one_sorted_tuple_and_each_type_has_one_spec():
    from nnterp.families import FAMILIES

    names = [family.name for family in FAMILIES]
    assert len(set(names)) == len(names)
    claims = [model_type for family in FAMILIES for model_type in family.model_types]
    assert len(set(claims)) == len(claims), sorted({t for t in claims if claims.count(t) > 1})


def test_the_coverage_page_names_a_type_the_census_does_not_know(monkeypatch):
    """A transformers newer than this nnterp: the page is written, and lists the type it does not know, refused."""
    from nnterp.documentation import coverage_page
    from nnterp.proof import coverage

    types = coverage.causal_lm_types()
    monkeypatch.setattr(coverage, "causal_lm_types", lambda: sorted([*types, "brand_new_decoder"]))
    page = coverage_page()
    assert "## Not known to this nnterp (1)" in page and "`brand_new_decoder`" in page
    assert "**1** this nnterp does not know" in page


def test_a_family_whose_pages_cannot_be_made_gets_a_page_that_says_why(monkeypatch):
    """A family whose classes fail under the installed transformers: its page names the failure, the other pages
    leave it out and say so, and the build goes on (a newer transformers than the suite's)."""
    import dataclasses

    from nnterp import documentation

    def missing_class():
        raise AttributeError("module transformers has no attribute BrokenConfig")

    gpt2 = next(family for family in FAMILIES if family.name == "GPT-2")
    broken = dataclasses.replace(gpt2, name="Broken-Test-Family", model_types=("broken_test",), tiny_config=missing_class)
    monkeypatch.setattr(documentation, "FAMILIES", (gpt2, broken))
    page = documentation.family_page(broken)
    assert "**This page could not be made**: with transformers" in page
    assert "AttributeError: module transformers has no attribute BrokenConfig" in page
    left_out = "Not documented with this transformers (each page says why): [Broken-Test-Family]"
    assert left_out in documentation.availability_page() and left_out in documentation.layer_page()
    assert "| [Broken-Test-Family](broken-test-family.md) | `broken_test` | not documented here |" \
        in documentation.families_index()
    assert "| [GPT-2](gpt-2.md) | " in documentation.families_index()  # the others as before
