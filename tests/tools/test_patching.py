"""Per-head, batched and attribution patching, against plain PyTorch hooks on the unwrapped HF model.

Ground truth: the clean run's tensor captured by a hook at the value's module boundary, then one plain forward of
the corrupted prompt (or batch of prompts) per patch with a hook that replaces that piece (a position of the value; a head's slice of
the output projection's input); for attribution patching, the gradient of the metric at the hooked corrupted
tensors from plain ``torch.autograd.grad``, times the hooked clean minus corrupted tensors. Batched patching must
give the hooks' numbers bit for bit: a pass of one patched run those of a hooked run of the prompt alone, a batched
pass those of a hooked batch of two rows (a batch of one can round differently: GPT-BigCode's multi-query attention
does, in the last bits; every batch of two or more rows rounds each row alike).
"""

from __future__ import annotations

import pytest
import torch

from nnterp import activation_patching
from nnterp.tools.patching import attribution_patching

from ..families.test_edits import hook_edit
from ..families.test_families import make, module_of, register_edit
from ..remote.test_remote import assert_same, checkpoints, requests, server  # noqa: F401  (the remote harness's fixtures)
from ..remote.test_remote import load as load_remote

CASES = ["gpt2", "llama", "gpt_bigcode", "qwen2"]  # Llama and Qwen2: GQA (4 heads, 2 kv); GPT-BigCode: MQA
CLEAN, CORRUPTED = "the cat sat on the mat", "the dog sat on the mat"
SEQ = 6
METRIC = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
VALUES = ("layer_input", "attention_output", "mlp_output", "layer_output")


