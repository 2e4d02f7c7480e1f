"""OPT with ``do_layer_norm_before=False`` (OPT-350m): post-norm blocks, no final norm, project_in/out, against hooks.

Ground truth: forward hooks on the unwrapped model at the boundaries of transformers' ``OPTDecoderLayer.forward``,
post-norm branch (``a = self_attn(x)[0]; n = self_attn_layer_norm(x + a)``; flattened to ``[batch * seq, hidden]``:
``m = fc2(activation_fn(fc1(n))); y = final_layer_norm(n + m)``), and ``OPTDecoder.forward`` after the blocks (no
``final_layer_norm`` then; ``project_out`` where ``word_embed_proj_dim != hidden_size``; then ``lm_head``). The
identity is that arithmetic, written here with ``torch.nn.functional.layer_norm`` and the blocks' norm weights.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, OPTConfig

from nnterp import StandardizedTransformer
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config
from nnterp.tools.lens import logit_lens

from ..conftest import build_tiny, edited_logits, perturb, tiny_tokenizer
from ..hooks import capture_once, logits_with_edit

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
DTYPES = [torch.float32, torch.bfloat16]

# value -> (module relative to the block, side); the MLP's modules see the stream flattened to [batch * seq, ...]
AT = {"layer_input": ("", "in"), "attention_premix": ("self_attn.out_proj", "in"),
      "attention_output": ("self_attn", "out"), "layer_mid": ("self_attn_layer_norm", "out"), "mlp_input": ("fc1", "in"),
      "mlp_activation": ("activation_fn", "out"), "mlp_neurons": ("fc2", "in"), "mlp_output": ("fc2", "out"),
      "layer_output": ("", "out")}
SUBLAYER = {"attention_premix": "self_attn", "attention_output": "self_attn", "mlp_activation": "mlp",
            "mlp_neurons": "mlp", "mlp_output": "mlp"}

# case -> changes to the OPT tiny config (hidden 64): OPT-350m's shape, embeddings narrower than the stream
# (project_in / project_out), and a post-norm model whose embeddings are the stream's width
CASES = {
    "opt-350m": {"do_layer_norm_before": False, "word_embed_proj_dim": 32},
    "opt post-norm": {"do_layer_norm_before": False},
}


def config_of(changes):
    config = BY_MODEL_TYPE["opt"].tiny_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def make(case="opt-350m", dtype=torch.float32):
    hf_model = build_tiny(config_of(CASES[case]), dtype)
    return StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()), hf_model


def hook_input(module, record):
    """A pre-hook recording the module's stream argument (positional or ``hidden_states``)."""
    return module.register_forward_pre_hook(
        lambda m, a, k: record(a[0] if a else k["hidden_states"]), with_kwargs=True)


def capture(hf_model, ids=IDS):
    """Each block's tensors at the truth's places, and the logits."""
    return capture_once(hf_model, hf_model.model.decoder.layers, AT, ids)


