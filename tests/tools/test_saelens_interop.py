"""SAELens itself (PyPI ``sae-lens`` 6) reading nnterp's collections and writing dictionaries nnterp reads.

Ground truth is independent of nnterp: the activations are captured by plain PyTorch forward hooks on the
unwrapped HF model, one prompt at a time; the dictionaries' math is SAELens's own ``encode``, ``decode`` and
``forward`` on the same tensors. SAELens is used as a researcher uses it, unchanged: its ``ActivationsStore``
reads the exported folder (``cached_activations_path``), its ``LanguageModelSAETrainingRunner`` trains from it
and saves the SAE, its ``SAE.save_model`` writes the folders ``load_dictionary`` reads. Everything is local: the
runner gets the model and the token dataset it would otherwise download (``override_model``,
``override_dataset``), and the cached activations stand in for running the model.
"""

from __future__ import annotations

import logging
import signal
import warnings

import datasets
import pytest
import torch

from nnterp import collect, load_dictionary

from ..tools.test_dictionaries_collect import hooked, model_of


def _import_sae_lens():
    """``import sae_lens``, leaving the process as it was: transformer-lens sets the transformers logger to ERROR
    and adds warning filters at import, which would reach every test collected after this file."""
    level = logging.getLogger("transformers").level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # transformer-lens's own utils module, at import
        import sae_lens
    logging.getLogger("transformers").setLevel(level)
    return sae_lens


sae_lens = _import_sae_lens()

# contexts of one length (SAELens's layout holds one prompt per context): 4 words, one token each
PROMPTS = ["the cat sat on", "a dog is in", "Paris is a city", "the mat of Rome", "Rome is in the",
           "a cat is on", "the dog of Paris", "Eiffel Tower is in"]


def activations_store(folder, hook, context_size, d_in, prompts_per_batch=1):
    """SAELens's ActivationsStore over a cached-activations folder, as ``from_cache_activations`` builds one."""
    return sae_lens.ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None, context_size=context_size,
        d_in=d_in, n_batches_in_buffer=2, total_training_tokens=context_size * len(PROMPTS),
        store_batch_size_prompts=prompts_per_batch, train_batch_size_tokens=context_size, prepend_bos=False,
        normalize_activations="none", device=torch.device("cpu"), dtype="float32",
        cached_activations_path=str(folder))


def token_ids(model, prompts):
    return torch.cat([model.tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts])


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_saelens_activations_store_reads_the_hooked_activations_from_an_export(case, tmp_path):
    model = model_of(case)
    collection = collect(model, PROMPTS, tmp_path / "c", values=["layer_output", "attention_premix"], layers=[1],
                         positions="all", batch_size=3, progress=False)
    collection.to_saelens(tmp_path / "sae")
    context = len(model.tokenizer(PROMPTS[0]).input_ids)
    for hook, where in [("blocks.1.hook_resid_post", "output"), ("blocks.1.attn.hook_z", "premix")]:
        store = activations_store(tmp_path / "sae", hook, context, model.hidden_size)
        batches = [store.get_raw_llm_batch() for _ in PROMPTS]  # one context each, in the folder's order
        acts, tokens = torch.cat([a for a, _ in batches]), torch.cat([t for _, t in batches])
        expected = torch.cat([hooked(model, p, 1, where) for p in PROMPTS])
        assert acts.shape == expected.shape == (len(PROMPTS) * context, model.hidden_size)
        torch.testing.assert_close(acts, expected, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, token_ids(model, PROMPTS).to(tokens.dtype))


