"""SAEs as SAELens users write them: ``run_with_saes``, ``run_with_cache_with_saes``, ``add_sae``, ``use_error_term``.

Ground truth is SAELens 6 itself: its ``SAE`` objects (random weights, saved by its ``save_model`` and read by
``load_dictionary``) and its ``HookedSAETransformer``, a TransformerLens model given the tiny GPT-2's own weights
(TransformerLens's ``convert_gpt2_weights``), run through SAELens's own ``run_with_saes`` and
``run_with_cache_with_saes``; and plain PyTorch forward hooks on the unwrapped transformers model that splice
SAELens's own ``encode``/``decode`` there.
"""

from __future__ import annotations

import json

import nnsight
import pytest
import torch
from nnsight.modeling.transformers import TransformersModel

import nnterp
from nnterp import Dictionary, load_dictionary, run_with_cache, splice
from nnterp.dictionaries import TL_SITES, from_saelens, transformerlens_site
from nnterp.spec import catalog

from ..remote.test_remote import checkpoints, requests, server  # noqa: F401  (the remote harness's fixtures)
from ..remote.test_remote import load as load_remote
from .test_dictionaries_collect import model_of
from .test_saelens_interop import SAES, sae_lens, saved_sae

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
D_SAE = 48


def make_sae(name, hook, d_in, folder=None, seed=0, **extra):
    """A SAELens SAE of class ``name`` at ``hook``, random weights off SAELens's initial zeros and ones (saved into
    ``folder`` by its own ``save_model`` when given)."""
    config = getattr(sae_lens, f"{name}Config")(d_in=d_in, d_sae=D_SAE, **extra)
    config.metadata.hook_name = hook
    torch.manual_seed(seed)
    sae = getattr(sae_lens, name)(config)
    with torch.no_grad():
        for parameter_name, parameter in sae.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.1 if parameter.dim() == 1 else 0.3))
            if parameter_name == "threshold":
                parameter.abs_()
    sae.eval()
    if folder is not None:
        sae.save_model(folder)
    return sae


def nnterp_sae(sae, folder):
    sae.save_model(folder)
    return load_dictionary(folder)


TL_MODELS: dict = {}
DOORS: dict = {}


def door(model):
    """The same transformers model through SAELens's door, ``nnterp.HookedSAETransformer`` (its ``run_with_saes``,
    ``add_sae`` and the rest: TransformerLens's and SAELens's names are that class's, not the core's)."""
    if id(model) not in DOORS:
        DOORS[id(model)] = nnterp.HookedSAETransformer(model._module, tokenizer=model.tokenizer)
    return DOORS[id(model)]


def hooked_sae_transformer():
    """SAELens's HookedSAETransformer with the tiny GPT-2's weights, and the standardized GPT-2 they come from."""
    if not TL_MODELS:
        from transformer_lens.config.hooked_transformer_config import HookedTransformerConfig
        from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

        model = model_of("gpt2")
        hf = model._module
        c = hf.config
        cfg = HookedTransformerConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head, d_mlp=4 * c.n_embd,
            d_vocab=c.vocab_size, n_ctx=c.n_positions, act_fn=c.activation_function, eps=c.layer_norm_epsilon,
            normalization_type="LN", positional_embedding_type="standard", default_prepend_bos=False,
            original_architecture="GPT2LMHeadModel", device="cpu")
        tl = sae_lens.HookedSAETransformer(cfg)
        tl.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
        tl.eval()
        TL_MODELS["gpt2"] = door(model), tl
    return TL_MODELS["gpt2"]


def plain_logits(model, ids=IDS):
    with torch.no_grad(), model.trace(ids):
        logits = nnsight.save(model.logits)
    return logits


def hooked_logits(model, layer, edit, ids=IDS):
    """The unwrapped transformers model's logits with block ``layer``'s output replaced by ``edit(output)``."""
    block = model._module.transformer.h[layer]
    handle = block.register_forward_hook(lambda m, a, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple)
                                         else edit(out))
    try:
        with torch.no_grad():
            return model._module(input_ids=ids).logits
    finally:
        handle.remove()


