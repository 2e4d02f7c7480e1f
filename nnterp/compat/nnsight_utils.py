"""nnterp 1.x's ``nnterp.nnsight_utils``: the function spellings of the standard values, kept working.

On a ``StandardizedTransformer`` each reads the standard value (``get_attention_output`` is what the
attention adds to the stream, on BLOOM too); on a plain nnsight model with Llama-style names it reads
the module boundary 1.x read. Each warns with the new spelling.
"""

from __future__ import annotations

from collections.abc import Callable

import nnsight
import torch
from nnsight import LanguageModel

from ..core.standardized import StandardizedTransformer
from .legacy import deprecated
from .utils import TraceTensor, unpack_tuple

GetModuleOutput = Callable[[LanguageModel, int], TraceTensor]


def _standard(nn_model) -> bool:
    return isinstance(nn_model, StandardizedTransformer)


def get_embed_tokens(model):
    deprecated("get_embed_tokens(model)", "model.embed_tokens")
    return model.embed_tokens


def get_layers(model):
    deprecated("get_layers(model)", "model.layers")
    return model.layers if _standard(model) else model.model.layers


def get_num_layers(nn_model) -> int:
    deprecated("get_num_layers(model)", "model.num_layers")
    return nn_model.num_layers if _standard(nn_model) else len(nn_model.model.layers)


def _block(nn_model, layer: int):
    """Block ``layer``: the standard one, or 1.x's ``model.model.layers[i]`` on a plain nnsight model."""
    return nn_model.layers[layer] if _standard(nn_model) else nn_model.model.layers[layer]


def get_layer(nn_model, layer: int):
    deprecated("get_layer(model, i)", "model.layers[i]")
    return _block(nn_model, layer)


def get_layer_input(nn_model, layer: int) -> TraceTensor:
    deprecated("get_layer_input(model, i)", "model.layers[i].layer_input")
    return nn_model.read_value(layer, "layer_input") if _standard(nn_model) else nn_model.model.layers[layer].input


def _value(nn_model, layer: int, name: str, native: Callable):
    """The standard value on a StandardizedTransformer; on a plain nnsight model, what 1.x read at ``native(block)``."""
    if _standard(nn_model):
        return nn_model.read_value(layer, name)
    return unpack_tuple(native(nn_model.model.layers[layer]))


def get_layer_output(nn_model, layer: int) -> TraceTensor:
    deprecated("get_layer_output(model, i)", "model.layers[i].layer_output")
    return _value(nn_model, layer, "layer_output", lambda block: block.output)


def get_attention(nn_model, layer: int):
    deprecated("get_attention(model, i)", "model.layers[i].self_attn")
    return _block(nn_model, layer).self_attn


def get_attention_output(nn_model, layer: int) -> TraceTensor:
    deprecated("get_attention_output(model, i)", "model.layers[i].self_attn.attention_output")
    return _value(nn_model, layer, "attention_output", lambda block: block.self_attn.output)


def get_mlp(nn_model, layer: int):
    deprecated("get_mlp(model, i)", "model.layers[i].mlp")
    return _block(nn_model, layer).mlp


def get_mlp_output(nn_model, layer: int) -> TraceTensor:
    deprecated("get_mlp_output(model, i)", "model.layers[i].mlp.mlp_output")
    return _value(nn_model, layer, "mlp_output", lambda block: block.mlp.output)


def get_logits(nn_model) -> TraceTensor:
    deprecated("get_logits(model)", "model.logits")
    return nn_model.output.logits


def get_unembed_norm(nn_model):
    deprecated("get_unembed_norm(model)", "model.ln_final")
    return nn_model.ln_final if _standard(nn_model) else nn_model.model.norm


def get_unembed(nn_model):
    deprecated("get_unembed(model)", "model.lm_head")
    return nn_model.lm_head


def project_on_vocab(nn_model, h: TraceTensor) -> TraceTensor:
    deprecated("project_on_vocab(model, h)", "model.project_on_vocab(h)")
    if _standard(nn_model):
        return nn_model.project_on_vocab(h)
    return nn_model.lm_head(nn_model.model.norm(h))


def get_next_token_probs(nn_model) -> TraceTensor:
    deprecated("get_next_token_probs(model)", "model.next_token_probs")
    return nn_model.output.logits[:, -1, :].softmax(-1)


def set_layer_output(nn_model, layer: int, tensor: TraceTensor) -> None:
    deprecated("set_layer_output(model, i, t)", "model.layers[i].layer_output = t")
    if _standard(nn_model):
        nn_model.write_value(layer, "layer_output", tensor)
        return
    block = nn_model.model.layers[layer]
    output = block.output
    block.output = (tensor, *output[1:]) if isinstance(output, tuple) else tensor


