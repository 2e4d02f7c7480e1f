"""Reformer's reversible blocks against plain hooks.

Ground truth, read from transformers' Reformer code: each block is called with the two halves of the stream
(``prev_attn_output=X1``, ``hidden_states=X2``) and returns ``ReformerOutput(hidden_states=Y2, attn_output=Y1)``;
the final norm reads ``cat([Y1, Y2])``, so the stream is ``cat([X1, X2])``. The model pads a sequence to a multiple
of its chunk lengths after the tokens; the hooks see the padded tensors, and the values are their token positions.
The identity is the block's own arithmetic, ``Y1 = X1 + attention``, ``Y2 = X2 + feed_forward(Y1)``.
"""

from __future__ import annotations

import math

import nnsight
import pytest
import torch
from transformers import AutoModelForCausalLM, ReformerConfig
from transformers.models.reformer.modeling_reformer import LocalSelfAttention, LSHSelfAttention

from nnterp import StandardizedTransformer, UnsupportedConfig, ValueUnavailable, logit_lens, skip_layers
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE, family_of
from nnterp.families.reformer import COUNT
from nnterp.proof.miniature import miniature_config
from nnterp.spec.locations import input, output

from ..conftest import build_tiny, perturb, tiny_tokenizer


def chunked_config():
    """The feed-forward run one position at a time, and LSH attention with two rounds of hashing."""
    config = BY_MODEL_TYPE["reformer"].tiny_config()
    config.chunk_size_feed_forward, config.num_hashes = 1, 2
    return config


CASES = {  # name -> (model type, config)
    "reformer": ("reformer", BY_MODEL_TYPE["reformer"].tiny_config),
    "reformer_chunked": ("reformer", chunked_config),
}
PADDED = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])  # 7 tokens: the model pads them to 8
UNPADDED = PADDED[:, :4]  # a multiple of the chunk lengths

# value -> (module path in the block, side, how the tensor is taken from what the hook sees)
TRUTH = {
    "layer_input": ("", "in", lambda args, kwargs: torch.cat((kwargs["prev_attn_output"], kwargs["hidden_states"]),
                                                             dim=-1)),
    "attention_norm_output": ("attention.layer_norm", "out", lambda out: out),
    "attention_premix": ("attention.output.dense", "in", lambda args, kwargs: args[0]),
    "attention_output": ("attention", "out", lambda out: out.hidden_states),
    "mlp_norm_output": ("feed_forward.layer_norm", "out", lambda out: out),
    "mlp_input": ("feed_forward.dense", "in", lambda args, kwargs: args[0]),
    "mlp_activation": ("feed_forward.dense.act_fn", "out", lambda out: out),
    "mlp_neurons": ("feed_forward.output.dense", "in", lambda args, kwargs: args[0]),
    "mlp_output": ("feed_forward", "out", lambda out: out),
    "layer_output": ("", "out", lambda out: torch.cat((out.attn_output, out.hidden_states), dim=-1)),
}
INNER_MLP = ("mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons")


def make(case="reformer", dtype=torch.float32):
    hf = build_tiny(CASES[case][1](), dtype)
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer()), hf  # proven on a miniature at load


def blocks(hf):
    return hf.reformer.encoder.layers


def capture(hf, ids, names):
    """The plain model's tensors at the hooks (the first call of each module: chunked modules run once per chunk),
    the final norm's output, and the logits."""
    captured, handles = {}, []
    for i, block in enumerate(blocks(hf)):
        for name in names:
            path, side, take = TRUTH[name]
            module = block.get_submodule(path) if path else block

            def hook(module, args, kwargs, out=None, key=(i, name), side=side, take=take):
                if key not in captured:
                    captured[key] = (take(args, kwargs) if side == "in" else take(out)).detach().clone()

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True) if side == "in" else
                           module.register_forward_hook(lambda m, a, k, o, hook=hook: hook(m, a, k, o),
                                                        with_kwargs=True))
    def norm(module, args, out):
        captured[("norm", "output")] = out.detach().clone()
    handles.append(hf.reformer.encoder.layer_norm.register_forward_hook(norm))
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