# -- the Dictionary is a torch module with SAELens's names ----------------------------------------------

@pytest.mark.parametrize("name", ["StandardSAE", "JumpReLUSAE", "TopKSAE", "GatedSAE"])
def test_a_dictionary_is_a_module_with_saelenss_names(name, tmp_path):
    sae = make_sae(name, "blocks.1.hook_resid_post", 64, **({"k": 6} if name == "TopKSAE" else {}))
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    assert isinstance(dictionary, torch.nn.Module) and dictionary.eval() is dictionary and not dictionary.training
    assert dictionary.state_dict().keys() == sae.state_dict().keys() if name != "GatedSAE" else True
    for parameter_name in sae.state_dict():  # sae.W_enc, sae.b_dec, sae.threshold, sae.b_gate ... as SAELens's
        assert torch.equal(getattr(dictionary, parameter_name), getattr(sae, parameter_name)), parameter_name
    assert {p.data_ptr() for p in dictionary.parameters()} == {t.data_ptr() for t in dictionary.state_dict().values()}
    cfg = dictionary.cfg
    assert (cfg.d_in, cfg.d_sae, cfg.dtype, cfg.device) == (sae.cfg.d_in, sae.cfg.d_sae, sae.cfg.dtype, sae.cfg.device)
    assert cfg.metadata.hook_name == cfg.hook_name == sae.cfg.metadata.hook_name == "blocks.1.hook_resid_post"
    assert cfg.architecture() == sae.cfg.architecture() and cfg.apply_b_dec_to_input == sae.cfg.apply_b_dec_to_input
    assert cfg.to_dict()["metadata"]["hook_name"] == sae.cfg.to_dict()["metadata"]["hook_name"]
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(dictionary(x), sae(x), atol=1e-5, rtol=1e-5)
        # b_dec is the centre SAELens subtracts: one parameter, an edit moves both
        dictionary.b_dec.add_(0.5)
        sae.b_dec.add_(0.5)
        torch.testing.assert_close(dictionary.encode(x), sae.encode(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(AttributeError, match="read from the dictionary"):
        cfg.d_sae = 3


@pytest.mark.parametrize("variant", list(SAES))
def test_a_saelens_sae_object_is_read_as_its_saved_folder(variant, tmp_path):
    sae, _ = saved_sae(*SAES[variant], tmp_path / "saved")
    read, saved = from_saelens(sae), load_dictionary(tmp_path / "saved")
    x = torch.randn(3, 5, sae.cfg.d_in)
    with torch.no_grad():
        assert torch.equal(read.encode(x), saved.encode(x)) and torch.equal(read(x), saved(x))
    assert (read.site, read.out_site, read.cfg.to_dict()) == (saved.site, saved.out_site, saved.cfg.to_dict())
    if not (variant.startswith("topk-") or variant.endswith("rescale")):  # folded there, so copies
        assert read.W_enc.data_ptr() == sae.W_enc.data_ptr()  # the SAE's own tensors


def test_to_converts_in_place_and_a_state_dict_round_trips(tmp_path):
    sae = make_sae("JumpReLUSAE", "blocks.1.hook_resid_post", 64)
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    assert dictionary.to(torch.float64) is dictionary
    assert all(p.dtype == torch.float64 for p in dictionary.parameters()) and dictionary.cfg.dtype == "float64"
    sae.to(torch.float64)
    with torch.no_grad():
        assert dictionary.encode(x).dtype == torch.float64
        torch.testing.assert_close(dictionary.encode(x), sae.encode(x))
    other = nnterp_sae(make_sae("JumpReLUSAE", "blocks.1.hook_resid_post", 64, seed=5), tmp_path / "other")
    with torch.no_grad():
        assert not torch.allclose(other.encode(x.float()), dictionary.encode(x).float())
        other.load_state_dict({name: t.float() for name, t in dictionary.state_dict().items()})
        torch.testing.assert_close(other.encode(x.float()), sae.to(torch.float32).encode(x.float()), atol=1e-5, rtol=1e-5)
    assert not any(p.requires_grad for p in dictionary.parameters())  # for analysis; requires_grad_() to train


def test_a_hook_z_sae_takes_and_gives_transformerlens_heads_shape(tmp_path):
    sae = make_sae("StandardSAE", "blocks.1.attn.hook_z", 64, reshape_activations="hook_z")
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    assert dictionary.site == (1, "attention_premix") and dictionary.cfg.reshape_activations == "hook_z"
    z = torch.randn(2, 5, 4, 16)
    with torch.no_grad():
        features = sae.encode(z)
        torch.testing.assert_close(dictionary.encode(z), features, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dictionary.encode(z.flatten(-2)), features, atol=1e-5, rtol=1e-5)
        forward = sae(z)
        assert dictionary(z).shape == forward.shape == z.shape
        torch.testing.assert_close(dictionary(z), forward, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dictionary.decode(features, z), sae.decode(features), atol=1e-5, rtol=1e-5)
    plain = Dictionary(torch.randn(64, 8), torch.zeros(8), torch.randn(8, 64), torch.zeros(64))
    with pytest.raises(ValueError, match="vectors of 64 features"):  # a stream dictionary takes no heads
        plain.encode(z)


def test_an_expected_average_only_in_folder_is_read_as_saelens_folds_its_scaling_factor(tmp_path):
    """A checkpoint of a SAE trained on activations times a norm scaling factor: SAELens's trainer runs it on
    ``scaler.scale(x)`` and unscales the output, and folds the factor at the end (as ``from_pretrained`` folds a
    release's): the same outputs, which nnterp reads from the folder's ``activation_scaler.json``."""
    from sae_lens.training.activation_scaler import ActivationScaler

    sae = make_sae("StandardSAE", "blocks.1.hook_resid_post", 64, normalize_activations="expected_average_only_in")
    folder = tmp_path / "checkpoint"
    sae.save_model(folder)
    scaler = ActivationScaler(scaling_factor=0.37)
    scaler.save(str(folder / "activation_scaler.json"))
    dictionary = load_dictionary(folder)
    x = torch.randn(3, 5, 64) * 4
    with torch.no_grad():
        trained_on = scaler.unscale(sae(scaler.scale(x)))  # the trainer's pipeline, unfolded
        features = sae.encode(scaler.scale(x))
        sae.fold_activation_norm_scaling_factor(json.loads((folder / "activation_scaler.json").read_text())
                                                ["scaling_factor"])
        torch.testing.assert_close(sae(x), trained_on, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dictionary(x), trained_on, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dictionary.encode(x), features, atol=1e-5, rtol=1e-5)
    assert dictionary.cfg.normalize_activations == sae.cfg.normalize_activations == "none"
    (folder / "activation_scaler.json").unlink()
    with pytest.raises(ValueError, match="scaling_factor"):  # without the factor, said: not the raw weights silently
        load_dictionary(folder)


# -- on the model, against SAELens's HookedSAETransformer ------------------------------------------------

def test_the_transformerlens_model_is_the_same_model():
    model, tl = hooked_sae_transformer()
    with torch.no_grad():
        torch.testing.assert_close(tl(IDS), plain_logits(model), atol=1e-4, rtol=1e-4)


SITES = {"resid_post": ("JumpReLUSAE", "blocks.1.hook_resid_post", {}),
         "mlp_out": ("JumpReLUSAE", "blocks.2.hook_mlp_out", {}),
         "hook_z": ("JumpReLUSAE", "blocks.1.attn.hook_z", {"reshape_activations": "hook_z"}),
         # the MLP's input stream to its output: cached after the hook it writes, as SAELens places it
         "transcoder": ("Transcoder", "blocks.1.hook_resid_mid", {"d_out": 64, "apply_b_dec_to_input": False})}


@pytest.mark.parametrize("use_error_term", [False, True])
@pytest.mark.parametrize("site", SITES)
def test_run_with_saes_and_its_cache_are_hookedsaetransformers(site, use_error_term, tmp_path):
    model, tl = hooked_sae_transformer()
    kind, hook, extra = SITES[site]
    sae = make_sae(kind, hook, 64, **extra)
    if kind == "Transcoder":
        sae.cfg.metadata.hook_name_out = "blocks.1.hook_mlp_out"
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    written = sae.cfg.metadata.hook_name_out or hook
    with torch.no_grad():
        expected = tl.run_with_saes(IDS, saes=[sae], use_error_term=use_error_term)
        expected_logits, expected_cache = tl.run_with_cache_with_saes(IDS, saes=[sae], use_error_term=use_error_term)
    logits = model.run_with_saes(IDS, saes=[dictionary], use_error_term=use_error_term)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # SAELens's SAE object itself, read by from_saelens: the same pass
    assert torch.equal(model.run_with_saes(IDS, saes=sae, use_error_term=use_error_term), logits)
    if use_error_term:  # the model goes on with the value itself
        assert torch.equal(logits, plain_logits(model))
    else:
        assert not torch.allclose(logits, plain_logits(model), atol=1e-2)
    cached_logits, cache = model.run_with_cache_with_saes(IDS, saes=[dictionary], use_error_term=use_error_term)
    # every hook point cached: the attention values on for the call (eager attention, the same numbers to float error)
    torch.testing.assert_close(cached_logits, logits, atol=1e-5, rtol=1e-5)
    theirs = {name for name in expected_cache.keys() if ".hook_sae_" in name}
    assert set(cache.sae_values) == theirs and len(theirs) == (6 if use_error_term else 5)
    for name in theirs:
        assert cache[name].shape == expected_cache[name].shape, name
        torch.testing.assert_close(cache[name], expected_cache[name], atol=1e-4, rtol=1e-4)
    acts = cache[f"{written}.hook_sae_acts_post"]
    assert (acts > 0).any() and (acts == 0).any()
    # the value at the site is what the model went on with
    site_value = cache[f"{written}.hook_sae_output"]
    layer, value = dictionary.out_site or dictionary.site
    assert torch.equal(cache[value, layer].reshape(site_value.shape), site_value)
    assert model.acts_to_saes == {}  # reset at the end, as SAELens's


def test_names_filter_keeps_the_sae_entries_it_names(tmp_path):
    model, tl = hooked_sae_transformer()
    sae = make_sae("StandardSAE", "blocks.1.hook_resid_post", 64)
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    wanted = "blocks.1.hook_resid_post.hook_sae_acts_post"
    _, cache = model.run_with_cache_with_saes(IDS, saes=[dictionary], names_filter=[wanted])
    with torch.no_grad():
        _, expected = tl.run_with_cache_with_saes(IDS, saes=[sae], names_filter=[wanted])
    assert list(cache.sae_values) == list(expected.keys()) == [wanted]
    torch.testing.assert_close(cache[wanted], expected[wanted], atol=1e-4, rtol=1e-4)
    _, cache = model.run_with_cache_with_saes(IDS, saes=[dictionary], names_filter=lambda n: n.endswith("recons"))
    assert list(cache.sae_values) == ["blocks.1.hook_resid_post.hook_sae_recons"]


def test_the_loss_is_transformerlenss(tmp_path):
    from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss

    model, tl = hooked_sae_transformer()
    sae = make_sae("StandardSAE", "blocks.1.hook_resid_post", 64)
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    logits, loss = model.run_with_saes(IDS, saes=[dictionary], return_type="both")
    torch.testing.assert_close(loss, lm_cross_entropy_loss(logits, IDS))
    per_token = model.run_with_saes(IDS, saes=[dictionary], return_type="loss", loss_per_token=True)
    torch.testing.assert_close(per_token, lm_cross_entropy_loss(logits, IDS, per_token=True))
    with torch.no_grad():
        torch.testing.assert_close(loss, tl.run_with_saes(IDS, saes=[sae], return_type="loss"), atol=1e-4, rtol=1e-4)
    assert model.run_with_saes(IDS, saes=[dictionary], return_type=None) is None
    with pytest.raises(ValueError, match="return_type"):
        model.run_with_saes(IDS, saes=[dictionary], return_type="tokens")


# -- attached SAEs: every later pass, until reset ---------------------------------------------------------

def test_an_attached_sae_runs_in_every_pass_until_reset(tmp_path):
    model = door(model_of("llama"))
    sae = make_sae("TopKSAE", "blocks.1.hook_resid_post", model.hidden_size, k=6)
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    before = plain_logits(model)
    edits = len(model._edits)
    with torch.no_grad():
        expected = hooked_logits_llama(model, 1, lambda out: sae.decode(sae.encode(out)))
    model.add_sae(dictionary)
    try:
        assert model.acts_to_saes == {"blocks.1.hook_resid_post": dictionary}
        torch.testing.assert_close(plain_logits(model), expected, atol=1e-5, rtol=1e-5)  # a plain trace
        torch.testing.assert_close(run_with_cache(model, IDS, names=["layer_output"])[0], expected, atol=1e-5,
                                   rtol=1e-5)  # a tool
        torch.testing.assert_close(model.run_with_saes(IDS), expected, atol=1e-5, rtol=1e-5)
        # another SAE for one run, then the attached one alone again
        other = nnterp_sae(make_sae("StandardSAE", "blocks.0.hook_resid_post", model.hidden_size, seed=3),
                           tmp_path / "other")
        assert not torch.allclose(model.run_with_saes(IDS, saes=[other]), expected, atol=1e-3)
        assert list(model.acts_to_saes) == ["blocks.1.hook_resid_post"]
        model.add_sae(sae)  # SAELens's object, replacing the dictionary at the same hook
        assert model.acts_to_saes == {"blocks.1.hook_resid_post": sae} and len(model._edits) == edits + 1
        torch.testing.assert_close(plain_logits(model), expected, atol=1e-5, rtol=1e-5)
    finally:
        model.reset_saes()
    assert model.acts_to_saes == {} and len(model._edits) == edits
    assert torch.equal(plain_logits(model), before)
    with pytest.raises(KeyError, match="No SAE is attached at blocks.1.hook_resid_post"):
        model.reset_saes("blocks.1.hook_resid_post")


def hooked_logits_llama(model, layer, edit):
    block = model._module.model.layers[layer]
    handle = block.register_forward_hook(lambda m, a, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple)
                                         else edit(out))
    try:
        return model._module(input_ids=IDS).logits
    finally:
        handle.remove()


def test_the_saes_context_restores_what_was_attached_and_keeps_other_edits(tmp_path):
    model = door(model_of("llama"))
    first = nnterp_sae(make_sae("StandardSAE", "blocks.1.hook_resid_post", model.hidden_size), tmp_path / "a")
    second = nnterp_sae(make_sae("StandardSAE", "blocks.1.hook_resid_post", model.hidden_size, seed=2),
                        tmp_path / "b")
    with model.edit(inplace=True):  # a user's own edit, kept through it all
        model.layers[0].layer_output[:, 0] = 0
    try:
        user_only = plain_logits(model)
        model.add_sae(first, use_error_term=True)
        assert torch.equal(plain_logits(model), user_only)  # with the error kept, the value itself
        with model.saes(saes=[second]) as same:
            assert same is model and model.acts_to_saes == {"blocks.1.hook_resid_post": second}
            inside = plain_logits(model)
        assert not torch.allclose(inside, user_only, atol=1e-3)
        assert model.acts_to_saes == {"blocks.1.hook_resid_post": first}
        assert torch.equal(plain_logits(model), user_only)
        model.reset_saes()
        assert torch.equal(plain_logits(model), user_only) and len(model._edits) == 1
    finally:
        model.clear_edits()
        model.__dict__.pop("_nnterp_saes", None)


# -- the splice's error term ------------------------------------------------------------------------------

def test_the_splices_error_is_editable_and_zeroing_it_is_dropping_it(tmp_path):
    model = model_of("gpt2")
    sae = make_sae("StandardSAE", "blocks.1.hook_resid_post", model.hidden_size)
    dictionary = nnterp_sae(sae, tmp_path / "sae")

    def spliced(keep_error=True):
        with torch.no_grad(), model.trace(IDS):
            with splice(model, dictionary, keep_error=keep_error):
                pass
            logits = nnsight.save(model.logits)
        return logits

    with torch.no_grad(), model.trace(IDS):
        s = splice(model, dictionary)
        with s:
            s.error[:] = 0
        zeroed = nnsight.save(model.logits)
    assert torch.equal(zeroed, spliced(keep_error=False))
    with torch.no_grad(), model.trace(IDS):
        s = splice(model, dictionary)
        with s:
            error = s.error
            s.error = torch.cat([error[:, :-1], torch.zeros_like(error[:, -1:])], dim=1)  # the last token's only
        last_dropped = nnsight.save(model.logits)

    def reconstructed_at_the_last(out):
        with torch.no_grad():
            new = out.clone()
            new[:, -1] = sae.decode(sae.encode(out[:, -1]))
            return new

    torch.testing.assert_close(last_dropped, hooked_logits(model, 1, reconstructed_at_the_last), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="drops the error"):
        with torch.no_grad(), model.trace(IDS):
            s = splice(model, dictionary, keep_error=False)
            with s:
                s.error[:] = 1
    with pytest.raises(ValueError, match="error tensor"):
        with torch.no_grad(), model.trace(IDS):
            s = splice(model, dictionary)
            with s:
                s.error = torch.zeros(3)


# -- the site table refuses the catalog's names that are no dictionary site ------------------------------

NOT_SITES = sorted({*(k for k in catalog.TRANSFORMERLENS_NAMES if k not in TL_SITES),
                    *getattr(catalog, "TRANSFORMERLENS_COMPUTED", {})})


@pytest.mark.parametrize("key", NOT_SITES)
def test_a_transformerlens_name_that_is_no_site_is_refused_with_a_reason(key):
    tail = key if "." in key or key.startswith("hook_") else f"hook_{key}"
    site, reason = transformerlens_site(f"blocks.1.{tail}")
    assert site is None and reason and f"blocks.1.{tail}" in reason


# -- remote: an attached SAE is an edit of the model, which rides with the request ------------------------

def test_an_attached_sae_runs_remotely_bit_exactly(checkpoints, requests, tmp_path):  # noqa: F811  (the fixtures)
    """The server has no nnterp: the attached SAE's edit ships with the request, the dictionary by value."""
    model = door(load_remote("llama", checkpoints))
    dictionary = nnterp_sae(make_sae("JumpReLUSAE", "blocks.1.hook_resid_post", model.hidden_size), tmp_path / "s")

    def run(remote):
        with torch.no_grad(), model.trace(IDS, remote=remote):
            logits = nnsight.save(model.logits)
        return logits

    plain = run(False)
    model.add_sae(dictionary)
    try:
        here, there = run(False), run(True)
    finally:
        model.reset_saes()
    assert requests and torch.equal(here, there) and not torch.allclose(here, plain, atol=1e-3)


def test_over_a_generation_an_attached_sae_runs_in_the_prompts_pass(tmp_path):
    """As the guide says: a generation's later steps run without it (an edit replays its block once per trace)."""
    model = door(model_of("llama"))
    sae = make_sae("StandardSAE", "blocks.1.hook_resid_post", model.hidden_size)
    dictionary = nnterp_sae(sae, tmp_path / "sae")
    prompt = IDS[:1, :5]
    passes = []

    def first_pass_only(module, args, out):
        passes.append(1)
        if len(passes) == 1:
            with torch.no_grad():
                return (sae.decode(sae.encode(out[0])), *out[1:]) if isinstance(out, tuple) else sae.decode(
                    sae.encode(out))

    handle = model._module.model.layers[1].register_forward_hook(first_pass_only)
    try:
        with torch.no_grad():
            expected = model._module.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    model.add_sae(dictionary)
    try:
        # nnsight's generation trace (HookedTransformer's own generate is TransformerLens's)
        with torch.no_grad(), TransformersModel.generate(model, prompt, max_new_tokens=4, min_new_tokens=4,
                                                         do_sample=False) as tracer:
            generated = nnsight.save(tracer.result)
    finally:
        model.reset_saes()
    assert len(passes) == 4 and torch.equal(generated, expected)