class ModuleAccessor:
    """1.x: the standard module names on a plain HF model, as its ``nn.Module`` objects.

    ``ModuleAccessor(hf_model).layers`` is the block list, ``.get_attention(i)`` a block's attention,
    and so on, by the model's family spec.
    """

    def __init__(self, model, rename_config=None, rename: dict[str, str] | None = None):
        from ..families import family_of
        from .legacy import STANDARD_MODULES, _names, check_renames, pop_renames

        deprecated("ModuleAccessor(model)", "nnterp.StandardizedTransformer(model, tokenizer=...) or the family spec "
                   "(nnterp.families.family_of(model.config))")
        family = family_of(model.config, type(model).__name__)
        # a standard name is taken where it names what the spec places (else refused); the user's own names pass
        check_renames(model, family, *pop_renames({"rename_config": rename_config, "rename": rename}),
                      own_aliases=True)
        own = {native: alias for native, alias in (rename or {}).items()
               if not any(name.rpartition(".")[2] in STANDARD_MODULES for name in _names(alias))}
        self.nn_model = nnsight.NNsight(model, rename={**family.rename(), **own})

    def __getattr__(self, name: str) -> torch.nn.Module:
        attribute = getattr(self.nn_model, name)
        if hasattr(attribute, "_module"):
            return attribute._module
        raise AttributeError(f"Attribute {name} is not a module")

    def get_embed_tokens(self):
        return self.nn_model.embed_tokens._module

    def get_layers(self):
        return self.nn_model.layers._module

    def get_mlp(self, layer: int):
        return self.nn_model.layers[layer].mlp._module

    def get_attention(self, layer: int):
        return self.nn_model.layers[layer].self_attn._module

    def get_unembed_norm(self):
        return self.nn_model.ln_final._module

    def get_unembed(self):
        return self.nn_model.lm_head._module


def _check_index(nn_model, idx: int) -> None:
    side = nn_model.tokenizer.padding_side
    if idx < 0 and side != "left":
        raise ValueError(f"negative index is currently only supported with left padding, not {side}")
    if idx > 0 and side != "right":
        raise ValueError(f"positive index is currently only supported with right padding, not {side}")


def _layer_output_quietly(nn_model, layer):
    return _value(nn_model, layer, "layer_output", lambda block: block.output)


@torch.no_grad()
def get_token_activations(nn_model, prompts=None, layers=None, get_activations: GetModuleOutput | None = None,
                          remote=False, idx: int | None = None, tracer=None):
    """``[layers, prompts, hidden]``: each layer's activation at token ``idx`` (the last by default), on the CPU."""
    deprecated("get_token_activations(model, prompts)", "nnterp.collect(model, prompts, folder) or a trace")
    if tracer is None and prompts is None:
        raise ValueError("prompts must be provided if tracer is None")
    get_activations = get_activations or _layer_output_quietly
    idx = -1 if idx is None else idx
    _check_index(nn_model, idx)
    count = nn_model.num_layers if _standard(nn_model) else len(nn_model.model.layers)
    layers = list(range(count)) if layers is None else layers
    if tracer is not None:
        device = _layer_output_quietly(nn_model, 0).device
        return torch.stack([get_activations(nn_model, layer)[:, idx].to(device) for layer in layers])
    with nn_model.trace(prompts, remote=remote) as tracer:
        acts = nnsight.save([get_activations(nn_model, layer)[:, idx].cpu() for layer in layers])
        tracer.stop()
    return torch.stack(acts)


@torch.no_grad()
def collect_last_token_activations_session(nn_model, prompts, batch_size, layers=None, get_activations=None,
                                           remote=False, idx=None):
    """``[layers, prompts, hidden]`` in batches (1.x ran them in one nnsight session)."""
    deprecated("collect_last_token_activations_session(...)", "nnterp.collect(model, prompts, folder)")
    batches = [get_token_activations(nn_model, list(prompts[i:i + batch_size]), layers, get_activations, remote, idx)
               for i in range(0, len(prompts), batch_size)]
    return torch.cat(batches, dim=1)


def collect_token_activations_batched(nn_model, prompts, batch_size, layers=None,
                                      get_activations: GetModuleOutput | None = None, remote=False, idx=None,
                                      tqdm=None, use_session=True):
    """``[layers, prompts, hidden]``: ``get_token_activations`` in batches, with an optional tqdm."""
    deprecated("collect_token_activations_batched(...)", "nnterp.collect(model, prompts, folder)")
    starts = range(0, len(prompts), batch_size)
    if tqdm is not None:
        starts = tqdm(starts)
    return torch.cat([get_token_activations(nn_model, list(prompts[i:i + batch_size]), layers, get_activations,
                                            remote, idx) for i in starts], dim=1)


def compute_next_token_probs(nn_model, prompt: str | list[str], remote=False) -> torch.Tensor:
    """``[batch, vocab]`` next-token probabilities, on the CPU."""
    deprecated("compute_next_token_probs(model, prompts)", "model.next_token_probs in a trace")
    with nn_model.trace(prompt, remote=remote):
        out = nnsight.save(nn_model.output.logits[:, -1].softmax(-1).cpu())
    return out
