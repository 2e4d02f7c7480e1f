"""nnterp 1.x code runs unchanged: its own tests' logic (from the 1.3.0 sdist), on tiny local models.

Each test below is a 1.x test body (``tests/test_nnsight_utils.py``, ``test_interventions.py``,
``test_prompt_utils.py``, ``test_probabilities.py``), with the hub models of its fixtures replaced by
tiny checkpoints of several families; where 1.x only checked shapes, the values are also compared
with today's standard values, which the family matrix checks against plain hooks.
"""

from __future__ import annotations

import warnings

import pytest
import torch as th
from nnsight import LanguageModel
from nnterp.interventions import (
    TargetPrompt,
    TargetPromptBatch,
    it_repeat_prompt,
    logit_lens,
    patch_object_attn_lens,
    patchscope_generate,
    patchscope_lens,
    repeat_prompt,
)
from nnterp.nnsight_utils import (
    collect_last_token_activations_session,
    collect_token_activations_batched,
    compute_next_token_probs,
    get_attention,
    get_attention_output,
    get_layer,
    get_layer_input,
    get_layer_output,
    get_logits,
    get_mlp_output,
    get_next_token_probs,
    get_num_layers,
    get_token_activations,
    project_on_vocab,
    set_layer_output,
)
from nnterp.prompt_utils import Prompt, get_first_tokens, next_token_probs_unsqueeze, run_prompts
from nnterp.rename_utils import get_vocab_size

from nnterp import StandardizedTransformer

from ..conftest import build_tiny
from ..families.test_families import CASES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # every 1.x name warns; checked below
FAMILIES = ["llama", "gpt2", "opt", "bloom", "gemma2", "qwen2_moe"]
WORDS = "Hello world Test prompt The quick brown fox jumps the cat hello beautiful for a".split()


def word_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    for word in [*WORDS, ",", "!", ".", "?", "1", "2", "3", "king", "1135", "|", "->", "X", "cat", "dog"]:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < 128:
        vocab[f"tok{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<eos>")


