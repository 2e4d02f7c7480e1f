"""Looped models (Dory, HRM-Text, Inkling-2-Loop): blocks that run several times per forward pass, with values per run, against
plain hooks.

Ground truth: forward hooks on the unwrapped model record every call of every block and of its sublayer modules
(boundaries written from transformers' DoryDecoderLayer and HrmTextDecoderLayer), in call order; run k of a block
is its k-th call. The identities are the blocks' own arithmetic, written here: Dory's L2 norm and interpolation
towards each sublayer's normalised output at the rate |λ·s|; HRM-Text's sequential adds; Inkling-2's float32
partial sum, restarting on a block's first layer (read from the module's ``is_block_boundary``).
"""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer
from nnterp.core.edits import skip_layers
from nnterp.core.standardized import schedule_of
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config
from nnterp.spec.errors import ReadoutUnavailable, RunNotChosen

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..hooks import capture_calls

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
DTYPES = [torch.float32, torch.bfloat16]

# value -> (module relative to the block, side)
DORY_AT = {"layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
           "attention_premix": ("self_attn.o_proj", "in"), "attention_output": ("post_attention_layernorm", "out"),
           "layer_mid": ("pre_feedforward_layernorm", "in"), "mlp_norm_output": ("pre_feedforward_layernorm", "out"),
           "mlp_input": ("mlp", "in"), "mlp_activation": ("mlp.act_fn", "out"), "mlp_neurons": ("mlp.down_proj", "in"),
           "mlp_output": ("post_feedforward_layernorm", "out"), "layer_output": ("", "out")}
SUBLAYER = {"attention_premix": "self_attn", "attention_output": "self_attn", "mlp_activation": "mlp",
            "mlp_neurons": "mlp", "mlp_output": "mlp"}
HRM_AT = {"layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
          "attention_premix": ("self_attn.o_proj", "in"), "attention_output": ("self_attn", "out"),
          "layer_mid": ("post_attention_layernorm", "in"), "mlp_norm_output": ("post_attention_layernorm", "out"),
          "mlp_input": ("mlp", "in"), "mlp_activation": ("mlp.act_fn", "out"), "mlp_neurons": ("mlp.down_proj", "in"),
          "mlp_output": ("mlp", "out"), "layer_output": ("", "out")}


def inkling2_at(block):
    """Inkling-2-Loop's places, by the layer's module: a loop layer, or a full-attention one, has no one normed input
    of its attention; the partial sum is the MLP mix's second input."""
    at = {"layer_input": ("", "in"), "attention_premix": ("self_attn.o_proj", "in"),
          "attention_output": ("post_attention_convolution", "out"), "layer_mid": ("mlp_input", "in1"),
          "mlp_norm_output": ("post_attention_layernorm", "out"), "mlp_input": ("mlp", "in"),
          "mlp_output": ("post_mlp_convolution", "out"), "layer_output": ("", "out")}
    if type(block).__name__ == "Inkling2LoopSlidingDecoderLayer":
        at["attention_norm_output"] = ("input_layernorm", "out")
    return at


def l2(x):
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6)).type_as(x)


def dory_adds(block, v):
    """Dory's block: normalise, move towards the sublayer's normalised output at |λ·s|, twice."""
    n1 = l2(v["layer_input"])
    mid = n1 + (block.lambda_1 * block.lambda_scale).abs() * (v["attention_output"] - n1)
    n2 = l2(mid)
    return (torch.equal(v["attention_norm_output"], n1) and torch.equal(v["layer_mid"], mid)
            and torch.equal(v["layer_output"], n2 + (block.lambda_2 * block.lambda_scale).abs() * (v["mlp_output"] - n2)))


def sequential_adds(block, v):
    mid = v["layer_input"] + v["attention_output"]
    return torch.equal(v["layer_mid"], mid) and torch.equal(v["layer_output"], mid + v["mlp_output"])


def partial_sum_adds(block, v):
    """Inkling-2's layer: the float32 partial sum, restarting from the attention's contribution on a block's first
    layer; cast back at the end."""
    x, a, m = v["layer_input"], v["attention_output"], v["mlp_output"]
    mid = a.float() if block.is_block_boundary else x.float() + a.float()
    return torch.equal(v["layer_mid"], mid) and torch.equal(v["layer_output"], (mid + m).to(x.dtype))


