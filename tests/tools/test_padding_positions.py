"""Positions and last tokens in a padded batch are each prompt's own, on both padding sides.

Ground truth: each prompt run alone, unpadded, on the unwrapped HF model, with plain forward hooks that add
the vector at (or patch) that prompt's own position; the batched tool runs under left and under right padding.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import nnsight
import pytest
import torch

from nnterp import Prompt, StandardizedTransformer, add_to, patchscope_lens, run_prompts, steered_generate
from nnterp.compat.interventions import TargetPromptBatch, patch_object_attn_lens
from nnterp.compat.interventions import patchscope_lens as patchscope_lens_1x  # takes 1.x's call too
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..remote.test_remote import checkpoints, load, requests, server  # noqa: F401  (the remote server's fixtures)

PROMPTS = ["the cat sat on the mat", "the dog", "Paris is in the city"]  # 6, 2 and 5 tokens
SIDES = ("left", "right")
LAYER = 1


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE[request.param].tiny_config()), tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


@contextmanager
def padded(model, side):
    before = model.tokenizer.padding_side
    model.tokenizer.padding_side = side
    try:
        yield model.tokenizer(PROMPTS, return_tensors="pt", padding=True).attention_mask.bool()
    finally:
        model.tokenizer.padding_side = before


def alone(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def vector_for(model, seed=1):
    return 3 * torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(seed))


def hooked(module, edit):
    """A forward hook applying ``edit`` in place to a copy of the module's output (a tensor or a tuple's first)."""
    def hook(m, args, output):
        stream = (output[0] if isinstance(output, tuple) else output).clone()
        edit(stream)
        return (stream, *output[1:]) if isinstance(output, tuple) else stream
    return module.register_forward_hook(hook)


def hf_logits(model, ids, hooks=()):
    """The unwrapped model's logits on one unpadded prompt, with the hooks (made by the callables) installed."""
    handles = [make() for make in hooks]
    try:
        with torch.no_grad():
            return model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    finally:
        for handle in handles:
            handle.remove()


def steered_alone(model, text, vector, positions, factor=1.0):
    def add(stream):
        stream[0, positions] += factor * vector

    return hf_logits(model, alone(model, text), [lambda: hooked(model.layers._module[LAYER], add)])


# -- add_to ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("positions", [0, -1, [0, -2], slice(1, None)], ids=["first", "last", "list", "slice"])
def test_add_to_positions_are_each_prompts_own_tokens(model, positions):
    vector = vector_for(model)
    for side in SIDES:
        with padded(model, side) as mask, torch.no_grad(), model.trace(PROMPTS):
            add_to(model, LAYER, vector, factor=2.0, positions=positions)
            logits = model.logits.save()
        for row, text in enumerate(PROMPTS):
            own = logits[row, mask[row]]  # the prompt's own tokens, in order
            expected = steered_alone(model, text, vector, positions, factor=2.0)
            assert torch.allclose(own, expected, atol=1e-5), (side, text)
            assert not torch.allclose(expected, hf_logits(model, alone(model, text)), atol=1e-3)  # it steers


def test_add_to_positions_with_batch_rows_steer_only_those_prompts(model):
    vector = vector_for(model)
    for side in SIDES:
        with padded(model, side) as mask, torch.no_grad(), model.trace(PROMPTS):
            add_to(model, 0, vector, positions=-1, batch=[1])
            add_to(model, 2, vector, positions=-1, batch=[1])  # a second call of the pass reuses its mask
            logits = model.logits.save()
        blocks = [model.layers._module[i] for i in (0, 2)]

        def add_last(s):
            s[0, -1] += vector

        for row, text in enumerate(PROMPTS):
            hooks = [lambda b=b: hooked(b, add_last) for b in blocks] if row == 1 else []
            assert torch.allclose(logits[row, mask[row]], hf_logits(model, alone(model, text), hooks), atol=1e-5), \
                (side, text)


def test_add_to_position_beyond_a_prompt_is_an_error(llama):
    for side in SIDES:
        with padded(llama, side), pytest.raises(IndexError, match="beyond prompt 1's 2 tokens"):
            with torch.no_grad(), llama.trace(PROMPTS):
                add_to(llama, LAYER, vector_for(llama), positions=4)
                llama.logits.save()


