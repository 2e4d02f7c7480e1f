"""Attention internals of the families that compute attention in their own code (BLOOM, Falcon, GPT-Neo, MPT),
and OPT's unscaled queries, against plain hooks and the models' own math.

Ground truth, independent of nnterp: forward hooks on the unwrapped model capture the projections' outputs and the
attention module's arguments (ALiBi, the mask, the rotary tables); queries, keys and values are split out of them
as transformers' code splits them, and the scores are recomputed with the model's own arithmetic, in float32. The
probabilities are what the model itself returns with ``output_attentions=True``. Edits are compared with the same
edit made by a plain hook.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import nnsight
import pytest
import torch
from transformers.models.falcon.modeling_falcon import FalconAttention, apply_rotary_pos_emb

from nnterp import StandardizedTransformer
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof import problems_of
from nnterp.spec.attention import STANDARD, set_implementation

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES

IDS = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
LAYER = 1
HEAD = 1
# from transformers 5.25 on, Falcon's attention calls transformers' attention interface (nnterp.families.falcon):
# then tests/families/test_attention.py checks it as every standard attention, and its own code's tests skip
_FALCON_OWN = pytest.mark.skipif("attention_interface(" in inspect.getsource(FalconAttention.forward),
                                 reason="the installed transformers' Falcon attention calls the attention interface")


def _cases(*cases):
    return [pytest.param(case, marks=_FALCON_OWN) if case.startswith("falcon") else case for case in cases]


FAMILY_CASES = _cases("bloom", "mpt", "gpt_neo", "falcon_7b_parallel", "falcon_rw_alibi", "falcon_rw_rope",
                      "falcon_40b_two_norms", "falcon_new_one_norm", "opt")
INTERNALS = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
# the attention module whose arguments the truth needs, and the projection(s) queries, keys and values come from
MODULES = {"bloom": ("self_attention", "self_attention.query_key_value"), "mpt": ("attn", "attn.Wqkv"),
           "gpt_neo": ("attn.attention", "attn.attention.q_proj"), "opt": ("self_attn", "self_attn.q_proj")}
# where a dropout module follows the softmax, a plain hook can edit the probabilities
DROPOUT = {"bloom": "self_attention.attention_dropout", "falcon_rw_alibi": "self_attention.attention_dropout",
           "gpt_neo": "attn.attention.attn_dropout"}


def modules(case):
    return ("self_attention", "self_attention.query_key_value") if case.startswith("falcon") else MODULES[case]


def make(case):
    hf = build_tiny(CASES[case][0]())
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), attention_values=True), hf


def eager(hf, **forward):
    own = hf.config._attn_implementation
    set_implementation(hf, "eager")
    try:
        with torch.no_grad():
            return hf(input_ids=IDS, attention_mask=torch.ones_like(IDS), **forward)
    finally:
        set_implementation(hf, own)


def with_hooks(hf, hooks, **forward):
    """The eager model's output with ``hooks`` ({path: (kind, fn)}) on block LAYER."""
    block = hf.get_submodule(BY_MODEL_TYPE[hf.config.model_type].layers)[LAYER]
    handles = []
    for path, (kind, fn) in hooks.items():
        module = block.get_submodule(path)
        if kind == "pre":
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(fn))
    try:
        return eager(hf, **forward)
    finally:
        for handle in handles:
            handle.remove()