# model type -> (the truth's places (or a function of the block's module giving them), the blocks in standard order
# from the plain model, the block's arithmetic)
CASES = {
    "dory": ("dory", DORY_AT, lambda hf: list(hf.model.layers), dory_adds),
    "hrm_text": ("hrm_text", HRM_AT, lambda hf: [*hf.model.L_module.layers, *hf.model.H_module.layers], sequential_adds),
    "inkling2_loop_text": ("inkling2_loop_text", inkling2_at, lambda hf: list(hf.model.layers), partial_sum_adds),
}


def places(case, block):
    truth = CASES[case][1]
    return truth(block) if callable(truth) else truth


def make(case="dory", dtype=torch.float32):
    if case == "inkling2_loop_text":  # built in dtype as a checkpoint loads: its router and convolutions stay float32
        torch.manual_seed(0)
        config = BY_MODEL_TYPE[case].tiny_config()
        hf_model = perturb(AutoModelForCausalLM.from_config(config, dtype=dtype)).eval()
    else:
        hf_model = build_tiny(BY_MODEL_TYPE[case].tiny_config(), dtype)
    return StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()), hf_model


def capture(hf_model, case="dory", ids=IDS):
    """Every call of every block, in order, and each call's tensors at the truth's places:
    (calls, {(layer, run, name)}, logits)."""
    return capture_calls(hf_model, CASES[case][2](hf_model), lambda block: places(case, block), ids)


def read_runs(model, ids=IDS):
    """Every value of every block call, through the standard names, in one trace in forward order."""
    saved = {}
    with torch.no_grad(), model.trace(ids):
        for i, run in model.schedule:
            at = model.layers[i].run(run) if model.runs_of(i) > 1 else model.layers[i]
            for key in model.order(i):
                owner, _, name = key.rpartition(".")
                saved[(i, run, name)] = getattr(getattr(at, owner) if owner else at, name).save()
        logits = model.logits.save()
    return saved, logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_run_of_every_block_equals_the_hooks_and_the_identity_holds(case, dtype):
    model, hf_model = make(case, dtype)
    calls, expected, expected_logits = capture(hf_model, case)
    assert max(calls.count(i) for i in set(calls)) >= 3  # the tiny config loops
    assert [layer for layer, _ in model.schedule] == calls  # the forward's own call order
    assert {i: model.runs_of(i) for i in range(model.num_layers)} == {i: calls.count(i) for i in range(model.num_layers)}
    saved, logits = read_runs(model)
    assert torch.equal(logits, expected_logits)
    assert {key for key in saved} == {key for key in expected}  # every value of every run, nothing else
    for key, tensor in saved.items():
        assert torch.equal(tensor, expected[key].reshape(tensor.shape)), key
    _, _, blocks, adds = CASES[case]
    for i, run in model.schedule:
        block = blocks(hf_model)[i]
        assert adds(block, {name: saved[(i, run, name)] for name in places(case, block)}), (i, run)
    # the runs differ: a loop sees another stream, so reading the first run everywhere would be wrong
    looped = next(i for i in range(model.num_layers) if model.runs_of(i) > 1)
    assert not torch.equal(saved[(looped, 0, "layer_output")], saved[(looped, 1, "layer_output")])
    assert all(result.exact for result in check_identity(model, IDS))


def run_with_hook(hf_model, module, side, call, edit, ids=IDS):
    """The plain model's logits with ``edit`` applied to the tensor at ``module`` on its ``call``-th call only."""
    seen = [-1]

    arg = int(side[2:] or 0) if side.startswith("in") else 0

    def pre(m, args):
        seen[0] += 1
        return (*args[:arg], edit(args[arg]), *args[arg + 1:]) if seen[0] == call else None

    def post(m, args, out):
        seen[0] += 1
        if seen[0] != call:
            return None
        return (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)

    handle = module.register_forward_pre_hook(pre) if side.startswith("in") else module.register_forward_hook(post)
    try:
        with torch.no_grad():
            return hf_model(input_ids=ids).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["attention_output", "layer_mid", "mlp_input", "mlp_output", "layer_input",
                                  "layer_output"])
