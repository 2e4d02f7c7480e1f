"""Capture over generated tokens: run_with_cache(..., max_new_tokens=N) and collect(..., max_new_tokens=N), steering
in the same pass, against plain forward hooks on the unwrapped model running transformers' own generate."""

from __future__ import annotations

import pytest
import torch

from nnterp import StandardizedTransformer, ValueUnavailable, collect, steered_generate
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES
from ..remote.test_remote import checkpoints, load, requests, server  # noqa: F401  (the remote tests' fixtures)

PROMPTS = ["the cat sat on the mat", "the dog sat"]  # two lengths: the batch is left-padded
N = 4
FAMILIES = ["gpt2", "llama", "gpt_neox_parallel"]  # sequential pre-norm (two codes), parallel


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    config, truth, _, _ = CASES[request.param]
    model = StandardizedTransformer(build_tiny(config()), tokenizer=tiny_tokenizer())
    truth = {name: where for name, where in (truth(0) if callable(truth) else truth).items() if where is not None}
    return model, truth


def hf_generate(model, truth, inputs, edits=(), max_new_tokens=N):
    """Ground truth: transformers' generate on the unwrapped model, greedy, exactly ``max_new_tokens`` steps, with
    ``edits`` ``[(module, function(call, output) -> output)]`` as forward hooks, then hooks that keep each call's
    tensor. Returns the ids and ``{(name, layer): [one tensor per call]}``, plus the final norm's input and output."""
    calls, handles = {}, []

    def keep(key, side):
        def hook(module, args, kwargs, out):
            tensor = (args[0] if args else kwargs["hidden_states"]) if side == "in" else out
            calls.setdefault(key, []).append((tensor[0] if isinstance(tensor, tuple) else tensor).detach().clone())
        return hook

    for module, edit in edits:  # registered first: the hooks that keep see the edited output
        count = []
        handles.append(module.register_forward_hook(
            lambda m, a, out, edit=edit, count=count: edit(count.append(0) or len(count) - 1, out)))
    for layer, block in enumerate(model.layers._module):
        for name, (path, side) in truth.items():
            module = block.get_submodule(path) if path else block
            handles.append(module.register_forward_hook(keep((name, layer), side), with_kwargs=True))
    norm = model.ln_final._module
    handles.append(norm.register_forward_hook(keep("ln_final_input", "in"), with_kwargs=True))
    handles.append(norm.register_forward_hook(keep("ln_final_output", "out"), with_kwargs=True))
    try:
        with torch.no_grad():
            ids = model._module.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    return ids, calls


def joined(tensors):
    """The calls of a generation joined along the sequence: the prompt's positions, then one per later step."""
    assert [t.shape[1] for t in tensors[1:]] == [1] * (len(tensors) - 1)
    return torch.cat(tensors, dim=1)


def assert_cache_is(cache, calls, truth, model):
    for layer in range(model.num_layers):
        for name in truth:
            expected = joined(calls[(name, layer)])
            got = cache[name, layer]
            assert torch.equal(got, expected.reshape(got.shape)), (name, layer)
    for name in ("ln_final_input", "ln_final_output"):
        assert torch.equal(cache[name], joined(calls[name])), name


def test_every_step_equals_hooks_on_transformers_generate(case):
    model, truth = case
    inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert not inputs.attention_mask[:, 0].all()  # padded on the left
    expected_ids, calls = hf_generate(model, truth, inputs)
    rng = torch.get_rng_state()
    ids, cache = model.run_with_cache(PROMPTS, max_new_tokens=N)
    assert torch.equal(torch.get_rng_state(), rng)  # greedy: the user's random state is left as it was
    assert torch.equal(ids, expected_ids)
    prompt = inputs.input_ids.shape[1]
    assert cache.prompt_length == prompt and cache.steps == N
    assert torch.equal(cache.input_ids, expected_ids[:, :-1])  # the last token generated is never run
    assert torch.equal(cache.attention_mask[:, :prompt], inputs.attention_mask)
    assert cache.attention_mask[:, prompt:].all()
    assert_cache_is(cache, calls, truth, model)
    assert cache["layer_output"].shape == (model.num_layers, 2, prompt + N - 1, model.hidden_size)
    for step in range(N):  # each step's own positions are its call's tensor
        assert torch.equal(cache["layer_output", 1][:, cache.step_positions(step)], calls[("layer_output", 1)][step])
    # the analyses read it as one pass over the sequence: the decomposition adds up to the stream the hooks saw
    assert torch.equal(cache.recompose_resid(cache.decompose_resid()), joined(calls["ln_final_input"]))


