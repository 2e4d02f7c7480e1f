"""Recurrent and state-space models (Mamba, Mamba-2, Falcon-Mamba, RWKV, xLSTM, Zamba, Zamba2) and Nemotron-H's
one-sublayer blocks against plain hooks.

Ground truth: module boundaries written from transformers' block code, captured with forward hooks on the
unwrapped model; which sublayer a Nemotron-H block holds is read from its module's class; the identities are the
blocks' own arithmetic (Mamba's block adds the mixer's output to the stream cast to float32 where
``residual_in_fp32``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE, ROUTED
from nnterp.proof.miniature import miniature_config
from nnterp.spec.catalog import ATTENTION_INTERNALS, CATALOG, WHERE_PRESENT

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, hook_capture, hooks_and_reads, read_all, register_edit, run_with_hook


def mamba_truth(blocks):
    def at(i):
        return {"layer_input": ("", "in"), "attention_norm_output": ("norm", "out"), "mixer_output": ("mixer", "out"),
                "layer_mid": ("", "out"), "layer_output": ("", "out")}
    return at


def mamba_adds(values, block):
    """The block's own add: the stream cast to float32 first where residual_in_fp32."""
    x = values["layer_input"].to(torch.float32) if block.residual_in_fp32 else values["layer_input"]
    return torch.equal(values["layer_output"], x + values["mixer_output"])


def rwkv_truth(blocks):
    def at(i):
        return {"layer_input": ("pre_ln", "out") if i == 0 else ("", "in"),  # block 0's adds start from pre_ln's output
                "attention_norm_output": ("ln1", "out"), "mixer_output": ("attention", "out"), "layer_mid": ("ln2", "in"),
                "mlp_norm_output": ("ln2", "out"), "mlp_input": ("feed_forward", "in"),
                "mlp_activation": ("feed_forward.value", "in"),  # relu(key(x'))²: checked by the math below
                "mlp_neurons": ("feed_forward.value", "in"), "mlp_output": ("feed_forward", "out"),
                "layer_output": ("", "out")}
    return at


def pre_norm_truth(ln1, mixer, ln2, mlp, act, down):
    def of(blocks):
        def at(i):
            return {"layer_input": ("", "in"), "attention_norm_output": (ln1, "out"), "mixer_output": (mixer, "out"),
                    "layer_mid": (ln2, "in"), "mlp_norm_output": (ln2, "out"), "mlp_input": (mlp, "in"),
                    "mlp_activation": (act, "out"), "mlp_neurons": (down, "in"), "mlp_output": (mlp, "out"),
                    "layer_output": ("", "out")}
        return at
    return of


def sequential_adds(values, block):
    mid = values["layer_input"] + values["mixer_output"]
    return torch.equal(values["layer_mid"], mid) and torch.equal(values["layer_output"], mid + values["mlp_output"])


def nemotron_h_truth(blocks):
    """By the module each block holds at ``mixer``: one sublayer per block."""
    def at(i):
        mixer = type(blocks[i].mixer).__name__
        values = {"layer_input": ("", "in"), "layer_output": ("", "out")}
        if mixer in ("NemotronHMLP", "NemotronHMoE"):  # no token mixer: the stream before the MLP's add is the input
            values |= {"layer_mid": ("", "in"), "mlp_norm_output": ("norm", "out"), "mlp_input": ("mixer", "in"),
                       "mlp_output": ("mixer", "out")}
            if mixer == "NemotronHMLP":  # a dense MLP: its activation and what down_proj sums
                values |= {"mlp_activation": ("mixer.act_fn", "out"), "mlp_neurons": ("mixer.down_proj", "in")}
            return values
        values |= {"attention_norm_output": ("norm", "out"), "mixer_output": ("mixer", "out"), "layer_mid": ("", "out")}
        if mixer == "NemotronHAttention":
            values |= {"attention_premix": ("mixer.o_proj", "in"), "attention_output": ("mixer", "out")}
        return values
    return at


def one_sublayer_adds(values, block):
    contribution = values["mixer_output"] if "mixer_output" in values else values["mlp_output"]
    after = values["layer_output"] if "mixer_output" in values else values["layer_input"]
    return torch.equal(values["layer_output"], values["layer_input"] + contribution) and torch.equal(
        values["layer_mid"], after)


def zamba_truth(blocks):
    """A hybrid block (it holds mamba_decoder) reads its Mamba there; the shared transformer adds nothing to the stream."""
    def at(i):
        mamba = "mamba_decoder." if hasattr(blocks[i], "mamba_decoder") else ""
        return {"layer_input": ("", "in"), "attention_norm_output": (f"{mamba}input_layernorm", "out"),
                "mixer_output": (f"{mamba}mamba", "out"), "layer_mid": ("", "out"), "layer_output": ("", "out")}
    return at