@pytest.mark.parametrize("case", CASES)
def test_an_edit_of_one_run_reaches_the_model_as_a_hook_on_that_call(case, name):
    model, hf_model = make(case)
    block = CASES[case][2](hf_model)[2]
    path, side = places(case, block)[name]
    module = block.get_submodule(path) if path else block
    def edit(t):  # in place, as the trace's edit: where the block keeps using the tensor (its residual), it sees it
        return t.copy_(t * 0.5 + 0.25)

    if name == "mlp_input":  # what the MLP is called with, for the MLP alone: the hook hands the MLP a new tensor
        def edit(t):
            return t * 0.5 + 0.25

    expected = run_with_hook(hf_model, module, side, 1, edit)
    with torch.no_grad(), model.trace(IDS):
        at = model.layers[2].run(1)
        owner = getattr(at, SUBLAYER[name]) if name in SUBLAYER else at
        tensor = getattr(owner, name)
        tensor[:] = tensor * 0.5 + 0.25  # in place
        logits = model.logits.save()
    assert torch.equal(logits, expected)
    assert not torch.equal(logits, run_with_hook(hf_model, module, side, 0, edit))
    last = model.runs_of(2) - 1
    with torch.no_grad(), model.trace(IDS):  # an assignment, of the last run
        at = model.layers[2].run(last)
        owner = getattr(at, SUBLAYER[name]) if name in SUBLAYER else at
        setattr(owner, name, getattr(owner, name) * 0.5 + 0.25)
        logits = model.logits.save()
    assert torch.equal(logits, run_with_hook(hf_model, module, side, last, edit))


def test_a_looped_value_without_a_run_an_absent_run_and_an_earlier_run_after_a_later_one_are_refused():
    model, _ = make()
    with pytest.raises(RunNotChosen, match=r"layers\[2\] runs 3 times.*run\(k\)\.layer_output"):
        with model.trace(IDS):
            model.layers[2].layer_output.save()
    with pytest.raises(RunNotChosen, match="run"):
        with model.trace(IDS):
            model.layers[1].self_attn.attention_output.save()
    with pytest.raises(IndexError, match="runs 3 times"):
        model.layers[2].run(3)
    with pytest.raises(IndexError, match="runs 1 time "):
        model.layers[0].run(1)
    with pytest.raises(OutOfOrderError, match="already ran past"):
        with model.trace(IDS):
            model.layers[3].run(1).layer_output.save()
            model.layers[2].run(1).layer_output.save()
    with pytest.raises(ValueError, match="a skip replaces one call"):
        with model.trace(IDS):
            skip_layers(model, 2, stream=torch.zeros(2, 7, 32))
    with model.trace(IDS):  # blocks that run once read as on any model, and the runs in order after a refusal
        first = model.layers[0].layer_output.save()
        later = model.layers[1].run(2).layer_output.save()
        logits = model.logits.save()
    assert first.shape == later.shape == (2, 7, 32) and logits.shape == (2, 7, 128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["dory", "hrm_text"])  # Inkling-2-Loop's readout mixes every block's summary in
def test_project_on_vocab_of_the_last_block_is_the_logits(case, dtype):
    model, _ = make(case, dtype)
    layer, run = model.schedule[-1]
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[layer].run(run).layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)


def test_the_attention_internals_are_read_at_each_run():
    model, hf_model = make()
    model.enable_attention_values()
    v_proj, calls = hf_model.model.layers[2].self_attn.v_proj, []
    handle = v_proj.register_forward_hook(lambda m, a, o: calls.append(o.detach().clone()))
    try:
        with torch.no_grad(), model.trace(IDS):
            first = model.layers[2].run(0).self_attn.attention_probabilities.save()
            attention = model.layers[2].run(2).self_attn
            values = attention.values.save()
            probabilities = attention.attention_probabilities.save()
    finally:
        handle.remove()
    assert len(calls) == 3
    assert torch.equal(values, calls[2].view(values.shape))  # [batch, seq, kv_heads, head_dim], the third call's
    assert probabilities.shape == (2, 4, 7, 7) and not torch.equal(first, probabilities)
    assert torch.allclose(probabilities.sum(-1), torch.ones(2, 4, 7))
    assert torch.equal(probabilities.triu(1), torch.zeros_like(probabilities))  # causal


def test_inkling2_loop_refuses_a_readout_of_one_stream():
    model, _ = make("inkling2_loop_text")
    with pytest.raises(ReadoutUnavailable, match="final_input"):
        model.project_on_vocab(torch.zeros(1, 3, 64))


