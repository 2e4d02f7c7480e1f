"""Image, audio and speech models served through the decoder they carry, against plain hooks on text input.

Ground truth: the module boundaries of each model's decoder layer, written from transformers' code (the decoder
at the path its causal-LM class keeps it), captured with forward hooks on the unwrapped model; the identity is the
block's own arithmetic, ``(x + a) + m``. The class each type builds is the one transformers maps it to.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nnterp import StandardizedTransformer
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE, family_of
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, LLAMA, PRE_NORM, hooks_and_reads, read_all, register_edit, run_with_hook

PERSIMMON = PRE_NORM("input_layernorm", "self_attn", "self_attn.dense", "post_attention_layernorm", "mlp", "mlp.act",
                     "mlp.dense_4h_to_h")
# Phi-3's block: each contribution passes a residual dropout module before its add
PHI3 = {**PRE_NORM("input_layernorm", "resid_attn_dropout", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                   "mlp.activation_fn", "mlp.down_proj"), "mlp_output": ("resid_mlp_dropout", "out")}
# Moshi's gated MLP: fc1 gives gate and up, activation_fn(gate) * up goes into fc2
MOSHI = PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                 "mlp.activation_fn", "mlp.fc2")
LANGUAGE_MODEL = "model.language_model"
# case -> (model type, the decoder's blocks, its token embedding, its truth, the encoders that text input leaves idle)
CASES = {
    "got_ocr2": ("got_ocr2", f"{LANGUAGE_MODEL}.layers", f"{LANGUAGE_MODEL}.embed_tokens", LLAMA,
                 ("model.vision_tower", "model.multi_modal_projector")),
    "moss_transcribe_diarize": ("moss_transcribe_diarize", f"{LANGUAGE_MODEL}.layers", f"{LANGUAGE_MODEL}.embed_tokens",
                                LLAMA, ("model.audio_tower", "model.multi_modal_projector")),
    "fuyu": ("fuyu", f"{LANGUAGE_MODEL}.layers", f"{LANGUAGE_MODEL}.embed_tokens", PERSIMMON,
             ("model.vision_embed_tokens",)),
    "emu3": ("emu3", "model.layers", "model.embed_tokens", LLAMA, ()),  # Emu3ForCausalLM: the text model alone
    "phi4_multimodal": ("phi4_multimodal", "model.layers", "model.embed_tokens", PHI3,
                        ("model.embed_tokens_extend.image_embed", "model.embed_tokens_extend.audio_embed")),
    "moshi": ("moshi", "model.layers", "model.embed_tokens", MOSHI, ()),  # the temporal transformer alone
}
# an image-text type whose causal LM is built on its text config, of another type
TEXT_TYPES = {"emu3": "emu3_text_model"}


def make(case, dtype=torch.float32):
    model_type, blocks, embed, truth, idle = CASES[case]
    hf = build_tiny(BY_MODEL_TYPE[model_type].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    assert model.layers._module is hf.get_submodule(blocks)
    hf.base_model_blocks = hf.get_submodule(blocks)
    return model, hf, lambda i: truth


def first_input_and_idle(hf, case):
    """The token embeddings and whether each encoder ran, in a plain forward on token ids."""
    _, _, embed, _, idle = CASES[case]
    seen, handles = {}, []
    handles.append(hf.get_submodule(embed).register_forward_hook(lambda m, a, o: seen.setdefault("embed", o.clone())))
    for path in idle:
        handles.append(hf.get_submodule(path).register_forward_hook(lambda m, a, o, path=path: seen.setdefault(path, 1)))
    try:
        with torch.no_grad():
            hf(input_ids=IDS, attention_mask=torch.ones_like(IDS))
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds(case, dtype):
    model, hf, truth = make(case, dtype)
    assert type(hf).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[CASES[case][0]]
    expected, saved, logits = hooks_and_reads(model, hf, truth, IDS)
    for i in range(model.num_layers):
        for name in truth(i):  # every value is available on these blocks
            got, want = saved[(i, name)], expected[(i, name)]
            assert torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"
        x, a, mid, m, y = (saved[(i, n)] for n in ("layer_input", "attention_output", "layer_mid", "mlp_output",
                                                    "layer_output"))
        assert torch.equal(mid, x + a) and torch.equal((x + a) + m, y), f"layer {i}: identity"
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
    # on token ids the encoders stay idle and block 0 reads the token embeddings
    seen = first_input_and_idle(hf, case)
    assert not set(CASES[case][4]) & set(seen)
    assert torch.equal(saved[(0, "layer_input")], seen["embed"])
    assert all(result.exact for result in check_identity(model, IDS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_project_on_vocab_of_the_last_block_is_the_logits(case, dtype):
    model, hf, _ = make(case, dtype)
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)
        assert torch.equal(logits, hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits)


@pytest.mark.parametrize("case", CASES)
def test_edits_reach_the_logits_as_hooks_do(case):
    model, hf, truth = make(case)
    blocks, middle = hf.base_model_blocks, model.num_layers // 2
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[middle].layer_output = model.layers[middle].layer_output * 2
        doubled = model.logits.save()
    assert torch.equal(doubled, run_with_hook(hf, blocks[middle], "out", lambda t: t * 2))
    assert not torch.equal(doubled, clean)

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    with torch.no_grad(), model.trace(IDS):
        model.layers[middle].self_attn.attention_output[:, -1] = 0  # in place
        model.layers[middle].mlp.mlp_output = model.layers[middle].mlp.mlp_output * 0.5  # assigned
        edited = model.logits.save()
    attention, mlp = (blocks[middle].get_submodule(truth(middle)[name][0]) for name in ("attention_output", "mlp_output"))
    handle = register_edit(hf, attention, "out", zero_last)
    try:
        expected = run_with_hook(hf, mlp, "out", lambda t: t * 0.5)
    finally:
        handle.remove()
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)


# case -> the image input of its tiny config: one placeholder token (127) and the pixels that replace its embedding
IMAGES = {
    "got_ocr2": lambda: torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)),  # one token per image
    "fuyu": lambda: torch.randn(1, 1, 4 * 4 * 3, generator=torch.Generator().manual_seed(0)),  # one 4x4 RGB patch
}


@pytest.mark.parametrize("case", IMAGES)
def test_with_an_image_the_blocks_read_the_merged_embeddings(case):
    """The image's embedding replaces the placeholder token's before block 0: the blocks' values are the hooks', the
    identity holds, and edits reach the logits as hooks' do."""
    model, hf, truth = make(case)
    ids, pixels = torch.tensor([[3, 127, 5, 6, 7]]), IMAGES[case]()
    blocks, captured = hf.base_model_blocks, {}

    def capture(module, args, kwargs, i):  # each block's input stream (a hook that returns nothing)
        captured.setdefault(i, (args[0] if args else kwargs["hidden_states"]).clone())

    handles = [block.register_forward_pre_hook(lambda m, a, k, i=i: capture(m, a, k, i), with_kwargs=True)
               for i, block in enumerate(blocks)]
    try:
        with torch.no_grad():
            expected = hf(input_ids=ids, pixel_values=pixels).logits
            text_only = hf(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    saved, logits = read_all(model, {"input_ids": ids, "pixel_values": pixels})
    assert torch.equal(logits, expected) and not torch.equal(expected, text_only)
    for i in range(model.num_layers):
        assert torch.equal(saved[(i, "layer_input")], captured[i]), f"layer {i}"
    assert all(result.exact for result in check_identity(model, {"input_ids": ids, "pixel_values": pixels}))
    with torch.no_grad(), model.trace(ids, pixel_values=pixels):
        model.layers[1].mlp.mlp_output = model.layers[1].mlp.mlp_output * 0.5
        edited = model.logits.save()
    handle = register_edit(hf, blocks[1].get_submodule(truth(1)["mlp_output"][0]), "out", lambda t: t * 0.5)
    try:
        with torch.no_grad():
            assert torch.equal(edited, hf(input_ids=ids, pixel_values=pixels).logits)
    finally:
        handle.remove()


@pytest.mark.parametrize("case", CASES)
def test_attention_values_are_proven_and_compose_to_the_premix(case):
    """The eager attention's probabilities times its values are each head's input to the output projection."""
    model, *_ = make(case)
    model.enable_attention_values()  # proven on the miniature first, the composition included
    with torch.no_grad(), model.trace(IDS):
        values = model.layers[1].self_attn.values.save()  # in forward order
        probabilities = model.layers[1].self_attn.attention_probabilities.save()
        premix = model.layers[1].self_attn.attention_premix.save()
    groups = model.num_heads // values.shape[2]
    mixed = probabilities @ values.transpose(1, 2).repeat_interleave(groups, dim=1)  # [batch, heads, seq, head_dim]
    assert torch.allclose(mixed.transpose(1, 2), premix, atol=1e-6)
    assert torch.allclose(probabilities.sum(-1), torch.ones(()))


def test_moshi_mlp_activation_and_neurons_are_its_gated_halves():
    """fc1 computes the gate and up halves at once: the activation is act(gate), the neurons act(gate) * up."""
    model, hf, _ = make("moshi")
    fc1 = {}
    handles = [block.mlp.fc1.register_forward_hook(lambda m, a, o, i=i: fc1.setdefault(i, o.clone()))
               for i, block in enumerate(hf.base_model_blocks)]
    try:
        saved, _ = read_all(model, IDS)
    finally:
        for handle in handles:
            handle.remove()
    for i, block in enumerate(hf.base_model_blocks):
        gate, up = fc1[i].view(*IDS.shape, 2, -1).unbind(-2)
        assert torch.equal(saved[(i, "mlp_activation")], block.mlp.activation_fn(gate))
        assert torch.equal(saved[(i, "mlp_neurons")], block.mlp.activation_fn(gate) * up)


@pytest.mark.parametrize("model_type", [case[0] for case in CASES.values()])
def test_the_default_config_miniature_is_proven(model_type):
    """The type's default config, vision and audio parts shrunk with the text model: the class transformers maps it
    to, proven at load, its identity exact and its logits the model's."""
    config = miniature_config(CONFIG_MAPPING[model_type]())
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(config)).eval()
    assert type(hf).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    assert sum(p.numel() for p in hf.parameters()) < 10_000_000  # the encoders shrink too
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))
    ids = IDS % model.vocab_size
    assert all(result.exact for result in check_identity(model, ids))
    with torch.no_grad(), model.trace(ids):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)
        assert torch.equal(model.project_on_vocab(last), logits)


