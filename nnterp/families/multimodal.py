"""Image, audio and speech models whose language model is a decoder served here: the same blocks, read the same way.

GOT-OCR2 (a Qwen2 decoder after an image encoder), MOSS-Transcribe-Diarize (a Qwen3 decoder after a Whisper-style
audio encoder) and Fuyu (a Persimmon decoder fed linearly embedded image patches) keep their decoder at
``model.language_model``, as Gemma-3's image-text class does, and read out with a plain ``lm_head``. On text input
(token ids, no pixel values or audio features) the encoders do not run and block 0 reads the token embeddings;
with images or audio, their embeddings replace the placeholder tokens' before block 0, so the blocks' values keep
their meaning.

Emu3's causal LM is its text model (its config type is ``emu3_text_model``): Llama's block, whose one dropout
module is applied to each contribution before its add (the identity in eval mode, where nnterp puts the model).
Phi-4-multimodal's causal LM is Phi-3's block; its image and audio embedders only rewrite the placeholder tokens'
embeddings (``model.embed_tokens_extend``). Its vision and speech LoRA adapters are not part of the model class:
loaded with PEFT, they wrap the projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) in place,
so every value stays at the module boundary it is read at. Moshi's causal LM is its text ("temporal")
transformer, Llama's block with a gated MLP whose ``fc1`` computes the gate and up halves at once:
``mlp_activation`` is ``activation_fn`` of the gate half and ``mlp_neurons`` what ``fc2`` sums (the depth decoder
and the audio codec belong to ``MoshiForConditionalGeneration`` only).

Emu3 and Moshi checkpoints are of the larger class (``Emu3ForConditionalGeneration``, ``MoshiForConditionalGeneration``),
which keeps the text model's weights under a prefix (``text_model.``, ``decoder.``) that transformers does not rename
for the causal LM it builds: loading by name renames them (``key_mapping``), or every weight would stay random.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import transformers
from transformers import PretrainedConfig

from .base import Family, pre_norm_block
from .llama import LLAMA, QWEN2, QWEN3
from .phi3 import PHI3
from .renamed import PERSIMMON

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
_PLACEHOLDER = 127  # the image / audio token, within the tiny vocabulary


def same_blocks(family: Family, name: str, model_types: tuple[str, ...], tiny_config: Callable[[], PretrainedConfig],
                *, language_model: bool = True, checkpoint_keys: tuple[tuple[str, str], ...] = ()) -> Family:
    """``family``'s blocks in another model class: under ``model.language_model`` (the backbone of an image-text or
    audio-text class), or where they are (``language_model=False``). The head is the class's plain ``lm_head``."""
    def inner(path: str) -> str:
        return path.replace("model.", "model.language_model.", 1) if language_model else path

    return dataclasses.replace(
        family, name=name, model_types=model_types, layers=inner(family.layers),
        embed_tokens=inner(family.embed_tokens), ln_final=inner(family.ln_final),
        block=lambda config, i: family.block(config, i),  # defined here: the docs read this module's docstring
        tiny_config=tiny_config, logits_transform=None, head_input_transform=None, variants=(),
        checkpoint_keys=checkpoint_keys)


GOT_OCR2 = same_blocks(QWEN2, "GOT-OCR2", ("got_ocr2",), lambda: transformers.GotOcr2Config(
    text_config=QWEN2.tiny_config().to_dict(), image_token_index=_PLACEHOLDER, image_seq_length=4,
    vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                       patch_size=16, window_size=2, global_attn_indexes=[1], mlp_dim=64)))
MOSS_TRANSCRIBE_DIARIZE = same_blocks(QWEN3, "MOSS-Transcribe-Diarize", ("moss_transcribe_diarize",), lambda: (
    transformers.MossTranscribeDiarizeConfig(
        text_config=QWEN3.tiny_config().to_dict(), audio_token_id=_PLACEHOLDER,
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_mel_bins=16, max_source_positions=32))))
FUYU = same_blocks(PERSIMMON, "Fuyu", ("fuyu",), lambda: transformers.FuyuConfig(
    text_config=PERSIMMON.tiny_config().to_dict(), image_size=16, patch_size=4, image_token_id=_PLACEHOLDER))
EMU3 = same_blocks(LLAMA, "Emu3", ("emu3", "emu3_text_model"), lambda: transformers.Emu3Config(
    text_config=transformers.Emu3TextConfig(**_SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2).to_dict()),
    language_model=False, checkpoint_keys=((r"^text_model\.model\.", "model."), (r"^text_model\.lm_head", "lm_head")))
PHI4_MULTIMODAL = same_blocks(PHI3, "Phi-4-multimodal", ("phi4_multimodal",), lambda: transformers.Phi4MultimodalConfig(
    **_SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, crop_size=28, patch_size=14, image_token_id=_PLACEHOLDER - 1),
    audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                      ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
                      audio_token_id=_PLACEHOLDER)), language_model=False)
MOSHI = Family(
    name="Moshi",
    model_types=("moshi",),
    block=lambda config, i: pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.activation_fn", down_proj="mlp.fc2",
    ),
    tiny_config=lambda: transformers.MoshiConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, ffn_dim=256,
        vocab_size=128, max_position_embeddings=64, sliding_window=64),
    checkpoint_keys=((r"^decoder\.", ""),),  # a MoshiForConditionalGeneration checkpoint's temporal transformer
)

MULTIMODAL = (GOT_OCR2, MOSS_TRANSCRIBE_DIARIZE, FUYU, EMU3, PHI4_MULTIMODAL, MOSHI)
