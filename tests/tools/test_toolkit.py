"""The research tools, against ground truth from plain hooks on the HF model."""

from __future__ import annotations

import resource

import pytest
import torch
import transformers as T

from nnterp import (
    Collection,
    Prompt,
    StandardizedTransformer,
    activation_patching,
    add_to,
    collect,
    first_tokens,
    logit_difference,
    logit_lens,
    patchscope_lens,
    run_prompts,
    skip_layers,
    steered_generate,
)
from nnterp.families import BY_MODEL_TYPE

from ..conftest import WORDS, build_tiny, tiny_tokenizer

CLEAN, CORRUPTED = "the cat sat on the mat", "the dog sat on the mat"


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


def ids_of(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def hf_logits(model, ids, hooks=()):
    """The unwrapped HF model's logits, with (module, hook_fn, is_pre) hooks installed for the call."""
    handles = [m.register_forward_pre_hook(f, with_kwargs=True) if pre else m.register_forward_hook(f)
               for m, f, pre in hooks]
    try:
        with torch.no_grad():
            return model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        for h in handles:
            h.remove()


def capture_block_outputs(model, ids):
    outs = {}
    hooks = [(b, lambda m, a, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()), False)
             for i, b in enumerate(model.layers._module)]
    return outs, hf_logits(model, ids, hooks)


# -- lens ------------------------------------------------------------------------------------------

def test_logit_lens_equals_readout_of_hooked_streams(llama):
    probs = logit_lens(llama, [CLEAN, "the dog"])
    assert probs.shape == (2, llama.num_layers, llama.vocab_size)
    outs, logits = capture_block_outputs(llama, ids_of(llama, CLEAN))
    hf = llama._module
    with torch.no_grad():
        for i, h in outs.items():  # the readout by hand: final norm, head
            expected = hf.lm_head(hf.model.norm(h[:, -1])).softmax(-1)
            assert torch.allclose(probs[0, i], expected[0], atol=1e-6)
    assert torch.allclose(probs[0, -1], logits[0, -1].softmax(-1), atol=1e-6)  # the model's own distribution


def test_logit_lens_at_every_position(llama):
    probs = logit_lens(llama, CLEAN, position=None, layers=[0, 2])
    assert probs.shape == (1, 2, 6, llama.vocab_size)
    assert torch.allclose(probs[0, :, -1], logit_lens(llama, CLEAN, layers=[0, 2])[0])


@pytest.mark.parametrize("model_type", ["gemma2", "cohere", "granite", "deepseek_v4", "zaya"])
def test_logit_lens_last_layer_is_the_model_on_readout_families(model_type):
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE[model_type].tiny_config()), tokenizer=tiny_tokenizer())
    with torch.no_grad(), model.trace(CLEAN):
        expected = model.next_token_probs.save()
    assert torch.allclose(logit_lens(model, CLEAN)[:, -1], expected.float(), atol=1e-6)


# -- patching --------------------------------------------------------------------------------------

def test_activation_patching_against_hooks(llama):
    cat, dog = (llama.tokenizer.convert_tokens_to_ids(w) for w in ("cat", "dog"))
    metric = logit_difference(cat, dog)
    effects = activation_patching(llama, CLEAN, CORRUPTED, metric, layers=[0, 2])
    assert effects.shape == (2, 6)
    clean_out, clean_logits = capture_block_outputs(llama, ids_of(llama, CLEAN))
    corrupted = ids_of(llama, CORRUPTED)
    for row, layer in enumerate([0, 2]):
        for position in range(6):
            def patch(m, a, o, p=position, source_layer=layer):
                o = o.clone()
                o[:, p] = clean_out[source_layer][:, p]
                return o
            expected = metric(hf_logits(llama, corrupted, [(llama.layers._module[layer], patch, False)]))
            assert torch.allclose(effects[row, position], expected[0], atol=1e-5)
    # patching the last position of the last block restores the clean metric exactly at the output
    assert torch.allclose(effects[1, -1], metric(clean_logits)[0], atol=1e-5)
    assert not torch.allclose(effects[0, 1], metric(hf_logits(llama, corrupted))[0])  # the changed token matters