@pytest.mark.parametrize("case", CASES)
def test_the_default_config_miniature_is_proven(case):
    torch.manual_seed(0)
    changes = {"dory": dict(num_hidden_layers=6, n_input_layers=1, n_output_layers=1), "hrm_text": {},
               "inkling2_loop_text": {}}
    config = miniature_config(CONFIG_MAPPING[case](**changes[case]))
    model = StandardizedTransformer(perturb(AutoModelForCausalLM.from_config(config)).eval(),
                                    tokenizer=tiny_tokenizer(256))
    assert max(model.runs_of(i) for i in range(model.num_layers)) > 1
    assert all(result.exact for result in check_identity(model, IDS))


def test_the_proof_refuses_a_schedule_that_is_not_the_models():
    """A spec that says the looped blocks run once, or twice, while the model runs them three times: a run's values
    would be another call's, so the proof names the blocks, from the calls it counts with hooks."""
    import dataclasses

    from nnterp.core.validation import problems_of

    model, _ = make()
    assert problems_of(model) == []
    right = model._nnterp_family
    for schedule in (lambda config: tuple(range(5)), lambda config: (0, 1, 2, 3, 1, 2, 3, 4)):
        model._nnterp_family = dataclasses.replace(right, schedule=schedule)
        model._nnterp_schedule, model._nnterp_runs = schedule_of(model._nnterp_family, model._nnterp_text_config, 5)
        problems = problems_of(model)
        assert problems and all("runs 3 times in a pass, not once per run" in p for p in problems)
        assert {p.split(":")[0] for p in problems} == {"layer 1", "layer 2", "layer 3"}


@pytest.mark.parametrize("case", ["dory", "hrm_text"])
def test_the_logit_lens_reads_every_block_call_and_each_run_asked_for(case):
    """By default one row per block call of the pass; ``(layer, run)`` names one run. Ground truth: each call's
    output from the hooks, read out with the plain model's own final norm and head."""
    from nnterp import logit_lens

    model, hf_model = make(case)
    ids = model.tokenizer("a b c d e f g", return_tensors="pt").input_ids
    calls, expected, logits = capture(hf_model, case, ids=ids)
    norm = hf_model.model.norm if case == "dory" else hf_model.model.H_module.final_norm
    with torch.no_grad():
        def readout(layer, run):
            return hf_model.lm_head(norm(expected[(layer, run, "layer_output")][:, -1:])).float().softmax(-1)[:, 0]

        lens = logit_lens(model, "a b c d e f g")
        assert lens.shape == (1, len(calls), 128)
        for row, (layer, run) in enumerate(model.schedule):
            assert torch.equal(lens[:, row], readout(layer, run)), (layer, run)
        assert torch.allclose(lens[:, -1], logits[:, -1].float().softmax(-1))
        looped = next(i for i in range(model.num_layers) if model.runs_of(i) > 1)
        once = [i for i in range(model.num_layers) if model.runs_of(i) == 1][:1]  # a block that runs once, by index
        asked = logit_lens(model, "a b c d e f g", layers=[(looped, 1), *once, (looped, 0)])
        assert torch.equal(asked[:, 0], readout(looped, 1)) and torch.equal(asked[:, -1], readout(looped, 0))
    with pytest.raises(RunNotChosen):
        logit_lens(model, "a b c", layers=[looped])
    with pytest.raises(IndexError, match="out of range"):
        logit_lens(model, "a b c", layers=[(looped, 9)])


def test_the_proof_refuses_a_misplaced_layer_mid_on_a_block_that_moves_its_stream():
    """Dory's layer_mid is not layer_input + attention_output: the spec says how it is made (``Block.mid``), and a
    layer_mid read elsewhere (here: the MLP's input, of the same shape) is named by the proof."""
    import dataclasses

    from nnterp.core.validation import problems_of
    from nnterp.families.base import input as at_input

    model, _ = make()
    right = model._nnterp_blocks
    model._nnterp_blocks = tuple(dataclasses.replace(b, values={**b.values, "layer_mid": at_input("mlp")}) for b in right)
    model._unbind()
    problems = problems_of(model)
    assert problems == ["layer 0: 'layer_mid' is not what the spec's mid() computes from the values"]
    model._nnterp_blocks = right
    model._unbind()
    assert problems_of(model) == []