# a few prompts on purpose: SAELens says it will train several epochs over them
@pytest.mark.filterwarnings("ignore:The training dataset contains fewer samples:UserWarning")
def test_saelens_trains_an_sae_from_an_nnterp_collection_and_nnterp_reads_it_back(tmp_path):
    model = model_of("llama")
    collection = collect(model, PROMPTS, tmp_path / "c", values=["layer_output"], layers=[1], positions="all",
                         batch_size=3, progress=False)
    collection.to_saelens(tmp_path / "sae")
    context, d_in = len(model.tokenizer(PROMPTS[0]).input_ids), model.hidden_size
    expected = torch.cat([hooked(model, p, 1, "output") for p in PROMPTS])  # what the SAE must train on
    steps, batch = 8, 8
    config = sae_lens.LanguageModelSAERunnerConfig(
        sae=sae_lens.StandardTrainingSAEConfig(d_in=d_in, d_sae=32), model_name="tiny",
        hook_name="blocks.1.hook_resid_post", context_size=context, use_cached_activations=True,
        cached_activations_path=str(tmp_path / "sae"), training_tokens=steps * batch, train_batch_size_tokens=batch,
        store_batch_size_prompts=1, n_batches_in_buffer=2, lr=1e-2, device="cpu", checkpoint_path=None,
        output_path=str(tmp_path / "trained"), logger=sae_lens.LoggingConfig(log_to_wandb=False))
    # the token dataset and model the runner would otherwise download; the cached activations replace running it
    tokens = datasets.Dataset.from_dict({"tokens": [model.tokenizer(p).input_ids for p in PROMPTS]})
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # the runner installs its own
    torch.manual_seed(0)
    try:
        runner = sae_lens.LanguageModelSAETrainingRunner(config, override_dataset=tokens, override_model=model._module)
        before = {name: p.detach().clone() for name, p in runner.sae.named_parameters()}
        with torch.no_grad():
            error_before = (runner.sae(expected) - expected).pow(2).mean()
        seen = []  # what the SAE is given at each step, from its own input hook
        hook = runner.sae.hook_sae_input.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
        with pytest.warns(UserWarning):  # SAELens says the 8 contexts make several epochs
            trained = runner.run()
        hook.remove()
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert len(seen) == steps and all(rows.shape == (batch, d_in) for rows in seen)
    # every row trained on is one of the hooked rows (SAELens mixes their order)
    distances = (torch.cat(seen)[:, None] - expected[None]).abs().amax(dim=-1).min(dim=1).values
    assert distances.max() < 1e-5
    assert all(not torch.equal(p, before[name]) for name, p in trained.named_parameters())
    with torch.no_grad():
        error_after = (trained(expected) - expected).pow(2).mean()
    assert torch.isfinite(error_after) and error_after < error_before
    # the runner's own save (save_inference_model) is read by nnterp, at the site it was trained on
    dictionary = load_dictionary(tmp_path / "trained")
    assert dictionary.site == (1, "layer_output") and dictionary.d_sae == 32
    with torch.no_grad():
        features = trained.encode(expected)
        torch.testing.assert_close(dictionary.encode(expected), features, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(dictionary.decode(features), trained.decode(features), atol=1e-6, rtol=1e-5)


D_IN, D_OUT, D_SAE = 24, 20, 40
SAES = {  # id: (SAELens class, its config's fields)
    "standard": ("StandardSAE", {}),
    "standard-no-b_dec-in": ("StandardSAE", {"apply_b_dec_to_input": False}),
    "standard-layer_norm": ("StandardSAE", {"normalize_activations": "layer_norm"}),
    "standard-constant_norm_rescale": ("StandardSAE", {"normalize_activations": "constant_norm_rescale"}),
    "topk": ("TopKSAE", {"k": 6}),
    "topk-rescaled": ("TopKSAE", {"k": 6, "rescale_acts_by_decoder_norm": True}),
    "jumprelu": ("JumpReLUSAE", {}),
    "gated": ("GatedSAE", {}),
    "transcoder": ("Transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}),
    "skip_transcoder": ("SkipTranscoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}),
    "jumprelu_transcoder": ("JumpReLUTranscoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}),
    "jumprelu_skip_transcoder": ("JumpReLUSkipTranscoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}),
    "transcoder-constant_norm_rescale": ("Transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT,
                                                        "normalize_activations": "constant_norm_rescale"}),
}


def saved_sae(name, extra, folder):
    """A SAELens SAE (class ``name``, config fields ``extra``) of random weights, saved by its ``save_model`` into
    ``folder``: (the SAE, whether a transcoder)."""
    transcoder = "Transcoder" in name
    sae_class = getattr(sae_lens, name)
    config = getattr(sae_lens, f"{name}Config")(d_in=D_IN, d_sae=D_SAE, **extra)
    config.metadata.hook_name = "blocks.2.hook_mlp_in" if transcoder else "blocks.2.hook_resid_post"
    if transcoder:
        config.metadata.hook_name_out = "blocks.2.hook_mlp_out"
    torch.manual_seed(0)
    sae = sae_class(config)
    with torch.no_grad():  # off SAELens's initial zeros and ones, so every tensor counts
        for parameter_name, parameter in sae.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.1 if parameter.dim() == 1 else 0.3))
            if parameter_name == "threshold":
                parameter.abs_()
    sae.eval()
    sae.save_model(folder)
    return sae, transcoder


@pytest.mark.parametrize("variant", list(SAES))
def test_an_sae_saelens_saved_encodes_and_decodes_as_saelens_does(variant, tmp_path):
    sae, transcoder = saved_sae(*SAES[variant], tmp_path / "saved")
    dictionary = load_dictionary(tmp_path / "saved")
    x = torch.randn(3, 5, D_IN)
    with torch.no_grad():
        features = sae.encode(x)  # SAELens's decode reads the normalization statistics of its last encode
        decoded = sae.decode(features)
        forward = sae(x)
    assert dictionary.d_in == D_IN and dictionary.d_sae == D_SAE and dictionary.transcoder == transcoder
    assert (features > 0).any() and (features == 0).any()  # a sparse code, not a degenerate one
    torch.testing.assert_close(dictionary.encode(x), features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dictionary.decode(features, x), decoded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dictionary.forward(x), forward, atol=1e-5, rtol=1e-5)
    if transcoder:
        assert dictionary.out_site == (2, "mlp_output")
    else:
        assert dictionary.site == (2, "layer_output")


DIRECTIONS = {**{variant: SAES[variant] for variant in (
    "standard", "topk-rescaled", "standard-layer_norm", "standard-constant_norm_rescale", "transcoder",
    "transcoder-constant_norm_rescale")},
    "standard-expected_average": ("StandardSAE", {"normalize_activations": "expected_average_only_in"})}


@pytest.mark.parametrize("variant", DIRECTIONS)
def test_a_direction_is_what_one_unit_of_the_feature_adds_to_saelenss_decoding(variant, tmp_path):
    """``decode(e_f) - decode(0)`` by SAELens, at an input: one vector where the decoder undoes no normalization of
    that input, the row times each vector's norm or spread where it does (then refused without the input)."""
    scaled = variant == "standard-expected_average"  # trained on activations times a norm scaling factor
    sae, _ = saved_sae(*DIRECTIONS[variant], tmp_path / "saved")
    dictionary = load_dictionary(tmp_path / "saved", scaling_factor=0.5 if scaled else None)
    if scaled:
        sae.fold_activation_norm_scaling_factor(0.5)  # as SAELens loads it, and as nnterp reads it
    x = torch.randn(3, 5, D_IN)
    x[1, 2] *= 10.0  # another norm, another spread
    feature = 7
    one = torch.zeros(3, 5, D_SAE)
    one[..., feature] = 1.0

    def decoded(features):
        sae.encode(x)  # SAELens's decode undoes the normalization statistics of its last encode
        return sae.decode(features)

    with torch.no_grad():
        added = decoded(one) - decoded(torch.zeros_like(one))
    if sae.cfg.normalize_activations == "none" or "transcoder" in variant:  # one vector for every input
        direction = dictionary.direction(feature)
        assert direction.shape == added.shape[-1:]
        torch.testing.assert_close(direction.expand_as(added), added, atol=1e-5, rtol=1e-5)
        return
    with pytest.raises(ValueError, match=r"direction\(feature, x\) gives it at the input x"):
        dictionary.direction(feature)
    torch.testing.assert_close(dictionary.direction(feature, x), added, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(added[1, 2], added[0, 0], atol=1e-3)  # it depends on the input