def split_heads(case, hf, fused):
    """Queries, keys and values ``[batch, seq, heads, head_dim]`` out of the projection's output, as the code splits."""
    config = hf.config
    b, s, _ = fused.shape
    heads = model_heads(hf)
    hd = config.hidden_size // heads
    if case == "mpt":
        return [t.reshape(b, s, heads, hd) for t in fused.chunk(3, dim=2)]
    if case == "bloom" or (case.startswith("falcon") and not config.new_decoder_architecture and not config.multi_query):
        f = fused.view(b, s, heads, 3, hd)
        return f[..., 0, :], f[..., 1, :], f[..., 2, :]
    if config.new_decoder_architecture:
        qkv = fused.view(b, s, -1, heads // config.num_kv_heads + 2, hd)
        q = qkv[:, :, :, :-2]
        k, v = (torch.broadcast_to(qkv[:, :, :, [i]], q.shape) for i in (-2, -1))
        return [t.flatten(2, 3) for t in (q, k, v)]
    f = fused.view(b, s, heads + 2, hd)  # Falcon's multi-query
    return f[..., :-2, :], f[..., [-2], :], f[..., [-1], :]


def truth(case, hf):
    """The internals of block LAYER, from hooks and the model's own arithmetic, and the model's probabilities."""
    attention_path, projection = modules(case)
    got = {}

    def arguments(m, args, kwargs):
        got["args"] = inspect.signature(type(m).forward).bind(m, *args, **kwargs).arguments
        got["module"] = m

    def projected(m, args, out):
        got[m] = out.detach().clone()

    hooks = {attention_path: ("pre", arguments), projection: ("post", projected)}
    if case in ("gpt_neo", "opt"):
        hooks |= {f"{attention_path}.{p}": ("post", projected) for p in ("k_proj", "v_proj")}
    out = with_hooks(hf, hooks, output_attentions=True)
    attn, a = got["module"], got["args"]
    if case in ("gpt_neo", "opt"):
        heads = attn.num_heads if hasattr(attn, "num_heads") else hf.config.num_attention_heads
        q, k, v = (got[getattr(attn, p)].unflatten(-1, (heads, -1)) for p in ("q_proj", "k_proj", "v_proj"))
    else:
        q, k, v = split_heads(case, hf, got[attn.get_submodule(projection.rpartition(".")[2])])
    b, s, h, hd = q.shape
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, s, hd]
    if case == "bloom":
        scores = a["alibi"].baddbmm(batch1=qh.reshape(b * h, s, hd), batch2=kh.reshape(b * h, s, hd).transpose(-1, -2),
                                    beta=attn.beta, alpha=attn.inv_norm_factor).view(b, h, s, s) + a["attention_mask"]
    elif case == "mpt":
        bias = a["position_bias"]
        bias = bias[:, max(0, bias.size(1) - s):, max(0, bias.size(2) - s):]
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * attn.softmax_scale + bias
        scores = scores.masked_fill(a["attention_mask"], torch.finfo(q.dtype).min)
    elif case == "gpt_neo":
        scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2))
        scores = torch.where(attn.bias[:, :, :s, :s], scores, torch.finfo(scores.dtype).min)
        if a.get("attention_mask") is not None:
            scores = scores + a["attention_mask"]
    elif case == "opt":  # OPT's own order: q_proj(h) * scaling, then matmul * 1.0
        scores = torch.matmul(qh * attn.scaling, kh.transpose(2, 3)) * 1.0 + a["attention_mask"]
    elif hf.config.alibi:
        scores = (qh @ kh.transpose(-1, -2) + a["alibi"].view(b, h, 1, -1)) * attn.inv_norm_factor + a["attention_mask"]
    else:  # Falcon with rotary embeddings: queries and keys after them
        qh, kh = apply_rotary_pos_emb(qh, kh, *a["position_embeddings"])
        scores = qh @ kh.transpose(-1, -2)
        scores /= math.sqrt(hd)
        scores = scores + a["attention_mask"]
        q, k = qh.transpose(1, 2), kh.transpose(1, 2)
    return {"queries": q, "keys": k, "values": v, "attention_scores": scores,
            "attention_probabilities": out.attentions[LAYER]}