def plain_adds(values, block):
    return torch.equal(values["layer_output"], values["layer_input"] + values["mixer_output"])


# case -> (model type, truth, the block's own arithmetic, the mixer's module, what the block lacks)
CASES = {
    "mamba": ("mamba", mamba_truth, mamba_adds, "mixer", "no MLP: a Mamba block is one token mixer"),
    "mamba2": ("mamba2", mamba_truth, mamba_adds, "mixer", "no MLP: a Mamba-2 block is one token mixer"),
    "falcon_mamba": ("falcon_mamba", mamba_truth, mamba_adds, "mixer", "no MLP: a Falcon-Mamba block is one token"),
    "rwkv": ("rwkv", rwkv_truth, sequential_adds, "attention", None),
    "xlstm": ("xlstm", pre_norm_truth("norm_mlstm", "mlstm_layer", "norm_ffn", "ffn", "ffn.act_fn", "ffn.proj_down"),
              sequential_adds, "mlstm_layer", None),
    "nemotron_h": ("nemotron_h", nemotron_h_truth, one_sublayer_adds, "mixer", "no MLP: a Nemotron-H block has one"),
    "zamba": ("zamba", zamba_truth, plain_adds, "mamba", None),
    "zamba2": ("zamba2", zamba_truth, plain_adds, "mamba", None),
}


def wrap(hf):
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.vocab_size))  # proven at load
    hf.base_model_blocks = model.layers._module
    return model


def make(case, dtype=torch.float32, **changes):
    model_type, truth, adds, *_ = CASES[case]
    config = BY_MODEL_TYPE[model_type].tiny_config()
    for key, value in changes.items():
        setattr(config, key, value)
    hf = build_tiny(config, dtype)
    model = wrap(hf)
    return model, hf, truth(hf.base_model_blocks), adds


def compare_with_hooks(model, hf, at, adds):
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    for i in range(model.num_layers):
        assert {key.rpartition(".")[2] for key in model.order(i, aliases=True)} == set(at(i))
        for name in at(i):
            got, want = saved[(i, name)], expected[(i, name)]
            assert got.dtype == want.dtype and torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"
        assert adds({name: saved[(i, name)] for name in at(i)}, hf.base_model_blocks[i]), f"layer {i}"
    assert all(result.exact for result in check_identity(model, IDS)), [str(r) for r in check_identity(model, IDS)]
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds_on_every_block(case, dtype):
    model, hf, at, adds = make(case, dtype)
    saved = compare_with_hooks(model, hf, at, adds)
    # the project's readout of the last block's output is the model's own, dtypes included
    with torch.no_grad(), model.trace(IDS):
        logits = model.logits.save()
    assert torch.equal(model.project_on_vocab(saved[(model.num_layers - 1, "layer_output")]), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c, (t, *_) in CASES.items() if t in ("mamba", "mamba2", "falcon_mamba")])
def test_mamba_without_a_float32_residual(case, dtype):
    model, hf, at, adds = make(case, dtype, residual_in_fp32=False)
    saved = compare_with_hooks(model, hf, at, adds)
    assert saved[(model.num_layers - 1, "layer_output")].dtype == dtype
    assert "float32" not in model.block_spec(0).formula


@pytest.mark.parametrize("case", CASES)
def test_order_and_availability(case):
    """Each block lists the values its modules have (by the hooks' truth), in forward order; the others are
    unavailable with a reason naming the block, and so are the sublayers it lacks."""
    model, hf, at, _ = make(case)
    lacks = CASES[case][4]
    for i in range(model.num_layers):
        order, table, names = model.order(i, aliases=True), model.availability(i), set(at(i))
        assert list(order.values()) == sorted(order.values())
        assert {key.rpartition(".")[2] for key in order} == names
        for value in CATALOG:  # (the values a block has where its module is: tests/families/test_where_present.py)
            if value.name not in names and value.name not in WHERE_PRESENT and not (
                    "attention_output" in names and value.name in ATTENTION_INTERNALS):
                reason = table[value.key].reason  # (internals: off until turned on; a mixture: no single activation)
                assert f"block {i} " in reason or reason == ROUTED.reason, (i, value.key)
        if {"attention_norm_output", "mixer_output"} <= names:
            assert order["attention_norm_output"] < order["mixer_output"] <= order["layer_mid"] <= order["layer_output"]
        for sublayer, value in (("self_attn", "attention_output"), ("mlp", "mlp_output")):
            if value in names:
                assert hasattr(model.layers[i], sublayer)
                continue
            assert not hasattr(model.layers[i], sublayer)
            with pytest.raises(ValueUnavailable, match=f"'{sublayer}' is unavailable .*block {i} "):
                getattr(model.layers[i], sublayer)
            with pytest.raises(ValueUnavailable, match=f"block {i} "):
                with model.trace(IDS):
                    model.read_value(i, value).save()
        if "mlp_output" not in names and lacks:
            assert lacks in table["mlp.mlp_output"].reason and lacks in table["mlp_norm_output"].reason
        if "attention_output" not in names:
            assert "not attention" in table["self_attn.attention_output"].reason or "mixes no tokens" in table[
                "self_attn.attention_output"].reason
            with pytest.raises(ValueUnavailable, match=f"block {i} "):
                with model.trace(IDS):
                    model.head_outputs(i).save()
    text = repr(model)
    assert "in forward order: " + ", ".join(model.order(0)) in text and "unavailable" in text


