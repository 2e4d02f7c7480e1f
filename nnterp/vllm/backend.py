"""The families vLLM runs through its Transformers backend (``vllm.model_executor.models.transformers``): where each
standard value lives there, derived from the family's transformers spec.

The backend runs transformers' own modules under the causal LM's ``model`` (the backbone, whatever transformers
calls it), with vLLM's replacements: its parallel linears for ``nn.Linear`` (returning the output alone, as
``nn.Linear`` does), its norms, its embedding, its attention kernel behind transformers' attention interface, and
its fusers, which merge q/k/v into one projection and a gated MLP's gate and up projections into one, computing
``act(gate) * up`` in one op. The blocks are transformers' decoder layers: the stream enters and leaves them as one
tensor (a plain block), and the activations are ``[1, tokens, width]`` for the whole step, which nnsight narrows to
each request's tokens (``VLLMBatcher._token_dim``): the layout transformers' values have. So the transformers
spec's locations (``At``) are read and written here by the core's own code (``At.read`` / ``At.write``), at the
same module boundaries, but for what the backend takes away: the attention kernel's inputs (``KERNEL``), a gated
MLP's activation where the GLU fuser fuses it (``GLU``), operations inside a recompiled forward (``OPERATION``).
"""

from __future__ import annotations

from ..spec.catalog import ATTENTION_INTERNALS, CATALOG
from ..spec.locations import At, Unavailable
from ..spec.views import Half, HeadsFirst
from .family import PLAIN, VLLMFamily

CLASSES = ("transformers.TransformersForCausalLM", "transformers.TransformersMoEForCausalLM")

# the nnterp families whose blocks are placed here, each proven against transformers (tests/vllm/test_vllm.py), each
# with whether vLLM's GLU fuser fuses its MLP's act(gate) * up (a gated MLP with separate gate and up projections:
# Llama's; GLM's, already one projection in transformers, keeps its activation module)
BACKEND_FAMILIES = {"GPT-NeoX": False, "OLMo": True, "OLMo-2": True, "OLMo-3": True, "GLM": False, "GPT-BigCode": False,
         "StarCoder2": False, "SmolLM3": True, "VaultGemma": True, "Phi": False, "Persimmon": False,
         "CodeGen": False, "BioGPT": False, "FlexOlmo": False,
         "nanochat": False, "Kolibri-1": False}
# model types nnterp files under Llama, whose placement describes vLLM's own Llama code, that vLLM runs through its
# Transformers backend (it has no class of its own for them): placed there by the Llama spec, each with whether the
# GLU fuser fuses its MLP (Arcee's and Jais-2's are ungated: up, ReLU squared, down)
THROUGH_BACKEND = {"helium": True, "seed_oss": True, "ministral": True, "cwm": True, "hunyuan_v1_dense": True,
                   "arcee": False, "jais2": False}


def fused_activation(name: str, model_type: str) -> bool:
    """Whether vLLM's GLU fuser fuses the MLP of the family ``name``'s type ``model_type`` on the backend."""
    return THROUGH_BACKEND[model_type] if model_type in THROUGH_BACKEND else BACKEND_FAMILIES[name]


# the nnterp families tried on vLLM 0.32 that it does not run as transformers does: why
REJECTED = {
    "GPT-Neo": "vLLM 0.32 does not run GPTNeoForCausalLM: it has no model of its own for it, and its Transformers "
               "backend refuses it (transformers' GPT-Neo attention does not dispatch through the attention "
               "interface, where the backend puts vLLM's kernel)",
    "XGLM": "vLLM 0.32 does not run XGLMForCausalLM: it has no model of its own for it, and its Transformers "
            "backend refuses it (transformers' XGLM attention does not dispatch through the attention interface, "
            "where the backend puts vLLM's kernel)",
    "JetMoE": "vLLM's Transformers backend runs JetMoE's mixture of attention heads otherwise than transformers: the "
              "engine computes another model (the first attention's output is off by 75% of its size on a tiny "
              "model, the stream entering it exact)",
    "Dory": "vLLM's Transformers backend cannot load a Dory checkpoint: its head's logit_scale parameter has no "
            "place in the head vLLM puts there (ParallelLMHead)",
    "Beam": "vLLM's Transformers backend cannot run Beam: its attention gates the attention interface's output per "
            "head, in transformers' [batch, tokens, heads, dim] layout, and vLLM's kernel returns [tokens, heads * dim] "
            "(its forward fails on the first prompt)",
    "ZAYA": "vLLM's Transformers backend runs ZAYA's convolutional attention (its CCA projection) over the whole "
            "step's tokens: requests batched in one step read each other's tokens (a second request's values off by "
            "their own size on a tiny model, the first one's exact)",
    "Doge": "vLLM's Transformers backend runs Doge's attention through vLLM's kernel, which drops the dynamic mask "
            "transformers adds to the scores (from dt_proj): the engine computes another model than transformers "
            "(every value from the first attention on differs, by 3e-3 of its size on a tiny model)",
}

KERNEL = ("vLLM's Transformers backend calls its attention kernel as `attn.forward(q, k, v)` from transformers' "
          "attention interface (vllm_attention_forward), not through the module call nnsight hooks, so the kernel's "
          "inputs are at no boundary nnsight reads; and the interface's own inputs are [1, heads, tokens, dim] for "
          "the whole step, which nnsight does not split per request. The scores and probabilities never exist as "
          "tensors (vLLM's paged-attention kernel)")