def emu3_image_text(config):
    """Emu3's image-text class, with a tiny image tokenizer (VQ-VAE) beside the tiny text model."""
    from transformers import Emu3ForConditionalGeneration

    config.vocabulary_map = {"<image>": 126, "<|extra_200|>": 127}
    config.vq_config.update(dict(base_channels=32, codebook_size=16, hidden_size=32))
    model = Emu3ForConditionalGeneration(config)
    return model, model  # on token ids, the image-text model's text logits


def moshi_speech_text(config):
    """Moshi's speech-to-speech class, a tiny depth decoder and audio codec beside the tiny temporal transformer."""
    from transformers import MoshiForConditionalGeneration

    config.audio_vocab_size = 16
    config.depth_decoder_config.update(dict(hidden_size=32, input_size=64, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=2, head_dim=16, ffn_dim=64, vocab_size=128,
                                            audio_vocab_size=16))
    config.audio_encoder_config.update(dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=2, head_dim=16, intermediate_size=64, codebook_size=16,
                                            codebook_dim=16, vector_quantization_hidden_dimension=16, num_filters=4,
                                            upsample_groups=32))
    model = MoshiForConditionalGeneration(config)
    return model, model.decoder  # its text logits: the temporal transformer's


# a type whose checkpoints are of a larger class than the causal LM transformers builds: that class, and the module
# whose text logits the causal LM must give
CHECKPOINT_CLASSES = {"emu3": emu3_image_text, "moshi": moshi_speech_text}