def test_patching_a_whole_layer_restores_the_clean_logits(llama):
    with torch.no_grad(), llama.trace(CLEAN):
        source = llama.layers[1].layer_output.save()
        clean = llama.logits.save()
    with torch.no_grad(), llama.trace(CORRUPTED):
        llama.layers[1].layer_output = source
        patched = llama.logits.save()
    assert torch.equal(patched, clean)


def test_patching_prompts_of_different_lengths_is_refused(llama):
    with pytest.raises(ValueError, match="one length"):
        activation_patching(llama, CLEAN, "the dog", logit_difference(3, 4))


def test_patchscope_lens(llama):
    probs = patchscope_lens(llama, ["the cat sat", "the dog"], "the a the a", index_to_patch=-1, layers=[0, 2])
    assert probs.shape == (2, 2, llama.vocab_size)
    outs, _ = capture_block_outputs(llama, ids_of(llama, "the dog"))
    target = ids_of(llama, "the a the a")

    def patch(m, a, o):
        o = o.clone()
        o[:, -1] = outs[2][:, -1]
        return o

    expected = hf_logits(llama, target, [(llama.layers._module[2], patch, False)])[0, -1].softmax(-1)
    assert torch.allclose(probs[1, 1], expected, atol=1e-6)


# -- steering --------------------------------------------------------------------------------------

def test_steering_with_zero_changes_nothing_and_otherwise_only_the_chosen_rows(llama):
    batch = torch.cat([ids_of(llama, CLEAN), ids_of(llama, CORRUPTED)])
    with torch.no_grad(), llama.trace(batch):
        clean = llama.logits.save()
    with torch.no_grad(), llama.trace(batch):
        add_to(llama, [1], torch.zeros(64))
        zero = llama.logits.save()
    assert torch.equal(zero, clean)
    vector = torch.randn(64)
    with torch.no_grad(), llama.trace(batch):
        add_to(llama, [1], vector, factor=2.0, positions=[3], batch=[0])
        mid = llama.layers[1].layer_output.save()
        steered = llama.logits.save()

    def add(m, a, o):
        o = o.clone()
        o[0, 3] += 2.0 * vector
        return o

    assert torch.equal(steered, hf_logits(llama, batch, [(llama.layers._module[1], add, False)]))
    assert torch.equal(steered[1], clean[1])  # the other row
    assert torch.equal(steered[0, :3], clean[0, :3])  # earlier positions (causal)
    assert not torch.equal(steered[0, 3:], clean[0, 3:])
    assert mid.shape == (2, 6, 64)


def test_model_steer_is_the_1x_method(llama):
    vector = torch.randn(64)
    with torch.no_grad(), llama.trace(CLEAN):
        llama.steer([0, 2], vector, factor=0.5, token_positions=-1)
        a = llama.logits.save()
    with torch.no_grad(), llama.trace(CLEAN):
        add_to(llama, [2, 0], vector, factor=0.5, positions=-1)
        b = llama.logits.save()
    assert torch.equal(a, b)


@pytest.mark.parametrize("scope, steps", [("prompt", {0}), ("generated", {1, 2, 3, 4}), ("all", {0, 1, 2, 3, 4}),
                                          (range(2, 4), {2, 3})])
def test_steering_during_generation_follows_its_scope(llama, scope, steps):
    vector = 3 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    prompt = ids_of(llama, CLEAN)
    got = steered_generate(llama, prompt, [1], vector, scope=scope, max_new_tokens=5)

    calls = []

    def add(m, a, o):  # ground truth: count the forward passes of generate; step 0 is the prompt
        step = len(calls)
        calls.append(step)
        if step in steps:
            o = o.clone()
            o += vector
        return o

    handle = llama.layers._module[1].register_forward_hook(add)
    try:
        with torch.no_grad():
            expected = llama._module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                              min_new_tokens=5, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(got.cpu(), expected)
    plain = steered_generate(llama, prompt, [1], torch.zeros(64), scope="all", max_new_tokens=5)
    with torch.no_grad():
        unsteered = llama._module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                           min_new_tokens=5, do_sample=False)
    assert torch.equal(plain.cpu(), unsteered)