def read(model, edited=None, edit=None):
    """Block LAYER's internals and the logits, in one trace; ``edit`` changes the value ``edited`` in place as soon
    as it is read (before the model goes on)."""
    with torch.no_grad(), model.trace(IDS):
        attn = model.layers[LAYER].self_attn
        saved = nnsight.save({})
        for name in INTERNALS:
            saved[name] = getattr(attn, name)
            if name == edited:
                edit(saved[name])
        saved["logits"] = model.logits
    return saved


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_internals_equal_the_hooks_and_the_models_math(case):
    model, hf = make(case)
    expected = truth(case, hf)
    saved = read(model)
    for name in ("queries", "keys", "values"):
        assert torch.equal(saved[name], expected[name]), name
    torch.testing.assert_close(saved["attention_scores"], expected["attention_scores"].to(saved["attention_scores"].dtype),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(saved["attention_probabilities"], expected["attention_probabilities"])
    assert torch.equal(saved["logits"], eager(hf).logits)  # reading them changes nothing
    assert saved["queries"].shape[2] == model.num_heads


def test_opt_queries_are_the_unscaled_query_projection():
    model, hf = make("opt")
    captured = {}
    q_proj = hf.model.decoder.layers[LAYER].self_attn.q_proj
    handle = q_proj.register_forward_hook(lambda m, a, out: captured.setdefault("q", out.detach().clone()))
    try:
        eager(hf)
    finally:
        handle.remove()
    queries = read(model)["queries"]
    assert torch.equal(queries, captured["q"].view(queries.shape))  # [batch, seq, heads, head_dim], not pre-scaled
    assert model.availability(LAYER)["self_attn.queries"].location.startswith("self_attn.source.self_q_proj_0.output")


def test_the_proof_catches_pre_scaled_queries(monkeypatch):
    """Reading OPT's queries where its attention function gets them (already scaled, with scaling=1.0) is refused."""
    assert problems_of(make("opt")[0]) == []
    monkeypatch.setitem(BY_MODEL_TYPE, "opt", dataclasses.replace(BY_MODEL_TYPE["opt"], attention_internals=STANDARD))
    hf = build_tiny(CASES["opt"][0]())
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), attention_values=True, validate=False)
    problems = problems_of(model)
    assert problems and all("read after the model scaled the queries" in p for p in problems)


def zero_query_in_projection(case, hf):
    """A hook zeroing head HEAD's queries in the projection's output (what the attention splits them from)."""
    def hook(m, args, out):
        out = out.clone()
        heads = model_heads(hf)
        hd = hf.config.hidden_size // heads
        if case in ("gpt_neo", "opt", "mpt"):
            out[..., HEAD * hd:(HEAD + 1) * hd] = 0  # MPT's queries are the first third of Wqkv's output
        elif case.startswith("falcon") and hf.config.new_decoder_architecture:  # [kv heads, its query heads + k + v]
            groups = heads // hf.config.num_kv_heads
            out.view(*out.shape[:2], -1, groups + 2, hd)[:, :, HEAD // groups, HEAD % groups] = 0
        else:
            split_heads(case, hf, out)[0][:, :, HEAD] = 0  # a view of the fused output
        return out
    return hook


def model_heads(hf):
    config = hf.config
    return config.num_attention_heads if hasattr(config, "num_attention_heads") else config.n_heads


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_zeroing_a_query_reaches_the_model_as_a_hook_edit(case):
    model, hf = make(case)
    clean = read(model)["logits"]

    def zero(queries):
        queries[:, :, HEAD] = 0

    edited = read(model, "queries", zero)
    expected = with_hooks(hf, {modules(case)[1]: ("post", zero_query_in_projection(case, hf))}).logits
    assert torch.equal(edited["logits"], expected)
    assert not torch.equal(edited["logits"], clean)
    assert (edited["queries"][:, :, HEAD] == 0).all()


@pytest.mark.parametrize("case", _cases(*sorted(DROPOUT)))
def test_scaling_a_heads_probabilities_reaches_the_model_as_a_hook_edit(case):
    model, hf = make(case)
    clean = read(model)["logits"]

    def scale(probabilities):
        probabilities[:, HEAD] *= 0.5

    edited = read(model, "attention_probabilities", scale)["logits"]

    def hook(m, args, out):
        out = out.clone()
        out[:, HEAD] *= 0.5
        return out

    expected = with_hooks(hf, {DROPOUT[case]: ("post", hook)}).logits
    assert torch.equal(edited, expected)
    assert not torch.equal(edited, clean)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_probabilities_mix_the_values_into_the_heads_outputs(case):
    model, _ = make(case)
    with torch.no_grad(), model.trace(IDS):
        attn = model.layers[LAYER].self_attn
        values, probs = attn.values.save(), attn.attention_probabilities.save()
        premix = attn.attention_premix.save()
    groups = probs.shape[1] // values.shape[2]
    mixed = probs @ values.transpose(1, 2).repeat_interleave(groups, dim=1)
    torch.testing.assert_close(mixed.transpose(1, 2), premix, rtol=1e-5, atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert (probs[..., torch.triu(torch.ones(IDS.shape[1], IDS.shape[1], dtype=torch.bool), 1)] == 0).all()