@pytest.fixture(scope="module", params=FAMILIES)
def model_name(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny(CASES[request.param][0]()).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama_like_model_name(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-like")
    build_tiny(CASES["llama"][0]()).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def model(model_name):
    return StandardizedTransformer(model_name)


# -- test_nnsight_utils.py -------------------------------------------------------------------------

def test_basic_utils(llama_like_model_name):
    with th.no_grad():
        model = LanguageModel(llama_like_model_name, device_map="auto", dispatch=True)
        prompt = "Hello, world!"
        num_layers = get_num_layers(model)
        assert num_layers > 0
        with model.trace(prompt):
            _layer = get_layer(model, 0)
            layer_input = get_layer_input(model, 0).save()
            _attention = get_attention(model, 0)
            attn_output = get_attention_output(model, 0).save()
            mlps_output = get_mlp_output(model, 0).save()
            layer_output = get_layer_output(model, 0).save()
            if num_layers > 1:
                set_layer_output(model, 1, layer_output)
            else:
                set_layer_output(model, 0, layer_output + 2)
            logits = get_logits(model).save()
            next_probs = get_next_token_probs(model).save()
            projected = project_on_vocab(model, layer_output).save()
            logits_output = model.output.logits.save()
        vocab_size = get_vocab_size(model)
        assert next_probs.shape[-1] == vocab_size
        assert projected.shape[-1] == vocab_size
        assert layer_input.shape == layer_output.shape
        assert logits.shape[-1] == vocab_size
        assert next_probs.shape == (logits.shape[0], vocab_size)
        assert logits_output.shape == projected.shape
        assert mlps_output.shape == layer_output.shape
        assert attn_output.shape == layer_input.shape
        assert th.equal(layer_input + attn_output + mlps_output, layer_output)  # Llama: the identity, exactly


def test_utils_on_a_standardized_model_are_the_standard_values(model):
    import nnsight

    with th.no_grad(), model.trace("the cat"):
        old = nnsight.save([get_layer_input(model, 1), get_attention_output(model, 1), get_mlp_output(model, 1),
                            get_layer_output(model, 1)])
    with th.no_grad(), model.trace("the cat"):
        new = nnsight.save([model.layers[1].layer_input, model.layers[1].self_attn.attention_output,
                            model.layers[1].mlp.mlp_output, model.layers[1].layer_output])
    assert all(th.equal(a, b) for a, b in zip(old, new))


def test_activation_collection(llama_like_model_name):
    with th.no_grad():
        model = LanguageModel(llama_like_model_name, device_map="auto", dispatch=True)
        prompts = ["Hello, world!", "Testing, 1, 2, 3"] * 2
        acts_session = collect_last_token_activations_session(model, prompts, batch_size=1)
        assert acts_session.shape[:2] == (get_num_layers(model), len(prompts))
        acts = get_token_activations(model, prompts)
        assert acts.shape[:2] == (get_num_layers(model), len(prompts))
        acts_batched = collect_token_activations_batched(model, prompts, batch_size=1)
        assert acts_batched.shape[:2] == (get_num_layers(model), len(prompts))
        acts_batched_no_batch = collect_token_activations_batched(model, prompts, batch_size=len(prompts))
        assert th.allclose(acts, acts_batched_no_batch)
        probs = compute_next_token_probs(model, prompts)
        assert probs.shape == (len(prompts), get_vocab_size(model))


def test_project_on_vocab_layer_output_backward(llama_like_model_name):
    import nnsight

    model = LanguageModel(llama_like_model_name, device_map="auto", dispatch=True)
    with model.trace("Hello, world!"):
        layer_input = get_layer_input(model, 0).save()
        attn_output = get_attention_output(model, 0).save()
        mlp_output = get_mlp_output(model, 0).save()
        layer_output = get_layer_output(model, 0).save()
        loss = project_on_vocab(model, layer_output).sum()
        with loss.backward():
            grads = nnsight.save([layer_output.grad, mlp_output.grad, attn_output.grad, layer_input.grad])
    for grad, tensor in zip(grads, [layer_output, mlp_output, attn_output, layer_input]):
        assert grad is not None and grad.shape == tensor.shape


# -- test_interventions.py -------------------------------------------------------------------------

def test_logit_lens(model):
    with th.no_grad():
        prompts = ["Hello world", "Test prompt"]
        assert logit_lens(model, prompts).shape == (len(prompts), get_num_layers(model), model.vocab_size)
        assert logit_lens(model, "Hello world").shape == (1, get_num_layers(model), model.vocab_size)
        probs, inverse = logit_lens(model, prompts, return_inv_logits=True)
        with model.trace(prompts):
            last = model.layers[-1].layer_output[:, -1:].save()
        assert th.allclose(inverse[:, -1], model.project_on_vocab(-last)[:, 0].softmax(-1), atol=1e-6)


def test_target_prompt_batch():
    prompts = [TargetPrompt("Hello", -1), TargetPrompt("World", 0)]
    batch = TargetPromptBatch.from_target_prompts(prompts)
    assert len(batch) == 2 and batch.prompts == ["Hello", "World"]
    assert th.equal(batch.index_to_patch, th.tensor([-1, 0]))
    assert len(TargetPromptBatch.auto(TargetPrompt("Hello", -1), batch_size=3)) == 3
    batch = TargetPromptBatch.from_prompts(["Hello", "World"], [-1, 0])
    assert batch[1].prompt == "World" and batch[1].index_to_patch == 0 and len(list(batch)) == 2
    assert th.equal(TargetPromptBatch.from_target_prompt(TargetPrompt("Test", -1), 3).index_to_patch,
                    th.tensor([-1, -1, -1]))


def test_patchscope_lens(model):
    with th.no_grad():
        source_prompts = ["Hello world", "Test prompt"]
        result = patchscope_lens(model, source_prompts)
        assert result.shape == (len(source_prompts), get_num_layers(model), model.vocab_size)
        result = patchscope_lens(model, ["Hello world"], TargetPrompt("The answer is ?", -1))
        assert result.shape == (1, get_num_layers(model), model.vocab_size)
        layers_to_test = [0, get_num_layers(model) // 2, get_num_layers(model) - 1]
        result = patchscope_lens(model, source_prompts, layers=layers_to_test)
        assert result.shape[1] == len(layers_to_test)
        # the same numbers as today's spelling, which the toolkit tests check against hooks
        target = repeat_prompt()
        today = patchscope_lens(model, source_prompts, target.prompt, target.index_to_patch, layers=layers_to_test)
        assert th.allclose(result, today)


def test_repeat_prompts(model):
    default = repeat_prompt()
    assert default.index_to_patch == -1 and "king king" in default.prompt and default.prompt.endswith("?")
    custom = repeat_prompt(words=["cat", "dog"], rel="->", sep=" | ", placeholder="X")
    assert "cat->cat" in custom.prompt and " | " in custom.prompt and custom.prompt.endswith("X")
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert isinstance(it_repeat_prompt(model.tokenizer), TargetPrompt)
    assert isinstance(it_repeat_prompt(model.tokenizer, words=["test", "word"], complete_prompt=False,
                                       add_user_instr=False, use_system_prompt=False), TargetPrompt)


def test_patchscope_generate_and_object_attention_lens(model):
    with th.no_grad():
        generations = patchscope_generate(model, ["Hello world"], repeat_prompt(), max_length=3, layers=[0, 1])
        assert set(generations) == {0, 1} and generations[0].shape[0] == 1
        result = patch_object_attn_lens(model, ["Hello world"], ["The quick brown fox"], 1, num_patches=2)
        assert result.shape == (1, get_num_layers(model), model.vocab_size)


# -- test_prompt_utils.py --------------------------------------------------------------------------

def test_prompts(model):
    with th.no_grad():
        assert len(get_first_tokens("hello", model)) > 0 and len(get_first_tokens(["hello", "world"], model)) >= 2
        prompt = Prompt.from_strings("The quick brown fox", "jumps", model)
        assert prompt.prompt == "The quick brown fox" and len(prompt.target_tokens["target"]) > 0
        prompt = Prompt.from_strings("The quick brown fox", {"target": "jumps", "animal": "fox"}, model)
        mock = th.rand(1, 3, model.vocab_size)
        assert prompt.get_target_probs(mock)["target"].shape == (1, 3)
        assert th.equal(prompt.get_target_probs(mock, layer=1)["animal"],
                        mock[:, 1, prompt.target_tokens["animal"]].sum(-1))
        prompt = Prompt.from_strings("Hello world", {"greeting": "hello", "punctuation": ".", "greeting2": "hello"},
                                     model)
        assert not prompt.has_no_collisions() and prompt.has_no_collisions(ignore_targets="greeting")
        result = Prompt.from_strings("The quick brown fox", {"target": "jumps"}, model).run(
            model, lambda nn_model, text: logit_lens(nn_model, text))
        assert result["target"].shape == (1, get_num_layers(model))
        probs = next_token_probs_unsqueeze(model, "Hello world")
        assert probs.shape == (1, 1, model.vocab_size)


def test_run_prompts(model):
    with th.no_grad():
        prompts = [Prompt.from_strings("Hello world", {"target": "!"}, model),
                   Prompt.from_strings("The quick brown", {"target": "fox"}, model)]
        result = run_prompts(model, prompts, batch_size=2)
        assert result["target"].shape == (len(prompts), 1)  # 1.x's shape: a layer dimension of one
        with model.trace([p.prompt for p in prompts]):
            expected = model.next_token_probs.save()
        assert th.allclose(result["target"][:, 0], th.stack([expected[i, p.target_tokens["target"]].sum()
                                                             for i, p in enumerate(prompts)]))
        result = run_prompts(model, prompts, batch_size=1,
                             get_probs_func=lambda nn_model, batch, **kwargs: logit_lens(nn_model, batch))
        assert result["target"].shape == (len(prompts), get_num_layers(model))
        with pytest.raises(TypeError, match="model first"):
            run_prompts(model.tokenizer, prompts)


# -- test_probabilities.py -------------------------------------------------------------------------

def test_attention_probabilities(model_name):

    with th.no_grad():
        model = StandardizedTransformer(model_name, enable_attention_probs=True,
                                        tokenizer_kwargs=dict(padding_side="right"))
        assert model.attn_probs_available and model.tokenizer.padding_side == "right"
        model.attention_probabilities.print_source()
        prompts = ["Hello, world!", "The quick brown fox jumps"]
        with model.trace(prompts):
            attn_probs = model.attention_probabilities[0].save()
            logits = model.logits.save()
        assert attn_probs.shape == (logits.shape[0], model.num_heads, logits.shape[1], logits.shape[1])
        summed = attn_probs.sum(dim=-1)
        real = summed[summed != 0]  # right padding: rows of padded queries may be all masked
        assert th.allclose(real, th.ones_like(real), atol=1e-5)
        with model.trace(prompts):
            for layer in range(model.num_layers):
                probs = model.attention_probabilities[layer]
                probs[:, :, :, 1] += probs[:, :, :, 0]
                probs[:, :, :, 0] = 0
            corrupted = model.logits.save()
        with model.trace(prompts):
            baseline = model.logits.save()
        assert not th.allclose(corrupted, baseline)


# -- the model-level 1.x names -----------------------------------------------------------------------

def test_model_level_names(model):
    import nnsight

    with th.no_grad(), model.trace("the cat"):
        size = nnsight.save(tuple(model.input_size))
        embeddings = model.token_embeddings.save()
        first = model.attentions_input[0].save()
        block = model.model.layers[0].output.save()
    assert embeddings.shape[-1] == model.hidden_size and tuple(size) == (1, 2)
    assert first.shape[-1] == model.hidden_size and block is not None
    assert model.attentions[0] is model.layers[0].self_attn and model.mlps[1] is model.layers[1].mlp
    with th.no_grad(), model.trace("the cat"):
        hidden = model.layers[-1].layer_output[0, -1].save()
    top = model.get_topk_closest_tokens(hidden, k=3)
    assert len(top) == 3 and all(isinstance(p, float) for p in top.values())
    with th.no_grad(), model.trace("the cat sat"):
        model.skip_layer(1, skip_with=model.layers[1].layer_input)
        skipped = model.logits.save()
    with th.no_grad(), model.trace("the cat sat"):
        model.layers[2].layer_input = model.layers[1].layer_input.clone()
        expected = model.logits.save()
    assert th.equal(skipped, expected)
    vector = th.ones(model.hidden_size)
    with th.no_grad(), model.trace("the cat sat"):
        model.steer(1, vector, positions=[1])
        steered = model.logits.save()
    with th.no_grad(), model.trace("the cat sat"):
        model.layers[1].layer_output[:, [1]] += vector
        added = model.logits.save()
    assert th.equal(steered, added)


def test_every_1x_name_warns_with_its_new_spelling(model):
    with pytest.warns(DeprecationWarning, match="use model.layers\\[i\\].layer_output"):
        model.layers_output  # noqa: B018
    with pytest.warns(DeprecationWarning, match="use attention_values="):
        StandardizedTransformer(model._module, tokenizer=model.tokenizer, enable_attention_probs=False)
    with pytest.warns(DeprecationWarning, match="model.num_layers"):
        get_num_layers(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="family spec"):
            from nnterp.rename_utils import RenameConfig

            StandardizedTransformer(model._module, tokenizer=model.tokenizer, rename_config=RenameConfig(attn_name="x"))


def test_model_names_on_every_family():
    """``model.model.layers[i]`` is the block on every family (1.x's backbone name)."""
    from ..conftest import tiny_tokenizer

    for case in CASES:
        std = StandardizedTransformer(build_tiny(CASES[case][0]()), tokenizer=tiny_tokenizer())
        assert std.model.layers[0]._module is std.layers[0]._module, case


# -- the 1.3.0 README's examples, as written (a 12-layer GPT-2 in place of "gpt2") -----------------------

def test_the_1x_readme_examples_run(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..conftest import perturb

    th.manual_seed(0)
    perturb(GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
            ).save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(str(tmp_path))
    with model.trace("The Eiffel Tower is in the city of"):
        attention_output = model.attentions_output[3]  # noqa: F841
        mlp_output = model.mlps_output[3]  # noqa: F841
        layer_5_output = model.layers_output[5]  # noqa: F841
        logits = model.logits.save()
    assert logits.shape[-1] == 128  # the example saves only the logits
    with model.trace("Hello world"):
        attn_out = model.attentions_output[3]  # noqa: F841
        mlp_out = model.mlps_output[3]  # noqa: F841
        layer_3_output = model.layers_output[3]
        layer_5_output = model.layers_output[5]  # noqa: F841
        model.layers_output[10] = model.layers_output[10] + layer_3_output
        added = model.logits.save()
    with model.trace("Hello world"):
        plain = model.logits.save()
    assert not th.equal(added, plain)  # the residual of layer 3 reached layer 10

    from nnterp.interventions import TargetPrompt, logit_lens, patchscope_lens, steer

    layer_probs = logit_lens(model, ["The capital of France is"])
    assert layer_probs.shape == (1, 12, 128)
    target = TargetPrompt("The capital of France is", index_to_patch=-1)
    patchscope_probs = patchscope_lens(model, source_prompts=["The capital of England is"],
                                       target_patch_prompts=target, layer_to_patch=10)
    assert patchscope_probs.shape == (1, 1, 128)
    steering_vector = th.randn(model.hidden_size)
    with model.trace("Hello, how are you?"):
        model.steer(layers=[5, 10], steering_vector=steering_vector, factor=1.5)
    with model.trace(["Hello, how are you?", "Goodbye, world!"]):
        model.steer(layers=5, steering_vector=steering_vector, token_positions=0)
        steer(model, layers=5, steering_vector=steering_vector, batch_index=1)

    prompts = [Prompt.from_strings("The capital of France is", {"target": "Paris", "other": ["London", "Madrid"]},
                                   model.tokenizer)]
    results = run_prompts(model, prompts)
    assert set(results) == {"target", "other"} and results["target"].shape == (1, 1)
    results = run_prompts(model, prompts, get_probs_func=logit_lens)
    assert results["target"].shape == (1, 12)


# every public name of nnterp 1.3.0's modules (read from its sdist), by its 1.x path
PUBLIC_1X = {
    "nnterp": ["StandardizedTransformer", "get_rename_dict", "ModuleAccessor"],
    "nnterp.nnsight_utils": [
        "get_embed_tokens", "get_layers", "get_num_layers", "get_layer", "get_layer_input", "get_layer_output",
        "get_attention", "get_attention_output", "get_mlp", "get_mlp_output", "get_logits", "get_unembed_norm",
        "get_unembed", "project_on_vocab", "get_next_token_probs", "set_layer_output", "ModuleAccessor",
        "get_token_activations", "collect_last_token_activations_session", "collect_token_activations_batched",
        "compute_next_token_probs"],
    "nnterp.interventions": ["logit_lens", "TargetPrompt", "repeat_prompt", "it_repeat_prompt", "TargetPromptBatch",
                             "patchscope_lens", "patchscope_generate", "patch_object_attn_lens"],
    "nnterp.prompt_utils": ["TokenizationError", "get_first_tokens", "Prompt", "next_token_probs_unsqueeze",
                            "run_prompts"],
    "nnterp.utils": ["TraceTensor", "ArchitectureNotFound", "is_notebook", "display_markdown", "display_source",
                     "DummyCache", "dummy_inputs", "try_with_scan", "unpack_tuple"],
    "nnterp.display": ["plot_topk_tokens", "prompts_to_df"],
    "nnterp.rename_utils": [
        "RenamingError", "AttnProbFunction", "RenameConfig", "expand_path_with_model", "default_attn_head_config_keys",
        "default_hidden_size_config_keys", "default_vocab_size_config_keys", "get_rename_dict", "text_config",
        "get_num_attention_heads", "get_hidden_size", "get_vocab_size", "IOType", "LayerAccessor",
        "bloom_attention_prob_source", "default_attention_prob_source", "gpt2_attention_prob_source",
        "gptj_attention_prob_source", "AttentionProbabilitiesAccessor", "check_model_renaming"],
}
MODEL_NAMES_1X = ["layers_input", "layers_output", "attentions_output", "mlps_input", "mlps_output",
                  "attention_probabilities", "attentions", "mlps", "attentions_input", "token_embeddings", "input_ids",
                  "attention_mask", "input_size", "attn_probs_available", "add_prefix_false_tokenizer", "logits",
                  "next_token_probs", "num_layers", "num_heads", "hidden_size", "vocab_size", "project_on_vocab",
                  "get_topk_closest_tokens", "probs_to_dict", "detect_layer_output_type", "steer", "skip_layer",
                  "skip_layers", "embed_tokens", "layers", "ln_final", "lm_head"]


def test_every_public_1x_name_imports_from_its_1x_path():
    import importlib

    missing = [f"{module}.{name}" for module, names in PUBLIC_1X.items() for name in names
               if not hasattr(importlib.import_module(module), name)]
    assert not missing
    # the class's own, or nnterp 1.x's names that its lookup finds (never set on the class: not its surface)
    fallback = StandardizedTransformer._nnterp_fallback
    assert not [name for name in MODEL_NAMES_1X if not hasattr(StandardizedTransformer, name)
                and name not in fallback and name not in ("embed_tokens", "layers", "ln_final", "lm_head")]
    assert not [name for name in fallback if name in vars(StandardizedTransformer)]
