"""Inside the attention: queries, keys, values, scores, probabilities, heads — against the math and hooks."""

from __future__ import annotations

import math
import re

import nnsight
import pytest
import torch

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.locations import Unavailable

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS

SUPPORTED = [case for case, (config, *_) in CASES.items()
             if not isinstance(BY_MODEL_TYPE[config().model_type].attention_of(config().get_text_config()), Unavailable)]
OWN = [case for case in CASES if case not in SUPPORTED]
INTERNALS = ("queries", "keys", "values", "attention_scores", "attention_probabilities", "attention_premix")


def make(case, attention_values=True):
    hf = build_tiny(CASES[case][0]())
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), attention_values=attention_values), hf


def read(model, layer):
    with torch.no_grad(), model.trace(IDS):
        attn = model.layers[layer].self_attn
        saved = nnsight.save({name: getattr(attn, name) for name in INTERNALS})
        saved["logits"] = model.logits
    return saved


def eager_logits(hf):
    """Ground truth: the model's own eager attention, no nnterp involved."""
    own = hf.config.get_text_config()._attn_implementation
    from nnterp.spec.attention import set_implementation

    set_implementation(hf, "eager")
    try:
        with torch.no_grad():
            return hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        set_implementation(hf, own)


@pytest.mark.parametrize("case", SUPPORTED)
def test_attention_internals_follow_the_math(case):
    model, hf = make(case)
    layer = 1
    saved = read(model, layer)
    q, k, v = saved["queries"], saved["keys"], saved["values"]
    probs, scores = saved["attention_probabilities"], saved["attention_scores"]
    batch, seq, heads, _ = q.shape
    assert heads == model.num_heads and probs.shape[:3] == (batch, heads, seq)
    # the model's output is the model's own eager attention's: bit for bit, except where the family's
    # eager code orders an operation differently (GPT-BigCode's multi-query keys, DeepSeek-V4's compressed ones)
    if case in ("gpt_bigcode", "deepseek_v4"):
        assert torch.allclose(saved["logits"], eager_logits(hf), atol=1e-5)
    else:
        assert torch.equal(saved["logits"], eager_logits(hf))
    # causal: nothing attends to the future
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    assert (probs[..., :seq][..., future] == 0).all()
    groups = heads // k.shape[2]
    k_all = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    v_all = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    config = hf.config.get_text_config()
    sinks = getattr(model.layers[layer].self_attn._module, "sinks", None)
    softcap = getattr(config, "attn_logit_softcapping", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and (layer_types is None or layer_types[layer] == "sliding_attention"):
        positions = torch.arange(seq)
        future = future | (positions[:, None] - positions[None, :] >= window)  # outside the sliding window
    learned_mask = case.startswith("doge")  # Doge adds a learned dynamic mask to the scores
    # softmax(q·kᵀ·scale + mask), recomputed from the saved queries and keys (unscaled on every family: OPT's too)
    scale = getattr(model.layers[layer].self_attn._module, "scaling", None)  # (own-code attentions keep it elsewhere)
    alibi = getattr(config, "alibi", False)  # Falcon on transformers 5.25: ALiBi comes in the mask, scale is set
    if sinks is None and softcap is None and probs.shape[-1] == seq and not learned_mask and scale is not None \
            and not alibi:
        logits = (q.transpose(1, 2).double() @ k_all.transpose(2, 3).double()) * scale
        expected = logits.masked_fill(future, -math.inf).softmax(dim=-1)
        assert torch.allclose(probs.double(), expected, atol=1e-5)
    if sinks is None:
        assert torch.allclose(probs.sum(dim=-1), torch.ones(()), atol=1e-5)
        assert torch.allclose(probs, scores.float().softmax(dim=-1).to(probs.dtype), atol=1e-6)
    else:  # attention sinks take part of every row
        assert (probs.sum(dim=-1) < 1).all()
    # probabilities · values, reassembled per head, is the heads' output before the projection
    if BY_MODEL_TYPE[CASES[case][0]().model_type].premix_is_not_mixed_values:
        return
    assert torch.allclose((probs @ v_all[:, :, : probs.shape[-1]]).transpose(1, 2), saved["attention_premix"], atol=1e-5)


@pytest.mark.parametrize("case", [c for c in SUPPORTED if c not in ("deepseek_v4", "jetmoe")])  # jetmoe: below
def test_head_outputs_sum_to_the_projection_and_ablation_matches_hooks(case):
    model, hf = make(case, attention_values=False)  # per-head outputs need no internals
    location = model.block_spec(1).resolve("attention_premix")
    projection = location.module(model.layers[1]._module)
    captured = {}
    handle = projection.register_forward_hook(lambda m, a, out: captured.setdefault("out", out.detach().clone()))
    try:
        with torch.no_grad():
            hf(input_ids=IDS, attention_mask=torch.ones_like(IDS))
    finally:
        handle.remove()
    with torch.no_grad(), model.trace(IDS):
        per_head = model.head_outputs(1).save()
    bias = projection.bias if projection.bias is not None else 0
    assert per_head.shape[2] == model.num_heads
    assert torch.allclose(per_head.sum(dim=2) + bias, captured["out"], atol=1e-5)

    with torch.no_grad(), model.trace(IDS):
        model.scale_heads(1, [2], 0.0)
        ablated = model.logits.save()

    def zero_head(mod, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        size = x.shape[-1] // model.num_heads
        x[..., 2 * size: 3 * size] = 0
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = projection.register_forward_pre_hook(zero_head, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()
    assert torch.equal(ablated, expected)
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    assert not torch.equal(ablated, clean)


@pytest.mark.parametrize("case", ["llama", "gpt2", "gemma2", "gpt_oss"])
def test_editing_probabilities_and_queries_reaches_the_output(case):
    model, _ = make(case)
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        values = model.layers[1].self_attn.values.save()
        probs = model.layers[1].self_attn.attention_probabilities
        eye = torch.eye(probs.shape[-2], probs.shape[-1], dtype=probs.dtype)
        model.layers[1].self_attn.attention_probabilities = eye.expand_as(probs).clone()  # each token reads itself
        premix = model.layers[1].self_attn.attention_premix.save()
        edited = model.logits.save()
    groups = model.num_heads // values.shape[2]
    assert torch.equal(premix, values.repeat_interleave(groups, dim=2))
    assert not torch.equal(edited, clean)
    with torch.no_grad(), model.trace(IDS):
        model.layers[0].self_attn.queries[:] = 0  # uniform attention over the prefix
        probs0 = model.layers[0].self_attn.attention_probabilities.save()
        zeroed = model.logits.save()
    assert not torch.equal(zeroed, clean)
    if case != "gpt_oss":  # equal scores: every position the mask allows gets the same share (sinks aside)
        for row in probs0[0, 0]:
            allowed = row[row > 0]
            assert torch.allclose(allowed, torch.full_like(allowed, 1 / len(allowed)), atol=1e-5)


def test_off_by_default_with_a_clear_error():
    model, _ = make("llama", attention_values=False)
    assert not hasattr(model.layers[0].self_attn, "attention_probabilities")
    with pytest.raises(ValueUnavailable, match="attention_values=True"):
        with model.trace(IDS):
            model.layers[0].self_attn.queries.save()
    assert "self_attn.queries" not in model.order(0)
    model.enable_attention_values()
    assert model.order(0)["self_attn.queries"] < model.order(0)["self_attn.attention_scores"]
    with torch.no_grad(), model.trace(IDS):
        probs = model.layers[0].self_attn.attention_probabilities.save()
    assert probs.shape == (2, 4, 7, 7)
    model.disable_attention_values()
    assert model._module.config._attn_implementation != "nnterp"


@pytest.mark.parametrize("case", OWN)
def test_families_with_their_own_attention_say_so(case):
    model, _ = make(case, attention_values=False)
    own = "its own code"
    with pytest.raises(ValueUnavailable, match=own):
        model.enable_attention_values()
    assert re.search(own, str(model.availability(0)["self_attn.attention_probabilities"]))


def test_two_wrappers_of_one_model_keep_their_own_attention_setting():
    """Turning the values on in one wrapper changes neither the bare model nor another wrapper of it."""
    hf = build_tiny(CASES["llama"][0]())
    own = hf.config._attn_implementation
    with_values = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), attention_values=True)
    without = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    assert hf.config._attn_implementation == own
    with torch.no_grad(), with_values.trace(IDS):
        probs = with_values.layers[1].self_attn.attention_probabilities.save()
    assert hf.config._attn_implementation == own
    with pytest.raises(ValueUnavailable, match="attention_values=True"):
        with without.trace(IDS):
            without.layers[1].self_attn.attention_probabilities.save()
    with_values.disable_attention_values()
    without.enable_attention_values()
    with torch.no_grad(), without.trace(IDS):
        again = without.layers[1].self_attn.attention_probabilities.save()
    assert torch.equal(probs, again) and hf.config._attn_implementation == own
    with torch.no_grad():
        assert torch.equal(hf(input_ids=IDS).logits, eager_logits(hf)) or own != "eager"


def test_jetmoe_serves_its_slots_as_the_attention_function_sees_them(monkeypatch):
    """JetMoE's attention is one eager attention over (expert slot x key-value head) slots: each value inside it is
    the tensor transformers' own attention function receives or returns (recorded by wrapping that function, no
    nnterp involved), and an edit of a slot's output reaches the model as the same edit made in that function."""
    from transformers.models.jetmoe import modeling_jetmoe

    model, hf = make("jetmoe")
    config = hf.config
    slots = config.num_experts_per_tok * config.num_key_value_heads
    eager = modeling_jetmoe.eager_attention_forward

    def plain_run(edit=None):
        """The plain model in eager attention, its attention function wrapped: what it saw, and the logits."""
        recorded = {}

        def attention(module, query, key, value, attention_mask, **kwargs):
            out, weights = eager(module, query, key, value, attention_mask, **kwargs)
            if edit is not None and module.layer_idx == 1:
                out = edit(out.clone())
            recorded[module.layer_idx] = {"queries": query.transpose(1, 2), "keys": key.transpose(1, 2),
                                          "values": value.transpose(1, 2), "attention_probabilities": weights,
                                          "attention_premix": out}
            return out, weights

        monkeypatch.setattr(modeling_jetmoe, "eager_attention_forward", attention)
        try:
            return recorded, eager_logits(hf)
        finally:
            monkeypatch.setattr(modeling_jetmoe, "eager_attention_forward", eager)

    def zero_slot(out):
        out[:, :, 1] = 0
        return out

    expected, clean = plain_run()
    _, wanted = plain_run(zero_slot)
    for layer in range(model.num_layers):
        saved = read(model, layer)
        assert saved["queries"].shape == (*IDS.shape, slots, config.kv_channels) and slots == model.num_heads
        assert saved["attention_probabilities"].shape == (IDS.shape[0], slots, IDS.shape[1], IDS.shape[1])
        for name, want in expected[layer].items():
            assert torch.equal(saved[name], want), (layer, name)
    with pytest.raises(ValueUnavailable, match="not mixed by one linear output projection"):
        with torch.no_grad(), model.trace(IDS):
            model.head_outputs(1).save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].self_attn.attention_premix[:, :, 1] = 0
        edited = model.logits.save()
    assert torch.equal(edited, wanted) and not torch.equal(edited, clean)