def read_all(model, ids):
    saved = {}
    with torch.no_grad(), model.trace(ids):
        for i in range(model.num_layers):
            for key in model.order(i):
                owner, _, name = key.rpartition(".")
                envoy = getattr(model.layers[i], owner) if owner else model.layers[i]
                saved[(i, name)] = getattr(envoy, name).save()
        logits = model.logits.save()
    return saved, logits


@pytest.mark.parametrize("ids", [PADDED, UNPADDED], ids=["padded", "unpadded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds(case, dtype, ids):
    model, hf = make(case, dtype)
    kinds = {type(block.attention.self_attention) for block in blocks(hf)}
    assert kinds == {LSHSelfAttention, LocalSelfAttention}  # both attentions are proven
    chunked = bool(hf.config.chunk_size_feed_forward)
    names = [name for name in TRUTH if not (chunked and name in INNER_MLP)]
    expected, logits = capture(hf, ids, names)
    saved, read_logits = read_all(model, ids)
    assert torch.equal(read_logits, logits)
    tokens, hidden = ids.shape[1], hf.config.hidden_size
    padded = expected[(0, "layer_input")].shape[1]
    assert padded == (8 if ids is PADDED else tokens)  # the padded pass is the one the model pads
    for (i, name), want in expected.items():
        if i == "norm":
            continue
        assert torch.equal(saved[(i, name)], want[:, :tokens].reshape(saved[(i, name)].shape)), f"layer {i} {name}"
    for i in range(model.num_layers):
        unread = {"layer_mid", *(INNER_MLP if chunked else ())}
        assert unread.isdisjoint(name for layer, name in saved if layer == i)
        x, a, m, y = (saved[(i, name)] for name in ("layer_input", "attention_output", "mlp_output", "layer_output"))
        assert x.shape == (*ids.shape, 2 * hidden)
        assert torch.equal(y, torch.cat((x[..., :hidden] + a, x[..., hidden:] + m), dim=-1))
        if i:
            assert torch.equal(x, saved[(i - 1, "layer_output")])
    assert all(result.exact for result in check_identity(model, ids))
    # the final norm and the head read the last block's [Y1, Y2]: the readout of it is the model's norm and head
    last = saved[(model.num_layers - 1, "layer_output")]
    normed = expected[("norm", "output")][:, :tokens]  # what the model's head runs on: its norm's tokens
    with torch.no_grad():
        assert torch.equal(hf.reformer.encoder.layer_norm(last), normed)
        assert torch.equal(model.project_on_vocab(last), hf.lm_head(normed.contiguous()))
    # and the model's logits, where the model's head reads a tensor of the same layout: on a padded batch it reads
    # a strided slice, which F.linear computes as a matmul then the bias add (one fused addmm on a contiguous one)
    if normed.is_contiguous():
        assert torch.equal(model.project_on_vocab(last), logits)


def test_the_stream_starts_as_the_embeddings_twice():
    model, hf = make()
    with torch.no_grad(), model.trace(PADDED):
        embedded = model.reformer.embeddings.output.save()
        stream = model.layers[0].layer_input.save()
    assert torch.equal(stream, torch.cat((embedded, embedded), dim=-1)[:, : PADDED.shape[1]])


def run_with(hf, module, hook, pre=False, ids=PADDED):
    handle = (module.register_forward_pre_hook(hook, with_kwargs=True) if pre else module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        handle.remove()


def test_edits_and_assignments_reach_the_model_as_hooks_do():
    model, hf = make()
    layers, n, h = blocks(hf), PADDED.shape[1], hf.config.hidden_size
    lsh = [isinstance(block.attention.self_attention, LSHSelfAttention) for block in layers].index(True)
    with torch.no_grad(), model.trace(PADDED):
        clean = model.logits.save()

    # an in-place edit of the joined stream reaches the half it falls in, at the block's input
    with torch.no_grad(), model.trace(PADDED):
        model.layers[1].layer_input[:, -1, :h] += 1
        model.layers[1].layer_input[:, 2, h + 3] = 0
        edited = model.logits.save()

    def input_edit(module, args, kwargs):
        x1, x2 = kwargs["prev_attn_output"].clone(), kwargs["hidden_states"].clone()
        x1[:, n - 1] += 1
        x2[:, 2, 3] = 0
        return args, {**kwargs, "prev_attn_output": x1, "hidden_states": x2}
    assert torch.equal(edited, run_with(hf, layers[1], input_edit, pre=True))
    assert not torch.equal(edited, clean)

    # edited later in the trace, after the attention ran: the model's halves are slices of the joined stream, so the
    # edit reaches what the block still reads of them (the residual add), as it would on a stream held as one tensor
    with torch.no_grad(), model.trace(PADDED):
        stream = model.layers[1].layer_input
        model.layers[1].self_attn.attention_output.save()
        stream[:, 0, :h] += 1
        late = model.logits.save()
    kept = {}

    def keep(module, args, kwargs):
        kept.update(kwargs)

    def edit_after_attention(module, args, out):
        kept["prev_attn_output"][:, 0] += 1
    handle = layers[1].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        assert torch.equal(late, run_with(hf, layers[1].attention, edit_after_attention))
    finally:
        handle.remove()
    assert not torch.equal(late, clean)

    # an assignment of the joined stream replaces both halves (the padding stays the model's: the next block's
    # whole input, padding included, is the hooks')
    with torch.no_grad(), model.trace(PADDED):
        model.layers[2].layer_output = model.layers[2].layer_output * 2
        kwargs = model.layers[3].inputs[1]
        handed_on = nnsight.save([kwargs["prev_attn_output"], kwargs["hidden_states"]])
        doubled = model.logits.save()
    seen = []

    def output_double(module, args, out):
        y2, y1 = out.hidden_states.clone(), out.attn_output.clone()
        y2[:, :n] *= 2
        y1[:, :n] *= 2
        seen.extend((y1, y2))
        return out._replace(hidden_states=y2, attn_output=y1)
    assert torch.equal(doubled, run_with(hf, layers[2], output_double))
    assert handed_on[0].shape[1] == n + 1 and all(map(torch.equal, handed_on, seen))

    # a contribution assigned on an LSH block (the attention's named tuple stays one), and edited in place
    with torch.no_grad(), model.trace(PADDED):
        model.layers[lsh].self_attn.attention_output = model.layers[lsh].self_attn.attention_output * 0.5
        halved = model.logits.save()

    def attention_half(module, args, out):
        a = out.hidden_states.clone()
        a[:, :n] *= 0.5
        return out._replace(hidden_states=a)
    assert torch.equal(halved, run_with(hf, layers[lsh].attention, attention_half))
    with torch.no_grad(), model.trace(PADDED):
        model.layers[0].mlp.mlp_output[:, 3] = 0
        zeroed = model.logits.save()

    def mlp_zero(module, args, out):
        out = out.clone()
        out[:, 3] = 0
        return out
    assert torch.equal(zeroed, run_with(hf, layers[0].feed_forward, mlp_zero))


def test_skipped_blocks_hand_on_their_input():
    model, hf = make()
    layers = blocks(hf)
    with pytest.raises(ValueError, match="use_cache=False"), torch.no_grad(), model.trace(PADDED):
        skip_layers(model, 1, 2)
    with torch.no_grad(), model.trace(PADDED, use_cache=False):  # the model's cache counts on every block
        skip_layers(model, 1, 2)
        skipped = model.logits.save()
    inputs = {}

    def keep(module, args, kwargs):
        inputs.update(kwargs)

    def identity(module, args, out):
        return out._replace(hidden_states=inputs["hidden_states"], attn_output=inputs["prev_attn_output"])
    handles = [layers[1].register_forward_pre_hook(keep, with_kwargs=True), layers[1].register_forward_hook(identity),
               layers[2].register_forward_hook(identity)]
    try:
        with torch.no_grad():
            expected = hf(input_ids=PADDED, attention_mask=torch.ones_like(PADDED)).logits
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(skipped, expected)


def test_generation_steps_read_their_own_tokens_and_edits_reach_them():
    """Without a cache each step runs the whole sequence: 7, 8 then 9 tokens, which the model pads to 8, leaves, and
    pads to 12. (transformers' cached decoding fails on LSH layers by itself.)"""
    model, hf = make()
    prompt, layers = PADDED[:1], blocks(hf)
    outputs = []

    def keep(module, args, out):
        outputs.append(torch.cat((out.attn_output, out.hidden_states), dim=-1))

    def scale_last(module, args, kwargs):
        n, x1 = kwargs["orig_sequence_length"], kwargs["prev_attn_output"].clone()
        x1[:, n - 1] *= 1.5
        return args, {**kwargs, "prev_attn_output": x1}
    heads = []
    handles = [layers[1].register_forward_hook(keep), layers[2].register_forward_pre_hook(scale_last, with_kwargs=True),
               hf.lm_head.register_forward_hook(lambda module, args, out: heads.append(out))]
    try:
        with torch.no_grad():
            want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                               use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert [output.shape[1] for output in outputs] == [8, 8, 12]
    with torch.no_grad(), model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False) as tracer:
        steps, logits = nnsight.save([]), nnsight.save([])
        for _ in tracer.iter[0:3]:
            steps.append(model.layers[1].layer_output)
            model.layers[2].layer_input[:, -1, : hf.config.hidden_size] *= 1.5
            logits.append(model.logits)
        generated = tracer.result.save()
    assert torch.equal(generated, want)
    assert [step.shape[1] for step in steps] == [7, 8, 9]
    for step, full, edited, head in zip(steps, outputs, logits, heads):
        assert torch.equal(step, full[:, : step.shape[1]])
        assert torch.equal(edited, head)
    with torch.no_grad():  # the edit changed the last position's logits
        assert not torch.equal(hf(input_ids=generated[:, :-1]).logits[:, -1], heads[-1][:, -1])


def test_unavailable_values_say_why_and_the_lens_is_the_model_s():
    model, _ = make()
    assert "two tensors at two moments" in model.availability(0)["layer_mid"].reason
    with pytest.raises(ValueUnavailable, match="reversible"), torch.no_grad(), model.trace(PADDED):
        model.layers[0].layer_mid.save()
    with pytest.raises(ValueUnavailable, match="chunk by chunk"):
        model.enable_attention_values()
    with pytest.raises(UnsupportedConfig, match="is_decoder=True"):
        family_of(ReformerConfig(is_decoder=False))
    with pytest.warns(UserWarning, match="hash_seed=0"):  # random hashing: passes differ
        family_of(ReformerConfig(is_decoder=True))
    chunked, _ = make("reformer_chunked")
    assert "chunk by chunk" in chunked.availability(0)["mlp.mlp_activation"].reason
    prompt = "the cat sat on the mat"  # six tokens: the model pads them
    probabilities = logit_lens(model, prompt)
    assert probabilities.shape[:2] == (1, model.num_layers)
    with torch.no_grad():
        own = model._module(**model.tokenizer(prompt, return_tensors="pt")).logits[:, -1].softmax(-1)
    assert torch.allclose(probabilities[:, -1], own, atol=1e-6)


@pytest.mark.parametrize("changes", [{}, {"num_buckets": [64, 128], "axial_pos_shape": [512, 1024],
                                         "num_attention_heads": 2, "max_position_embeddings": 524288}],
                         ids=["default", "factorized_buckets"])
def test_the_default_config_miniature_is_proven(changes):
    """Shrunk, the chunks are shorter than the tokens: the model pads them and hashes them into buckets."""
    config = ReformerConfig(is_decoder=True, hash_seed=0, **changes)
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))
    lsh, local = hf.config.lsh_attn_chunk_length, hf.config.local_attn_chunk_length
    assert PADDED.shape[1] > lsh and PADDED.shape[1] % math.lcm(lsh, local)
    assert all(result.exact for result in check_identity(model, PADDED))


def test_a_joined_value_takes_plain_parts_of_its_own_boundary():
    halves = (input("", arg=0, kwarg="prev_attn_output"), input("", arg=1, kwarg="hidden_states"))
    assert "prev_attn_output, hidden_states joined" in input("", join=halves).describe()
    with pytest.raises(ValueError, match="join reads a new tensor"):
        input("", join=halves, heads=True)
    with pytest.raises(ValueError, match="plain elements of the same boundary"):
        input("", join=(input("attention", kwarg="hidden_states"), halves[1]))
    with pytest.raises(ValueError, match="count views"):
        output("", count=COUNT, prefix=2)