@pytest.mark.parametrize("dispatch", [True, False], ids=["loaded", "lazy"])
@pytest.mark.parametrize("model_type", CHECKPOINT_CLASSES)
def test_a_checkpoint_of_the_larger_class_loads_its_weights_by_name(model_type, dispatch, tmp_path):
    """transformers builds the text model from such a checkpoint without renaming its keys (its weights would stay
    random): loading by name renames them, and the model gives the checkpoint's own text logits."""
    torch.manual_seed(0)
    full, text = CHECKPOINT_CLASSES[model_type](BY_MODEL_TYPE[model_type].tiny_config())
    perturb(full).eval().save_pretrained(tmp_path)
    with torch.no_grad():
        expected = text(input_ids=IDS).logits
    model = StandardizedTransformer(tmp_path, tokenizer=tiny_tokenizer(), dispatch=dispatch)
    with torch.no_grad(), model.trace(IDS):
        logits = model.logits.save()
    assert type(model._module).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("model_type, text_type", TEXT_TYPES.items())
def test_the_image_text_config_builds_the_text_model_of_the_same_family(model_type, text_type):
    """An Emu3 checkpoint's config is the image-text one; the causal LM transformers builds from it is the text model,
    whose config has the text type: both name the same family, and the model loaded by name is proven."""
    from nnterp.core.validation import validate

    config = BY_MODEL_TYPE[model_type].tiny_config()
    assert config.model_type == model_type
    architecture = AutoModelForCausalLM._model_mapping[type(config)]
    hf = build_tiny(config)
    assert isinstance(hf, architecture) and hf.config.model_type == text_type
    assert family_of(config) is family_of(hf.config) is BY_MODEL_TYPE[model_type]
    events = validate(config, architecture, tiny_tokenizer(), use_cache=False)  # what loading by name proves
    assert ("model.layers.0.self_attn", "output") in events


def test_mllama_stays_excluded_its_cross_attention_blocks_do_not_run_on_text():
    """MllamaForCausalLM on token ids skips its cross-attention blocks: they would have no values to read."""
    from nnterp.proof.coverage import EXCLUDED
    from nnterp.spec.errors import UnknownArchitecture

    config = miniature_config(CONFIG_MAPPING["mllama"]())
    hf = AutoModelForCausalLM.from_config(config).eval()
    cross = config.get_text_config().cross_attention_layers
    ran = set()
    handles = [block.register_forward_hook(lambda m, a, o, i=i: ran.add(i)) for i, block in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hf(input_ids=IDS % 256)
    finally:
        for handle in handles:
            handle.remove()
    assert cross and ran == set(range(len(hf.model.layers))) - set(cross)
    assert all(hasattr(hf.model.layers[i], "cross_attn_attn_gate") for i in cross)  # the gated terms
    assert "mllama" in EXCLUDED and "mllama" not in BY_MODEL_TYPE
    with pytest.raises(UnknownArchitecture, match="mllama"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))
