"""The registry: one spec per family, found by the config's ``model_type``.

A spec reaches transformers' classes only inside the functions it gives (``tiny_config``, ``rename``,
``sublayer_classes``, ...): a config class as ``transformers.<Name>``, a class of a model's own modules
imported in the function. So a family's model package is imported when the family is used (placed,
proven, its miniature built), never at ``import nnterp`` (tests/unit/test_import_time.py).
"""

from __future__ import annotations

import dataclasses
import threading

from transformers import PretrainedConfig

from ..spec.errors import UnknownArchitecture
from .base import (
    OWN_ATTENTION,
    ROUTED,
    Block,
    Family,
    SameAs,
    Unavailable,
    input,
    output,
    parallel_block,
    pre_norm_block,
)
from .beam import BEAM
from .biogpt import BIOGPT, XGLM
from .bloom import BLOOM
from .cpmant import CPMANT
from .ctrl import CTRL
from .dbrx import DBRX
from .deepseek_v4 import DEEPSEEK_V4
from .dory import DORY
from .falcon import FALCON
from .falcon_h1 import FALCON_H1
from .gated import DOGE, ZAYA
from .gemma3n import GEMMA3N
from .gemma4 import GEMMA4, GEMMA4_MULTIMODAL, GEMMA4_UNIFIED, GEMMA4_UNIFIED_MULTIMODAL
from .gpt2 import GPT2, GPT_BIGCODE
from .gpt_neo import GPT_NEO
from .gpt_neox import GPT_NEOX
from .gpt_neox_japanese import GPT_NEOX_JAPANESE
from .gptj import CODEGEN, GPTJ
from .granite import GRANITE, GRANITE_MOE, GRANITE_MOE_SHARED, HYPERCLOVAX, MINICPM3
from .hrm_text import HRM_TEXT
from .hy_v4 import HY_V4
from .hybrid import (
    BAMBA,
    GRANITE_MOE_HYBRID,
    JAMBA,
    LARA_MINI,
    LFM2,
    LFM2_MOE,
    LFM3,
    OLMO_HYBRID,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
)
from .inkling import INKLING
from .inkling2 import INKLING2, INKLING2_LOOP
from .kimi_linear import BAILING_HYBRID, KIMI_LINEAR
from .llama import GEMMA, LLAMA, MISTRAL, OLMO, QWEN2, QWEN3, SMOLLM3
from .llama4 import LLAMA4
from .longcat_flash import LONGCAT_FLASH
from .minimax import MINIMAX
from .modernbert_decoder import MODERNBERT_DECODER
from .moe import DEEPSEEK_V3, GPT_OSS, JETMOE, MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from .mpt import MPT
from .multimodal import EMU3, FUYU, GOT_OCR2, MOSHI, MOSS_TRANSCRIBE_DIARIZE, PHI4_MULTIMODAL
from .openai_gpt import OPENAI_GPT
from .opt import OPT
from .parallel import COHERE, COHERE2_MOE, PHI, STABLELM
from .phi3 import PHI3
from .qwen4_exp import QWEN4_EXP
from .recurrent import FALCON_MAMBA, MAMBA, MAMBA2, NEMOTRON_H, RWKV, XLSTM
from .recurrent_gemma import RECURRENT_GEMMA
from .reformer import REFORMER
from .renamed import APERTUS, GLM, NANOCHAT, PERSIMMON, STARCODER2, VAULTGEMMA
from .sandwich import AFMOE, FLEX_OLMO, GEMMA2, GEMMA3, GEMMA3_MULTIMODAL, GLM4, KOLIBRI1, OLMO2, OLMO3
from .unserved import WHERE_SERVED, why_not_served
from .zamba import ZAMBA, ZAMBA2