def test_generation_scope_is_checked(llama):
    with pytest.raises(ValueError, match="scope"):
        steered_generate(llama, CLEAN, [1], torch.zeros(64), scope="sometimes", max_new_tokens=2)
    with pytest.raises(TypeError, match="the layers come before the vector, as in add_to"):
        steered_generate(llama, CLEAN, torch.zeros(64), [1], max_new_tokens=2)


# -- skipping --------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "bloom", "zaya"])
def test_skipping_blocks_against_hooks(model_type):
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE[model_type].tiny_config()), tokenizer=tiny_tokenizer())
    ids = ids_of(model, CLEAN)
    with torch.no_grad(), model.trace(ids):
        x1 = model.layers[1].layer_input.save()
        skip_layers(model, 1, 1)
        x2 = model.layers[2].layer_input.save()
        logits = model.logits.save()
    assert torch.equal(x1, x2)

    def identity(m, args, kwargs, out):
        stream = args[0] if args else kwargs["hidden_states"]
        if isinstance(out, tuple):
            return (stream, *(args[1:2] if model_type == "zaya" else (None,)))
        return stream

    block = model.layers._module[1]
    handle = block.register_forward_hook(identity, with_kwargs=True)
    try:
        expected = hf_logits(model, ids)
    finally:
        handle.remove()
    assert torch.equal(logits, expected)


def test_skip_layers_method(llama):
    with torch.no_grad(), llama.trace(CLEAN):
        llama.skip_layers(0, 1)
        a = llama.logits.save()
    with torch.no_grad(), llama.trace(CLEAN):
        x0 = llama.layers[0].layer_input.save()
        llama.layers[2].layer_input = x0.clone()
        b = llama.logits.save()
    assert torch.equal(a, b)


# -- prompts ---------------------------------------------------------------------------------------

def test_first_tokens_on_gpt2(gpt2_tokenizer_dir):
    tok = T.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    paris = first_tokens(tok, "Paris")
    assert paris == [tok.encode(" Paris")[0], tok.encode("Paris")[0]] and len(set(paris)) == 2
    assert first_tokens(tok, " Paris") == paris


def test_prompts_and_batched_runs(llama):
    prompts = [Prompt.from_strings("the cat sat on the", {"place": "mat", "animal": ["cat", "dog"]}, llama.tokenizer),
               Prompt.from_strings("the dog", {"place": "mat", "animal": "cat"}, llama.tokenizer)]
    assert not prompts[0].collisions()
    batched = run_prompts(llama, prompts, batch_size=2)
    singles = run_prompts(llama, prompts, batch_size=1)
    for category in ("place", "animal"):
        assert batched[category].shape == (2,)
        assert torch.allclose(batched[category], singles[category], atol=1e-6)
    with torch.no_grad(), llama.trace("the dog"):
        probs = llama.next_token_probs.save()
    assert torch.allclose(singles["animal"][1], probs[0, llama.tokenizer.convert_tokens_to_ids("cat")], atol=1e-6)
    lens = run_prompts(llama, prompts, get_probs=logit_lens)
    assert lens["place"].shape == (2, llama.num_layers)
    assert torch.allclose(lens["place"][:, -1], batched["place"], atol=1e-6)


# -- collection ------------------------------------------------------------------------------------

def sentences(n):
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(n)]


def test_collection_equals_single_traces(llama, tmp_path):
    prompts = sentences(10)
    last = collect(llama, prompts, tmp_path / "last", values=["layer_output", "mlp.mlp_output"], layers=[0, 2],
                   batch_size=4, progress=False)
    every = collect(llama, prompts, tmp_path / "all", values=["layer_input"], positions="all", batch_size=3,
                    progress=False)
    assert last["layer_output"].shape == (10, 2, 64) and last.complete
    offsets = every.offsets
    for i, prompt in enumerate(prompts):
        with torch.no_grad(), llama.trace(prompt):
            mlp = llama.layers[0].mlp.mlp_output.save()
            out0 = llama.layers[0].layer_output.save()
            out2 = llama.layers[2].layer_output.save()
        assert torch.allclose(last["layer_output"][i, 0], out0[0, -1], atol=1e-5)
        assert torch.allclose(last["layer_output"][i, 1], out2[0, -1], atol=1e-5)
        assert torch.allclose(last["mlp_output"][i, 0], mlp[0, -1], atol=1e-5)
        with torch.no_grad(), llama.trace(prompt):
            x0 = llama.layers[0].layer_input.save()
        rows = every["layer_input"][offsets[i]:offsets[i + 1], 0]
        assert torch.allclose(rows, x0[0], atol=1e-5)


