"""Validation on a miniature of the config, `nnterp check`, and property tests over configs."""

from __future__ import annotations

import dataclasses
import os
import re
import resource

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnterp.families as registry
from nnterp import StandardizedTransformer
from nnterp.__main__ import main
from nnterp.core.validation import ValidationError, check_identity, validate
from nnterp.families import BY_MODEL_TYPE
from nnterp.families.base import output

from ..conftest import build_tiny, tiny_tokenizer


def test_7b_shaped_config_validates_without_allocating_its_weights():
    config = T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    events = validate(config, T.LlamaForCausalLM, tiny_tokenizer(), use_cache=False)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 500  # 7B float32 weights would be 26 GiB
    assert ("model.layers.31.mlp", "output") in events  # every block of the real depth was run


@pytest.fixture
def broken_gpt2(monkeypatch):
    """GPT-2's spec with mlp_output read at the MLP's activation: a wrong location of the right name."""
    right = BY_MODEL_TYPE["gpt2"]

    def wrong_block(config, i):
        block = right.block(config, i)
        return dataclasses.replace(block, values={**block.values, "mlp_output": output("ln_2")})

    monkeypatch.setitem(registry.BY_MODEL_TYPE, "gpt2", dataclasses.replace(right, block=wrong_block))


def test_a_wrong_spec_fails_validation_naming_the_mismatch(broken_gpt2):
    hf = build_tiny(BY_MODEL_TYPE["gpt2"].tiny_config())
    with pytest.raises(ValidationError, match=r"(?s)GPT-2 spec does not hold.*layer 0: the identity fails.*'mlp.mlp_output' or 'layer_output' is misplaced"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), validate=False)  # the opt-out
    assert not all(r.exact for r in check_identity(model))


def test_a_wrong_spec_fails_before_any_weight_loads(broken_gpt2, tmp_path, monkeypatch):
    build_tiny(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128)).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the spec was proven")

    monkeypatch.setattr(T.GPT2LMHeadModel, "from_pretrained", no_weights)
    with pytest.raises(ValidationError):
        StandardizedTransformer(str(tmp_path))


def test_validation_is_cached(monkeypatch):
    config = T.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=3, vocab_size=100)
    validate(config, T.LlamaForCausalLM, tiny_tokenizer())
    monkeypatch.setattr("nnterp.core.validation.build_miniature", lambda *a: pytest.fail("validated twice"))
    validate(config, T.LlamaForCausalLM, tiny_tokenizer())


def test_check_cli_passes_and_fails(tmp_path, capsys, broken_gpt2):
    build_tiny(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=128)).save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    with pytest.raises(SystemExit) as exit_code:
        main(["check", str(tmp_path / "llama")])
    out = capsys.readouterr().out
    assert exit_code.value.code == 0 and out.rstrip().endswith("OK")
    assert "family Llama" in out and re.search(r"^  mlp\.mlp_neurons +mlp\.down_proj\.input$", out, re.M)
    assert "2/2 blocks exact" in out

    build_tiny(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128)).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SystemExit) as exit_code:
        main(["check", str(tmp_path / "gpt2")])
    out = capsys.readouterr().out
    assert exit_code.value.code == 1 and out.rstrip().endswith("FAILED")
    assert re.search(r"^  mlp\.mlp_output +ln_2\.output$", out, re.M) and "identity fails" in out and "MISMATCH" in out


# -- property tests: random sizes and options of each family's config -----------------------------

heads_and_kv = st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
OPTIONS = {
    "llama": lambda d: st.fixed_dictionaries({"attention_bias": st.booleans(), "mlp_bias": st.booleans(),
                                              "tie_word_embeddings": st.booleans()}),
    "gpt2": lambda d: st.fixed_dictionaries({"scale_attn_by_inverse_layer_idx": st.booleans(),
                                             "reorder_and_upcast_attn": st.booleans()}),
    "gpt_neox": lambda d: st.fixed_dictionaries({"use_parallel_residual": st.booleans(),
                                                 "attention_bias": st.booleans()}),
    "falcon": lambda d: st.sampled_from([
        {"new_decoder_architecture": False, "parallel_attn": True, "multi_query": True},
        {"new_decoder_architecture": False, "parallel_attn": False, "alibi": True, "bias": True, "num_kv_heads": d},
        {"new_decoder_architecture": False, "parallel_attn": False, "multi_query": False, "num_kv_heads": d},
        {"new_decoder_architecture": True, "num_kv_heads": d // 2 or 1},
        {"new_decoder_architecture": True, "num_kv_heads": d // 2 or 1, "num_ln_in_parallel_attn": 1}]),
    "stablelm": lambda d: st.fixed_dictionaries({"use_parallel_residual": st.booleans(),
                                                 "use_qkv_bias": st.booleans(), "qk_layernorm": st.booleans()}),
    "phi": lambda d: st.fixed_dictionaries({"qk_layernorm": st.booleans()}),
    "qwen2_moe": lambda d: st.fixed_dictionaries({"decoder_sparse_step": st.integers(1, 2),
                                                  "mlp_only_layers": st.sampled_from([[], [0]])}),
    "gemma2": lambda d: st.fixed_dictionaries({"sliding_window": st.integers(2, 6)}),
}


@pytest.mark.parametrize("model_type", OPTIONS)
@settings(max_examples=int(os.environ.get("NNTERP_HYPOTHESIS_EXAMPLES", 8)), deadline=None,
          derandomize=not os.environ.get("NNTERP_HYPOTHESIS_EXAMPLES"),  # CI: the same examples every run
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), layers=st.integers(1, 3), heads=heads_and_kv, head_dim=st.sampled_from([8, 16]))
def test_random_configs_validate_and_keep_the_identity(model_type, data, layers, heads, head_dim):
    num_heads, kv = heads
    config = BY_MODEL_TYPE[model_type].tiny_config()
    config.num_hidden_layers = layers
    config.num_attention_heads = num_heads
    config.hidden_size = num_heads * head_dim
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = kv
    if "head_dim" in vars(config):  # a plain attribute, not Falcon's derived property
        config.head_dim = head_dim
    for key, value in data.draw(OPTIONS[model_type](num_heads)).items():
        setattr(config, key, value)
    for dtype in (torch.float32, torch.bfloat16):
        model = StandardizedTransformer(build_tiny(config, dtype), tokenizer=tiny_tokenizer())  # validates
        assert all(r.exact for r in check_identity(model)), config


@pytest.mark.parametrize("spec, message", [
    ("cohere", "'mlp_norm_output' is not what the MLP is called with"),  # a parallel spec on a sequential block
    ("mixtral", "labels the MLP routed, but the block .* has no experts"),  # a mixture spec on dense blocks
])
def test_a_spec_whose_identity_holds_but_places_a_value_wrongly_fails(monkeypatch, spec, message):
    """The identity alone passes both (the residual adds are the same); the placement checks do not."""
    llama = BY_MODEL_TYPE["llama"]
    monkeypatch.setitem(registry.BY_MODEL_TYPE, "llama", dataclasses.replace(BY_MODEL_TYPE[spec], model_types=("llama",)))
    hf = build_tiny(llama.tiny_config())
    with pytest.raises(ValidationError, match=message):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