# Model types whose blocks are an existing family's, module for module (each proven, like every other, on a
# miniature of its config before its values are trusted; tests/families/test_more_types.py compares them with hooks)
SAME_BLOCKS: dict[str, tuple[str, ...]] = {
    "Llama": ("arcee", "cwm", "ernie4_5", "exaone", "helium", "hunyuan_v1_dense", "internlm3", "iquestcoder", "jais2",
              "ministral", "ministral3", "nemotron", "seed_oss", "youtu",
              "bitnet", "diffllama"),  # sub-norms / differential attention: their attention internals are refused
    "Cohere": ("cohere2", "cohere_compass_text"),
    "Apertus": ("apertus1p5_text",),
    "Llama 4": ("llama4",),  # the image-text checkpoints' type: transformers builds the text model
    "OLMo-2": ("exaone4",),
    "GPT-2": ("gpt-sw3",),
    "Granite": ("granite_swa",),  # its eager attention adds sinks its own way: the attention internals are refused
    "Qwen2-MoE": ("flint",),  # the same
    "Mixtral": ("aria_text", "ernie4_5_moe", "glm4_moe_lite", "hunyuan_v1_moe", "mellum", "minimax_m2", "minimax_m3_vl_text", "phimoe", "solar_open",
                "hy_v3", "mimo_v2_flash", "laguna",  # dense layers named by mlp_layer_types; laguna gates its attention
                "dots3_note", "dots3_note_text",  # gated latent attention, heads per layer
                "minicpm5_moe"),  # transformers 5.25: GLM-4-MoE-Lite's blocks, its attention gated
    "DeepSeek-V3": ("deepseek_v32", "exaone_moe", "glm4_moe", "glm_moe_dsa", "sarvam_mla",
                    "sarvam_moe", "deepseek_v2", "dots1", "axk1", "axk2",
                    "param2moe"),  # transformers 5.25: a Glm4MoeForCausalLM
}


# what each of those types is called: a model of one is served by its family's spec under this name, so what it
# refuses names the model, and says whose blocks it has
BORROWER_NAMES: dict[str, str] = {
    "arcee": "Arcee", "cwm": "CWM", "ernie4_5": "ERNIE-4.5", "exaone": "EXAONE", "helium": "Helium",
    "hunyuan_v1_dense": "Hunyuan-V1-Dense", "internlm3": "InternLM3", "iquestcoder": "IQuestCoder", "jais2": "Jais-2",
    "ministral": "Ministral", "ministral3": "Ministral-3", "nemotron": "Nemotron", "seed_oss": "Seed-OSS",
    "youtu": "Youtu", "bitnet": "BitNet", "diffllama": "DiffLlama", "cohere2": "Cohere2",
    "cohere_compass_text": "Cohere-Compass", "apertus1p5_text": "Apertus-1.5", "llama4": "Llama 4 image-text",
    "exaone4": "EXAONE-4", "gpt-sw3": "GPT-SW3", "granite_swa": "Granite-SWA", "flint": "Flint",
    "aria_text": "Aria text", "ernie4_5_moe": "ERNIE-4.5-MoE", "glm4_moe_lite": "GLM-4-MoE-Lite",
    "hunyuan_v1_moe": "Hunyuan-V1-MoE", "mellum": "Mellum", "minimax_m2": "MiniMax-M2",
    "minimax_m3_vl_text": "MiniMax-M3-VL text", "phimoe": "PhiMoE", "solar_open": "Solar-Open", "hy_v3": "HY-V3",
    "mimo_v2_flash": "MiMo-V2-Flash", "laguna": "Laguna", "dots3_note": "dots3-note",
    "dots3_note_text": "dots3-note text", "deepseek_v32": "DeepSeek-V3.2", "exaone_moe": "EXAONE-MoE",
    "glm4_moe": "GLM-4-MoE", "glm_moe_dsa": "GLM-MoE-DSA", "sarvam_mla": "Sarvam-MLA", "sarvam_moe": "Sarvam-MoE",
    "deepseek_v2": "DeepSeek-V2", "dots1": "dots1", "axk1": "A.X-K1", "axk2": "A.X-K2", "minicpm5_moe": "MiniCPM5-MoE",
    "param2moe": "Param2-MoE",
}


def _with_same_blocks(family: Family) -> Family:
    return dataclasses.replace(family, model_types=family.model_types + SAME_BLOCKS.get(family.name, ()))