@pytest.mark.parametrize("case", CASES)
def test_edits_of_the_mixer_reach_the_logits_as_hooks_do(case):
    model, hf, at, _ = make(case)
    mixer = CASES[case][3]
    block = next(i for i in range(model.num_layers - 1) if "mixer_output" in at(i))
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].mixer_output[:, -1] = 0  # in place
        edited = model.logits.save()

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    expected = run_with_hook(hf, hf.base_model_blocks[block].get_submodule(mixer), "out", zero_last)
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].mixer_output = model.layers[block].mixer_output * 2  # assigned
        model.layers[block + 1].layer_output = model.layers[block + 1].layer_output * 0.5
        doubled = model.logits.save()
    handle = register_edit(hf, hf.base_model_blocks[block].get_submodule(mixer), "out", lambda t: t * 2)
    try:
        expected = run_with_hook(hf, hf.base_model_blocks[block + 1], "out", lambda t: t * 0.5)
    finally:
        handle.remove()
    assert torch.equal(doubled, expected)


@pytest.mark.parametrize("case", CASES)
def test_the_default_config_miniature_is_proven(case):
    """The type's default config, shrunk by the miniature (the stream, the mixers' sizes), proven and equal to hooks."""
    model_type, truth, adds, *_ = CASES[case]
    # enough blocks for two hybrid blocks of Zamba's default layout (transformers ties one hybrid block's shared
    # transformer to the others'), for one of Zamba2's (whose default lists its 54 block types)
    if model_type == "zamba2":
        config = CONFIG_MAPPING[model_type](num_hidden_layers=7,
                                            layers_block_type=CONFIG_MAPPING[model_type]().layers_block_type[:7])
    else:
        config = CONFIG_MAPPING[model_type](num_hidden_layers={"zamba": 8}.get(model_type, 3))
    mini = miniature_config(config)
    assert mini.hidden_size < config.hidden_size
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(mini)).eval()
    assert sum(p.numel() for p in hf.parameters()) < 1_000_000
    model = wrap(hf)
    compare_with_hooks(model, hf, truth(hf.base_model_blocks), adds)


def test_tools_on_a_recurrent_model():
    from nnterp import activation_patching, logit_lens, run_with_cache

    model, hf, at, _ = make("mamba", torch.bfloat16)
    prompt = "the cat sat on the mat"
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    probs = logit_lens(model, prompt)
    outputs, logits = hook_capture(hf, at, ids)
    with torch.no_grad():
        for i in range(model.num_layers):  # the model's own readout: norm_f on the float32 stream, the head in bf16
            stream = outputs[(i, "layer_output")][:, -1:]
            readout = hf.lm_head(hf.backbone.norm_f(stream).to(torch.bfloat16)).float().softmax(-1)
            assert torch.allclose(probs[0, i], readout[0, 0], atol=1e-6)
    assert torch.allclose(probs[0, -1], logits[0, -1].softmax(-1), atol=1e-6)
    _, cache = run_with_cache(model, IDS)
    expected, _ = hook_capture(hf, at, IDS)
    assert all(torch.equal(cache["mixer_output", i], expected[(i, "mixer_output")]) for i in range(model.num_layers))
    for names in (["attention_output"], ["mlp_output"]):
        with pytest.raises(ValueUnavailable, match="block 0"):
            run_with_cache(model, IDS, names=names)
    with pytest.raises(ValueUnavailable, match="no block of this model has attention"):
        model.enable_attention_values()
    with pytest.raises(ValueUnavailable, match="'self_attn.attention_output' is unavailable .*block 0 mixes tokens"):
        activation_patching(model, "the cat sat", "the dog sat", lambda logits: logits[:, -1, 3], value="attention_output",
                            progress=False)
    effects = activation_patching(model, "the cat sat", "the dog sat", lambda logits: logits[:, -1, 3],
                                  value="mixer_output", layers=[1], positions=[1], progress=False)
    clean = model.tokenizer("the cat sat", return_tensors="pt").input_ids
    source, _ = hook_capture(hf, at, clean)

    def patch(t):
        t = t.clone()
        t[:, 1] = source[(1, "mixer_output")][:, 1]
        return t

    patched = run_with_hook(hf, hf.base_model_blocks[1].mixer, "out", patch,
                            ids=model.tokenizer("the dog sat", return_tensors="pt").input_ids)
    assert torch.equal(effects[0, 0], patched[0, -1, 3])


