"""Dictionaries by standard name: each producer's files, read by nnterp, spliced into a trace.

Ground truth is independent of nnterp: the files are written as each producer writes them (config keys and
tensor names from their sources: SAELens's ``SAE.save_model``, sparsify's ``SparseCoder.save_to_disk``,
dictionary_learning's ``trainSAE``), each format's own encoding is written out below from those sources, and
the values are captured (and edited) by plain PyTorch forward hooks on the unwrapped HF model, at the module
boundaries of test_families' truth tables.
"""

from __future__ import annotations

import json

import nnsight
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nnterp.dictionaries import Dictionary, DictionaryError, load_dictionary, site_table
from nnterp.dictionaries.splicing import splice, top_activations

from ..families.test_families import make
from ..remote.test_remote import checkpoints, requests, server  # noqa: F401  (the remote harness's fixtures)
from ..remote.test_remote import load as load_remote

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
D_SAE, K = 96, 8
MODELS: dict = {}


def model_of(case, dtype=torch.float32):
    if (case, dtype) not in MODELS:
        model, hf, truth, *_ = make(case, dtype)
        MODELS[(case, dtype)] = model, hf, truth
    return MODELS[(case, dtype)]


def hooked(case, sites, edits=None, dtype=torch.float32, inputs=None):
    """A plain forward of the unwrapped model: ``({(layer, value): tensor}, logits)`` at ``sites``, with
    ``edits[(layer, value)](x) -> x'`` applied there (a block's input in place: the stream it goes on with), on
    ``IDS`` or ``inputs`` (the model's keyword arguments: a padded batch's ids, mask and positions)."""
    model, hf, truth = model_of(case, dtype)
    captured, handles = {}, []
    for layer, value in sites:
        path, side = truth(layer)[value]
        block = hf.base_model_blocks[layer]
        module = block.get_submodule(path) if path else block
        edit = (edits or {}).get((layer, value))
        if side == "in":
            def pre(mod, args, kwargs, key=(layer, value), edit=edit):
                x = args[0] if args else kwargs["hidden_states"]
                captured.setdefault(key, x.detach().clone())
                if edit is not None:
                    x.copy_(edit(x))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(mod, args, out, key=(layer, value), edit=edit):
                x = out[0] if isinstance(out, tuple) else out
                captured.setdefault(key, x.detach().clone())
                if edit is not None:
                    new = edit(x)
                    return (new, *out[1:]) if isinstance(out, tuple) else new
            handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            logits = hf(**(inputs or {"input_ids": IDS})).logits
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


def spliced(model, dictionaries, edit=None, keep_error=True):
    """A trace that splices ``dictionaries`` in order, applying ``edit(features)`` in each: (features, logits)."""
    with torch.no_grad(), model.trace(IDS):
        seen = nnsight.save([])
        for dictionary in dictionaries:
            with splice(model, dictionary, keep_error=keep_error) as features:
                seen.append(features.clone())
                if edit is not None:
                    edit(features)
        logits = nnsight.save(model.logits)
    return seen, logits


