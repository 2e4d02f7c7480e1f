"""Loading, model-level names, and bad input that must fail clearly and lose nothing."""

from __future__ import annotations

import nnsight
import pytest
import torch
from transformers import BloomConfig, GPT2Config, GPT2LMHeadModel

from nnterp import BadAssignment, StandardizedTransformer, UnknownArchitecture, UnsupportedConfig
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

IDS = torch.tensor([[3, 4, 5, 6]])


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


def test_model_level_names_match_the_hf_model(llama):
    hf = llama._module
    assert llama.layers._module is hf.model.layers
    assert llama.embed_tokens._module is hf.model.embed_tokens
    assert llama.ln_final._module is hf.model.norm
    assert llama.lm_head._module is hf.lm_head
    assert llama.layers[0].self_attn._module is hf.model.layers[0].self_attn
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.vocab_size) == (3, 64, 4, 128)
    assert not hf.training


def test_logits_and_next_token_probs(llama):
    with torch.no_grad():
        expected = llama._module(input_ids=IDS).logits
        with llama.trace(IDS):
            logits = llama.logits.save()
            probs = llama.next_token_probs.save()
    assert torch.equal(logits, expected)
    assert torch.allclose(probs, torch.softmax(expected[:, -1], dim=-1))


def test_project_on_vocab_of_last_layer_is_the_logits(llama):
    with torch.no_grad(), llama.trace(IDS):
        last = llama.layers[-1].layer_output.save()
        logits = llama.logits.save()
    assert torch.equal(llama.project_on_vocab(last), logits)


def test_loading_from_a_folder(tmp_path):
    build_tiny(BY_MODEL_TYPE["llama"].tiny_config()).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(str(tmp_path), dtype=torch.bfloat16)
    assert model.family.name == "Llama" and model._module.dtype == torch.bfloat16
    with model.trace("the cat sat"):
        out = model.layers[0].layer_output.save()
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, 64)


def test_a_checkpoint_without_the_blocks_weights_is_refused_not_left_random(tmp_path):
    """A checkpoint that keeps its weights under other names (an image-text checkpoint's prefix) would load with
    random blocks; loading refuses it, and key_mapping renames them."""
    from safetensors.torch import load_file, save_file

    hf = build_tiny(BY_MODEL_TYPE["llama"].tiny_config())
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({f"text_model.{key}": tensor for key, tensor in weights.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights of the blocks .* not in the checkpoint.*key_mapping"):
        StandardizedTransformer(str(tmp_path))
    model = StandardizedTransformer(str(tmp_path), key_mapping={r"^text_model\.": ""})
    assert torch.equal(model._module.model.layers[1].mlp.down_proj.weight, hf.model.layers[1].mlp.down_proj.weight)


def test_missing_model_says_what_to_do(tmp_path):
    with pytest.raises(OSError, match="No model folder at .*nowhere.*no such path"):
        StandardizedTransformer(str(tmp_path / "nowhere"))


def test_unknown_architecture_names_it():
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128)
    model = GPT2LMHeadModel(config)
    model.config.model_type = "mystery"
    with pytest.raises(UnknownArchitecture, match="'mystery' \\(GPT2LMHeadModel\\)"):
        StandardizedTransformer(model, tokenizer=tiny_tokenizer())


def test_unsupported_config_says_why():
    hf = build_tiny(BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=128,
                                apply_residual_connection_post_layernorm=True))
    with pytest.raises(UnsupportedConfig, match="apply_residual_connection_post_layernorm"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())


def test_wrapping_needs_a_tokenizer_and_rejects_loading_options():
    hf = build_tiny(BY_MODEL_TYPE["gpt2"].tiny_config())
    with pytest.raises(ValueError, match="tokenizer=tok"):
        StandardizedTransformer(hf)
    with pytest.raises(TypeError, match="dtype"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), dtype=torch.float16)


def test_layer_out_of_range(llama):
    with pytest.raises(IndexError, match="3 layers"):
        llama.order(7)


@pytest.mark.parametrize("bad, message", [
    (lambda t: t[:, :-1], "shape"),
    (lambda t: t.to(torch.float64), "float64"),
    (lambda t: 1.0, "torch.Tensor"),
])
def test_bad_assignment_is_refused_and_the_model_stays_usable(llama, bad, message):
    with torch.no_grad(), llama.trace(IDS):
        clean = llama.logits.save()
    with pytest.raises(BadAssignment, match=message):
        with torch.no_grad(), llama.trace(IDS):
            llama.layers[1].mlp.mlp_output = bad(llama.layers[1].mlp.mlp_output)
    with torch.no_grad(), llama.trace(IDS):
        again = llama.logits.save()
    assert torch.equal(again, clean)


@pytest.mark.parametrize("config, message", [
    (lambda: __import__("transformers").FalconConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                                     vocab_size=128, new_decoder_architecture=True,
                                                     parallel_attn=False), "parallel_attn=False"),
])
def test_configs_without_a_residual_identity_are_refused(config, message):
    with pytest.raises(UnsupportedConfig, match=message):
        StandardizedTransformer(build_tiny(config()), tokenizer=tiny_tokenizer())


def test_layer_index_out_of_range_inside_a_trace(llama):
    with pytest.raises(IndexError, match="Layer 99 is out of range: the model has 3 layers"):
        with llama.trace(IDS):
            llama.layers[99].layer_output.save()
    with llama.trace(IDS):
        last = llama.layers[-1].layer_output.save()
    assert last.shape == (1, 4, 64)


def test_hub_name_without_network_says_so():
    with pytest.raises(OSError, match="no network, HF_HUB_OFFLINE set"):
        StandardizedTransformer("nnterp-tests/no-such-model")


