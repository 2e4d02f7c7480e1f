"""Hybrids (attention on some blocks, Mamba / linear attention / short convolution on the others) against plain hooks.

Ground truth: module boundaries written from transformers' decoder-layer code, captured with forward hooks on the
unwrapped model; the identities are the blocks' own arithmetic. Which block has which mixer is read from the HF
model's modules, not from the family spec.
"""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import (
    IDS,
    assert_placed_as_hooks,
    hook_capture,
    hooks_and_reads,
    read_all,
    register_edit,
    run_with_hook,
)

ATTENTION_VALUES = ("attention_premix", "attention_output")


def truth(ln1, ln2, mlp, act, down, o_proj="o_proj", contribution=None, mlp_output=None, on_attention=None):
    """value -> (module path, side) of block ``i`` of ``blocks``, by the modules the block really has.

    ``contribution``: where the mixer's contribution is read where it is not the mixer's output (a norm after
    it); ``on_attention``: what differs on the attention blocks."""
    def of(blocks):
        def at(i):
            block = blocks[i]
            mixer = next(name for name in ("self_attn", "mamba", "linear_attn", "conv")
                         if getattr(block, name, None) is not None)
            attention = mixer == "self_attn"
            routed = any("expert" in name for name, _ in block.named_modules())
            values = {
                "layer_input": ("", "in"), "attention_norm_output": (ln1, "out"),
                "attention_premix": (f"self_attn.{o_proj}", "in") if attention else None,
                "attention_output": ("self_attn", "out") if attention else None,
                "mixer_output": (contribution or mixer, "out"), "layer_mid": (ln2, "in"), "mlp_norm_output": (ln2, "out"),
                "mlp_input": (mlp, "in"), "mlp_activation": None if routed or not act else (act, "out"),
                "mlp_neurons": None if routed else (down, "in"), "mlp_output": (mlp_output or mlp, "out"),
                "layer_output": ("", "out"),
            }
            if on_attention and attention:
                values.update(on_attention)
            if contribution and mixer == "self_attn":
                values["attention_output"] = (contribution, "out")
            if not act and not routed:  # an activation applied as a function: by the math (test below)
                del values["mlp_activation"]
            return values
        return at
    return of


FEED_FORWARD = truth("input_layernorm", "pre_ff_layernorm", "feed_forward", "feed_forward.act_fn",
                     "feed_forward.down_proj")
QWEN = truth("input_layernorm", "post_attention_layernorm", "mlp", "mlp.act_fn", "mlp.down_proj")
DELTANET = "a Gated DeltaNet linear attention"
# LFM's MLP applies silu as a function: its activation is checked by the math below
LFM = truth("operator_norm", "ffn_norm", "feed_forward", "", "feed_forward.w2", o_proj="out_proj")
# OLMo-Hybrid's attention blocks are OLMo-2's: no norm before the sublayers, the norms after them give the contributions
OLMO2 = {"attention_norm_output": None, "attention_output": ("post_attention_layernorm", "out"),
         "mixer_output": ("post_attention_layernorm", "out"), "layer_mid": ("mlp", "in"), "mlp_norm_output": None,
         "mlp_output": ("post_feedforward_layernorm", "out")}


def granite_truth(blocks):
    """Granite-4.0-H: the MLP contribution is the experts' and the shared MLP's outputs summed in the block's code
    (no module returns it: checked by the math below); both are called with the norm's output."""
    at = truth("input_layernorm", "post_attention_layernorm", "shared_mlp", "shared_mlp.activation",
               "shared_mlp.output_linear")(blocks)

    def values(i):
        found = {**at(i), "mlp_input": ("post_attention_layernorm", "out")}
        del found["mlp_output"]
        for name in ("attention_output", "mixer_output"):  # the block adds them times its residual multiplier
            if found[name] is not None:
                found[name] = (*found[name], "residual_multiplier")
        return found
    return values