def ids(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def forward(hf_model, input_ids, hooks=(), grad=False):
    """The HF model's logits with ``hooks`` (``(module, side, edit)``) installed for the call."""
    handles = [register_edit(hf_model, module, side, edit) for module, side, edit in hooks]
    try:
        with torch.set_grad_enabled(grad):
            return hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        for handle in handles:
            handle.remove()


def captured(model, hf_model, truth, name, text, grad=False):
    """``({layer: tensor at the value's boundary}, logits)`` of one plain forward (clones unless ``grad``)."""
    seen = {}

    def keep(layer):
        def record(t):
            seen[layer] = t if grad else t.detach().clone()
            return t
        return record

    hooks = [(*module_of(hf_model, truth, layer, name), keep(layer)) for layer in range(model.num_layers)]
    return seen, forward(hf_model, ids(model, text), hooks, grad)


def head_count(hf_model) -> int:
    return hf_model.config.num_attention_heads


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param, *make(request.param, torch.float32)[:3]


def test_per_head_patching_equals_a_hook_on_the_output_projection(case):
    _, model, hf_model, truth = case
    clean, _ = captured(model, hf_model, truth, "attention_premix", CLEAN)
    heads = head_count(hf_model)

    def hooked(layer, head, position=slice(None), rows=1):
        """The corrupted run with head ``head``'s slice of the output projection's input the clean run's (in row 0
        of ``rows`` copies of the prompt)."""
        def patch(t):
            t = t.clone()
            view, source = t.view(*t.shape[:2], heads, -1), clean[layer].view(1, SEQ, heads, -1)
            view[0, position, head] = source[0, position, head]
            return t
        module, side = module_of(hf_model, truth, layer, "attention_premix")
        return METRIC(forward(hf_model, ids(model, CORRUPTED).repeat(rows, 1), [(module, side, patch)]))[0]

    for positions in (None, [1, 4, -1]):
        at = [slice(None)] if positions is None else positions
        shape = (model.num_layers, heads) if positions is None else (model.num_layers, len(positions), heads)
        for rows, sizes in ((1, (1,)), (2, (None, 3, 64))):  # one patched run per pass; batched passes
            expected = torch.tensor([[[hooked(layer, head, p, rows) for head in range(heads)] for p in at]
                                     for layer in range(model.num_layers)]).view(shape)
            for batch_size in sizes:
                effects = activation_patching(model, CLEAN, CORRUPTED, METRIC, per="head", positions=positions,
                                              batch_size=batch_size, progress=False)
                assert effects.shape == shape
                assert torch.equal(effects, expected), f"positions={positions}, batch_size={batch_size}"


def test_batched_patching_equals_sequential_and_hooks_on_every_value(case):
    _, model, hf_model, truth = case
    for name in VALUES:
        clean, _ = captured(model, hf_model, truth, name, CLEAN)

        def hooked(layer, position, rows, name=name, clean=clean):
            def patch(t):
                t = t.clone()
                t[0, position] = clean[layer][0, position]
                return t
            module, side = module_of(hf_model, truth, layer, name)
            patched = forward(hf_model, ids(model, CORRUPTED).repeat(rows, 1), [(module, side, hook_edit(name, patch))])
            return METRIC(patched)[0]

        sequential = activation_patching(model, CLEAN, CORRUPTED, METRIC, value=name, batch_size=1, progress=False)
        expected = torch.tensor([[hooked(layer, p, 1) for p in range(SEQ)] for layer in range(model.num_layers)])
        assert torch.equal(sequential, expected), f"{name}: one patched run per pass"
        expected = torch.tensor([[hooked(layer, p, 2) for p in range(SEQ)] for layer in range(model.num_layers)])
        for batch_size in (None, 4, 7, 64):  # 4 and 7 rows: passes that span two layers
            batched = activation_patching(model, CLEAN, CORRUPTED, METRIC, value=name, batch_size=batch_size,
                                          progress=False)
            assert torch.equal(batched, expected), f"{name}: batch_size={batch_size}"
            # a batch rounds as a single run within float32 (bit for bit on all but MQA's attention)
            assert torch.allclose(batched, sequential, rtol=1e-5, atol=1e-6)
    # layers in any order, repeated, and a subset of positions: the rows as asked
    layers, positions = [2, 0, 2], [5, 1]
    batched = activation_patching(model, CLEAN, CORRUPTED, METRIC, layers=layers, positions=positions, batch_size=3,
                                  progress=False)
    assert torch.equal(batched, expected[layers][:, positions])


@pytest.mark.parametrize("per, name", [("position", "layer_output"), ("position", "attention_output"),
                                       ("position", "mlp_output"), ("head", "attention_premix"),
                                       ("neuron", "mlp_neurons")])
def test_attribution_patching_equals_autograd_on_hooked_activations(case, per, name):
    _, model, hf_model, truth = case
    clean, _ = captured(model, hf_model, truth, name, CLEAN)
    corrupted, logits = captured(model, hf_model, truth, name, CORRUPTED, grad=True)
    layers = list(range(model.num_layers))
    grads = torch.autograd.grad(METRIC(logits).sum(), [corrupted[layer] for layer in layers])
    rows = []
    for layer, grad in zip(layers, grads):
        product = ((clean[layer] - corrupted[layer].detach()) * grad)[0]  # [seq, ...]
        if per == "head":
            rows.append(product.view(SEQ, head_count(hf_model), -1).sum(-1))
        else:
            rows.append(product.sum(-1) if per == "position" else product)
    expected = torch.stack(rows)
    value = None if name in ("attention_premix", "mlp_neurons") else name
    attributions = attribution_patching(model, CLEAN, CORRUPTED, METRIC, value=value, per=per)
    assert attributions.shape == expected.shape
    assert torch.equal(attributions, expected)
    assert all(p.grad is None for p in hf_model.parameters()), "the weights' gradients are not computed"
    # a subset of layers, as asked
    assert torch.equal(attribution_patching(model, CLEAN, CORRUPTED, METRIC, value=value, per=per, layers=[2, 0]),
                       expected[[2, 0]])


def test_refusals(case):
    _, model, _, _ = case
    with pytest.raises(ValueError, match="per='head' patches attention_premix"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, value="layer_output", per="head")
    with pytest.raises(ValueError, match="per is one of"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, per="neuron")
    with pytest.raises(ValueError, match="batch_size"):
        activation_patching(model, CLEAN, CORRUPTED, METRIC, batch_size=0)
    # a metric of the whole patched run, as TransformerLens's users write it, is one score of the one pair
    assert torch.equal(activation_patching(model, CLEAN, CORRUPTED, lambda logits: METRIC(logits).mean(),
                                           progress=False, layers=[1]),
                       activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False, layers=[1]))
    with pytest.raises(ValueError, match=r"must return one number; it gave shape \[6\]"):
        activation_patching(model, CLEAN, CORRUPTED, lambda logits: logits[0, :, 5], progress=False)
    with pytest.raises(ValueError, match="one length"):
        attribution_patching(model, CLEAN, "the dog", METRIC)
    with pytest.raises(ValueError, match="per='neuron' patches mlp_neurons"):
        attribution_patching(model, CLEAN, CORRUPTED, METRIC, value="mlp_output", per="neuron")