def rand(*shape, seed, scale=0.3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# -- the producers' files, written as they write them -----------------------------------------------

def saelens_folder(root, architecture, d_in, hook, seed=0, normalize="none", apply_b_dec=True, extra_cfg=None,
                   hook_out=None, d_out=None):
    """SAELens 6's ``save_model``: ``cfg.to_dict()`` as cfg.json, the state dict as sae_weights.safetensors."""
    d_out = d_out or d_in
    weights = {"W_enc": rand(d_in, D_SAE, seed=seed), "W_dec": rand(D_SAE, d_out, seed=seed + 1),
               "b_dec": rand(d_out, seed=seed + 2, scale=0.1)}
    if architecture == "gated":
        weights.update(b_gate=rand(D_SAE, seed=seed + 3, scale=0.1), b_mag=rand(D_SAE, seed=seed + 4, scale=0.1),
                       r_mag=rand(D_SAE, seed=seed + 5, scale=0.1))
    else:
        weights["b_enc"] = rand(D_SAE, seed=seed + 3, scale=0.1)
    if architecture in ("jumprelu", "jumprelu_transcoder"):
        weights["threshold"] = rand(D_SAE, seed=seed + 6, scale=0.1).abs()
    if architecture == "skip_transcoder":
        weights["W_skip"] = rand(d_out, d_in, seed=seed + 7, scale=0.05)
    cfg = {"d_in": d_in, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": apply_b_dec,
           "normalize_activations": normalize, "reshape_activations": "hook_z" if hook.endswith("hook_z") else "none",
           "metadata": {"sae_lens_version": "6.5.1", "sae_lens_training_version": "6.5.1", "model_name": "tiny",
                        "hook_name": hook, "hook_head_index": None, "prepend_bos": True, "context_size": 128},
           "architecture": architecture, **(extra_cfg or {})}
    if hook_out:
        cfg["metadata"]["hook_name_out"] = hook_out
        cfg["d_out"] = d_out
    folder = root / f"saelens-{architecture}-{seed}"
    folder.mkdir()
    save_file(weights, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder, cfg, weights


def saelens_features(cfg, w, x):
    """SAELens's encode (process_sae_in, then the architecture's activation)."""
    x = x.float()
    if cfg["normalize_activations"] == "constant_norm_rescale":
        x = x * (cfg["d_in"] ** 0.5) / x.norm(dim=-1, keepdim=True)
    elif cfg["normalize_activations"] == "layer_norm":
        x = x - x.mean(-1, keepdim=True)
        x = x / (x.std(-1, keepdim=True) + 1e-5)
    if cfg["apply_b_dec_to_input"]:
        x = x - w["b_dec"]
    architecture = cfg["architecture"]
    if architecture == "gated":
        active = (x @ w["W_enc"] + w["b_gate"] > 0).float()
        return active * torch.relu(x @ (w["W_enc"] * w["r_mag"].exp()) + w["b_mag"])
    pre = x @ w["W_enc"] + w["b_enc"]
    if architecture in ("jumprelu", "jumprelu_transcoder"):
        return torch.relu(pre) * (pre > w["threshold"]).float()
    if architecture == "topk":
        if cfg.get("rescale_acts_by_decoder_norm"):
            pre = pre * w["W_dec"].norm(dim=-1)
        values, indices = torch.topk(pre, k=cfg["k"], dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
    return torch.relu(pre)


def sparsify_folder(root, hookpoint, d_in, transcode=False, skip=False, activation="topk", seed=0, d_out=None):
    """sparsify's ``save_to_disk``: ``save_model`` of the SparseCoder (encoder.weight / encoder.bias / W_dec /
    b_dec / W_skip) and ``{**cfg.to_dict(), "d_in": d_in}`` as cfg.json, in a folder named after the hookpoint."""
    d_out = d_out or d_in
    weights = {"encoder.weight": rand(D_SAE, d_in, seed=seed), "encoder.bias": rand(D_SAE, seed=seed + 1, scale=0.1),
               "W_dec": rand(D_SAE, d_out, seed=seed + 2), "b_dec": rand(d_out, seed=seed + 3, scale=0.1)}
    if skip:
        weights["W_skip"] = rand(d_out, d_in, seed=seed + 4, scale=0.05)
    cfg = {"activation": activation, "expansion_factor": 32, "normalize_decoder": not transcode,
           "num_latents": D_SAE, "k": K, "multi_topk": False, "skip_connection": skip, "transcode": transcode,
           "d_in": d_in}
    folder = root / f"run-{seed}" / hookpoint
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder, cfg, weights


def sparsify_features(cfg, w, x):
    """sparsify's encode (fused_encoder: relu(linear), then topk or groupmax), as a dense tensor."""
    x = x.float()
    if not cfg["transcode"]:
        x = x - w["b_dec"]
    pre = F.relu(F.linear(x, w["encoder.weight"], w["encoder.bias"]))
    if cfg["activation"] == "topk":
        values, indices = torch.topk(pre, cfg["k"], dim=-1, sorted=False)
    else:
        values, indices = pre.unflatten(-1, (cfg["k"], -1)).max(dim=-1)
        indices = indices + torch.arange(0, pre.shape[-1], pre.shape[-1] // cfg["k"])
    return torch.zeros_like(pre).scatter_(-1, indices, values)


DL_CLASSES = ("AutoEncoder", "AutoEncoderNew", "GatedAutoEncoder", "JumpReluAutoEncoder", "AutoEncoderTopK",
              "BatchTopKSAE", "MatryoshkaBatchTopKSAE")


def dictionary_learning_folder(root, kind, d_in, submodule_name, layer, seed=0):
    """dictionary_learning's ``trainSAE``: the module's state dict as ae.pt, ``{"trainer": trainer.config,
    "buffer": buffer.config}`` as config.json."""
    enc, dec = rand(D_SAE, d_in, seed=seed), rand(d_in, D_SAE, seed=seed + 1)
    vec = lambda n, s: rand(n, seed=seed + s, scale=0.1)  # noqa: E731
    states = {
        "AutoEncoder": {"bias": vec(d_in, 2), "encoder.weight": enc, "encoder.bias": vec(D_SAE, 3), "decoder.weight": dec},
        "AutoEncoderNew": {"encoder.weight": enc, "encoder.bias": vec(D_SAE, 3), "decoder.weight": dec,
                           "decoder.bias": vec(d_in, 2)},
        "GatedAutoEncoder": {"decoder_bias": vec(d_in, 2), "encoder.weight": enc, "r_mag": vec(D_SAE, 4),
                             "gate_bias": vec(D_SAE, 5), "mag_bias": vec(D_SAE, 6), "decoder.weight": dec},
        "JumpReluAutoEncoder": {"W_enc": enc.T.contiguous(), "b_enc": vec(D_SAE, 3), "W_dec": dec.T.contiguous(),
                                "b_dec": vec(d_in, 2), "threshold": vec(D_SAE, 7).abs()},
        "AutoEncoderTopK": {"k": torch.tensor(K, dtype=torch.int), "threshold": torch.tensor(-1.0),
                            "decoder.weight": dec, "encoder.weight": enc, "encoder.bias": vec(D_SAE, 3),
                            "b_dec": vec(d_in, 2)},
        "BatchTopKSAE": {"k": torch.tensor(K, dtype=torch.int), "threshold": torch.tensor(0.05),
                         "decoder.weight": dec, "encoder.weight": enc, "encoder.bias": vec(D_SAE, 3),
                         "b_dec": vec(d_in, 2)},
        "MatryoshkaBatchTopKSAE": {"k": torch.tensor(K, dtype=torch.int), "threshold": torch.tensor(0.05),
                                   "group_sizes": torch.tensor([32, 64]), "W_enc": enc.T.contiguous(),
                                   "b_enc": vec(D_SAE, 3), "W_dec": dec.T.contiguous(), "b_dec": vec(d_in, 2)},
    }
    trainer = {"dict_class": kind, "trainer_class": "Trainer", "activation_dim": d_in, "dict_size": D_SAE,
               "layer": layer, "lm_name": "tiny", "submodule_name": submodule_name, "device": "cpu", "seed": seed}
    if "TopK" in kind:
        trainer["k"] = K
    folder = root / f"dl-{kind}-{seed}"
    folder.mkdir()
    torch.save(states[kind], folder / "ae.pt")
    (folder / "config.json").write_text(json.dumps({"trainer": trainer, "buffer": {
        "d_submodule": d_in, "io": "out", "n_ctxs": 30000, "ctx_len": 128, "refresh_batch_size": 512,
        "out_batch_size": 8192, "device": "cpu"}}, indent=4))
    return folder, states[kind]


def dictionary_learning_features(kind, s, x):
    """dictionary_learning's encode (with ``from_pretrained``'s decoder normalization of an AutoEncoder)."""
    x = x.float()
    if kind == "AutoEncoder":
        norms = s["decoder.weight"].norm(dim=0)
        return F.relu(F.linear(x - s["bias"], s["encoder.weight"] * norms[:, None], s["encoder.bias"] * norms))
    if kind == "AutoEncoderNew":
        return F.relu(F.linear(x, s["encoder.weight"], s["encoder.bias"]))
    if kind == "GatedAutoEncoder":
        x_enc = F.linear(x - s["decoder_bias"], s["encoder.weight"])
        gate = (x_enc + s["gate_bias"] > 0).float()
        return gate * F.relu(s["r_mag"].exp() * x_enc + s["mag_bias"])
    if kind == "JumpReluAutoEncoder":
        pre = x @ s["W_enc"] + s["b_enc"]
        return F.relu(pre * (pre > s["threshold"]))
    if kind == "MatryoshkaBatchTopKSAE":
        post = F.relu((x - s["b_dec"]) @ s["W_enc"] + s["b_enc"])
    else:
        post = F.relu(F.linear(x - s["b_dec"], s["encoder.weight"], s["encoder.bias"]))
    if kind == "AutoEncoderTopK":
        top = post.topk(K, sorted=False, dim=-1)
        return torch.zeros_like(post).scatter_(-1, top.indices, top.values)
    return post * (post > s["threshold"])


# -- features equal each format's own encoding of the hooked value ----------------------------------

SAELENS_CASES = {
    "standard": {}, "gated": {}, "jumprelu": {}, "topk": {"k": K},
    "topk_rescaled": {"k": K, "rescale_acts_by_decoder_norm": True},
    "constant_norm_rescale": {"normalize": "constant_norm_rescale"},
    "layer_norm": {"normalize": "layer_norm"}, "no_b_dec_to_input": {"apply_b_dec": False},
}
FAMILIES = ["gpt2", "llama", "gptj"]


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("variant", SAELENS_CASES)
def test_saelens_features_are_its_encoding_of_the_hooked_value(case, variant, tmp_path):
    model, *_ = model_of(case)
    options = dict(SAELENS_CASES[variant])
    architecture = variant if variant in ("standard", "gated", "jumprelu") else "topk" if "k" in options else "standard"
    extra = {key: options.pop(key) for key in ("k", "rescale_acts_by_decoder_norm") if key in options}
    folder, cfg, weights = saelens_folder(tmp_path, architecture, model.hidden_size, "blocks.1.hook_resid_post",
                                          extra_cfg=extra, **options)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (1, "layer_output") and (dictionary.d_in, dictionary.d_sae) == (model.hidden_size, D_SAE)
    captured, _ = hooked(case, [(1, "layer_output")])
    (features,), _ = spliced(model, [dictionary])
    expected = saelens_features(cfg, weights, captured[(1, "layer_output")])
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    assert 0 < (expected > 0).float().mean() < 1  # some features on, some off: the comparison means something


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("activation", ["topk", "groupmax"])
def test_sparsify_features_are_its_encoding_of_the_hooked_value(case, activation, tmp_path):
    model, hf, _ = model_of(case)
    hookpoint = {"gpt2": "h.2", "gptj": "h.2", "llama": "layers.2"}[case]
    folder, cfg, weights = sparsify_folder(tmp_path, hookpoint, model.hidden_size, activation=activation)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (2, "layer_output")
    captured, _ = hooked(case, [(2, "layer_output")])
    (features,), _ = spliced(model, [dictionary])
    torch.testing.assert_close(features, sparsify_features(cfg, weights, captured[(2, "layer_output")]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("kind", DL_CLASSES)
def test_dictionary_learning_features_are_its_encoding_of_the_hooked_value(case, kind, tmp_path):
    model, *_ = model_of(case)
    folder, state = dictionary_learning_folder(tmp_path, kind, model.hidden_size, "resid_post_layer_0", 0)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (0, "layer_output") and dictionary.d_sae == D_SAE
    captured, _ = hooked(case, [(0, "layer_output")])
    (features,), _ = spliced(model, [dictionary])
    expected = dictionary_learning_features(kind, state, captured[(0, "layer_output")])
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    assert 0 < (expected > 0).float().mean() < 1


def test_a_dictionary_learning_site_comes_from_its_folder_name(tmp_path):
    """The Pythia releases name the submodule only in their folders (``mlp_out_layer1/10_32768/ae.pt``)."""
    model, *_ = model_of("gpt2")
    (tmp_path / "mlp_out_layer1").mkdir()
    folder, state = dictionary_learning_folder(tmp_path / "mlp_out_layer1", "AutoEncoder", 64, None, 1)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (1, "mlp_output")
    captured, _ = hooked("gpt2", [(1, "mlp_output")])
    (features,), _ = spliced(model, [dictionary])
    torch.testing.assert_close(features, dictionary_learning_features("AutoEncoder", state,
                                                                      captured[(1, "mlp_output")]))
    (tmp_path / "unnamed").mkdir()
    anonymous = load_dictionary(dictionary_learning_folder(tmp_path / "unnamed", "AutoEncoder", 64, None, 1)[0])
    assert anonymous.site is None
    with pytest.raises(DictionaryError, match="does not say which submodule|not which submodule"):
        splice(model, anonymous)


# -- the site table: every TransformerLens name on the families where it has a counterpart ----------

TL_SITES = {
    "hook_resid_pre": "layer_input", "attn.hook_z": "attention_premix", "hook_attn_out": "attention_output",
    "hook_resid_mid": "layer_mid", "hook_mlp_in": "layer_mid", "mlp.hook_post": "mlp_neurons",
    "hook_mlp_out": "mlp_output", "hook_resid_post": "layer_output",
}
PARALLEL_ONLY_SEQUENTIAL = ("hook_resid_mid", "hook_mlp_in")


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("hook", TL_SITES)
def test_each_transformerlens_name_reads_its_standard_value(case, hook, tmp_path):
    model, *_ = model_of(case)
    value = TL_SITES[hook]
    parallel = case == "gptj" and hook in PARALLEL_ONLY_SEQUENTIAL
    captured = {} if parallel else hooked(case, [(1, value)])[0]
    width = model.hidden_size if parallel else captured[(1, value)].shape[-1]
    folder, cfg, weights = saelens_folder(tmp_path, "standard", width, f"blocks.1.{hook}")
    dictionary = load_dictionary(folder)
    assert dictionary.site == (1, value)
    if parallel:  # a parallel block has no stream between its sublayers
        with pytest.raises(DictionaryError, match=r"layer_mid.*unavailable on GPT-J: .*parallel"):
            splice(model, dictionary)
        return
    (features,), logits = spliced(model, [dictionary])
    torch.testing.assert_close(features, saelens_features(cfg, weights, captured[(1, value)]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hook", ["ln2.hook_normalized", "attn.hook_q", "hook_embed", "mlp.hook_pre"])
def test_a_transformerlens_name_without_a_standard_value_is_refused_with_the_reason(hook, tmp_path):
    model, *_ = model_of("gpt2")
    folder, *_ = saelens_folder(tmp_path, "standard", 64, hook if hook == "hook_embed" else f"blocks.1.{hook}")
    dictionary = load_dictionary(folder)
    assert dictionary.site is None
    reason = {"ln2.hook_normalized": "before the norm's weight", "attn.hook_q": "rotary",
              "hook_embed": "not a value of a block", "mlp.hook_pre": "no standard value"}[hook]
    with pytest.raises(DictionaryError, match=reason):
        splice(model, dictionary)
    given = load_dictionary(folder, site=(1, "mlp_norm_output"))  # the user says what it was trained on
    assert given.site == (1, "mlp_norm_output") and splice(model, given).site == (1, "mlp_norm_output")


def test_the_site_table_lists_every_name_the_readers_translate():
    table = site_table()
    for hook, value in TL_SITES.items():
        assert f"| `blocks.N.{hook}` | `(N, {value!r})` |" in table
    assert "| `blocks.N.ln1.hook_normalized` | refused |" in table
    assert "| `layers.N.mlp`, `layers.N.ffn`" in table and "| `resid_post_layerN` | `(N, 'layer_output')` |" in table


@pytest.mark.parametrize(("case", "hookpoint", "value"), [
    ("gpt2", "h.1", "layer_output"), ("gpt2", "h.1.mlp", "mlp_output"), ("gpt2", "h.1.attn", "attention_output"),
    ("llama", "layers.1.mlp", "mlp_output"), ("llama", "layers.1.self_attn", "attention_output"),
    ("gptj", "h.1.attn", "attention_output"), ("gptj", "h.1.mlp", "mlp_output")])
def test_each_sparsify_module_path_reads_its_standard_value(case, hookpoint, value, tmp_path):
    model, *_ = model_of(case)
    folder, cfg, weights = sparsify_folder(tmp_path, hookpoint, model.hidden_size)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (1, value)
    captured, _ = hooked(case, [(1, value)])
    (features,), _ = spliced(model, [dictionary])
    torch.testing.assert_close(features, sparsify_features(cfg, weights, captured[(1, value)]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "value"), [
    ("resid_post_layer_1", "layer_output"), ("resid_out_layer1", "layer_output"), ("resid_pre_layer_1", "layer_input"),
    ("mlp_out_layer1", "mlp_output"), ("attn_out_layer1", "attention_output")])
def test_each_dictionary_learning_name_reads_its_standard_value(name, value, tmp_path):
    model, *_ = model_of("llama")
    folder, state = dictionary_learning_folder(tmp_path, "AutoEncoderTopK", 64, name, 1)
    dictionary = load_dictionary(folder)
    assert dictionary.site == (1, value)
    captured, _ = hooked("llama", [(1, value)])
    (features,), _ = spliced(model, [dictionary])
    torch.testing.assert_close(features, dictionary_learning_features("AutoEncoderTopK", state, captured[(1, value)]),
                               rtol=1e-5, atol=1e-5)


def test_a_sparsify_module_whose_output_is_not_the_value_is_refused(tmp_path):
    """Gemma-2's MLP output is normed before the add: the output of module ``mlp`` is not mlp_output."""
    model, *_ = model_of("gemma2")
    dictionary = load_dictionary(sparsify_folder(tmp_path, "layers.1.mlp", 64)[0])
    assert dictionary.site == (1, "mlp_output")
    with pytest.raises(DictionaryError, match="post_feedforward_layernorm.output"):
        splice(model, dictionary)
    block = load_dictionary(sparsify_folder(tmp_path, "layers.1", 64, seed=1)[0])
    assert splice(model, block).site == (1, "layer_output")


# -- splicing: the model goes on with decode(features) + error --------------------------------------

@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("value", ["layer_output", "layer_mid", "attention_premix", "mlp_output"])
def test_ablating_or_clamping_a_feature_adds_its_direction_times_the_change(case, value, tmp_path):
    model, *_ = model_of(case)
    # the first hook that reads the value: hook_resid_mid for the stream (hook_mlp_in is a copy only the MLP reads)
    hook = next(h for h, v in TL_SITES.items() if v == value)
    captured, plain = hooked(case, [(1, value)])
    x = captured[(1, value)]
    folder, cfg, weights = saelens_folder(tmp_path, "standard", x.shape[-1], f"blocks.1.{hook}")
    dictionary = load_dictionary(folder)
    features = saelens_features(cfg, weights, x)
    feature = int(features.flatten(0, 1).gt(0).sum(0).argmax())  # active on most tokens
    direction = weights["W_dec"][feature]

    # an unedited splice keeps the logits bit for bit (decode(features) + error is the value itself)
    _, logits = spliced(model, [dictionary])
    assert torch.equal(logits, plain)

    for new in (0.0, 2.5):  # ablate, clamp
        change = new - features[..., feature]
        _, expected = hooked(case, [(1, value)], edits={(1, value): lambda t, c=change: t + c[..., None] * direction})
        _, logits = spliced(model, [dictionary], edit=lambda f, new=new: f[..., feature].fill_(new))
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits, plain, atol=1e-4)


def test_a_bfloat16_model_is_spliced_in_the_dictionarys_float32(tmp_path):
    model, *_ = model_of("llama", torch.bfloat16)
    site = (1, "layer_output")
    captured, plain = hooked("llama", [site], dtype=torch.bfloat16)
    folder, cfg, weights = saelens_folder(tmp_path, "standard", 64, "blocks.1.hook_resid_post")
    dictionary = load_dictionary(folder)
    (features,), logits = spliced(model, [dictionary])
    expected = saelens_features(cfg, weights, captured[site])
    assert features.dtype == torch.float32 and torch.equal(logits, plain)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    feature = int(expected.flatten(0, 1).gt(0).sum(0).argmax())
    change = -expected[..., feature:feature + 1] * weights["W_dec"][feature]
    _, edited = hooked("llama", [site], edits={site: lambda t: t + change.to(t.dtype)}, dtype=torch.bfloat16)
    _, logits = spliced(model, [dictionary], edit=lambda f: f[..., feature].zero_())
    torch.testing.assert_close(logits, edited)


def test_features_added_to_reach_the_model_and_the_error_is_readable(tmp_path):
    model, *_ = model_of("llama")
    captured, _ = hooked("llama", [(2, "mlp_output")])
    x = captured[(2, "mlp_output")]
    folder, cfg, weights = saelens_folder(tmp_path, "jumprelu", 64, "blocks.2.hook_mlp_out")
    dictionary = load_dictionary(folder)
    steer = rand(D_SAE, seed=9, scale=0.5).relu()
    _, expected = hooked("llama", [(2, "mlp_output")], edits={(2, "mlp_output"): lambda t: t + steer @ weights["W_dec"]})
    with torch.no_grad(), model.trace(IDS):
        spliced_here = splice(model, dictionary)
        with spliced_here as features:
            features += steer
        error = nnsight.save(spliced_here.error)
        reconstruction = nnsight.save(spliced_here.reconstruction)
        logits = nnsight.save(model.logits)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    decoded = saelens_features(cfg, weights, x) @ weights["W_dec"] + weights["b_dec"]
    torch.testing.assert_close(reconstruction, decoded)
    torch.testing.assert_close(error, x - decoded)


def test_without_the_error_the_model_goes_on_with_the_reconstruction(tmp_path):
    model, *_ = model_of("gpt2")
    captured, _ = hooked("gpt2", [(1, "layer_output")])
    folder, cfg, weights = saelens_folder(tmp_path, "topk", 64, "blocks.1.hook_resid_post", extra_cfg={"k": K})
    dictionary = load_dictionary(folder)
    decode = lambda t: saelens_features(cfg, weights, t) @ weights["W_dec"] + weights["b_dec"]  # noqa: E731
    _, expected = hooked("gpt2", [(1, "layer_output")], edits={(1, "layer_output"): decode})
    _, logits = spliced(model, [dictionary], keep_error=False)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_several_dictionaries_splice_in_one_pass_in_forward_order(tmp_path):
    model, *_ = model_of("llama")
    sites = [(0, "layer_output"), (2, "mlp_output")]
    captured, _ = hooked("llama", sites)
    first, cfg0, w0 = saelens_folder(tmp_path, "standard", 64, "blocks.0.hook_resid_post", seed=0)
    second, cfg1, w1 = saelens_folder(tmp_path, "standard", 64, "blocks.2.hook_mlp_out", seed=10)
    dictionaries = [load_dictionary(first), load_dictionary(second)]
    f0 = saelens_features(cfg0, w0, captured[sites[0]])
    # the second site's value is the model's after the first edit: read it from a hooked run with that edit
    edit0 = lambda t: t - f0[..., 5:6] * w0["W_dec"][5]  # noqa: E731
    edited, _ = hooked("llama", sites, edits={sites[0]: edit0})
    f1 = saelens_features(cfg1, w1, edited[sites[1]])
    edit1 = lambda t: t - f1[..., 7:8] * w1["W_dec"][7]  # noqa: E731
    _, expected = hooked("llama", sites, edits={sites[0]: edit0, sites[1]: edit1})
    with torch.no_grad(), model.trace(IDS):
        with splice(model, dictionaries[0]) as features:
            features[..., 5] = 0
        with splice(model, dictionaries[1]) as features:
            second_features = nnsight.save(features.clone())
            features[..., 7] = 0
        logits = nnsight.save(model.logits)
    torch.testing.assert_close(second_features, f1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_reading_a_later_value_inside_the_splice_is_refused(tmp_path):
    model, *_ = model_of("gpt2")
    early = load_dictionary(saelens_folder(tmp_path, "standard", 64, "blocks.0.hook_resid_post")[0])
    late = load_dictionary(saelens_folder(tmp_path, "standard", 64, "blocks.2.hook_resid_post", seed=3)[0])
    with pytest.raises(DictionaryError, match=r"went on past layers\[0\].layer_output"):
        with torch.no_grad(), model.trace(IDS):
            with splice(model, early) as features:
                features[..., 0] = 0
                nnsight.save(model.layers[1].layer_output)
    with pytest.raises(DictionaryError, match="went on past"):  # nested: the outer one cannot write any more
        with torch.no_grad(), model.trace(IDS):
            with splice(model, early) as outer, splice(model, late) as inner:
                outer[..., 0] = inner[..., 0] = 0
    with pytest.raises(DictionaryError, match="inside a trace"):
        with splice(model, early):
            pass
    with pytest.raises(DictionaryError, match="entered once"):
        with torch.no_grad(), model.trace(IDS):
            once = splice(model, early)
            with once:
                pass
            with once:
                pass
    with pytest.raises(DictionaryError, match=r"features tensor \[2, 7, 96\]; it was set to torch.Size\(\[3\]\)"):
        with torch.no_grad(), model.trace(IDS):
            replaced = splice(model, early)
            with replaced:
                replaced.features = torch.zeros(3)
    with pytest.raises(TypeError, match="a Dictionary"):
        splice(model, "blocks.0.hook_resid_post")


# -- transcoders: the MLP's input encoded, its output written ---------------------------------------

@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_sparsify_transcoder_replaces_the_mlp(case, skip, tmp_path):
    model, *_ = model_of(case)
    hookpoint = {"gpt2": "h.1.mlp", "llama": "layers.1.mlp"}[case]
    folder, cfg, weights = sparsify_folder(tmp_path, hookpoint, 64, transcode=True, skip=skip)
    dictionary = load_dictionary(folder)
    assert (dictionary.site, dictionary.out_site) == ((1, "mlp_input"), (1, "mlp_output"))
    sites = [(1, "mlp_input"), (1, "mlp_output")]
    captured, plain = hooked(case, sites)
    features = sparsify_features(cfg, weights, captured[sites[0]])
    decoded = features @ weights["W_dec"] + weights["b_dec"]
    if skip:
        decoded = decoded + captured[sites[0]] @ weights["W_skip"].mT
    feature = int(features.flatten(0, 1).gt(0).sum(0).argmax())
    change = 3.0 - features[..., feature]
    _, expected = hooked(case, sites, edits={sites[1]: lambda t: t + change[..., None] * weights["W_dec"][feature]})
    with torch.no_grad(), model.trace(IDS):
        spliced_here = splice(model, dictionary)
        with spliced_here as live:
            seen = nnsight.save(live.clone())
            live[..., feature] = 3.0
        error = nnsight.save(spliced_here.error)
        logits = nnsight.save(model.logits)
    torch.testing.assert_close(seen, features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(error, captured[sites[1]] - decoded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    _, unedited = spliced(model, [dictionary])
    assert torch.equal(unedited, plain)
    _, replaced = hooked(case, sites, edits={sites[1]: lambda t: decoded})  # the MLP's output is the prediction
    _, logits = spliced(model, [dictionary], keep_error=False)
    torch.testing.assert_close(logits, replaced, rtol=1e-5, atol=1e-5)


def test_a_saelens_transcoder_says_its_input_hook_is_ambiguous_and_splices_once_given(tmp_path):
    model, *_ = model_of("llama")
    folder, cfg, weights = saelens_folder(tmp_path, "skip_transcoder", 64, "blocks.1.ln2.hook_normalized",
                                          apply_b_dec=False, hook_out="blocks.1.hook_mlp_out")
    dictionary = load_dictionary(folder)
    assert dictionary.transcoder and dictionary.out_site == (1, "mlp_output") and dictionary.site is None
    with pytest.raises(DictionaryError, match="before the norm's weight"):
        splice(model, dictionary)
    dictionary = load_dictionary(folder, site=(1, "mlp_norm_output"))
    sites = [(1, "mlp_norm_output"), (1, "mlp_output")]
    captured, plain = hooked("llama", sites)
    features = saelens_features(cfg, weights, captured[sites[0]])
    predicted = features @ weights["W_dec"] + weights["b_dec"] + captured[sites[0]] @ weights["W_skip"].T
    (seen,), logits = spliced(model, [dictionary])
    torch.testing.assert_close(seen, features, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, plain)
    _, expected = hooked("llama", sites, edits={sites[1]: lambda t: predicted})
    _, logits = spliced(model, [dictionary], keep_error=False)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


# -- loading --------------------------------------------------------------------------------------

def test_a_pre_6_saelens_config_and_its_norm_scaling_factor(tmp_path):
    """SAELens 5 put the hook at the top (``hook_point``, ``activation_fn_str``); a dictionary trained on
    activations scaled by a factor needs it, as SAELens folds it."""
    model, *_ = model_of("gpt2")
    folder, cfg, weights = saelens_folder(tmp_path, "standard", 64, "blocks.1.hook_resid_post")
    old = {"d_in": 64, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", "hook_point": "blocks.1.hook_resid_post",
           "hook_point_layer": 1, "hook_point_head_index": None, "activation_fn_str": "topk",
           "activation_fn_kwargs": {"k": K}, "apply_b_dec_to_input": True, "normalize_activations": True,
           "sae_lens_training_version": "3.13.0"}
    (folder / "cfg.json").write_text(json.dumps(old))
    with pytest.raises(DictionaryError, match="scaling_factor"):
        load_dictionary(folder)
    dictionary = load_dictionary(folder, scaling_factor=0.5)
    assert dictionary.site == (1, "layer_output") and dictionary.activation == "topk"
    captured, _ = hooked("gpt2", [(1, "layer_output")])
    (features,), _ = spliced(model, [dictionary])
    scaled = saelens_features({**cfg, "architecture": "topk", "k": K}, weights, captured[(1, "layer_output")] * 0.5)
    torch.testing.assert_close(features, scaled, rtol=1e-5, atol=1e-5)


def test_what_is_not_a_dictionary_is_refused(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DictionaryError, match="holds no dictionary"):
        load_dictionary(tmp_path / "empty")
    sparsify_folder(tmp_path, "layers.0", 64, seed=0)
    with pytest.raises(DictionaryError, match="layers.0: load one of them"):
        load_dictionary(tmp_path / "run-0")
    assert load_dictionary(tmp_path / "run-0", folder="layers.0").site == (0, "layer_output")
    with pytest.raises(DictionaryError, match="no such path"):
        load_dictionary(tmp_path / "missing")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it"):
        load_dictionary("nobody/no-such-dictionary", folder="layers.0")

    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("socket.create_connection", unreachable)  # no network: said at once, no download tried
    with pytest.raises(OSError, match="the hub cannot be reached .Network is unreachable.. Set HF_HUB_OFFLINE=1"):
        load_dictionary("nobody/no-such-dictionary")


def test_a_dictionary_whose_width_is_not_the_sites_is_refused(tmp_path):
    model, *_ = model_of("gpt2")
    dictionary = load_dictionary(saelens_folder(tmp_path, "standard", 32, "blocks.1.hook_resid_post")[0])
    with pytest.raises(DictionaryError, match="vectors of 32 features"):
        spliced(model, [dictionary])


def test_dictionary_math_without_a_model():
    """encode, decode, d_in, d_sae on tensors: SAELens's layer_norm normalization is undone by the decoder."""
    x = rand(5, 16, seed=1, scale=2.0)
    W_enc, W_dec, b_enc, b_dec = rand(16, 40, seed=2), rand(40, 16, seed=3), rand(40, seed=4), rand(16, seed=5)
    d = Dictionary(W_enc, b_enc, W_dec, b_dec, normalize="layer_norm", center=b_dec)
    mean = x.mean(-1, keepdim=True)
    std = (x - mean).std(-1, keepdim=True)
    features = torch.relu(((x - mean) / (std + 1e-5) - b_dec) @ W_enc + b_enc)
    torch.testing.assert_close(d.encode(x), features)
    torch.testing.assert_close(d.decode(features, x), (features @ W_dec + b_dec) * std + mean)
    assert (d.d_in, d.d_sae, d.d_out) == (16, 40, 16)
    with pytest.raises(DictionaryError, match="needs the input x"):
        d.decode(features)


# -- the tools on top -----------------------------------------------------------------------------

def test_top_activations_rank_the_tokens_by_the_features_value(tmp_path):
    model, *_ = model_of("gpt2")
    folder, cfg, weights = saelens_folder(tmp_path, "standard", 64, "blocks.1.hook_resid_post")
    dictionary = load_dictionary(folder)
    _, hf, _ = model_of("gpt2")
    prompts = ["the cat sat on the mat", "Paris is in", "a dog"]
    per_prompt = []
    for prompt in prompts:  # each prompt alone, unpadded
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        captured = {}
        handle = hf.base_model_blocks[1].register_forward_hook(lambda m, a, o, c=captured: c.setdefault("x", o.detach()))
        with torch.no_grad():
            hf(input_ids=ids)
        handle.remove()
        per_prompt.append(saelens_features(cfg, weights, captured["x"])[0])
    feature = int(torch.cat(per_prompt).gt(0).sum(0).argmax())
    expected = sorted(((float(a), index, position) for index, acts in enumerate(per_prompt)
                       for position, a in enumerate(acts[:, feature])), key=lambda item: -item[0])[:4]
    found = top_activations(model, dictionary, prompts, feature, k=4, batch_size=2)
    assert [(i, p) for _, i, p, _ in found] == [(i, p) for _, i, p in expected]
    torch.testing.assert_close(torch.tensor([a for a, *_ in found]), torch.tensor([a for a, *_ in expected]))


# -- remote: the dictionary's tensors travel with the request -------------------------------------

def test_splices_run_remotely_bit_exactly(checkpoints, requests, tmp_path):  # noqa: F811  (the fixtures)
    """The server has no nnterp: the splice and the dictionaries ship by value, as plain tensors and functions."""
    model = load_remote("llama", checkpoints)
    sae = load_dictionary(saelens_folder(tmp_path, "topk", 64, "blocks.0.hook_resid_post", extra_cfg={"k": K})[0])
    transcoder = load_dictionary(sparsify_folder(tmp_path, "layers.2.mlp", 64, transcode=True, skip=True)[0])

    def run(remote):
        with torch.no_grad(), model.trace(IDS, remote=remote):
            first = splice(model, sae)
            with first as features:
                features[..., 3] = 2.0
            error = nnsight.save(first.error)
            with splice(model, transcoder) as features:
                features[..., 1] = 0
            logits = nnsight.save(model.logits)
        return error, logits

    here, there = run(False), run(True)
    assert requests and all(torch.equal(a, b) for a, b in zip(here, there))


def test_the_guide_shows_the_site_table_the_code_translates_by():
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "guide" / "dictionaries.md"
    assert site_table() in page.read_text(), "paste nnterp.dictionaries.site_table() into docs/guide/dictionaries.md"