x_a = lambda x, a, block: x + a  # noqa: E731
a_x = lambda x, a, block: a + x  # noqa: E731
mid_m = lambda mid, m, block: mid + m  # noqa: E731
SHORT_CONV = "a short convolution"
# case -> (model type, truth, the stream after the mixer's add, the block's output, mixer kind on its other blocks)
CASES = {
    "jamba": ("jamba", FEED_FORWARD, x_a, mid_m, "a Mamba layer"),
    "bamba": ("bamba", FEED_FORWARD, x_a, mid_m, "a Mamba-2 layer"),
    "granitemoehybrid": ("granitemoehybrid", granite_truth, x_a, mid_m, "a Mamba-2 layer"),
    "qwen3_next": ("qwen3_next", QWEN, x_a, mid_m, DELTANET),
    "qwen3_5": ("qwen3_5_text", QWEN, x_a, mid_m, DELTANET),
    "qwen3_5_moe": ("qwen3_5_moe_text", QWEN, x_a, mid_m, DELTANET),
    "lara_mini": ("lara_mini", QWEN, x_a, mid_m, DELTANET),
    "olmo_hybrid": ("olmo_hybrid", truth("input_layernorm", "post_attention_layernorm", "mlp", "mlp.act_fn",
                                         "mlp.down_proj", on_attention=OLMO2), x_a, mid_m, DELTANET),
    "lfm2": ("lfm2", LFM, a_x, mid_m, SHORT_CONV),
    "lfm2_moe": ("lfm2_moe", LFM, a_x, mid_m, SHORT_CONV),
    "lfm3": ("lfm3", truth("operator_norm", "ffn_norm", "feed_forward", "", "feed_forward.w2",
                           contribution="post_operator_norm", mlp_output="post_ffn_norm"), x_a, mid_m, SHORT_CONV),
}


