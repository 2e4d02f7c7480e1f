"""Where each standard value lives in vLLM's own model code, per family: data, one entry per family.

vLLM reimplements each family's model (``vllm.model_executor.models``), with its own module names and its own
calling convention between blocks. Two block shapes cover the families placed here:

* ``fused``: a block is called ``layer(positions, hidden, residual)`` (``residual`` None at block 0) and returns
  ``(mlp_out, residual)``; the next norm adds the two (``norm(hidden, residual)`` returns ``(normed, hidden +
  residual)``). The stream is never a tensor between blocks: ``layer_input``, ``layer_mid`` and ``layer_output`` are
  read as the sum of the two parts, and written back as ``(0, stream)``, which the next norm's add turns into the
  stream exactly (``0 + x == x`` in every float format).
* ``plain``: a block takes and returns the stream as one tensor (GPT-2's).

The families vLLM runs through its Transformers backend (transformers' own modules) are placed by their
transformers spec itself (``nnterp.vllm.backend``), plain blocks read as the core reads them (``batched``).

Each value is declared in the core's vocabulary (``nnterp.spec.locations.At`` and its views, as the transformers
family specs declare theirs), but for the fused stream, which is no one tensor (``FusedStream``). What differs on
vLLM is the backend's (``nnterp.vllm.standardized``, ``nnterp.vllm.stream``): activations are flat ``[tokens, width]``
slabs, read as ``[1, tokens, width]`` per invoke (one prompt per invoke, nnsight's rule for vLLM), then through the
location's views.
"""

from __future__ import annotations

import dataclasses

from ..families.base import PARALLEL_NO_MID, ROUTED, is_norm_path, qk_norms
from ..spec.catalog import ATTENTION_INTERNALS, QK_NORM_VALUES
from ..spec.locations import At
from ..spec.views import Half, Times, View
from .backend import BACKEND_FAMILIES, CLASSES, REJECTED, THROUGH_BACKEND, backend_family
from .family import FUSED, PLAIN, FromKernel, FusedStream, Place, VLLMFamily

__all__ = ["FUSED", "PLAIN", "FromKernel", "FusedStream", "Place", "VLLMFamily", "FAMILIES", "family_for",
           "served_family", "sharded", "vllm_class"]

_FUSED_GATE = ("vLLM's gated MLP computes act(gate) * up in one fused op (act_fn, SiluAndMul or GeluAndMul): "
               "act(gate) alone is never a tensor; mlp_neurons is that op's output")
_INTERNALS = ("vLLM computes the attention in its paged-attention kernel (queries, keys and values leave qkv_proj "
              "fused, are rotated inside the attention's forward and go to the KV cache): there is no module "
              "boundary for them, and the scores and probabilities never exist as tensors")


def _fused(name: str, classes: tuple[str, ...], *, attention_contribution: str = "self_attn", mlp_norm: str = "post_attention_layernorm",
           mlp: str = "mlp", mlp_contribution: str | None = None, neurons: str | None = "mlp.down_proj",
           unavailable: dict[str, str] | None = None) -> VLLMFamily:
    """A fused-stream family: Llama's module names unless named (the contributions are the sublayers' outputs,
    or the norms after them: Gemma-2's sandwich)."""
    values = {
        "layer_input": FusedStream("", "input", (1, 2)),
        "attention_norm_output": At("input_layernorm", "output"),
        "attention_premix": At("self_attn.o_proj", "input", heads=True),
        "attention_output": At(attention_contribution, "output"),
        "layer_mid": FusedStream(mlp_norm, "input", (0, 1)),
        "mlp_norm_output": At(mlp_norm, "output"),
        "mlp_input": At(mlp, "input"),
        **({"mlp_neurons": At(neurons, "input")} if neurons else {}),
        "mlp_output": At(mlp_contribution or mlp, "output"),
        "layer_output": FusedStream("", "output", (0, 1)),
    }
    return VLLMFamily(name=name, shape=FUSED, values=values, mlp=mlp, classes=classes, unavailable={
        **{internal: _INTERNALS for internal in ATTENTION_INTERNALS},
        "mlp_activation": _FUSED_GATE,
        **({} if neurons else {"mlp_neurons": ROUTED.reason, "mlp_activation": ROUTED.reason}),
        **(unavailable or {}),
    })