def test_remote_code_is_not_run_unless_asked(tmp_path):
    marker = tmp_path / "code-ran"
    (tmp_path / "config.json").write_text(
        '{"model_type": "toy_remote", "auto_map": {"AutoConfig": "configuration_toy.ToyConfig"}}')
    (tmp_path / "configuration_toy.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises((ValueError, OSError), match="trust_remote_code"):
        StandardizedTransformer(str(tmp_path))
    assert not marker.exists()


def test_batch_without_pad_token_says_what_to_set():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "the": 1, "cat": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")  # neither pad nor eos
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tok)
    with pytest.raises(ValueError, match="pad_token"):
        with model.trace(["the cat", "the"]):
            model.logits.save()


def test_padded_batch_gives_each_prompt_its_single_values(llama):
    prompts = ["the cat sat on the mat", "the dog"]
    with torch.no_grad(), llama.trace(prompts):
        batch_mlp = llama.layers[1].mlp.mlp_output.save()
        batch = nnsight.save([llama.layers[i].layer_output for i in range(1, 3)])
    for row, prompt in enumerate(prompts):
        with torch.no_grad(), llama.trace(prompt):
            single_mlp = llama.layers[1].mlp.mlp_output.save()
            single = nnsight.save([llama.layers[i].layer_output for i in range(1, 3)])
        n = single[0].shape[1]  # left padding: the prompt's tokens are the last n
        for b, s in zip(batch, single):
            assert torch.allclose(b[row, -n:], s[0], atol=1e-5)
        assert torch.allclose(batch_mlp[row, -n:], single_mlp[0], atol=1e-5)


@pytest.mark.slow  # outside the fast tier (./run.sh test --fast)
def test_thousands_of_traces_keep_memory_flat(llama):
    import resource

    def run(n):
        for _ in range(n):
            with torch.no_grad(), llama.trace(IDS):
                llama.layers[1].mlp.mlp_output.save()
                llama.layers[2].layer_output.save()

    run(200)  # warm up caches
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(2000)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 50  # MiB


def test_envoys_declare_exactly_the_catalog():
    """The values an editor completes are the catalog's, each on the envoy of its owner."""
    from nnterp.core.envoys import AttentionEnvoy, BlockEnvoy, BlockWithMLPEnvoy, MLPEnvoy, standard_values
    from nnterp.spec.catalog import values_of

    for envoy, owners in ((BlockEnvoy, ["block"]), (AttentionEnvoy, ["self_attn"]), (MLPEnvoy, ["mlp"]),
                          (BlockWithMLPEnvoy, ["block", "mlp"])):
        assert standard_values(envoy) == {v.name for owner in owners for v in values_of(owner)}


def test_availability_prints_one_value_an_entry(llama):
    table = llama.availability(1)
    lines = repr(table).splitlines()
    starts = [line.split()[0] for line in lines if not line.startswith(" ")]  # a long reason continues indented
    assert starts == list(table) and all(len(line) <= 120 for line in lines)
    assert lines[0].startswith("layer_input") and "self_attn.queries" in repr(table)


@pytest.fixture(scope="module")
def gptj():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["gptj"].tiny_config()), tokenizer=tiny_tokenizer())


def test_hasattr_outside_a_trace_tells_availability_on_every_family(llama, gptj):
    for model in (llama, gptj):
        for i in range(model.num_layers):
            table = model.availability(i)
            for key, entry in table.items():
                owner, _, name = key.rpartition(".")
                envoy = model.layers[i] if not owner else getattr(model.layers[i], owner)
                assert hasattr(envoy, name) == entry.available, (model.family.name, i, key)
    assert not hasattr(gptj.layers[0], "layer_mid") and hasattr(llama.layers[0], "layer_mid")


def test_a_value_outside_a_trace_says_where_it_lives_and_how_to_read_it(llama):
    value = llama.layers[1].layer_mid
    assert "post_attention_layernorm.input" in repr(value) and "model.trace" in repr(value)
    with pytest.raises(ValueError, match=r"layers\[1\]\.layer_mid is a tensor only inside a trace"):
        value.shape  # noqa: B018
    with pytest.raises(ValueError, match=r"assigned only inside a trace"):
        llama.layers[1].layer_mid = torch.zeros(1, 4, 64)
    with llama.trace(IDS):  # and inside a trace the same access is the live tensor
        inside = llama.layers[1].layer_mid.save()
    assert inside.shape == (1, 4, 64)


def test_printing_the_model_shows_its_tree_once_and_the_standard_names(gptj):
    text = repr(gptj)
    assert text.count("GPTJBlock(") == 1  # the block list is not repeated under its alias
    assert "(layers/h): ModuleList(" in text
    assert "model.layers[i] = transformer.h[i]" in text and "model.ln_final = transformer.ln_f" in text
    order = gptj.order(0)
    listed = text.split("in forward order: ")[1].splitlines()[0].split(", ")
    assert sorted(listed) == sorted(order)
    assert [order[k] for k in listed] == sorted(order[k] for k in listed)  # listed in forward order
    assert "unavailable (model.availability(0) says why):" in text and "layer_mid" in text.split("unavailable")[-1]


@pytest.mark.slow  # outside the fast tier (./run.sh test --fast)
def test_generated_docs_draw_no_transformers_warnings_and_leave_logging_as_found(capfd):
    from transformers.utils import logging as transformers_logging

    from nnterp.documentation import generated_pages

    before = transformers_logging.get_verbosity()
    generated_pages()
    assert "[transformers]" not in capfd.readouterr().err
    assert transformers_logging.get_verbosity() == before