def generate_alone(model, text, vector, positions, new_tokens, step=0):
    """Each prompt alone: the vector added at its own ``positions`` in forward pass ``step`` only (0: the prompt's)."""
    ids, calls = alone(model, text), []

    def add(m, args, output):
        calls.append(None)
        if len(calls) == step + 1:
            output = output.clone()
            output[0, positions] += vector
        return output

    handle = model.layers._module[LAYER].register_forward_hook(add)
    try:
        with torch.no_grad():
            out = model._module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False)
    finally:
        handle.remove()
    return out[0, ids.shape[1]:]


def test_add_to_in_a_cached_generation_step_steers_each_prompts_new_token(llama):
    vector, steps = vector_for(llama), 3
    with padded(llama, "left"), torch.no_grad(), llama.generate(PROMPTS, max_new_tokens=steps, min_new_tokens=steps,
                                                               do_sample=False) as tracer:
        for step in tracer.iter[0:steps]:
            if step == 1:
                add_to(llama, LAYER, vector, positions=-1)
        ids = tracer.result.save()
    for row, text in enumerate(PROMPTS):
        expected = generate_alone(llama, text, vector, -1, steps, step=1)
        assert torch.equal(ids[row, -steps:].cpu(), expected), text
        assert not torch.equal(expected, generate_alone(llama, text, 0 * vector, -1, steps, step=1))  # it steers
    with pytest.raises(IndexError, match="not in this forward pass"):  # a step with a cache runs its new token only
        with torch.no_grad(), llama.generate(PROMPTS, max_new_tokens=2) as tracer:
            for step in tracer.iter[0:2]:
                if step == 1:
                    add_to(llama, LAYER, vector, positions=0)


def test_add_to_positions_after_a_read_is_refused(llama):
    with pytest.raises(ValueError, match="call add_to before reading any value"):
        with torch.no_grad(), llama.trace(PROMPTS):
            llama.layers[0].layer_output.save()
            add_to(llama, LAYER, vector_for(llama), positions=0)


# -- steered_generate ------------------------------------------------------------------------------

def test_steered_generate_prompt_scope_steers_each_prompts_own_tokens(llama):
    vector, new_tokens = 4 * vector_for(llama), 5
    for positions in (0, -1):
        with padded(llama, "left"):  # a batch generates left-padded
            ids = steered_generate(llama, PROMPTS, LAYER, vector, scope="prompt", positions=positions,
                                   max_new_tokens=new_tokens)
        for row, text in enumerate(PROMPTS):
            expected = generate_alone(llama, text, vector, positions, new_tokens)
            assert torch.equal(ids[row, -new_tokens:].cpu(), expected), (positions, text)
        unsteered = generate_alone(llama, PROMPTS[1], 0 * vector, positions, new_tokens)
        assert not torch.equal(unsteered, generate_alone(llama, PROMPTS[1], vector, positions, new_tokens))  # it steers


def test_steered_generate_refuses_a_right_padded_batch(llama):
    with padded(llama, "right"), pytest.raises(ValueError, match="right-padded"):
        steered_generate(llama, PROMPTS, LAYER, vector_for(llama), scope="prompt", positions=0, max_new_tokens=2)


# -- the last token --------------------------------------------------------------------------------

def test_run_prompts_reads_each_prompts_own_last_token(llama):
    prompts = [Prompt.from_strings(text, {"animal": ["cat", "dog"], "place": "mat"}, llama.tokenizer)
               for text in PROMPTS]
    expected = {category: torch.stack([hf_logits(llama, alone(llama, p.text))[-1].softmax(-1)[p.targets[category]]
                                       .sum() for p in prompts]) for category in ("animal", "place")}
    for side in SIDES:
        with padded(llama, side):
            got = run_prompts(llama, prompts, batch_size=len(prompts), progress=False)
        for category in expected:
            assert torch.allclose(got[category], expected[category], atol=1e-6), (side, category)


