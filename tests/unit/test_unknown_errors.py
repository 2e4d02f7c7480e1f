"""A model type nnterp does not serve is refused in one line: the coverage table's reason where the table excludes the
type, else the type and where the served types are listed; never the list of served types itself."""

import re

import pytest
from transformers import BertConfig, PretrainedConfig

from nnterp import StandardizedTransformer, UnknownArchitecture
from nnterp.families import BY_MODEL_TYPE, family_of
from nnterp.proof.coverage import EXCLUDED, served_types

from ..conftest import tiny_tokenizer


def _served_types_named(message: str) -> set[str]:
    return set(re.findall(r"[\w.-]+", message)) & set(BY_MODEL_TYPE)


def _config_of_type(model_type: str) -> PretrainedConfig:
    return type("Config", (PretrainedConfig,), {"model_type": model_type})()


def test_a_bert_folder_is_refused_in_one_line_as_an_encoder(tmp_path):
    BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               is_decoder=True, architectures=["BertLMHeadModel"]).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UnknownArchitecture) as caught:
        StandardizedTransformer(str(tmp_path))
    message = str(caught.value)
    assert "\n" not in message
    assert "'bert' (BertLMHeadModel), an encoder: " + EXCLUDED["bert"][1] in message
    assert "docs/coverage.md" in message and not _served_types_named(message)


@pytest.mark.parametrize("model_type", sorted(EXCLUDED))
def test_every_excluded_type_is_refused_with_its_coverage_reason(model_type):
    with pytest.raises(UnknownArchitecture) as caught:
        family_of(_config_of_type(model_type))
    message = str(caught.value)
    assert "\n" not in message and EXCLUDED[model_type][1] in message
    assert f"{model_type!r}" in message and not _served_types_named(message)


def test_an_unknown_type_is_named_with_where_the_served_types_are():
    with pytest.raises(UnknownArchitecture) as caught:
        family_of(_config_of_type("nnterp_unknown_decoder"))
    message = str(caught.value)
    assert "\n" not in message and "'nnterp_unknown_decoder'" in message
    assert "docs/coverage.md" in message and "nnterp.proof.coverage.served_types()" in message
    assert not _served_types_named(message)
    assert {"gpt2", "llama"} <= set(served_types())  # where the message points