def test_steering_in_the_same_pass_equals_hooks_that_add_the_vector(case):
    model, truth = case
    inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(1)
    v, w, u = (torch.randn(model.hidden_size, generator=g) for _ in range(3))
    first_token = (inputs.attention_mask == 0).sum(dim=1)  # each prompt's own first token, left-padded
    steer = [{"layers": 1, "vector": v, "factor": 2.0},  # every step
             {"layers": 0, "vector": w, "value": "mlp_output", "scope": "generated"},
             {"layers": 2, "vector": u, "positions": 0, "scope": "prompt"}]

    def at_first_token(call, out):
        if call == 0:
            out = out.clone()
            out[torch.arange(2), first_token] += u
        return out

    blocks = model.layers._module
    mlp = blocks[0].get_submodule(truth["mlp_output"][0])
    edits = [(blocks[1], lambda call, out: out + 2.0 * v), (mlp, lambda call, out: out + w if call else out),
             (blocks[2], at_first_token)]
    expected_ids, calls = hf_generate(model, truth, inputs, edits)
    _, plain = hf_generate(model, truth, inputs)
    assert not torch.equal(calls[("layer_output", 2)][0], plain[("layer_output", 2)][0])  # the steering matters
    ids, cache = model.run_with_cache(PROMPTS, max_new_tokens=N, steer=steer)
    assert torch.equal(ids, expected_ids)
    assert_cache_is(cache, calls, truth, model)  # steered values as steered, the rest as the model saw them
    # steered_generate is the same steering: the same tokens
    assert torch.equal(steered_generate(model, PROMPTS, 1, v, factor=2.0, max_new_tokens=N),
                       hf_generate(model, truth, inputs, edits[:1])[0])


def test_steering_one_forward_pass_equals_hooks(case):
    model, truth = case
    inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    v = torch.linspace(-1, 1, model.hidden_size)
    logits, cache = model.run_with_cache(PROMPTS, names=["layer_output", "layer_input"],
                                         steer={"layers": 1, "vector": v, "factor": 3.0, "positions": -1})
    _, calls = hf_generate(model, {"layer_output": truth["layer_output"], "layer_input": truth["layer_input"]}, inputs,
                           [(model.layers._module[1], lambda call, out: torch.cat([out[:, :-1], out[:, -1:] + 3 * v], 1))],
                           max_new_tokens=1)
    for layer in range(model.num_layers):
        for name in ("layer_output", "layer_input"):
            assert torch.equal(cache[name, layer], calls[(name, layer)][0]), (name, layer)


def test_collect_over_generated_tokens_equals_hooks(case, tmp_path):
    model, truth = case
    inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    v = torch.linspace(-1, 1, model.hidden_size)
    edits = [(model.layers._module[1], lambda call, out: out + v if call else out)]
    expected_ids, calls = hf_generate(model, truth, inputs, edits)
    steer = {"layers": 1, "vector": v, "scope": "generated"}
    values, layers = ["layer_output", "mlp_output"], [2, 0]
    collection = collect(model, PROMPTS, tmp_path / "all", values, layers=layers, positions="all", batch_size=2,
                         progress=False, max_new_tokens=N, steer=steer)
    assert collection.offsets.tolist() == [0, N, 2 * N]
    for name in values:  # row k of a prompt: the last position of step k, the one that predicts generated token k+1
        expected = torch.stack([torch.cat([c[:, -1:] for c in calls[(name, layer)]], dim=1) for layer in layers], 2)
        assert torch.equal(collection[name], expected.flatten(0, 1)), name
    prompt = inputs.input_ids.shape[1]
    last = collect(model, PROMPTS, tmp_path / "last", values, layers=layers, positions=-1, batch_size=2,
                   progress=False, max_new_tokens=N, steer=steer)
    assert torch.equal(last["layer_output"], collection["layer_output"][[N - 1, 2 * N - 1]])
    # a mask of the stepped tokens: the rows whose own token is a given one (the prompt's last, then generated ones)
    stepped = expected_ids[:, prompt - 1:prompt - 1 + N]
    chosen = int(stepped[0, 2])
    masked = collect(model, PROMPTS, tmp_path / "mask", values, layers=layers, positions=lambda ids, mask: ids == chosen,
                     batch_size=2, progress=False, max_new_tokens=N, steer=steer)
    assert torch.equal(masked["mlp_output"], collection["mlp_output"][(stepped == chosen).flatten()])
    with pytest.raises(ValueError, match="other settings"):  # a resume with another steering is refused
        collect(model, PROMPTS, tmp_path / "all", values, layers=layers, positions="all", batch_size=2,
                progress=False, max_new_tokens=N, steer={**steer, "factor": 2.0})


