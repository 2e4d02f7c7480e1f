"""nnterp 1.x's ``nnterp.interventions``: its names, its calls, each on today's tools.

``patchscope_lens`` takes 1.x's call, ``(model, source_prompts, target_patch_prompts, layers, latents, remote)``
with ``TargetPrompt`` objects (default: ``repeat_prompt()``), with a DeprecationWarning, and today's, which is
``nnterp.tools.patchscope.patchscope_lens``'s. ``TargetPrompt``, ``TargetPromptBatch``, ``repeat_prompt``,
``it_repeat_prompt``, ``patchscope_generate``, ``patch_object_attn_lens`` and ``steer`` are kept as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import nnsight
import torch
from nnsight.modeling.transformers import TransformersModel  # its generate: nnsight's tracer on any subclass

from ..spec.selection import layer_indices, token_index
from ..tools import patchscope
from ..tools.lens import logit_lens
from ..tools.patchscope import last_token_values, patched_next_token_probs
from .legacy import deprecated, steer  # steer: 1.x's README's steer(model, layers, ...), model.steer as a function

__all__ = ["TargetPrompt", "TargetPromptBatch", "it_repeat_prompt", "logit_lens", "patch_object_attn_lens",
           "patchscope_generate", "patchscope_lens", "repeat_prompt", "steer"]


def patchscope_lens(model, source_prompts=None, target_prompt=None, index_to_patch=-1, layers=None,
                    value: str = "layer_output", remote: bool | str = False, *, latents=None,
                    target_patch_prompts=None, layer_to_patch=None) -> torch.Tensor:
    """Today's ``patchscope_lens(model, source_prompts, target_prompt, index_to_patch, layers, value, remote)``, or
    1.x's ``patchscope_lens(model, source_prompts, target_patch_prompts, layers, latents, remote)``."""
    if layer_to_patch is not None:  # the 1.x README's spelling of layers
        layers = layer_to_patch
    if target_patch_prompts is None and latents is None and target_prompt is not None and not isinstance(
            target_prompt, (TargetPrompt, TargetPromptBatch, list)):
        return patchscope.patchscope_lens(model, source_prompts, target_prompt, index_to_patch, layers, value, remote)
    # the 1.x positions: (model, source_prompts, target_patch_prompts, layers, latents, remote)
    legacy_layers = layers if index_to_patch == -1 and layers is not None else (None if index_to_patch == -1
                                                                                else index_to_patch)
    if latents is None and layers is not None and index_to_patch != -1:
        latents = layers
    return _patchscope_lens_1x(model, source_prompts, target_patch_prompts or target_prompt, legacy_layers,
                               latents, remote if value == "layer_output" else value)


@dataclass
class TargetPrompt:
    """1.x: a prompt to patch, and the index of the token to patch."""

    prompt: str
    index_to_patch: int


def repeat_prompt(words=None, rel=" ", sep="\n", placeholder="?", index_to_patch=-1) -> TargetPrompt:
    """The patchscopes paper's next-token prompt: ``"king king\n1135 1135\nhello hello\n?"``."""
    words = ["king", "1135", "hello"] if words is None else words
    return TargetPrompt(sep.join(w + rel + w for w in words) + sep + placeholder, index_to_patch)


def it_repeat_prompt(tokenizer, words=None, rel=" ", sep="\n", placeholder="?", complete_prompt=True,
                     add_user_instr=True, use_system_prompt=True) -> TargetPrompt:
    """``repeat_prompt`` in the tokenizer's chat template, for instruction-tuned models."""
    prompt = repeat_prompt(words, rel, sep, placeholder).prompt
    answer = {"role": "assistant", "content": prompt if complete_prompt else ""}
    system = [{"role": "system", "content": "You are a helpful assistant."}] if use_system_prompt else []
    if add_user_instr:
        chat = system + [
            {"role": "user", "content": "I will provide you with a series of sentences. Your task is to guess the next "
                                        "word in the sentence. You must answer with the next word only."},
            {"role": "assistant", "content": "Ok."}, {"role": "user", "content": prompt}, answer]
    elif use_system_prompt:
        chat = [{"role": "system", "content": "The user will provide you with a sentence. Your task is to guess the "
                                              "next word in the sentence. You must answer with the next word only."},
                {"role": "user", "content": prompt}, answer]
    else:
        chat = [{"role": "user", "content": "Guess the next word in the following sentence (answer only the next "
                                            f"word): {prompt}"}, answer]
    text = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True, add_special_tokens=False)
    return TargetPrompt(text, -1)