def test_collection_resumes_without_redoing_batches(llama, tmp_path, monkeypatch):
    import nnterp.collection.runner as runner
    import nnterp.collection.shards as module

    prompts = sentences(9)
    real_save, calls = module.save_file, []

    def failing_save(tensors, path):
        if len(calls) == 2:
            raise KeyboardInterrupt("stopped")
        calls.append(path)
        real_save(tensors, path)

    monkeypatch.setattr(module, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        collect(llama, prompts, tmp_path, batch_size=2, progress=False)
    assert not Collection(tmp_path).complete
    monkeypatch.setattr(module, "save_file", real_save)
    ran = []
    real_batch = runner._collect_batch
    monkeypatch.setattr(runner, "_collect_batch", lambda *a: ran.append(1) or real_batch(*a))
    done = collect(llama, prompts, tmp_path, batch_size=2, progress=False)
    assert len(ran) == 3 and done.complete  # 5 batches, 2 already on disk
    fresh = collect(llama, prompts, tmp_path / "fresh", batch_size=2, progress=False)
    assert torch.equal(done["layer_output"], fresh["layer_output"])
    with pytest.raises(ValueError, match="other settings"):
        collect(llama, prompts[:4], tmp_path, batch_size=2, progress=False)


def test_collection_memory_is_flat(llama, tmp_path):
    def peak_after(n, folder):
        collect(llama, sentences(n), folder, batch_size=50, progress=False)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    peak_after(200, tmp_path / "warm")
    small = peak_after(200, tmp_path / "small")
    large = peak_after(2000, tmp_path / "large")
    assert (large - small) / 1024 < 20  # MiB: ten times the prompts, no more memory
    assert Collection(tmp_path / "large")["layer_output"].shape == (2000, 3, 64)


# -- plots and the CLI -----------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_are_valid_pngs(llama, tmp_path):
    import matplotlib.image

    from nnterp.tools.plots import plot_logit_lens, plot_patching

    lens_png = plot_logit_lens(llama, CLEAN, tmp_path / "lens.png", html=False)
    effects = activation_patching(llama, CLEAN, CORRUPTED, logit_difference(3, 4), layers=[0, 1])
    patch_png = plot_patching(effects, CLEAN.split(), tmp_path / "patch.png", layers=[0, 1], html=False)
    for path in (lens_png, patch_png):
        assert path.read_bytes()[:8] == PNG
        assert matplotlib.image.imread(path).shape[2] in (3, 4)


def test_lens_cli(tmp_path, capsys):
    build_tiny(BY_MODEL_TYPE["llama"].tiny_config()).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    from nnterp.__main__ import main

    main(["lens", "--model", str(tmp_path / "m"), "--prompt", CLEAN, "--plot", str(tmp_path / "l.png")])
    out = capsys.readouterr().out
    assert "layer" in out and len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3
    assert (tmp_path / "l.png").read_bytes()[:8] == PNG


# -- the 1.x names ---------------------------------------------------------------------------------

def test_1x_accessors_are_the_standard_values(llama):
    with torch.no_grad(), llama.trace(CLEAN):
        a = llama.layers_input[1].save()
        b = llama.attentions_output[1].save()
        c = llama.mlps_output[1].save()
        d = llama.layers_output[1].save()
    with torch.no_grad(), llama.trace(CLEAN):
        x = llama.layers[1].layer_input.save()
        y = llama.layers[1].layer_output.save()
    assert torch.equal(a, x) and torch.equal(d, y) and torch.equal(a + b + c, d)
    with torch.no_grad(), llama.trace(CLEAN):
        llama.layers_output[0] = llama.layers_output[0] * 0
        zeroed = llama.layers_input[1].save()
    assert not zeroed.any() and len(llama.layers_output) == 3
    from nnterp.interventions import logit_lens as old_lens

    assert old_lens is logit_lens  # 1.x's run_prompts and its shapes: tests/compat/test_legacy.py