def last_token_streams(model, text):
    """``{layer: stream}``: each block's output at the prompt's last token, the prompt alone."""
    outs = {}
    hooks = [lambda i=i, b=b: hooked(b, lambda s, i=i: outs.__setitem__(i, s[0, -1].clone()))
             for i, b in enumerate(model.layers._module)]
    hf_logits(model, alone(model, text), hooks)
    return outs


def patched_alone(model, text, index, layer, stream):
    """Next-token probabilities of ``text`` alone, block ``layer``'s output at its token ``index`` replaced."""
    def patch(s):
        s[0, index] = stream

    return hf_logits(model, alone(model, text), [lambda: hooked(model.layers._module[layer], patch)])[-1].softmax(-1)


def test_patchscope_lens_patches_and_reads_each_prompts_own_tokens(llama):
    sources, targets, indices, layers = PROMPTS, ["the a the a", "the cat is", "tok20"], [-2, 1, 0], [0, 2]
    streams = [last_token_streams(llama, source) for source in sources]
    expected = torch.stack([torch.stack([patched_alone(llama, target, index, layer, streams[j][layer])
                                         for layer in layers]) for j, (target, index) in enumerate(zip(targets, indices))])
    expected_one_target = torch.stack([torch.stack([patched_alone(llama, "the cat is", 1, layer, streams[j][layer])
                                                    for layer in layers]) for j in range(len(sources))])
    for side in SIDES:
        with padded(llama, side), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the 1.x call: one index per target prompt
            got = patchscope_lens_1x(llama, sources, target_patch_prompts=TargetPromptBatch.from_prompts(targets, indices),
                                     layers=layers)
        assert torch.allclose(got.float(), expected, atol=1e-6), side
        with padded(llama, side):  # today's call: one target prompt
            got = patchscope_lens(llama, sources, "the cat is", index_to_patch=1, layers=layers)
        assert torch.allclose(got, expected_one_target, atol=1e-6), side


def test_patch_object_attn_lens_patches_and_reads_each_targets_own_tokens(llama):
    sources, targets, index, patches = PROMPTS, ["the a the a", "the cat", "Paris is in"], 1, 2
    attention = [block.self_attn for block in llama.layers._module]

    def attention_inputs(text):
        seen = {}
        handles = [a.register_forward_pre_hook(lambda m, args, kwargs, i=i: seen.__setitem__(
            i, (args[0] if args else kwargs["hidden_states"])[0, -1].clone()), with_kwargs=True)
            for i, a in enumerate(attention)]
        try:
            hf_logits(llama, alone(llama, text))
        finally:
            for handle in handles:
                handle.remove()
        return seen

    def replacing(module, stream):
        def hook(m, args, kwargs):
            hidden = (args[0] if args else kwargs["hidden_states"]).clone()
            hidden[0, index] = stream
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def patched(target, inputs, layer):  # attention layer .. layer + patches - 1 read the source's input
        hooks = [lambda i=i: replacing(attention[i], inputs[i]) for i in range(layer, min(len(attention), layer + patches))]
        return hf_logits(llama, alone(llama, target), hooks)[-1].softmax(-1)

    inputs = [attention_inputs(source) for source in sources]
    expected = torch.stack([torch.stack([patched(target, inputs[j], layer) for layer in range(llama.num_layers)])
                            for j, target in enumerate(targets)])
    for side in SIDES:
        with padded(llama, side), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            got = patch_object_attn_lens(llama, sources, targets, index, num_patches=patches)
        assert torch.allclose(got.float(), expected, atol=1e-6), side


# -- model.next_token_probs ------------------------------------------------------------------------

def own_last_probs(model, text, hooks=()):
    """The softmax of the unwrapped model's logits at ``text``'s last token, the prompt alone."""
    return hf_logits(model, alone(model, text), hooks)[-1].softmax(-1)


def test_next_token_probs_reads_each_prompts_own_last_token(model):
    expected = torch.stack([own_last_probs(model, text) for text in PROMPTS])
    for side in SIDES:
        with padded(model, side), torch.no_grad(), model.trace(PROMPTS):
            probs = model.next_token_probs.save()
        assert torch.allclose(probs, expected, atol=1e-6), side
        with padded(model, side), torch.no_grad(), model.trace() as tracer:  # two invokes, padded to one length
            with tracer.invoke(PROMPTS[:2]):
                first = model.next_token_probs.save()
            with tracer.invoke(PROMPTS[2]):
                second = model.next_token_probs.save()
        assert torch.allclose(torch.cat([first, second]), expected, atol=1e-6), side