GLU = ("vLLM's Transformers backend fuses the gated MLP's gate and up projections and computes act(gate) * up in "
       "one op (its GLU fuser: the act module becomes an act-and-mul): act(gate) alone is never a tensor; "
       "mlp_neurons is that op's output")
GLU_INPUT = ("vLLM's Transformers backend fuses the gated MLP's gate and up projections into one (its GLU fuser), "
             "whose act-and-mul module reads both: the activation's input and the up projection's output, its two "
             "parts, are not placed on the backend yet")
HEADS_FIRST = ("read where the attention holds it [batch, heads, seq, dim]: on vLLM's Transformers backend that tensor is "
               "[1, heads, tokens, dim] for the whole step, which nnsight does not split per request")
OPERATION = ("read at an operation inside transformers' forward (`.source`), which vLLM's Transformers backend "
             "recompiles where it fuses modules: nnterp reads it at module boundaries only there")
# the block's values (``mixer_output`` is the attention's output on these families)
NAMES = [value.name for value in CATALOG if value.owner in ("block", "self_attn", "mlp")
         and value.name not in ("mixer_output", *ATTENTION_INTERNALS)]


def _under_model(path: str | None) -> str | None:
    """A path from transformers' causal LM root, from the backend's: its backbone is ``model`` whatever
    transformers names it (``gpt_neox.layers`` is ``model.layers``)."""
    return None if path is None else "model." + path.partition(".")[2]


def backend_family(spec, config) -> VLLMFamily:
    """``spec``'s (an nnterp ``Family``) placement in vLLM's Transformers backend for ``config`` (its text config):
    its transformers locations, those the fusers took away said unavailable, the attention's internals refused."""
    block = spec.block(config, 0)
    values, unavailable = {}, dict.fromkeys(ATTENTION_INTERNALS, KERNEL)
    for name in NAMES:
        location = block.resolve(name)
        if isinstance(location, Unavailable):
            unavailable[name] = location.reason
        elif location.op or location.join:
            unavailable[name] = OPERATION
        elif name == "mlp_activation" and fused_activation(spec.name, config.model_type):
            unavailable[name] = GLU
        elif name in ("mlp_pre_activation", "mlp_up_output") and fused_activation(spec.name, config.model_type):
            unavailable[name] = GLU_INPUT
        elif any(isinstance(view, HeadsFirst) for view in location.views):
            unavailable[name] = HEADS_FIRST
        else:
            values[name] = location
    return VLLMFamily(name=spec.name, shape=PLAIN, values=_in_forward_order(values), layers=_under_model(spec.layers),
                      embed_tokens=_under_model(spec.embed_tokens), ln_final=_under_model(spec.ln_final),
                      attention=spec.attention, mlp=spec.mlp, unavailable=unavailable, classes=CLASSES, batched=True)


def _in_forward_order(values: dict) -> dict:
    """``values`` (the catalog's order) with each value read at an earlier one's boundary moved beside it: a parallel
    block's one norm feeds both sublayers, so ``mlp_norm_output`` is read where ``attention_norm_output`` is,
    before the attention runs (a trace reads values in forward order: run_with_cache, collect); and the up half of
    one gate-and-up projection before the activation's input."""
    up = values.get("mlp_up_output")
    if up is not None and "mlp_pre_activation" in values and any(isinstance(view, Half) for view in up.views):
        # the up half of one gate-and-up projection (GLM's) exists before the activation reads the gate's half
        values = {name: place for name, place in values.items() if name != "mlp_up_output"}
        at = list(values).index("mlp_pre_activation")
        values = dict([*list(values.items())[:at], ("mlp_up_output", up), *list(values.items())[at:]])
    ordered = {}
    for name, place in values.items():
        if name not in ordered:
            ordered[name] = place
            ordered.update({other: at for other, at in values.items()
                            if other not in ordered and (at.path, at.side) == (place.path, place.side)})
    return ordered


def check_tree(family: VLLMFamily, config, root) -> None:
    """Raise where the backend's module tree (``root``, the engine's model, built for ``config``) is not the one
    ``family`` describes: a module a value is read at that is not there, or an activation module the GLU fuser
    fused (an act-and-mul) where ``BACKEND_FAMILIES`` says it did not, or the other way round. The declaration is then wrong
    for this checkpoint, and no value is read from it."""
    from ..families import BY_MODEL_TYPE

    block = root.get_submodule(f"{family.layers}.0")
    wrong = []
    for name, place in family.values.items():
        try:
            if place.path:
                block.get_submodule(place.path)
        except AttributeError:
            wrong.append(f"{name} at {place.path} (no such module in vLLM's tree)")
    act = BY_MODEL_TYPE[config.model_type].block(config, 0).resolve("mlp_activation")
    if isinstance(act, At) and act.path and not act.op:
        try:
            fused = type(block.get_submodule(act.path)).__name__.endswith("AndMul")
        except AttributeError:
            fused = None
        declared = fused_activation(family.name, config.model_type)
        if fused is not None and fused != declared:
            wrong.append(f"the activation at {act.path} is {'' if fused else 'not '}fused with the up projection "
                         f"(declared {'' if declared else 'not '}fused)")
    if wrong:
        raise NotImplementedError(
            f"vLLM's Transformers backend built {family.name}'s blocks otherwise than nnterp/vllm/backend.py "
            f"describes: {'; '.join(wrong)}. Use StandardizedTransformer for it.")