@pytest.mark.parametrize("case", CASES)
def test_skipping_a_block_against_hooks(case):
    from nnterp import skip_layers

    model, hf, *_ = make(case)
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, 1)
        skipped = model.logits.save()

    def identity(m, args, kwargs, out):  # the block hands on its input (and the state it was given) in its tuple
        if not isinstance(out, tuple):
            return args[0]
        return (args[0], kwargs["state"] if "state" in kwargs else args[1], *out[2:])

    handle = hf.base_model_blocks[1].register_forward_hook(identity, with_kwargs=True)
    try:
        with torch.no_grad():
            assert torch.equal(skipped, hf(input_ids=IDS).logits)
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rwkv_halves_the_stream_between_blocks_and_its_activation_is_the_squared_relu(dtype):
    """In eval mode RWKV halves the stream after every rescale_every-th block (outside the blocks); the channel
    mixing's activation is relu(key(x'))², which the value projection sums."""
    model, hf, at, _ = make("rwkv", dtype)
    every = hf.config.rescale_every
    captured, handles = {}, []
    for i, block in enumerate(hf.base_model_blocks):
        handles.append(block.feed_forward.key.register_forward_hook(
            lambda m, a, o, i=i: captured.setdefault(i, o.clone())))
    try:
        saved, _ = read_all(model, IDS)
    finally:
        for handle in handles:
            handle.remove()
    halved = 0
    for i in range(model.num_layers):
        assert torch.equal(saved[(i, "mlp_activation")], torch.square(torch.relu(captured[i])))
        if i + 1 < model.num_layers:
            y, x = saved[(i, "layer_output")], saved[(i + 1, "layer_input")]
            halved += (i + 1) % every == 0
            assert torch.equal(x, y / 2 if (i + 1) % every == 0 else y), f"layer {i}"
    assert halved and model.num_layers % every == 0  # the test config halves between blocks and after the last


def test_nemotron_h_sublayers_follow_the_block():
    """``self_attn`` is the mixer of an attention block, ``mlp`` that of an MLP block; edits of either reach the
    logits as the same edit by a plain hook does; the attention's internals are proven on its attention block."""
    model, hf, at, _ = make("nemotron_h")
    kinds = [type(block.mixer).__name__ for block in hf.base_model_blocks]
    attention, dense = kinds.index("NemotronHAttention"), kinds.index("NemotronHMLP")
    assert model.layers[attention].self_attn._module is hf.base_model_blocks[attention].mixer
    assert model.layers[dense].mlp._module is hf.base_model_blocks[dense].mixer
    with torch.no_grad(), model.trace(IDS):
        model.layers[attention].self_attn.attention_output = model.layers[attention].self_attn.attention_output * 2
        model.layers[dense].mlp.mlp_activation[:, -1] = 0
        edited = model.logits.save()

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    handle = register_edit(hf, hf.base_model_blocks[attention].mixer, "out", lambda t: t * 2)
    try:
        expected = run_with_hook(hf, hf.base_model_blocks[dense].mixer.act_fn, "out", zero_last)
    finally:
        handle.remove()
    assert torch.equal(edited, expected)
    model.enable_attention_values()  # proven on the miniature, the premix check included
    with torch.no_grad(), model.trace(IDS):
        probabilities = model.layers[attention].self_attn.attention_probabilities.save()
    assert probabilities.shape == (2, model.num_heads, IDS.shape[1], IDS.shape[1])
    assert "mixes tokens with a Mamba-2" in model.availability(kinds.index("NemotronHMamba2Mixer"))[
        "self_attn.attention_probabilities"].reason


def test_nemotron_h_block_types_the_spec_does_not_place_are_refused():
    from nnterp.families import family_of
    from nnterp.spec.errors import UnsupportedConfig

    config = BY_MODEL_TYPE["nemotron_h"].tiny_config()
    config.layers_block_type = [*config.layers_block_type[:-1], "sliding_attention"]
    with pytest.raises(UnsupportedConfig, match="sliding_attention"):
        family_of(config)