@dataclass
class TargetPromptBatch:
    """1.x: several target prompts, each with its own index to patch."""

    prompts: list[str]
    index_to_patch: torch.Tensor

    @classmethod
    def from_target_prompts(cls, prompts: list[TargetPrompt]) -> TargetPromptBatch:
        return cls([p.prompt for p in prompts], torch.tensor([p.index_to_patch for p in prompts]))

    @classmethod
    def from_target_prompt(cls, prompt: TargetPrompt, batch_size: int) -> TargetPromptBatch:
        return cls([prompt.prompt] * batch_size, torch.tensor([prompt.index_to_patch] * batch_size))

    @classmethod
    def from_prompts(cls, prompts: str | list[str], index_to_patch: int | list[int] | torch.Tensor) -> TargetPromptBatch:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if isinstance(index_to_patch, int):
            index_to_patch = [index_to_patch] * len(prompts)
        if not isinstance(index_to_patch, (list, torch.Tensor)):
            raise ValueError(f"index_to_patch must be an int, a list of ints or a tensor, got {type(index_to_patch)}")
        return cls(prompts, torch.as_tensor(index_to_patch))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx) -> TargetPrompt:
        return TargetPrompt(self.prompts[idx], self.index_to_patch[idx])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @staticmethod
    def auto(target_prompt, batch_size: int) -> TargetPromptBatch:
        if isinstance(target_prompt, TargetPrompt):
            return TargetPromptBatch.from_target_prompt(target_prompt, batch_size)
        if isinstance(target_prompt, list):
            return TargetPromptBatch.from_target_prompts(target_prompt)
        if not isinstance(target_prompt, TargetPromptBatch):
            raise ValueError("patch prompts must be a TargetPrompt, a list of TargetPrompt or a TargetPromptBatch, "
                             f"got {type(target_prompt).__name__}")
        return target_prompt


def _patchscope_lens_1x(model, source_prompts, target_patch_prompts, layers, latents, remote) -> torch.Tensor:
    deprecated("patchscope_lens(model, source_prompts, target_patch_prompts, layers, latents)",
               "patchscope_lens(model, source_prompts, target_prompt, index_to_patch, layers)", stacklevel=4)
    target_patch_prompts = repeat_prompt() if target_patch_prompts is None else target_patch_prompts
    if latents is not None:
        if source_prompts is not None:
            raise ValueError("You cannot provide both source_prompts and latents")
        count = len(latents[0])
    elif source_prompts is None:
        raise ValueError("Either source_prompts or latents must be provided")
    else:
        source_prompts = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
        count = len(source_prompts)
    batch = TargetPromptBatch.auto(target_patch_prompts, count)
    if len(batch) != count:
        raise ValueError(f"Number of sources ({count}) does not match number of patch prompts ({len(batch)})")
    layers = layer_indices(model, [layers] if isinstance(layers, int) else layers)
    if latents is None:
        latents = last_token_values(model, source_prompts, layers, remote)
    return patched_next_token_probs(model, batch.prompts, batch.index_to_patch.tolist(), layers, latents, remote)


def patchscope_generate(model, prompts, target_patch_prompt: TargetPrompt, max_length: int = 50, layers=None,
                        remote: bool | str = False, max_batch_size: int = 32) -> dict[int, torch.Tensor]:
    """1.x: per layer, the generation from ``target_patch_prompt`` with its token patched by each prompt's
    last-token stream: ``{layer: [prompts, seq]}`` token ids."""
    deprecated("patchscope_generate(...)", "a model.generate trace patching model.layers[i].layer_output")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    layers = layer_indices(model, layers)
    latents = last_token_values(model, prompts, layers, remote)
    generations = {}
    for k, layer in enumerate(layers):
        with torch.no_grad(), TransformersModel.generate(model, [target_patch_prompt.prompt] * len(prompts), max_new_tokens=max_length,
                                             remote=remote) as tracer:
            stream = model.read_value(layer, "layer_output")  # the prompt's pass
            stream[:, target_patch_prompt.index_to_patch] = latents[k].to(device=stream.device, dtype=stream.dtype)
            ids = nnsight.save(tracer.result)
        generations[layer] = ids.cpu()
    return generations


def patch_object_attn_lens(model, source_prompts, target_prompts, attn_idx_patch: int, num_patches: int = 5
                           ) -> torch.Tensor:
    """1.x: for each layer, the attention of that layer and the ``num_patches - 1`` after it reads the sources'
    last-token attention input at ``attn_idx_patch``; next-token probabilities ``[targets, layers, vocab]``."""
    deprecated("patch_object_attn_lens(...)", "a trace assigning model.layers[i].self_attn.input")
    source_prompts = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
    target_prompts = [target_prompts] if isinstance(target_prompts, str) else list(target_prompts)
    inputs = model.tokenizer(source_prompts, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(source_prompts)), token_index(inputs.attention_mask, -1)
    with torch.no_grad(), model.trace(inputs):
        sources = nnsight.save([model.layers[layer].self_attn.input[rows, last] for layer in range(model.num_layers)])
    targets = model.tokenizer(target_prompts, return_tensors="pt", padding=True)
    # each target's own token attn_idx_patch and its own last token, whichever side pads
    rows, at, last = (torch.arange(len(target_prompts)), token_index(targets.attention_mask, attn_idx_patch),
                      token_index(targets.attention_mask, -1))
    probs = []
    for layer in range(model.num_layers):
        with torch.no_grad(), model.trace(targets):
            for patched in range(layer, min(model.num_layers, layer + num_patches)):
                model.layers[patched].self_attn.input[rows, at] = sources[patched]
            layer_probs = nnsight.save(model.logits[rows, last].softmax(dim=-1).cpu())
        probs.append(layer_probs)
    return torch.stack(probs, dim=1)