# Mistral's class is Llama's under another name (vLLM's MistralForCausalLM subclasses LlamaForCausalLM)
_LLAMA_LIKE = {"Llama": ("llama.LlamaForCausalLM", "mistral.MistralForCausalLM"),
               "Mistral": ("mistral.MistralForCausalLM", "llama.LlamaForCausalLM"),
               "Qwen2": ("qwen2.Qwen2ForCausalLM",), "Qwen3": ("qwen3.Qwen3ForCausalLM",),
               "Gemma": ("gemma.GemmaForCausalLM",)}

FAMILIES: dict[str, VLLMFamily] = {name: _fused(name, classes) for name, classes in _LLAMA_LIKE.items()}
FAMILIES["Gemma-2"] = _fused("Gemma-2", ("gemma2.Gemma2ForCausalLM",),
                             attention_contribution="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm", mlp_contribution="post_feedforward_layernorm")
FAMILIES["Gemma-3"] = _fused("Gemma-3", ("gemma3.Gemma3ForCausalLM",), attention_contribution="post_attention_layernorm",
                             mlp_norm="pre_feedforward_layernorm", mlp_contribution="post_feedforward_layernorm")
FAMILIES["GLM-4"] = _fused("GLM-4", ("glm4.Glm4ForCausalLM",), attention_contribution="post_self_attn_layernorm",
                           mlp_contribution="post_mlp_layernorm")
FAMILIES["Mixtral"] = _fused("Mixtral", ("mixtral.MixtralForCausalLM",), mlp="block_sparse_moe", neurons=None)
FAMILIES["Qwen2-MoE"] = _fused("Qwen2-MoE", ("qwen2_moe.Qwen2MoeForCausalLM",), neurons=None)
FAMILIES["OLMoE"] = _fused("OLMoE", ("olmoe.OlmoeForCausalLM",), neurons=None)
FAMILIES["Qwen3-MoE"] = _fused("Qwen3-MoE", ("qwen3_moe.Qwen3MoeForCausalLM",), neurons=None)
# vLLM's Phi-3 is its Llama (the fused qkv_proj and gate_up_proj are Llama's there too)
FAMILIES["Phi-3"] = _fused("Phi-3", ("phi3.Phi3ForCausalLM",))