def make(case, dtype=torch.float32):
    model_type, of, first_add, second_add, kind = CASES[case]
    hf = build_tiny(BY_MODEL_TYPE[model_type].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = model.layers._module
    return model, hf, of(hf.base_model_blocks), (first_add, second_add), kind


def mixers(hf):
    return ["self_attn" if getattr(block, "self_attn", None) is not None else "other" for block in hf.base_model_blocks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds_on_every_block(case, dtype):
    model, hf, at, (first_add, second_add), _ = make(case, dtype)
    kinds = mixers(hf)
    assert "self_attn" in kinds and "other" in kinds  # the test config has both block types
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    assert_placed_as_hooks(saved, expected, at, model.num_layers)
    for i in range(model.num_layers):
        x, a, mid, m, y = (saved[(i, n)] for n in ("layer_input", "mixer_output", "layer_mid", "mlp_output",
                                                    "layer_output"))
        block = hf.base_model_blocks[i]
        assert torch.equal(mid, first_add(x, a, block)) and torch.equal(second_add(mid, m, block), y), f"layer {i}"
        if kinds[i] == "self_attn":
            assert torch.equal(saved[(i, "attention_output")], a)
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
    assert all(result.exact for result in check_identity(model, IDS)), [str(r) for r in check_identity(model, IDS)]


@pytest.mark.parametrize("case", ["lfm2", "lfm2_moe", "lfm3"])
def test_lfm_mlp_activation_is_silu_of_w1(case):
    model, hf, *_ = make(case)  # block 0 has a dense MLP
    captured = {}
    handle = hf.base_model_blocks[0].feed_forward.w1.register_forward_hook(
        lambda m, a, o: captured.setdefault("w1", o.clone()))
    try:
        saved, _ = read_all(model, IDS)
    finally:
        handle.remove()
    assert torch.equal(saved[(0, "mlp_activation")], torch.nn.functional.silu(captured["w1"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_granite_hybrid_mlp_output_is_the_experts_plus_the_shared_mlp(dtype):
    model, hf, *_ = make("granitemoehybrid", dtype)
    captured, handles = {}, []
    for i, block in enumerate(hf.base_model_blocks):
        for name in ("block_sparse_moe", "shared_mlp"):
            handles.append(block.get_submodule(name).register_forward_hook(
                lambda m, a, o, key=(i, name): captured.setdefault(key, o.clone())))
    try:
        saved, _ = read_all(model, IDS)
    finally:
        for handle in handles:
            handle.remove()
    for i, block in enumerate(hf.base_model_blocks):  # what the block adds: the sum times its residual multiplier
        assert torch.equal(saved[(i, "mlp_output")],
                           (captured[(i, "block_sparse_moe")] + captured[(i, "shared_mlp")]) * block.residual_multiplier)


@pytest.mark.parametrize("case", CASES)
def test_order_and_availability_per_block_type(case):
    model, hf, at, _, kind = make(case)
    for i, mixer in enumerate(mixers(hf)):
        order, table = model.order(i, aliases=True), model.availability(i)
        names = {key.rpartition(".")[2] for key in order}
        by_math = {name for name in ("mlp_activation", "mlp_output") if name not in at(i)}
        assert names == {name for name, where in at(i).items() if where is not None} | by_math
        assert list(order.values()) == sorted(order.values())
        if mixer == "self_attn":
            assert order["mixer_output"] == order["self_attn.attention_output"]
            assert "mixer_output" not in model.order(i)  # the plain listing leaves out the attention's alias
            assert table["mixer_output"].location == table["self_attn.attention_output"].location
            continue
        assert order["attention_norm_output"] < order["mixer_output"] < order["layer_mid"]
        for key in ("self_attn.attention_output", "self_attn.attention_premix", "self_attn.queries"):
            assert table[key].reason == f"block {i} mixes tokens with {kind}, not attention: its contribution is mixer_output"
        assert not hasattr(model.layers[i], "self_attn")
        with pytest.raises(ValueUnavailable, match=f"'self_attn' is unavailable .*block {i} mixes tokens with"):
            model.layers[i].self_attn  # noqa: B018
        with pytest.raises(ValueUnavailable, match=f"block {i} mixes tokens with"):
            with model.trace(IDS):
                model.layers[i].self_attn.attention_output.save()
        with pytest.raises(ValueUnavailable, match=f"'self_attn.head_outputs' is unavailable .*block {i} mixes tokens"):
            with model.trace(IDS):
                model.head_outputs(i).save()


def test_a_mixer_block_reads_in_forward_order_only():
    model, hf, *_ = make("jamba")
    block = mixers(hf).index("other")
    with model.trace(IDS):
        model.layers[block].mixer_output.save()
        model.layers[block].layer_mid.save()
    with pytest.raises(OutOfOrderError, match=rf"layers\[{block}\]\.mixer_output was requested"):
        with model.trace(IDS):
            model.layers[block].layer_mid.save()
            model.layers[block].mixer_output.save()


@pytest.mark.parametrize("case", CASES)
def test_edits_of_the_mixer_reach_the_logits_as_hooks_do(case):
    model, hf, at, *_ = make(case)
    block = mixers(hf).index("other")
    mixer = at(block)["mixer_output"][0]

    def zero(t, position):
        t = t.clone()
        t[:, position] = 0
        return t

    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].mixer_output[:, -1] = 0  # in place
        model.layers[block].mlp.mlp_output = zero(model.layers[block].mlp.mlp_output, 1)  # assigned
        edited = model.logits.save()

    blocks = hf.base_model_blocks
    # Granite-4.0-H sums two modules' outputs (and scales the sum): zeroing a position of each zeroes it in what the
    # block adds, bit for bit
    zeroed = [at(block)["mlp_output"][0]] if "mlp_output" in at(block) else ["block_sparse_moe", "shared_mlp"]
    handles = [register_edit(hf, blocks[block].get_submodule(mixer), "out", lambda t: zero(t, -1))]
    handles += [register_edit(hf, blocks[block].get_submodule(path), "out", lambda t: zero(t, 1)) for path in zeroed[1:]]
    try:
        expected = run_with_hook(hf, blocks[block].get_submodule(zeroed[0]), "out", lambda t: zero(t, 1))
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)
    # an assignment of mixer_output on an attention block is the attention's contribution assigned
    attention = mixers(hf).index("self_attn")
    with torch.no_grad(), model.trace(IDS):
        model.layers[attention].mixer_output = model.layers[attention].mixer_output * 2
        doubled = model.logits.save()
    contribution = blocks[attention].get_submodule(at(attention)["attention_output"][0])
    assert torch.equal(doubled, run_with_hook(hf, contribution, "out", lambda t: t * 2))


def test_tools_on_a_hybrid():
    from nnterp import add_to, logit_lens, run_with_cache

    model, hf, at, *_ = make("jamba")
    kinds = mixers(hf)
    text = repr(model)
    assert "mixer_output" in text and "blocks 1, in forward order" in text and "unavailable" in text
    expected, _ = hook_capture(hf, at, IDS)
    logits, cache = run_with_cache(model, IDS)
    for i, kind in enumerate(kinds):
        assert torch.equal(cache["mixer_output", i], expected[(i, "mixer_output")])
        assert (("attention_output", i) in cache) == (kind == "self_attn")
    with pytest.raises(ValueUnavailable, match="mixes tokens with a Mamba layer"):
        run_with_cache(model, IDS, names=["attention_output"])
    # the lens of a contribution: each block's mixer output through the final norm and head
    prompt = "the cat sat on the mat"
    probs = logit_lens(model, prompt, value="mixer_output")
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    outputs, _ = hook_capture(hf, at, ids)
    with torch.no_grad():
        for i in range(model.num_layers):
            readout = hf.lm_head(hf.model.final_layernorm(outputs[(i, "mixer_output")][:, -1])).softmax(-1)
            assert torch.allclose(probs[0, i], readout[0], atol=1e-6)
    vector = torch.randn(model.hidden_size)
    with torch.no_grad(), model.trace(IDS):
        add_to(model, [0], vector, value="mixer_output", positions=-1)
        steered = model.logits.save()

    def add(t):
        t = t.clone()
        t[:, -1] += vector
        return t

    assert torch.equal(steered, run_with_hook(hf, hf.base_model_blocks[0].mamba, "out", add))


def test_attention_values_on_a_hybrid_stay_unavailable_on_its_other_blocks():
    model, hf, *_ = make("jamba")
    model.enable_attention_values()
    attention, other = mixers(hf).index("self_attn"), mixers(hf).index("other")
    assert model.availability(attention)["self_attn.attention_probabilities"].available
    assert "mixes tokens with a Mamba layer" in model.availability(other)["self_attn.attention_probabilities"].reason
    with torch.no_grad(), model.trace(IDS):
        probabilities = model.layers[attention].self_attn.attention_probabilities.save()
    assert probabilities.shape == (2, model.num_heads, IDS.shape[1], IDS.shape[1])
    assert torch.allclose(probabilities.sum(-1), torch.ones(()))


@pytest.mark.parametrize("model_type", [case[0] for case in CASES.values()])
def test_the_default_config_miniature_is_proven(model_type):
    """The type's default config (its miniature: the Mamba-2 and linear-attention heads shrink with the rest)."""
    # every block type within 8 layers; the default configs of Bamba, Granite-4.0-H (all Mamba) and LFM2 (all
    # attention) given both
    both = {"bamba": dict(attn_layer_indices=[1]), "lfm2": dict(layer_types=["conv", "full_attention"] * 4),
            "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 4),
            "lfm3": dict(layer_types=["conv", "full_attention"] * 4),
            "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 4)}  # all Mamba: transformers fails
    config = CONFIG_MAPPING[model_type](num_hidden_layers=8, **both.get(model_type, {}))
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))
    assert len(set(map(repr, (model.order(i) for i in range(model.num_layers))))) > 1  # two block types at least
    assert all(result.exact for result in check_identity(model, IDS))


@pytest.mark.parametrize("case", CASES)
def test_attention_values_are_proven_on_the_attention_blocks(case):
    """The eager attention's internals compose to attention_premix (or the family says why not: a gate)."""
    model, hf, *_ = make(case)
    model.enable_attention_values()  # proven on the miniature, the premix check included
    block = mixers(hf).index("self_attn")
    with torch.no_grad(), model.trace(IDS):
        queries = model.layers[block].self_attn.queries.save()
    assert queries.shape[:3] == (*IDS.shape, model.num_heads)


IMAGE_TEXT = [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")]


@pytest.mark.parametrize("model_type, text_type", IMAGE_TEXT)
def test_the_image_text_config_loads_the_text_family(model_type, text_type):
    """A Qwen3.5 checkpoint's config is the image-text one; the causal LM it builds is the text model."""
    from nnterp.core.validation import validate
    from nnterp.families import family_of

    text = BY_MODEL_TYPE[text_type].tiny_config().to_dict()
    config = CONFIG_MAPPING[model_type](text_config=text)
    assert family_of(config) is BY_MODEL_TYPE[text_type]
    architecture = AutoModelForCausalLM._model_mapping[type(config)]
    events = validate(config, architecture, tiny_tokenizer(), use_cache=False)  # proven on its miniature
    assert ("model.layers.0.linear_attn", "output") in events and ("model.layers.1.self_attn", "output") in events


@pytest.mark.parametrize("case", ["jamba", "bamba", "lfm2"])
def test_skipping_a_mixer_block_against_hooks(case):
    from nnterp import skip_layers

    model, hf, *_ = make(case)
    block = mixers(hf).index("other")
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, block)
        logits = model.logits.save()

    def identity(m, args, kwargs, out):
        stream = args[0] if args else kwargs["hidden_states"]
        return (stream, None) if isinstance(out, tuple) else stream

    handle = hf.base_model_blocks[block].register_forward_hook(identity, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()
    assert torch.equal(logits, expected)


def test_the_proof_catches_a_misplaced_mixer_output():
    """Validation covers the mixer: mixer_output read at the mixer's input instead of its output fails the proof."""
    import dataclasses

    from nnterp.core.validation import problems_of
    from nnterp.spec.locations import input as input_of

    model, hf, *_ = make("jamba")
    block = mixers(hf).index("other")
    assert problems_of(model) == []
    right = model._nnterp_blocks[block]
    wrong = dataclasses.replace(right, values={**right.values, "mixer_output": input_of("mamba", kwarg="hidden_states")})
    model._nnterp_blocks = tuple(wrong if i == block else b for i, b in enumerate(model._nnterp_blocks))
    model._unbind()
    problems = problems_of(model)
    assert problems and all(p.startswith(f"layer {block}:") for p in problems)
    assert any("the identity fails" in p for p in problems)


def test_granite_hybrid_without_experts_reads_the_shared_mlp():
    """num_local_experts=0: the MLP is the shared MLP alone, its activation and neurons available."""
    config = BY_MODEL_TYPE["granitemoehybrid"].tiny_config()
    config.num_local_experts = 0
    hf = build_tiny(config)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    hf.base_model_blocks = model.layers._module
    plain = truth("input_layernorm", "post_attention_layernorm", "shared_mlp", "shared_mlp.activation",
                  "shared_mlp.output_linear")(hf.base_model_blocks)
    scaled = ("attention_output", "mixer_output", "mlp_output")  # the block adds them times its residual multiplier
    at = lambda i: {name: (*where, "residual_multiplier") if name in scaled and where else where  # noqa: E731
                    for name, where in plain(i).items()}
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    for i in range(model.num_layers):
        assert {key.rpartition(".")[2] for key in model.order(i, aliases=True)} == {n for n, w in at(i).items() if w is not None}
        for name, where in at(i).items():
            if where is not None:
                got = saved[(i, name)]
                assert torch.equal(got, expected[(i, name)].reshape(got.shape)), f"layer {i} {name}"
    assert all(result.exact for result in check_identity(model, IDS))