def layer_norm(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_value_equals_the_hooks_and_the_post_norm_identity_holds(case, dtype):
    model, hf_model = make(case, dtype)
    expected, expected_logits = capture(hf_model)
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
    for i, block in enumerate(hf_model.model.decoder.layers):
        v = {name: saved[(i, name)] for name in AT}
        assert v["layer_output"].shape == (*IDS.shape, model.hidden_size)
        assert torch.equal(v["layer_mid"], layer_norm(block.self_attn_layer_norm, v["layer_input"] + v["attention_output"]))
        assert torch.equal(v["mlp_input"], v["layer_mid"])
        assert torch.equal(v["layer_output"], layer_norm(block.final_layer_norm, v["layer_mid"] + v["mlp_output"]))
        assert not torch.equal(v["layer_output"], v["layer_input"] + v["attention_output"] + v["mlp_output"])
    assert all(result.exact for result in check_identity(model, IDS))
    for name in ("attention_norm_output", "mlp_norm_output"):
        entry = model.availability(0)[name]
        assert not entry.available and "post-norm" in entry.reason
        with model.trace(IDS):
            assert not hasattr(model.layers[0], name)


def edit(t):
    return t * 0.5 + 0.25


@pytest.mark.parametrize("name", ["layer_input", "attention_premix", "attention_output", "layer_mid", "mlp_input",
                                  "mlp_activation", "mlp_neurons", "mlp_output", "layer_output"])
def test_an_edit_reaches_the_model_as_a_hook_edit(name):
    model, hf_model = make()
    path, side = AT[name]
    block = hf_model.model.decoder.layers[1]
    expected = logits_with_edit(hf_model, block.get_submodule(path) if path else block, side, edit, IDS)
    with torch.no_grad():
        plain = hf_model(input_ids=IDS).logits
    assert not torch.equal(expected, plain)
    for assign in (False, True):
        assert torch.equal(edited_logits(model, IDS, 1, name, SUBLAYER.get(name), edit, assign), expected), (name, assign)


@pytest.mark.parametrize("name", ["mlp_neurons", "mlp_output"])
def test_a_value_the_block_flattens_takes_an_assigned_tensor_of_any_layout(name):
    """Viewed as [batch, seq, ...] over the block's [batch * seq, ...]: an assigned tensor laid out otherwise in
    memory (a transpose made contiguous and transposed back: the same values) reaches the model as the hook edit."""
    model, hf_model = make()
    path, side = AT[name]
    expected = logits_with_edit(hf_model, hf_model.model.decoder.layers[1].get_submodule(path), side, edit, IDS)

    def strided(t):
        value = edit(t).transpose(0, 1).contiguous().transpose(0, 1)
        assert not value.is_contiguous()
        return value

    assert torch.equal(edited_logits(model, IDS, 1, name, SUBLAYER.get(name), strided, True), expected)


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
        block = hf_model.model.decoder.layers[1]
        mid = captured[(1, "layer_mid")]

        def mlp(x):
            return block.fc2(block.activation_fn(block.fc1(x)))

        # the MLP reads the doubled stream, the residual stays the model's
        assert torch.equal(outputs["mlp_input"], layer_norm(block.final_layer_norm, mid + mlp(mid * 2)))
        assert torch.equal(outputs["layer_mid"], layer_norm(block.final_layer_norm, mid * 2 + mlp(mid * 2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_project_on_vocab_of_the_last_block_is_the_logits_through_project_out_and_there_is_no_final_norm(dtype):
    model, hf_model = make(dtype=dtype)
    decoder = hf_model.model.decoder
    assert decoder.final_layer_norm is None and decoder.project_out is not None and decoder.project_in is not None
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    assert last.shape[-1] == model.hidden_size != hf_model.config.word_embed_proj_dim
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)
        assert torch.equal(hf_model.lm_head(decoder.project_out(last)), logits)
    with pytest.raises(AttributeError, match="OPT has no final norm.*project_out"):
        model.ln_final  # noqa: B018
    assert "model.ln_final = none" in repr(model) and "lm_head (reading model.decoder.project_out's output)" in repr(model)


@pytest.mark.parametrize("changes", [{"word_embed_proj_dim": 32}, {"_remove_final_layer_norm": True}], ids=str)
def test_a_pre_norm_readout_runs_what_the_decoder_runs_after_its_blocks(changes):
    """Pre-norm OPT, with project_out after the final norm, or with the final norm removed (the config's own flag)."""
    hf_model = build_tiny(config_of(changes))
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    decoder = hf_model.model.decoder
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        normed = decoder.final_layer_norm(last) if decoder.final_layer_norm is not None else last
        expected = hf_model.lm_head(decoder.project_out(normed) if decoder.project_out is not None else normed)
        assert torch.equal(expected, logits)
        assert torch.equal(model.project_on_vocab(last), logits)
    assert (decoder.final_layer_norm is None) == ("_remove_final_layer_norm" in changes)


def test_the_logit_lens_is_each_blocks_output_through_project_out_and_the_head():
    model, hf_model = make()
    probs = logit_lens(model, ["tok5 tok6 tok7"])
    assert probs.shape == (1, model.num_layers, model.vocab_size)
    ids = model.tokenizer(["tok5 tok6 tok7"], return_tensors="pt").input_ids
    captured, logits = capture(hf_model, ids)
    with torch.no_grad():
        for i in range(model.num_layers):
            stream = captured[(i, "layer_output")][0, -1]
            expected = hf_model.lm_head(hf_model.model.decoder.project_out(stream)).softmax(-1)
            assert torch.allclose(probs[0, i], expected, atol=1e-6), i
    assert torch.allclose(probs[0, -1], logits[0, -1].softmax(-1), atol=1e-6)


def test_the_opt_350m_config_miniature_is_proven():
    """OPT-350m's config shape (post-norm, 512-wide embeddings projected to a 1024-wide stream), on its miniature."""
    torch.manual_seed(0)
    config = miniature_config(OPTConfig(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                                        word_embed_proj_dim=512, do_layer_norm_before=False))
    hf_model = perturb(AutoModelForCausalLM.from_config(config)).eval()
    assert hf_model.model.decoder.project_out is not None and hf_model.model.decoder.final_layer_norm is None
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer(256))  # validate=True: proven on its miniature
    assert all(result.exact for result in check_identity(model, IDS))
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    assert torch.equal(model.project_on_vocab(last), logits)


def test_generation_matches_the_plain_model_and_reads_every_step():
    model, hf_model = make()
    prompt = IDS[:1]
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    steps = []
    handle = hf_model.model.decoder.layers[1].fc1.register_forward_pre_hook(lambda m, a: steps.append(a[0].clone()))
    try:
        with torch.no_grad():
            want = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    finally:
        handle.remove()
    with torch.no_grad(), model.generate(prompt, **options) as tracer:
        read = nnsight.save([])
        for _ in tracer.iter[0:3]:
            read.append(model.layers[1].mlp_input)
        out = tracer.result.save()
    assert torch.equal(out, want)
    assert len(read) == len(steps) == 3
    for got, truth in zip(read, steps):
        assert torch.equal(got, truth.reshape(got.shape))


def test_the_attention_internals_are_read_from_the_unnormed_stream():
    """The post-norm attention projects ``layer_input`` itself: queries (unscaled, as on every family: the model
    scales them after), keys and values are q_proj, k_proj and v_proj of it, per head; the probabilities mix the
    values into attention_premix."""
    model, hf_model = make()
    model.enable_attention_values()  # proven on the miniature, with the internals
    attn = hf_model.model.decoder.layers[1].self_attn
    seen = {}
    handles = [getattr(attn, name).register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, o.clone()))
               for name in ("q_proj", "k_proj", "v_proj")]
    handles.append(hook_input(hf_model.model.decoder.layers[1], lambda t: seen.__setitem__("input", t.clone())))
    try:
        with torch.no_grad(), model.trace(IDS):
            at = model.layers[1].self_attn
            q, k, v = at.queries.save(), at.keys.save(), at.values.save()
            probabilities, premix = at.attention_probabilities.save(), at.attention_premix.save()
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        assert torch.equal(attn.q_proj(seen["input"]), seen["q_proj"])  # the attention reads the block input as is
    heads = model.num_heads
    for got, want in ((q, seen["q_proj"]), (k, seen["k_proj"]), (v, seen["v_proj"])):
        assert torch.equal(got, want.view(*want.shape[:2], heads, -1))
    assert torch.allclose(probabilities.sum(-1), torch.ones(()), atol=1e-6)
    mixed = torch.matmul(probabilities, v.transpose(1, 2)).transpose(1, 2)
    assert torch.allclose(mixed, premix, atol=1e-6)