FAMILIES["GPT-2"] = VLLMFamily(
    name="GPT-2", shape=PLAIN, classes=("gpt2.GPT2LMHeadModel",), layers="transformer.h", embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    values={
        "layer_input": At("", "input"),
        "attention_norm_output": At("ln_1", "output"),
        "attention_premix": At("attn.c_proj", "input", heads=True),
        "attention_output": At("attn", "output"),
        "layer_mid": At("ln_2", "input", shared=True),
        "mlp_norm_output": At("ln_2", "output"),
        "mlp_input": At("mlp", "input"),
        # vLLM builds one activation module and shares it between the blocks: read where it goes, c_proj's input
        "mlp_activation": At("mlp.c_proj", "input"),
        "mlp_neurons": At("mlp.c_proj", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={internal: _INTERNALS for internal in ATTENTION_INTERNALS},
)


# vLLM builds one activation module and shares it between the blocks (so it has one path, block 0's): the
# activation is read where it goes, the down projection's input (the MLPs here have no gate: it is mlp_neurons)
FAMILIES["GPT-J"] = VLLMFamily(
    name="GPT-J", shape=PLAIN, classes=("gpt_j.GPTJForCausalLM",), layers="transformer.h", embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    values={
        "layer_input": At("", "input", arg=1),  # layer(position_ids, hidden_states)
        "attention_norm_output": At("ln_1", "output"),
        "mlp_norm_output": At("ln_1", "output"),  # one norm feeds both sublayers
        "attention_premix": At("attn.out_proj", "input", heads=True),
        "attention_output": At("attn", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_activation": At("mlp.fc_out", "input"),
        "mlp_neurons": At("mlp.fc_out", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={"layer_mid": PARALLEL_NO_MID.reason, **{internal: _INTERNALS for internal in ATTENTION_INTERNALS}},
)

# OPT's MLP layers sit on the block; fc2 returns (output, bias) as vLLM's linear layers do. Configs with the norms
# after the adds (OPT-350m) or with project_in/out are refused by the StandardizedVLLM constructor.
FAMILIES["OPT"] = VLLMFamily(
    name="OPT", shape=PLAIN, classes=("opt.OPTForCausalLM",), layers="model.decoder.layers",
    embed_tokens="model.decoder.embed_tokens",
    ln_final="model.decoder.final_layer_norm", mlp=None,
    values={
        "layer_input": At("", "input"),
        "attention_norm_output": At("self_attn_layer_norm", "output"),
        "attention_premix": At("self_attn.out_proj", "input", heads=True),
        "attention_output": At("self_attn", "output"),
        "layer_mid": At("final_layer_norm", "input", shared=True),
        "mlp_norm_output": At("final_layer_norm", "output"),
        "mlp_input": At("fc1", "input"),
        "mlp_activation": At("fc2", "input"),  # the activation module is shared between the blocks
        "mlp_neurons": At("fc2", "input"),
        "mlp_output": At("fc2", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={internal: _INTERNALS for internal in ATTENTION_INTERNALS},
)

# Falcon's parallel blocks with one norm (Falcon-7B's layout; the constructor refuses the others). Both sublayers
# return (output, bias); the block then adds the attention output into the MLP's output in place.
FAMILIES["Falcon"] = VLLMFamily(
    name="Falcon", shape=PLAIN, classes=("falcon.FalconForCausalLM",), layers="transformer.h",
    # Falcon-7B's layout: parallel blocks with one norm, rotary positions
    requires={"new_decoder_architecture": False, "parallel_attn": True, "alibi": False},
    embed_tokens="transformer.word_embeddings",
    ln_final="transformer.ln_f", attention="self_attention",
    values={
        "layer_input": At("", "input", arg=1),  # layer(positions, hidden_states)
        "attention_norm_output": At("input_layernorm", "output"),
        "mlp_norm_output": At("input_layernorm", "output"),  # one norm feeds both sublayers
        "attention_premix": At("self_attention.dense", "input", heads=True),
        "attention_output": At("self_attention", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_activation": At("mlp.dense_4h_to_h", "input"),  # the activation module is shared between blocks
        "mlp_neurons": At("mlp.dense_4h_to_h", "input"),
        "mlp_output": At("mlp", "output", copy=True),
        "layer_output": At("", "output"),
    },
    unavailable={"layer_mid": PARALLEL_NO_MID.reason, **{internal: _INTERNALS for internal in ATTENTION_INTERNALS}},
)

# BLOOM (ALiBi) with the residual taken before the norms (every released checkpoint; the constructor refuses the
# other setting). vLLM's attention and MLP return their contributions; the block adds the residual (transformers'
# modules add it inside themselves).
FAMILIES["BLOOM"] = VLLMFamily(
    name="BLOOM", shape=PLAIN, classes=("bloom.BloomForCausalLM",), layers="transformer.h",
    requires={"apply_residual_connection_post_layernorm": False},  # the residual before the norms (every release)
    embed_tokens="transformer.word_embeddings",
    ln_final="transformer.ln_f", attention="self_attention",
    values={
        "layer_input": At("", "input", arg=1),  # layer(position_ids, hidden_states)
        "attention_norm_output": At("input_layernorm", "output"),
        "attention_premix": At("self_attention.dense", "input", heads=True),
        "attention_output": At("self_attention", "output"),
        "layer_mid": At("post_attention_layernorm", "input", shared=True),
        "mlp_norm_output": At("post_attention_layernorm", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_activation": At("mlp.dense_4h_to_h", "input"),  # the activation module is shared between blocks
        "mlp_neurons": At("mlp.dense_4h_to_h", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={internal: _INTERNALS for internal in ATTENTION_INTERNALS},
)

# vLLM's StableLM: a block takes (positions, hidden) and returns (stream, residual before the MLP); sequential
# blocks without q/k norms only (vLLM's code has neither use_parallel_residual nor qk_layernorm)
FAMILIES["StableLM"] = VLLMFamily(
    name="StableLM", shape=PLAIN, classes=("stablelm.StablelmForCausalLM",),
    requires={"use_parallel_residual": False, "qk_layernorm": False},
    values={
        "layer_input": At("", "input", arg=1),
        "attention_norm_output": At("input_layernorm", "output"),
        "attention_premix": At("self_attn.o_proj", "input", heads=True),
        "attention_output": At("self_attn", "output"),
        "layer_mid": At("post_attention_layernorm", "input", shared=True),
        "mlp_norm_output": At("post_attention_layernorm", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_neurons": At("mlp.down_proj", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={internal: _INTERNALS for internal in ATTENTION_INTERNALS} | {
        "mlp_activation": "vLLM's gated MLP computes act(gate) * up in one fused op (SiluAndMul): act(gate) alone is "
                          "never a tensor; mlp_neurons is that op's output"},
)

# Cohere's parallel block (vLLM's commandr.py, Cohere and Cohere2): one norm feeds the attention and the MLP, the block
# adds both to its input and returns (stream, its input); the norm returns (normed, residual) and has no bias.
# vLLM's Cohere2 sliding layers attend to sliding_window + 1 positions (its training convention, says its code),
# transformers' to sliding_window: past the window the two engines compute different models; the values here are
# vLLM's own
FAMILIES["Cohere"] = VLLMFamily(
    name="Cohere", shape=PLAIN, classes=("commandr.CohereForCausalLM",),
    requires={"use_qk_norm": False},  # the q/k norms of Command-R+ are not described here
    values={
        "layer_input": At("", "input", arg=1),  # layer(positions, hidden_states, residual)
        "attention_norm_output": At("input_layernorm", "output"),
        "mlp_norm_output": At("input_layernorm", "output"),  # one norm feeds both sublayers
        "attention_premix": At("self_attn.o_proj", "input", heads=True),
        "attention_output": At("self_attn", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_neurons": At("mlp.down_proj", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": At("", "output"),
    },
    unavailable={"layer_mid": PARALLEL_NO_MID.reason, **{internal: _INTERNALS for internal in ATTENTION_INTERNALS},
                 "mlp_activation": _FUSED_GATE},
)


def _times(name: str, classes: tuple[str, ...], *, mlp: str = "mlp", post_norms: tuple[str, str] | None = None, routed: bool = False) -> VLLMFamily:
    """A sequential block whose code adds each contribution times the block's ``residual_multiplier`` (Granite's
    muP), as transformers' does: the contributions are read as those products (the core's ``Times`` view, handed
    back through the factor where edited), computed from the sublayer's output, or from the norm after it
    (HyperCLOVAX's ``post_norm1`` / ``post_norm2``)."""
    attention, mlp_out = post_norms or ("self_attn", mlp)
    factor = (Times("residual_multiplier"),)
    values = {
        "layer_input": At("", "input", arg=1),  # layer(positions, hidden_states[, residual])
        "attention_norm_output": At("input_layernorm", "output"),
        "attention_premix": At("self_attn.o_proj", "input", heads=True),
        "attention_output": At(attention, "output", views=factor),
        "layer_mid": At("post_attention_layernorm", "input", shared=True),
        "mlp_norm_output": At("post_attention_layernorm", "output"),
        "mlp_input": At(mlp, "input"),
        **({} if routed else {"mlp_neurons": At(f"{mlp}.down_proj", "input")}),
        "mlp_output": At(mlp_out, "output", views=factor),
        "layer_output": At("", "output"),  # the stream (element 0 where the block also returns its residual)
    }
    return VLLMFamily(name=name, shape=PLAIN, classes=classes, mlp=mlp, values=values, unavailable={
        **{internal: _INTERNALS for internal in ATTENTION_INTERNALS},
        "mlp_activation": ROUTED.reason if routed else _FUSED_GATE, **({"mlp_neurons": ROUTED.reason} if routed else {})})


FAMILIES["Granite"] = _times("Granite", ("granite.GraniteForCausalLM",))
FAMILIES["Granite-MoE"] = _times("Granite-MoE", ("granitemoe.GraniteMoeForCausalLM",), mlp="block_sparse_moe", routed=True)
# HyperCLOVAX norms each sublayer's output (post_norm1, post_norm2: use_post_norm, every release) before the factor
FAMILIES["HyperCLOVAX"] = dataclasses.replace(
    _times("HyperCLOVAX", ("hyperclovax.HyperCLOVAXForCausalLM",), post_norms=("post_norm1", "post_norm2")),
    requires={"use_post_norm": True})

# GPT-OSS: Llama's fused stream, but a block is called layer(hidden, positions, residual); the attention (`attn`,
# with one sink logit per head in its kernel) and the routed MLP (`mlp`: router, then the fused experts)
FAMILIES["GPT-OSS"] = VLLMFamily(
    name="GPT-OSS", shape=FUSED, classes=("gpt_oss.GptOssForCausalLM",), embed_tokens="model.embedding",
    attention="attn",
    values={
        "layer_input": FusedStream("", "input", (0, 2)),
        "attention_norm_output": At("input_layernorm", "output"),
        "attention_premix": At("attn.o_proj", "input", heads=True),
        "attention_output": At("attn", "output"),
        "layer_mid": FusedStream("post_attention_layernorm", "input", (0, 1)),
        "mlp_norm_output": At("post_attention_layernorm", "output"),
        "mlp_input": At("mlp", "input"),
        "mlp_output": At("mlp", "output"),
        "layer_output": FusedStream("", "output", (0, 1)),
    },
    unavailable={**{internal: _INTERNALS for internal in ATTENTION_INTERNALS},
                 "mlp_neurons": ROUTED.reason, "mlp_activation": ROUTED.reason},
)


class HalvesInterleaved(View):
    """A head's query or key in transformers' order, where vLLM's loader reorders each head's rows of the query and
    key projections (Llama 4's: the pairs its rotary rotates, (x0, x1), (x2, x3), ..., moved into two halves for
    its kernel): the halves interleaved back, a new tensor, handed back through the inverse order where edited."""

    name = "halves_interleaved"
    rank = 65  # after the heads' view
    fresh = True

    def view(self, tensor, block, heads):
        return tensor.unflatten(-1, (2, tensor.shape[-1] // 2)).transpose(-1, -2).flatten(-2)

    def unview(self, value, tensor, block, heads):
        return value.unflatten(-1, (value.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)

    def describe(self) -> str:
        return " (each head's halves interleaved back: transformers' order)"


# Llama 4: Llama's fused stream with the MLP at feed_forward, a routed mixture on the moe_layers and the gated MLP on
# the others; a placement holds for every block of a family, so mlp_neurons is refused on all, saying where to read it
FAMILIES["Llama 4"] = _fused("Llama 4", ("llama4.Llama4ForCausalLM",), mlp="feed_forward", neurons=None, unavailable={
    reason: "vLLM's Llama 4 alternates routed blocks (each token runs its own experts: no single activation) and "
            "dense ones (the gated MLP, act(gate) * up fused in one op); one placement serves every block, so it is "
            "not placed: on a dense block, read feed_forward.down_proj's input natively"
    for reason in ("mlp_neurons", "mlp_activation")})
KERNEL_VIEWS = {"Llama 4": (HalvesInterleaved(),)}  # what a family's queries and keys are read through, at the kernel


def family_for(model_type: str) -> VLLMFamily:
    """The vLLM placement of the family of ``model_type`` (a config's), or a ``NotImplementedError`` naming why. A
    family vLLM runs through its Transformers backend is placed for the family's tiny config (``served_family``
    places it for the checkpoint's own)."""
    from ..families import BY_MODEL_TYPE

    family = BY_MODEL_TYPE.get(model_type)
    name = family.name if family is not None else model_type
    placed = FAMILIES.get(name)
    if placed is None and name in BACKEND_FAMILIES:
        return backend_family(family, family.tiny_config().get_text_config())
    if placed is None and name in REJECTED:
        raise NotImplementedError(f"StandardizedVLLM does not serve {name}: {REJECTED[name]}. Use "
                                  "StandardizedTransformer for it.")
    if placed is None:
        raise NotImplementedError(
            f"StandardizedVLLM has no placement of the standard values in vLLM's code for {name} (model_type "
            f"{model_type!r}): vLLM reimplements each family with its own module names and block calls, and this "
            f"one is declared neither in nnterp/vllm/places.py nor, for its Transformers backend, in "
            f"nnterp/vllm/backend.py. Placed: {', '.join(sorted([*FAMILIES, *BACKEND_FAMILIES]))}. Use "
            "StandardizedTransformer for it.")
    return placed


def vllm_class(config, model_impl: str = "auto") -> str:
    """The model class vLLM's registry will run for ``config`` (``"<module>.<Class>"`` under
    vllm.model_executor.models), by vLLM's own rule: the first of the config's architectures that vLLM registers,
    else (or with ``model_impl="transformers"``) its Transformers backend. Read from the registry, no engine started."""
    from vllm.model_executor.models.registry import ModelRegistry

    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:  # a bare config: the class transformers' save_pretrained would name
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        named = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if named is None:
            raise NotImplementedError(
                f"The config (model_type {config.model_type!r}) names no `architectures`, which vLLM resolves its "
                "model class from, and transformers has no causal LM for its type: set config.architectures.")
        architectures = [named]
    registered = [ModelRegistry.models[arch] for arch in architectures if arch in ModelRegistry.models]
    if model_impl == "transformers" or not registered:
        return "transformers.TransformersForCausalLM"
    model = registered[0]
    return f"{model.module_name.rpartition('.')[2]}.{model.class_name}"


def served_family(config, model_impl: str = "auto") -> VLLMFamily:
    """The placement of ``config``'s family, checked against the code vLLM will run for it (``vllm_class``), or a
    ``NotImplementedError`` naming why, before any engine starts."""
    from ..families import BY_MODEL_TYPE

    text = config.get_text_config()
    family = family_for(text.model_type)
    runs = vllm_class(config, model_impl)
    # on the backend: placed for this checkpoint's own config (its block's variant), by its family's spec
    if runs in CLASSES and (family.batched or text.model_type in THROUGH_BACKEND):
        return backend_family(BY_MODEL_TYPE[text.model_type], text)
    if runs not in family.classes:
        backend = runs.startswith("transformers.")
        raise NotImplementedError(
            f"StandardizedVLLM does not place the standard values on {config.model_type!r} "
            f"({', '.join(config.architectures or [])}): nnterp files it under {family.name}, but vLLM would run "
            + ("it through its Transformers backend, where nnterp/vllm/backend.py places it only for the families "
               "proven there" if backend else f"its own class {runs}")
            + f", not the code the {family.name} places describe ({', '.join(family.classes)}; "
            "nnterp/vllm/places.py). Use StandardizedTransformer for it.")
    return family


def _with_kernel(family: VLLMFamily) -> VLLMFamily:
    """The attention's values at the kernel's module (``<attention>.attn``: vLLM's ``Attention``, called as
    ``attn(q, k, v)`` with the queries and keys rotated): the queries, keys and values entering it, per head
    (keys and values per key-value head), and the scores and probabilities recomputed from them; in forward order,
    before the heads' mixed output."""
    kernel = f"{family.attention}.attn"
    order = KERNEL_VIEWS.get(family.name, ())
    internals = {"queries": At(kernel, "input", arg=0, heads=True, views=order),
                 "keys": At(kernel, "input", arg=1, heads=True, views=order),
                 "values": At(kernel, "input", arg=2, heads=True), "attention_scores": FromKernel(kernel),
                 "attention_probabilities": FromKernel(kernel)}
    values = {}
    for name, place in family.values.items():
        if name == "attention_premix":
            values.update(internals)
        values[name] = place
    unavailable = {name: reason for name, reason in family.unavailable.items() if name not in internals}
    return dataclasses.replace(family, values=values, unavailable=unavailable)


# vLLM's rotary embedding rotates the normed queries and keys in place: their norms' outputs are read as copies (an
# edit handed back), so a value kept past the rotation is still what the norm gave
_QK_NORMS = {name: {value: dataclasses.replace(place, copy=True) if place.side == "output" else place
                    for value, place in qk_norms().items()} for name in ("Qwen3", "Qwen3-MoE", "Gemma-3")}
_ROUTERS = {"Mixtral": "block_sparse_moe.gate", "Granite-MoE": "block_sparse_moe.gate", "Qwen2-MoE": "mlp.gate",
            "Qwen3-MoE": "mlp.gate", "OLMoE": "mlp.gate", "GPT-OSS": "mlp.router"}
# where vLLM's MLP computes its activation's input, on the blocks whose activation module is shared between them (the
# up projection's output; vLLM's linear layers return (output, bias))
_UP = {"GPT-2": "mlp.c_fc", "GPT-J": "mlp.fc_in", "OPT": "fc1", "Falcon": "mlp.dense_h_to_4h",
       "BLOOM": "mlp.dense_h_to_4h"}
_NO_QK_NORM = ("vLLM's code for this family norms no queries or keys of their own, or nnterp places none on it yet "
               "(OLMoE's norms read the whole projection, gathered across the ranks)")


def _where_present(family: VLLMFamily) -> VLLMFamily:
    """``family`` with the values the catalog has only where their module is (``WHERE_PRESENT``): the q/k norms'
    inputs and outputs, the router's logits, the activation's input and the up projection's output (the two halves of
    the fused gate-and-up output vLLM's activation reads; the up projection's output where the MLP is not gated), and
    the contributions before a sandwich block's norms (the norm's input; elsewhere the contribution's own place), each
    inserted in forward order."""
    name, values, unavailable = family.name, family.values, dict(family.unavailable)
    new: dict[str, Place] = dict(_QK_NORMS.get(name, {}))
    if name not in _QK_NORMS:
        unavailable.update(dict.fromkeys(QK_NORM_VALUES, _NO_QK_NORM))
    if name in _ROUTERS:
        new["router_logits"] = At(_ROUTERS[name], "output")
    else:
        unavailable.setdefault("router_logits", unavailable.get("mlp_neurons", "a dense MLP: no router"))
    if name in _UP:
        new["mlp_pre_activation"] = At(_UP[name], "output")
    elif "mlp_neurons" in values and family.mlp:
        # the gate-and-up projection's output, not the act-and-mul module's input: vLLM shares one such module
        # between the blocks on some families (Gemma-3's, from its registry), so it has one path, block 0's
        new["mlp_pre_activation"] = At(f"{family.mlp}.gate_up_proj", "output", views=(Half(0),))
        new["mlp_up_output"] = At(f"{family.mlp}.gate_up_proj", "output", views=(Half(1),))
    else:
        unavailable["mlp_pre_activation"] = unavailable["mlp_neurons"]
    if "mlp_up_output" not in new:
        unavailable["mlp_up_output"] = unavailable.get("mlp_neurons", "the MLP is not gated: no up projection "
                                                       "multiplies its activation")
    for contribution in ("attention_output", "mlp_output"):
        place = values[contribution]
        after_norm = isinstance(place, At) and is_norm_path(place.path)
        new[f"{contribution}_before_norm"] = At(place.path, "input") if after_norm else place
    ordered: dict[str, Place] = {}
    anchors = {"queries": QK_NORM_VALUES,
               "attention_output": ("attention_output_before_norm",),
               "mlp_output": ("router_logits", "mlp_pre_activation", "mlp_up_output", "mlp_output_before_norm")}
    for key, place in values.items():
        if key in ("mlp_activation", "mlp_neurons", "mlp_output"):  # the router and the activation's input first
            for early in ("router_logits", "mlp_pre_activation", "mlp_up_output"):
                if early in new and early not in ordered:
                    ordered[early] = new[early]
        for before in anchors.get(key, ()):
            if before in new and before not in ordered:
                ordered[before] = new[before]
        ordered[key] = place
    return dataclasses.replace(family, values=ordered, unavailable=unavailable)


FAMILIES = {name: _where_present(_with_kernel(family)) for name, family in FAMILIES.items()}


KERNEL_SHARDED = ("under tensor parallelism each rank's attention kernel receives its own heads' queries, keys and "
                  "values, at no parallel linear layer's boundary (where nnsight gathers the ranks' pieces into the "
                  "whole): read here they would be one rank's heads. attention_premix (the output projection's "
                  "input, gathered) is whole; run with tensor_parallel_size=1 for the attention's internals")


RANK_SHARDED = ("under tensor parallelism each rank norms its own heads' queries and keys at no parallel linear layer's "
                "boundary (where nnsight gathers the ranks' pieces into the whole), and the fused gate-and-up "
                "projection's output gathered is each rank's [gate | up] side by side, not [gate | up]: read here "
                "they would be one rank's slice, or the halves mixed; run with tensor_parallel_size=1 for them")


def sharded(family: VLLMFamily) -> VLLMFamily:
    """``family`` on a tensor-parallel engine: the values at module boundaries are whole (the stream is all-reduced;
    nnsight gathers the pieces at the parallel linear layers' boundaries), those at the attention kernel are one
    rank's heads, and are refused with the reason."""
    kernel = [name for name in ATTENTION_INTERNALS if name in family.values]  # at the kernel (``_with_kernel``)
    # a rank's own heads (each rank norms its heads' queries and keys) and a rank's own gate-and-up slab (the
    # activation's input): at no parallel linear layer's boundary either
    own = [name for name, place in family.values.items() if name in QK_NORM_VALUES
           or isinstance(place, At) and any(isinstance(view, Half) for view in place.views)]
    refused = {**dict.fromkeys(kernel, KERNEL_SHARDED), **dict.fromkeys(own, RANK_SHARDED)}
    return dataclasses.replace(family, values={k: v for k, v in family.values.items() if k not in refused},
                               unavailable={**family.unavailable, **refused})