def test_bad_input_is_refused_clearly(tmp_path):
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer(),
                                    attention_values=True)
    vector = torch.zeros(model.hidden_size)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens is the number of tokens to generate"):
            model.run_with_cache(PROMPTS, max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_new_tokens is the number"):
        collect(model, PROMPTS, tmp_path / "zero", max_new_tokens=0, progress=False)
    model.tokenizer.padding_side = "right"
    try:
        with pytest.raises(ValueError, match="right-padded.*Pad on the left"):
            model.run_with_cache(PROMPTS, max_new_tokens=2)
        with pytest.raises(ValueError, match="right-padded"):
            collect(model, PROMPTS, tmp_path / "right", max_new_tokens=2, progress=False)
    finally:
        model.tokenizer.padding_side = "left"
    with pytest.raises(ValueUnavailable, match="attention_probabilities.*earlier steps"):
        model.run_with_cache(PROMPTS, names=["attention_probabilities"], max_new_tokens=2)
    _, cache = model.run_with_cache(PROMPTS, max_new_tokens=2)  # every value it can cache; the internals refused
    with pytest.raises(ValueUnavailable, match="earlier steps"):
        cache["attention_scores", 0]
    with pytest.raises(ValueError, match="does not collect keys"):
        collect(model, PROMPTS, tmp_path / "keys", ["keys"], max_new_tokens=2, progress=False)
    with pytest.raises(IndexError, match="counts the steps of a generation of 2"):
        collect(model, PROMPTS, tmp_path / "far", positions=2, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="generates nothing"):
        model.run_with_cache(PROMPTS, steer={"layers": 1, "vector": vector, "scope": "generated"})
    with pytest.raises(TypeError, match="unknown \\['layer'\\]"):
        model.run_with_cache(PROMPTS, steer={"layer": 1, "vector": vector}, max_new_tokens=2)
    with pytest.raises(TypeError, match="generates only with max_new_tokens"):
        model.run_with_cache(PROMPTS, do_sample=True)
    with pytest.raises(IndexError, match="Step 2 is not in this cache"):
        cache.step_positions(2)
    gptj = StandardizedTransformer(build_tiny(BY_MODEL_TYPE["gptj"].tiny_config()), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueUnavailable, match="layer_mid"):  # a steering of a value the block lacks, before running
        gptj.run_with_cache(PROMPTS, max_new_tokens=2, steer={"layers": 0, "vector": vector, "value": "layer_mid"})


def test_generation_capture_runs_remotely_bit_exactly(checkpoints, requests, tmp_path):  # noqa: F811
    model = load("gpt2", checkpoints)
    model.disable_attention_values()
    steer = {"layers": 1, "vector": torch.linspace(-1, 1, model.hidden_size), "factor": 4.0}
    ids, cache = model.run_with_cache(PROMPTS, max_new_tokens=3, steer=steer)
    ids_remote, cache_remote = model.run_with_cache(PROMPTS, max_new_tokens=3, steer=steer, remote=True)
    assert requests and torch.equal(ids, ids_remote) and cache.keys() == cache_remote.keys()
    for key in cache:
        assert torch.equal(cache[key], cache_remote[key]), key
    here = collect(model, PROMPTS, tmp_path / "here", positions="all", max_new_tokens=3, steer=steer, progress=False)
    there = collect(model, PROMPTS, tmp_path / "there", positions="all", max_new_tokens=3, steer=steer,
                    progress=False, remote=True)
    assert torch.equal(here["layer_output"], there["layer_output"])
