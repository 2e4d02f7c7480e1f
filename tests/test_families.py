"""The family matrix: every standard value against plain PyTorch hooks, the identity, edits.

Ground truth is independent of nnterp: the module boundaries below are written from the
reference survey of transformers' code, captured with ``register_forward_(pre_)hook`` on
the unwrapped HF model, and the identities are the families' own arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError
from transformers import GPTNeoXConfig

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.families import FAMILIES, BY_MODEL_TYPE

from .conftest import build_tiny, tiny_tokenizer

# value -> (module path relative to the block, "in" | "out"); None where the value has no meaning
PRE_NORM = lambda ln1, attn, o_proj, ln2, mlp, act, down: {  # noqa: E731
    "layer_input": ("", "in"), "attention_norm_output": (ln1, "out"), "attention_premix": (o_proj, "in"),
    "attention_output": (attn, "out"), "layer_mid": (ln2, "in"), "mlp_norm_output": (ln2, "out"),
    "mlp_input": (mlp, "in"), "mlp_activation": (act, "out"), "mlp_neurons": (down, "in"),
    "mlp_output": (mlp, "out"), "layer_output": ("", "out"),
}
LLAMA = PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                 "mlp.act_fn", "mlp.down_proj")
NEOX_SEQ = PRE_NORM("input_layernorm", "attention", "attention.dense", "post_attention_layernorm", "mlp",
                    "mlp.act", "mlp.dense_4h_to_h")
seq = lambda x, a, m: (x + a) + m  # noqa: E731

# case -> (config factory, truth, layer formula in the code's order of addition, block output is a tuple)
CASES = {
    "gpt2": (BY_MODEL_TYPE["gpt2"].tiny_config,
             PRE_NORM("ln_1", "attn", "attn.c_proj", "ln_2", "mlp", "mlp.act", "mlp.c_proj"), seq, False),
    "gptj": (BY_MODEL_TYPE["gptj"].tiny_config,
             {**PRE_NORM("ln_1", "attn", "attn.out_proj", None, "mlp", "mlp.act", "mlp.fc_out"),
              "layer_mid": None, "mlp_norm_output": ("ln_1", "out")},
             lambda x, a, m: (a + m) + x, False),
    "gpt_neo": (BY_MODEL_TYPE["gpt_neo"].tiny_config,
                PRE_NORM("ln_1", "attn", "attn.attention.out_proj", "ln_2", "mlp", "mlp.act", "mlp.c_proj"),
                seq, True),
    "gpt_neox_parallel": (BY_MODEL_TYPE["gpt_neox"].tiny_config,
                          {**NEOX_SEQ, "layer_mid": None}, lambda x, a, m: (m + a) + x, False),
    "gpt_neox_sequential": (
        lambda: GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=128,
                              vocab_size=128, max_position_embeddings=64, use_parallel_residual=False),
        NEOX_SEQ, seq, False),
    # BLOOM adds the residual inside self_attention and mlp: the contributions enter those adds.
    "bloom": (BY_MODEL_TYPE["bloom"].tiny_config,
              {**PRE_NORM("input_layernorm", None, "self_attention.dense", "post_attention_layernorm", "mlp",
                          "mlp.gelu_impl", "mlp.dense_4h_to_h"),
               "attention_output": ("self_attention.dense", "out"), "mlp_output": ("mlp.dense_4h_to_h", "out")},
              seq, True),
    "llama": (BY_MODEL_TYPE["llama"].tiny_config, LLAMA, seq, False),
    "mistral": (BY_MODEL_TYPE["mistral"].tiny_config, LLAMA, seq, False),
    "qwen2": (BY_MODEL_TYPE["qwen2"].tiny_config, LLAMA, seq, False),
    "qwen3": (BY_MODEL_TYPE["qwen3"].tiny_config, LLAMA, seq, False),
}
DTYPES = [torch.float32, torch.bfloat16]
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])


def test_every_family_has_a_case():
    covered = {t for f in FAMILIES for t in f.model_types}
    assert covered == {case.rsplit("_parallel", 1)[0].rsplit("_sequential", 1)[0] for case in CASES}


def first(x):
    return x[0] if isinstance(x, tuple) else x


def hook_capture(hf_model, truth, ids):
    """Run the plain HF model with forward hooks; return {(layer, value): tensor} and the logits."""
    captured, handles = {}, []
    for i, block in enumerate(hf_model.base_model_blocks):
        for name, where in truth.items():
            if where is None:
                continue
            path, side = where
            module = block.get_submodule(path) if path else block

            def hook(mod, args, kwargs, out=None, key=(i, name), side=side):
                if key in captured:
                    return
                if side == "in":
                    tensor = args[0] if args else kwargs["hidden_states"]
                else:
                    tensor = first(out)
                captured[key] = tensor.detach().clone()  # a clone: later in-place adds must not change it

            if side == "in":
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(
                    lambda m, a, k, o, hook=hook: hook(m, a, k, o), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        for h in handles:
            h.remove()
    return captured, logits


def make(case, dtype):
    config_factory, truth, formula, is_tuple = CASES[case]
    hf_model = build_tiny(config_factory(), dtype)
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    hf_model.base_model_blocks = model.layers._module  # the ModuleList, for the hooks
    return model, hf_model, truth, formula, is_tuple


def read_all(model, ids):
    """Every available value of every block, read in one trace in order(i) order."""
    saved = {}
    with torch.no_grad(), model.trace(ids):
        for i in range(model.num_layers):
            for key in model.order(i):
                owner, _, name = key.rpartition(".")
                envoy = model.layers[i] if not owner else getattr(model.layers[i], owner)
                saved[(i, name)] = getattr(envoy, name).save()
        logits = model.logits.save()
    return saved, logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds(case, dtype):
    model, hf_model, truth, formula, is_tuple = make(case, dtype)
    expected, expected_logits = hook_capture(hf_model, truth, IDS)
    saved, logits = read_all(model, IDS)
    assert torch.equal(logits, expected_logits)
    for i in range(model.num_layers):
        for name, where in truth.items():
            if where is None:
                assert name not in {k.rpartition(".")[2] for k in model.order(i)}
                continue
            got, want = saved[(i, name)], expected[(i, name)]
            if name == "attention_premix":
                assert got.shape == (*want.shape[:-1], model.num_heads, want.shape[-1] // model.num_heads)
                want = want.view(got.shape)
            assert torch.equal(got, want), f"layer {i} {name}"
        x, a, m, y = (saved[(i, n)] for n in ("layer_input", "attention_output", "mlp_output", "layer_output"))
        assert x.shape == a.shape == m.shape == y.shape == (2, 7, model.hidden_size)
        assert torch.equal(formula(x, a, m), y), f"layer {i}: identity"
        if truth["layer_mid"] is not None:
            assert torch.equal(saved[(i, "layer_mid")], x + a)
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
        # the plain sum: exact on a sequential block, one ulp of the dtype on a parallel one
        plain = x + a + m
        ulp = torch.finfo(dtype).eps * y.abs().clamp_min(1)
        assert ((plain - y).abs() <= ulp).all()


def run_with_hook(hf_model, module, side, edit, ids=IDS):
    """Ground truth for an edit: the HF model with a hook that applies ``edit`` to the tensor."""
    if side == "in":
        def pre(mod, args, kwargs):
            if args:
                return (edit(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        def post(mod, args, out):
            return (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
        handle = module.register_forward_hook(post)
    try:
        with torch.no_grad():
            return hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        handle.remove()


def module_of(hf_model, truth, layer, name):
    path, side = truth[name]
    block = hf_model.base_model_blocks[layer]
    return (block.get_submodule(path) if path else block), side


@pytest.mark.parametrize("case", CASES)
def test_edits_and_assignments_reach_the_logits(case):
    model, hf_model, truth, _, is_tuple = make(case, torch.float32)
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    # in place on a contribution
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].mlp.mlp_output[:, -1] = 0
        edited = model.logits.save()
    assert torch.equal(edited, run_with_hook(hf_model, *module_of(hf_model, truth, 1, "mlp_output"), zero_last))
    assert not torch.equal(edited, clean)

    # assignment of a block output: the tuple is kept for the next block
    with torch.no_grad(), model.trace(IDS):
        model.layers[0].layer_output = model.layers[0].layer_output * 2
        raw = model.layers[0].output.save()
        doubled = model.logits.save()
    assert isinstance(raw, tuple) == is_tuple
    assert torch.equal(doubled, run_with_hook(hf_model, *module_of(hf_model, truth, 0, "layer_output"), lambda t: t * 2))

    # assignment of an input, and a single head zeroed in place through the per-head view
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].layer_input = model.layers[1].layer_input * 0.5
        model.layers[1].self_attn.attention_premix[:, :, 0] = 0
        both = model.logits.save()
    o_proj, _ = module_of(hf_model, truth, 1, "attention_premix")
    block1 = hf_model.base_model_blocks[1]
    head_dim = o_proj.weight.shape[0 if type(o_proj).__name__ == "Conv1D" else 1] // model.num_heads

    def zero_head(t):
        t = t.clone()
        t[..., :head_dim] = 0
        return t

    handle = block1.register_forward_pre_hook(
        lambda mod, args, kwargs: ((args[0] * 0.5, *args[1:]), kwargs), with_kwargs=True)
    try:
        expected = run_with_hook(hf_model, o_proj, "in", zero_head)
    finally:
        handle.remove()
    assert torch.equal(both, expected)


@pytest.mark.parametrize("case", ["gpt2", "gpt_neox_parallel", "bloom"])
def test_order_is_the_forward_order(case):
    model, *_ = make(case, torch.float32)
    order = model.order(1)
    keys = list(order)
    assert list(order.values()) == sorted(order.values())

    def read(key):
        owner, _, name = key.rpartition(".")
        return getattr(model.layers[1] if not owner else getattr(model.layers[1], owner), name)

    for earlier, later in zip(keys, keys[1:]):
        if order[earlier] == order[later]:
            continue
        with model.trace(IDS):  # forward order works
            read(earlier).save()
            read(later).save()
        with pytest.raises(OutOfOrderError):
            with model.trace(IDS):
                read(later).save()
                read(earlier).save()


def test_out_of_order_read_raises():
    model, *_ = make("llama", torch.float32)
    with pytest.raises(OutOfOrderError):
        with model.trace(IDS):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].layer_input.save()


@pytest.mark.parametrize("case", ["gptj", "gpt_neox_parallel"])
def test_unavailable_value_raises_with_its_reason(case):
    model, *_ = make(case, torch.float32)
    assert not hasattr(model.layers[0], "layer_mid")
    with pytest.raises(ValueUnavailable, match=r"'layer_mid' is unavailable on GPT-(J|NeoX): a parallel block"):
        with model.trace(IDS):
            model.layers[0].layer_mid.save()
    info = model.availability(0)
    assert not info["layer_mid"].available and "parallel" in info["layer_mid"].reason
    assert info["mlp.mlp_output"].available
    assert "layer_mid" not in model.order(0)
    # the model is still usable after the error
    with model.trace(IDS):
        out = model.layers[0].layer_output.save()
    assert out.shape == (2, 7, model.hidden_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_check_identity_passes_on_every_family(case, dtype):
    from nnterp.validation import check_identity

    model, *_ = make(case, dtype)
    results = check_identity(model)
    assert len(results) == model.num_layers and all(r.exact for r in results), [str(r) for r in results]


def test_check_identity_catches_a_wrong_spec():
    import dataclasses

    from nnterp.validation import check_identity

    model, *_ = make("gpt2", torch.float32)
    right = model._nnterp_blocks[1]
    wrong = dataclasses.replace(right, values={**right.values, "mlp_output": right.values["mlp_input"]})
    model._nnterp_blocks = (model._nnterp_blocks[0], wrong, *model._nnterp_blocks[2:])
    results = check_identity(model)
    assert results[0].exact and not results[1].exact and results[1].max_abs_diff > 0
    assert "MISMATCH" in str(results[1])
