"""OpenAI GPT: post-norm blocks that return a list, and no final norm, against plain hooks.

Ground truth: forward hooks on the unwrapped model at the boundaries of transformers' OpenAI GPT ``Block.forward``
(``a = attn(x)[0]; n = ln_1(x + a); m = mlp(n); h = ln_2(n + m); return [h, ...]``) and ``MLP.forward``
(``c_proj(act(c_fc(x)))``). The identity is that arithmetic, written here with ``torch.nn.functional.layer_norm`` and
the blocks' norm weights. The head reads the last block's output directly.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer
from nnterp.core.edits import skip_layers
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config
from nnterp.spec.attention import head_outputs
from nnterp.tools.lens import logit_lens

from ..conftest import build_tiny, edited_logits, perturb, tiny_tokenizer
from ..hooks import capture_once, logits_with_edit

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
DTYPES = [torch.float32, torch.bfloat16]

# value -> (module relative to the block, side); the block and the attention return lists: element 0
AT = {"layer_input": ("", "in"), "attention_premix": ("attn.c_proj", "in"), "attention_output": ("attn", "out"),
      "layer_mid": ("ln_1", "out"), "mlp_input": ("mlp", "in"), "mlp_activation": ("mlp.c_proj", "in"),
      "mlp_neurons": ("mlp.c_proj", "in"), "mlp_output": ("mlp", "out"), "layer_output": ("", "out")}
SUBLAYER = {"attention_premix": "self_attn", "attention_output": "self_attn", "mlp_activation": "mlp",
            "mlp_neurons": "mlp", "mlp_output": "mlp"}

# case -> (model type, changes to the tiny config): the activation is a plain function with GELU; with ReLU it is one
# nn.ReLU module shared by every block's MLP (a hook on it would see every block's call), so the activation is read,
# and checked, as what c_proj reads on both
CASES = {
    "openai-gpt": ("openai-gpt", {}),
    "openai-gpt relu": ("openai-gpt", {"afn": "relu"}),
}


def make(case="openai-gpt", dtype=torch.float32):
    model_type, changes = CASES[case]
    config = BY_MODEL_TYPE[model_type].tiny_config()
    for key, value in changes.items():
        setattr(config, key, value)
    hf_model = build_tiny(config, dtype)
    return StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()), hf_model


def capture(hf_model, case="openai-gpt", ids=IDS):
    """Each block's tensors at the truth's places, and the logits."""
    return capture_once(hf_model, hf_model.transformer.h, AT, ids)


def layer_norm(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_value_equals_the_hooks_and_the_post_norm_identity_holds(case, dtype):
    model, hf_model = make(case, dtype)
    expected, expected_logits = capture(hf_model, case)
    saved = {}
    with torch.no_grad(), model.trace(IDS):
        for i in range(model.num_layers):
            for key in model.order(i):
                owner, _, name = key.rpartition(".")
                if name in AT:
                    saved[(i, name)] = getattr(getattr(model.layers[i], owner) if owner else model.layers[i], name).save()
        logits = model.logits.save()
    assert torch.equal(logits, expected_logits)
    assert set(saved) == set(expected)
    for key, tensor in saved.items():
        assert torch.equal(tensor, expected[key].reshape(tensor.shape)), key
    for i, block in enumerate(hf_model.transformer.h):
        v = {name: saved[(i, name)] for name in AT}
        assert torch.equal(v["layer_mid"], layer_norm(block.ln_1, v["layer_input"] + v["attention_output"]))
        assert torch.equal(v["mlp_input"], v["layer_mid"])
        assert torch.equal(v["layer_output"], layer_norm(block.ln_2, v["layer_mid"] + v["mlp_output"]))
        assert not torch.equal(v["layer_output"], v["layer_input"] + v["attention_output"] + v["mlp_output"])
    assert all(result.exact for result in check_identity(model, IDS))
    for name in ("attention_norm_output", "mlp_norm_output"):
        entry = model.availability(0)[name]
        assert not entry.available and "post-norm" in entry.reason
        with model.trace(IDS):
            assert not hasattr(model.layers[0], name)


def edit(t):
    return t * 0.5 + 0.25


@pytest.mark.parametrize("name", ["layer_input", "attention_output", "layer_mid", "mlp_input", "mlp_neurons",
                                  "mlp_output", "layer_output"])
def test_an_edit_reaches_the_model_as_a_hook_edit(name):
    model, hf_model = make()
    path, side = AT[name]
    block = hf_model.transformer.h[1]
    expected = logits_with_edit(hf_model, block.get_submodule(path) if path else block, side, edit, IDS)
    with torch.no_grad():
        plain = hf_model(input_ids=IDS).logits
    assert not torch.equal(expected, plain)
    for assign in (False, True):
        assert torch.equal(edited_logits(model, IDS, 1, name, SUBLAYER.get(name), edit, assign), expected), (name, assign)


def test_an_edit_of_mlp_input_reaches_the_mlp_alone_and_one_of_layer_mid_the_stream_too():
    model, hf_model = make()
    outputs = {}
    for name in ("mlp_input", "layer_mid"):
        with torch.no_grad(), model.trace(IDS):
            tensor = getattr(model.layers[1], name)
            tensor[:] = tensor * 2  # in place
            outputs[name] = model.layers[1].layer_output.save()
    captured, _ = capture(hf_model)
    with torch.no_grad():
        block = hf_model.transformer.h[1]
        mid = captured[(1, "layer_mid")]
        # the MLP reads the doubled stream, the residual stays the model's
        assert torch.equal(outputs["mlp_input"], layer_norm(block.ln_2, mid + block.mlp(mid * 2)))
        assert torch.equal(outputs["layer_mid"], layer_norm(block.ln_2, mid * 2 + block.mlp(mid * 2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_project_on_vocab_is_the_head_alone_and_there_is_no_final_norm(dtype):
    model, hf_model = make(dtype=dtype)
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)
        assert torch.equal(hf_model.lm_head(last), logits)
    with pytest.raises(AttributeError, match="OpenAI GPT has no final norm"):
        model.ln_final  # noqa: B018
    assert not hasattr(model, "ln_final")
    assert "model.ln_final = none" in repr(model)


def test_the_logit_lens_of_the_last_block_is_the_models_distribution():
    model, hf_model = make()
    probs = logit_lens(model, ["tok5 tok6 tok7"])
    assert probs.shape == (1, model.num_layers, model.vocab_size)
    ids = model.tokenizer(["tok5 tok6 tok7"], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits[0, -1].softmax(-1)
    assert torch.allclose(probs[0, -1], expected, atol=1e-6)
    assert not torch.allclose(probs[0, 0], expected, atol=1e-3)


def test_skip_layers_equals_a_hook_that_makes_the_blocks_identities():
    model, hf_model = make()
    handles = [block.register_forward_hook(lambda m, a, o: [a[0], *o[1:]]) for block in hf_model.transformer.h[1:3]]
    try:
        with torch.no_grad():
            expected = hf_model(input_ids=IDS).logits
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, 1, 2)
        logits = model.logits.save()
    assert torch.equal(logits, expected)


def test_the_attention_internals_are_the_split_projection_and_its_softmax():
    model, hf_model = make()
    model.enable_attention_values()
    attn = hf_model.transformer.h[1].attn
    seen = []
    handle = attn.c_attn.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    try:
        with torch.no_grad(), model.trace(IDS):
            at = model.layers[1].self_attn
            q, k, v = at.queries.save(), at.keys.save(), at.values.save()
            scores, probabilities = at.attention_scores.save(), at.attention_probabilities.save()
            premix = at.attention_premix.save()
    finally:
        handle.remove()
    heads = model.num_heads
    parts = [part.reshape(*part.shape[:2], heads, -1) for part in seen[0].split(model.hidden_size, dim=2)]
    for got, want in zip((q, k, v), parts):
        assert torch.equal(got, want)
    s = IDS.shape[1]
    causal = torch.tril(torch.ones(s, s))
    raw = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) / (v.shape[-1] ** 0.5)
    assert torch.allclose(scores, raw * causal - 1e4 * (1 - causal), atol=1e-5)
    assert torch.equal(probabilities, scores.softmax(-1))
    assert torch.allclose(torch.matmul(probabilities, v.transpose(1, 2)).transpose(1, 2), premix, atol=1e-6)
    with torch.no_grad(), model.trace(IDS):  # each head through the Conv1D output projection, summed: the output
        per_head = head_outputs(model, 1).save()
        output = model.layers[1].self_attn.attention_output.save()
    assert torch.allclose(per_head.sum(2) + attn.c_proj.bias, output, atol=1e-6)


def test_the_default_config_miniature_is_proven():
    torch.manual_seed(0)
    config = miniature_config(CONFIG_MAPPING["openai-gpt"]())
    model = StandardizedTransformer(perturb(AutoModelForCausalLM.from_config(config)).eval(),
                                    tokenizer=tiny_tokenizer(256))  # validate=True: proven on its miniature
    assert all(result.exact for result in check_identity(model))


def test_generation_matches_the_plain_model_and_reads_every_step():
    """No cache: each step runs the whole sequence again, and the blocks' list outputs are read at every step."""
    model, hf_model = make()
    prompt = IDS[:1]
    with torch.no_grad():
        want = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    with torch.no_grad(), model.generate(prompt, max_new_tokens=3, do_sample=False) as tracer:
        outputs = nnsight.save([])
        for _ in tracer.iter[0:3]:
            outputs.append(model.layers[-1].layer_output)
        out = tracer.result.save()
    assert torch.equal(out, want)
    assert [tuple(o.shape) for o in outputs] == [(1, 7 + step, model.hidden_size) for step in range(3)]
