"""One door per audience: StandardizedTransformer's public surface is nnterp's, exactly what the API page lists;
TransformerLens's and SAELens's names are HookedTransformer's; nnterp 1.x's are found on lookup, not on the class."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import nnsight
import pytest

import nnterp
from nnterp import HookedSAETransformer, HookedTransformer, StandardizedTransformer
from nnterp.compat import transformer_lens
from nnterp.compat.legacy import LegacyNames
from nnterp.compat.transformer_lens import config, saes
from nnterp.core import standardized
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MOST_NAMES = 45  # beyond nnsight's LanguageModel (36 public names); TransformerLens's HookedTransformer has ~80


@pytest.fixture(scope="module")
def tiny_model():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


def surface(cls) -> set[str]:
    """The public names of ``cls`` beyond nnsight's ``LanguageModel``'s."""
    return {name for name in set(dir(cls)) - set(dir(nnsight.LanguageModel)) if not name.startswith("_")}


def documented() -> set[str]:
    """The members the API page documents for ``StandardizedTransformer``: the class's own (mkdocstrings reads the
    class body), the mixins' it lists as ``inherited_members``, and the tools documented under the class's name."""
    text = API_PAGE.read_text()
    block = text.split("::: nnterp.StandardizedTransformer", 1)[1].split("\n::: ", 1)[0]
    inherited = re.search(r"inherited_members: \[([^\]]*)\]", block)
    assert inherited, "the API page lists the mixins' members of StandardizedTransformer as inherited_members"
    names = {name.strip() for name in inherited.group(1).split(",")}
    names |= set(re.findall(r'heading: "StandardizedTransformer\.(\w+)"', text))
    tree = ast.parse(Path(standardized.__file__).read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "StandardizedTransformer")
    names |= {node.name for node in cls.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    return names - set(dir(nnsight.LanguageModel))


def test_the_public_surface_is_what_the_api_page_lists():
    names = surface(StandardizedTransformer)
    assert names == documented(), (f"undocumented on the API page: {sorted(names - documented())}; documented but "
                                   f"absent: {sorted(documented() - names)}")
    assert len(names) <= MOST_NAMES, f"{len(names)} public names beyond nnsight's LanguageModel: {sorted(names)}"


def test_transformerlens_and_saelens_names_are_the_doors():
    theirs = set(transformer_lens.METHODS) | set(config.PROPERTIES) | set(saes.METHODS) | {"acts_to_saes"}
    assert not theirs & surface(StandardizedTransformer)
    assert theirs <= surface(HookedTransformer)
    assert HookedSAETransformer is HookedTransformer and nnterp.HookedSAETransformer is HookedTransformer


def test_1x_names_resolve_with_a_warning_without_being_on_the_class(tiny_model):
    old = {name for name in vars(LegacyNames) if not name.startswith("__")}
    assert not old & set(dir(StandardizedTransformer))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = tiny_model.layers_output
        tiny_model.skip_layer  # noqa: B018  (a method, bound to the model)
    assert len(layers) == tiny_model.num_layers
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "model.layers[i].layer_output" in str(caught[0].message)


def test_a_door_s_name_on_the_core_class_says_where_it_is(tiny_model):
    for name in ("to_tokens", "run_with_hooks", "cfg", "W_Q", "blocks", "run_with_saes", "acts_to_saes"):
        assert not hasattr(tiny_model, name)
        with pytest.raises(AttributeError, match=r"HookedTransformer\.from_pretrained"):
            getattr(tiny_model, name)
    with pytest.raises(AttributeError, match="nor its module"):  # any other name: nnsight's own message
        tiny_model.no_such_name  # noqa: B018