# every family, in alphabetical order of its constant; no two claim a model type, so the order decides only
# where the docs' tables list them
FAMILIES: tuple[Family, ...] = tuple(map(_with_same_blocks, (
    AFMOE, APERTUS, BAILING_HYBRID, BAMBA, BEAM, BIOGPT, BLOOM, CODEGEN, COHERE, COHERE2_MOE, CPMANT, CTRL, DBRX,
    DEEPSEEK_V3, DEEPSEEK_V4, DOGE, DORY, EMU3, FALCON, FALCON_H1, FALCON_MAMBA, FLEX_OLMO, FUYU, GEMMA, GEMMA2,
    GEMMA3, GEMMA3N, GEMMA3_MULTIMODAL, GEMMA4, GEMMA4_MULTIMODAL, GEMMA4_UNIFIED, GEMMA4_UNIFIED_MULTIMODAL, GLM,
    GLM4, GOT_OCR2, GPT2, GPTJ, GPT_BIGCODE, GPT_NEO, GPT_NEOX, GPT_NEOX_JAPANESE, GPT_OSS, GRANITE, GRANITE_MOE,
    GRANITE_MOE_HYBRID, GRANITE_MOE_SHARED, HRM_TEXT, HYPERCLOVAX, HY_V4, INKLING, INKLING2, INKLING2_LOOP, JAMBA,
    JETMOE, KIMI_LINEAR, KOLIBRI1, LARA_MINI, LFM2, LFM2_MOE, LFM3, LLAMA, LLAMA4, LONGCAT_FLASH, MAMBA, MAMBA2,
    MINICPM3, MINIMAX, MISTRAL, MIXTRAL, MODERNBERT_DECODER, MOSHI, MOSS_TRANSCRIBE_DIARIZE, MPT, NANOCHAT,
    NEMOTRON_H, OLMO, OLMO2, OLMO3, OLMOE, OLMO_HYBRID, OPENAI_GPT, OPT, PERSIMMON, PHI, PHI3, PHI4_MULTIMODAL,
    QWEN2, QWEN2_MOE, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT, QWEN4_EXP, RECURRENT_GEMMA, REFORMER,
    RWKV, SMOLLM3, STABLELM, STARCODER2, VAULTGEMMA, XGLM, XLSTM, ZAMBA, ZAMBA2, ZAYA,
)))
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


# the spec a proof serves its own model types with while it wraps and checks a miniature, by thread (``Proving``):
# a candidate is proven without being registered, and the registry is never changed to prove one. A plain dict, as
# the registry is: code shipped to a remote server pickles what family_of names
_PROVING: dict[int, Family] = {}


class Proving:
    """``with Proving(family):`` in this thread, ``family_of`` gives ``family`` for its model types."""

    def __init__(self, family: Family):
        self.family, self.thread = family, threading.get_ident()

    def __enter__(self) -> Family:
        self.previous = _PROVING.get(self.thread)
        _PROVING[self.thread] = self.family
        return self.family

    def __exit__(self, *exception) -> None:
        if self.previous is None:
            _PROVING.pop(self.thread, None)
        else:
            _PROVING[self.thread] = self.previous


def family_of(config: PretrainedConfig, architecture: str | None = None) -> Family:
    """The family spec for a config (of a model of class ``architecture``); a clear error when none covers it."""
    model_type = getattr(config, "model_type", None)
    candidate = _PROVING.get(threading.get_ident())
    family = candidate if candidate is not None and model_type in candidate.model_types else BY_MODEL_TYPE.get(model_type)
    if family is None:
        architectures = architecture or ", ".join(getattr(config, "architectures", None) or []) or "unknown class"
        why = why_not_served(model_type)
        if why:  # a type the coverage table excludes, with its reason
            raise UnknownArchitecture(
                f"nnterp does not serve model_type {model_type!r} ({architectures}), {why}. {WHERE_SERVED}; "
                "plain nnsight (nnsight.LanguageModel) wraps any model.")
        raise UnknownArchitecture(
            f"No nnterp family spec covers model_type {model_type!r} ({architectures}); {WHERE_SERVED}. "
            "To serve it: nnterp.register_family(spec) with its spec (docs: guide/custom-architecture.md), or "
            "nnterp.register_family(nnterp.infer_family(config)) where its module names say enough; meanwhile "
            "plain nnsight (nnsight.LanguageModel) wraps any model."
        )
    if model_type in SAME_BLOCKS.get(family.name, ()):  # another family's spec: the model is named as itself
        family = dataclasses.replace(family, name=f"{BORROWER_NAMES.get(model_type, model_type)} ({family.name}'s blocks)")
    return for_config(family, config)


def for_config(family: Family, config: PretrainedConfig) -> Family:
    """``family`` as it serves a model of ``config``: the config checked, the fields that differ on it applied."""
    text_config = config.get_text_config()
    family.check_config(text_config)
    changes = family.per_config(text_config) if family.per_config else {}
    return dataclasses.replace(family, **changes) if changes else family


# the pieces a spec is made of, for a user's own family (``nnterp.register_family``)
__all__ = ["FAMILIES", "BY_MODEL_TYPE", "OWN_ATTENTION", "ROUTED", "Block", "Family", "SameAs",
           "Unavailable", "family_of", "input", "output", "parallel_block", "pre_norm_block"]