def test_next_token_probs_after_add_to_positions_reads_each_prompts_own_last_token(llama):
    vector = vector_for(llama)

    def add_first(stream):
        stream[0, 0] += vector

    expected = torch.stack([own_last_probs(llama, text, [lambda: hooked(llama.layers._module[LAYER], add_first)])
                            for text in PROMPTS])
    for side in SIDES:
        with padded(llama, side), torch.no_grad(), llama.trace(PROMPTS):
            add_to(llama, LAYER, vector, positions=0)  # reads the batch's mask first: next_token_probs reuses it
            llama.layers[2].layer_output.save()
            probs = llama.next_token_probs.save()
        assert torch.allclose(probs, expected, atol=1e-6), side


def test_next_token_probs_past_the_inputs_reads_the_last_column_and_warns_under_right_padding(llama):
    expected = torch.stack([own_last_probs(llama, text) for text in PROMPTS])
    with padded(llama, "left"), warnings.catch_warnings(), torch.no_grad(), llama.trace(PROMPTS):
        warnings.simplefilter("error")  # the last column is each prompt's last token: no warning
        llama.layers[0].layer_output.save()  # the pass runs past its inputs: the mask cannot be read after this
        probs = llama.next_token_probs.save()
    assert torch.allclose(probs, expected, atol=1e-6)
    with padded(llama, "right") as mask, pytest.warns(UserWarning, match="padding_side='right'"):
        with torch.no_grad(), llama.trace(PROMPTS):
            llama.layers[0].layer_output.save()
            probs = llama.next_token_probs.save()
            logits = llama.logits.save()
    assert torch.equal(probs, logits[:, -1].softmax(-1)) and not mask[:, -1].all()  # a pad for the shorter prompts
    with padded(llama, "right"), warnings.catch_warnings(), torch.no_grad(), llama.trace(PROMPTS[0]):
        warnings.simplefilter("error")  # one prompt: nothing is padded
        llama.layers[0].layer_output.save()
        llama.next_token_probs.save()


def test_next_token_probs_in_a_generation_step_is_each_prompts_new_token(llama):
    steps = 2
    with padded(llama, "left"), torch.no_grad(), llama.generate(PROMPTS, max_new_tokens=steps, min_new_tokens=steps,
                                                               do_sample=False) as tracer:
        probs = nnsight.save([])
        for _ in tracer.iter[0:steps]:
            probs.append(llama.next_token_probs)
        ids = tracer.result.save()
    for row, text in enumerate(PROMPTS):
        new = ids[row, -steps:].cpu()
        for step in range(steps):  # the prompt and the tokens generated before the step, alone
            ran = torch.cat([alone(llama, text)[0], new[:step]]).unsqueeze(0)
            assert torch.allclose(probs[step][row], hf_logits(llama, ran)[-1].softmax(-1), atol=1e-5), (text, step)


def test_next_token_probs_runs_remotely_where_nnterp_is_not_installed(checkpoints, requests):  # noqa: F811
    model = load("llama", checkpoints)
    expected = torch.stack([own_last_probs(model, text) for text in PROMPTS])
    with padded(model, "right") as mask:  # tokenized here: a server tokenizes with its own tokenizer's side
        inputs = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    got, steered = [], []
    for remote in (False, True):
        with torch.no_grad(), model.trace(inputs, remote=remote):
            probs = model.next_token_probs.save()
        with torch.no_grad(), model.trace(inputs, remote=remote):  # the mask read by add_to, reused after a read
            add_to(model, LAYER, vector_for(model), positions=0)
            model.layers[2].layer_output.save()
            steered_probs = model.next_token_probs.save()
        got.append(probs.detach())
        steered.append(steered_probs.detach())
    assert requests and not mask[:, -1].all() and torch.equal(*got) and torch.equal(*steered)
    assert torch.allclose(got[1], expected, atol=1e-6) and not torch.allclose(steered[1], expected, atol=1e-3)