@pytest.mark.parametrize("remote_case", ["gpt2", "llama"])
def test_patching_runs_remotely_bit_exactly(remote_case, checkpoints, requests):  # noqa: F811
    model = load_remote(remote_case, checkpoints)
    for kwargs in (dict(per="head", batch_size=5), dict(value="mlp_output", layers=[0, 2], batch_size=4)):
        assert_same(activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False, **kwargs),
                    activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False, remote=True, **kwargs))
    for per in ("position", "head", "neuron"):
        assert_same(attribution_patching(model, CLEAN, CORRUPTED, METRIC, per=per),
                    attribution_patching(model, CLEAN, CORRUPTED, METRIC, per=per, remote=True))
    assert requests


# An IOI-like batch of 8 prompt pairs, as TransformerLens's users write it: [batch, seq] token tensors, the corrupted
# prompts with another name in each, each pair's answer and wrong answer, and a metric of the whole batch
PAIRS, LENGTH = 8, 7


def ioi_batch(vocab_size: int):
    generator = torch.Generator().manual_seed(3)
    clean = torch.randint(3, vocab_size, (PAIRS, LENGTH), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(3, vocab_size, (PAIRS,), generator=generator)
    answers, wrong = clean[:, 2], corrupted[:, 2]
    rows = torch.arange(PAIRS)

    def metric(logits):  # the mean logit difference over the batch: one number
        return (logits[rows, -1, answers] - logits[rows, -1, wrong]).mean()
    return clean, corrupted, metric


def block_forward(hf_model, input_ids, layer=None, edit=None, grad=False):
    """The HF model's logits, with a plain forward hook editing block ``layer``'s output (``layer_output``)."""
    handles = []
    if edit is not None:
        def hook(module, args, output):
            return (edit(output[0]), *output[1:]) if isinstance(output, tuple) else edit(output)
        handles.append(hf_model.base_model_blocks[layer].register_forward_hook(hook))
    try:
        with torch.set_grad_enabled(grad):
            return hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        for handle in handles:
            handle.remove()


def block_outputs(hf_model, input_ids, grad=False):
    """``({layer: block output}, logits)`` of one plain forward, each block's output caught by a forward hook."""
    seen, handles = {}, []
    for layer, block in enumerate(hf_model.base_model_blocks):
        def hook(module, args, output, layer=layer):
            tensor = output[0] if isinstance(output, tuple) else output
            seen[layer] = tensor if grad else tensor.detach().clone()
        handles.append(block.register_forward_hook(hook))
    try:
        with torch.set_grad_enabled(grad):
            logits = hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


def test_a_batch_of_prompt_pairs_patches_every_pair_at_once_as_hooks_do(case):
    _, model, hf_model, _ = case
    clean, corrupted, metric = ioi_batch(hf_model.config.vocab_size)
    sources, _ = block_outputs(hf_model, clean)

    def hooked(layer, position):
        def patch(t):
            t = t.clone()
            t[:, position] = sources[layer][:, position]
            return t
        return metric(block_forward(hf_model, corrupted, layer, patch)).item()

    expected = torch.tensor([[hooked(layer, p) for p in range(LENGTH)] for layer in range(model.num_layers)])
    one_by_one = activation_patching(model, clean, corrupted, metric, batch_size=1, progress=False)
    assert one_by_one.shape == (model.num_layers, LENGTH)
    assert torch.equal(one_by_one, expected)  # each pass the hooked batch of 8 rows itself
    for batch_size in (None, 5):  # several patched runs of 8 rows in a pass: rounding of other row counts
        torch.testing.assert_close(activation_patching(model, clean, corrupted, metric, batch_size=batch_size,
                                                       progress=False), expected, rtol=1e-5, atol=1e-5)
    # the unpatched batches bound it: patching the last block's last position restores the clean metric
    clean_score = metric(block_forward(hf_model, clean)).item()
    assert expected[-1, -1].item() == pytest.approx(clean_score, rel=1e-5, abs=1e-5)
    # attribution patching over the same batch: the gradient of the batch's metric, summed over the pairs
    corrupted_values, logits = block_outputs(hf_model, corrupted, grad=True)
    layers = list(range(model.num_layers))
    grads = torch.autograd.grad(metric(logits), [corrupted_values[layer] for layer in layers])
    expected = torch.stack([((sources[layer] - corrupted_values[layer].detach()) * grad).sum((0, -1))
                            for layer, grad in zip(layers, grads)])
    estimate = attribution_patching(model, clean, corrupted, metric)
    assert estimate.shape == (model.num_layers, LENGTH)
    torch.testing.assert_close(estimate, expected, rtol=1e-5, atol=1e-6)


def test_a_list_of_prompt_pairs_is_the_batch_of_their_tokens(case):
    _, model, hf_model, _ = case
    clean = ["the cat sat on the mat", "the dog sat on the mat", "a cat is in the city"]
    corrupted = ["the dog sat on the mat", "the cat sat on the mat", "a dog is in the city"]
    rows = torch.arange(len(clean))

    def metric(logits):
        return logits[rows, -1, 5].mean()
    as_text = activation_patching(model, clean, corrupted, metric, progress=False)
    clean_ids = torch.stack([ids(model, text)[0] for text in clean])
    corrupted_ids = torch.stack([ids(model, text)[0] for text in corrupted])
    assert torch.equal(as_text, activation_patching(model, clean_ids, corrupted_ids, metric, progress=False))
    assert torch.equal(attribution_patching(model, clean, corrupted, metric),
                       attribution_patching(model, clean_ids, corrupted_ids, metric))
    # a one-pair list, a [seq] tensor and the strings are one pair
    one = activation_patching(model, CLEAN, CORRUPTED, METRIC, progress=False)
    assert torch.equal(activation_patching(model, [CLEAN], [CORRUPTED], METRIC, progress=False), one)
    assert torch.equal(activation_patching(model, ids(model, CLEAN)[0], ids(model, CORRUPTED)[0], METRIC,
                                           progress=False), one)


def test_a_batch_misused_names_the_shape_it_needs(case):
    _, model, hf_model, _ = case
    clean, corrupted, metric = ioi_batch(hf_model.config.vocab_size)
    per_row = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731  (one score per pair: no reduction)
    for call in (activation_patching, attribution_patching):
        with pytest.raises(ValueError, match=r"\[8, seq, vocab\] for the 8 prompt pairs' rows, and must return one "
                                             r"number; it gave shape \[8\]"):
            call(model, clean, corrupted, per_row, **({"progress": False} if call is activation_patching else {}))
        with pytest.raises(ValueError, match=r"\[batch, seq\] tensors of one shape, not \[8, 7\] and \[7, 7\]"):
            call(model, clean, corrupted[:7], metric)
        with pytest.raises(ValueError, match=r"prompts have 7 tokens, the corrupted ones 6"):
            call(model, clean, corrupted[:, :6], metric)
        with pytest.raises(ValueError, match=r"shape \[1, 8, 7\]; they must be a string, a list of strings"):
            call(model, clean[None], corrupted, metric)
        with pytest.raises(ValueError, match=r"one token length, a \[batch, seq\] batch without padding; they have "
                                             r"\[6, 3\] tokens"):
            call(model, [CLEAN, "the dog sat"], [CORRUPTED, "the cat sat"], metric)
