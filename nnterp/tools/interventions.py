"""Interventions written once for every family: steering, skipping, activation patching, patchscopes.

Everything here reads and writes standard values (``layer_output`` by default, any value of
the catalog by name), so it means the same thing on every family.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import nnsight
import torch

from ..core import edits
from ..core.edits import Positions, skip_layers  # noqa: F401  (skip_layers: part of the toolkit's API)
from ..core.readout import pass_attention_mask
from ..core.tokens import single_token
from ..spec.catalog import BY_NAME
from ..spec.selection import forward_order, layer_indices, token_index, value_name
from .lens import logit_lens  # noqa: F401  (its 1.x import path)
from .patching import activation_patching, attribution_patching  # noqa: F401  (the toolkit's API)

# -- steering -------------------------------------------------------------------------------------

def add_to(model, layers, vector: torch.Tensor, value: str = "layer_output", factor: float = 1.0,
           positions: Positions = None, batch: Positions = None) -> None:
    """Inside a trace: add ``factor * vector`` in place to ``value`` at ``layers``, ``positions`` and ``batch`` rows.

    ``vector`` has the value's last dimension (``hidden_size`` for the stream and the contributions).
    ``positions`` are each prompt's own tokens (``0`` its first, ``-1`` its last, a list or a slice of
    them), whichever side the tokenizer pads, found through the batch's attention mask; a position
    beyond a prompt's tokens is an error. ``batch`` indexes the rows of the batch. ``None``: all.
    With ``positions``, the first ``add_to`` of a forward pass comes before the trace reads any value
    of the pass: it reads the mask from the model's inputs, which come first.
    """
    if positions is None:
        return edits.add_to(model, layers, vector, value, factor, None, batch)
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        raise TypeError("add_to's positions are token positions (ints or a slice), not a boolean mask.")
    mask = _attention_mask(model)
    groups = None
    for layer in forward_order(layer_indices(model, layers)):
        if groups is None:  # the same for every layer: each row's columns in this forward pass
            groups = _own_columns(mask, positions, batch, model.read_value(layer, value_name(value)).shape[1])
        for columns, rows in groups:
            edits.add_to(model, layer, vector, value, factor, columns, rows)


def _attention_mask(model) -> torch.Tensor | None:
    """Inside a trace: the batch's ``[batch, seq]`` attention mask (None: no padding), read once per forward pass
    (``readout.pass_attention_mask``), so a later ``add_to`` of the pass reuses it."""
    mask = pass_attention_mask(model, "add_to(..., positions=...)", "call add_to before reading any value of the pass")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"add_to(..., positions=...) needs the batch's [batch, seq] attention mask to find each "
                         f"prompt's own tokens; this trace's attention mask has shape {tuple(mask.shape)}.")
    return mask


def _own_columns(mask, positions, batch, seq: int) -> list[tuple[Positions, Positions]]:
    """``[(columns, rows)]``: the columns of the value (``seq`` long) holding each row's own tokens ``positions``,
    rows with the same columns together. A generation step with a cache holds the mask's last ``seq`` columns."""
    if mask is None:  # no padding: the value's columns are the prompts' own positions
        return [(positions, batch)]
    mask = mask.detach().bool().cpu()
    rows = torch.arange(mask.shape[0])[slice(None) if batch is None else batch].reshape(-1)
    selected = mask[rows]
    if isinstance(positions, slice):  # each row's own tokens in the slice
        columns = [own.nonzero().flatten()[positions].tolist() for own in selected]
    else:
        try:
            wanted = [token_index(selected, int(p)) for p in torch.as_tensor(positions).reshape(-1).tolist()]
        except IndexError as error:  # token_index counts the selected rows
            raise IndexError(str(error) if batch is None else f"{str(error)[:-1]}, counting the prompts among the rows "
                             f"batch={batch} selects.") from None
        columns = torch.stack(wanted, dim=1).tolist()
    offset = mask.shape[1] - seq
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, own in zip(rows.tolist(), columns):
        if own and min(own) < offset:
            raise IndexError(f"Position {positions} of prompt {row} is not in this forward pass, which runs only the "
                             f"last {seq} of its {mask.shape[1]} tokens (a generation step with a cache).")
        if own:
            groups.setdefault(tuple(c - offset for c in own), []).append(row)
    if batch is None and len(groups) == 1 and len(next(iter(groups.values()))) == mask.shape[0]:
        return [(list(next(iter(groups))), None)]  # every row alike (no padding): one edit of the whole batch
    return [(list(columns), rows) for columns, rows in groups.items()]


def steered_generate(model, prompts, layers, vector: torch.Tensor, *, value: str = "layer_output",
                     factor: float = 1.0, scope: str | range = "all", positions: Positions = None,
                     batch: Positions = None, max_new_tokens: int = 20, remote: bool | str = False,
                     **generate_kwargs) -> torch.Tensor:
    """Generate with a steering vector added during an explicit ``scope`` of the generation.

    ``scope`` is ``"prompt"`` (the forward pass over the prompt only), ``"generated"`` (every
    generated step, not the prompt), ``"all"`` (both), or a ``range`` of step numbers (step 0
    is the prompt, step k the k-th generated token). ``positions`` apply to the prompt step, as
    each prompt's own tokens (``add_to``'s); a generated step steers its one new position. A
    right-padded batch is refused: its shorter prompts would continue after their padding. The
    generation runs exactly ``max_new_tokens`` steps (``min_new_tokens`` is set to it) so that
    every scope is reached.
    The arguments after ``prompts`` are ``add_to``'s: ``layers``, ``vector``, then by name
    ``value``, ``factor``, ``positions``, ``batch``. Returns the token ids, prompt included.
    """
    if isinstance(layers, torch.Tensor) and layers.is_floating_point() and not isinstance(vector, torch.Tensor):
        raise TypeError("steered_generate(model, prompts, layers, vector, ...): the layers come before the vector, "
                        "as in add_to(model, layers, vector); the call passed the vector first.")
    check_new_tokens(max_new_tokens, "steered_generate")
    plan = steering_plan(model, {"layers": layers, "vector": vector, "value": value, "factor": factor, "scope": scope,
                                 "positions": positions, "batch": batch}, max_new_tokens)
    refuse_right_padding(model, prompts, "steered_generate")
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs["min_new_tokens"] = max_new_tokens
    with torch.no_grad(), model.generate(prompts, max_new_tokens=max_new_tokens, remote=remote,
                                         **generate_kwargs) as tracer:
        for step in tracer.iter[0:max_new_tokens]:
            for (layer, name), steerings in plan.items():  # in forward order
                apply_steering(model, layer, name, steerings, step)
        ids = nnsight.save(tracer.result)
    return ids


# -- steering in the same pass as a readout (run_with_cache, collect) ------------------------------

STEERING_KEYS = ("layers", "vector", "value", "factor", "scope", "positions", "batch")


def steering_plan(model, steer, max_new_tokens: int | None) -> dict[tuple[int, str], list[tuple]]:
    """``steer=`` of ``run_with_cache`` and ``collect``, checked before anything runs.

    ``steer`` is one steering, a dict of ``steered_generate``'s steering arguments (``layers`` and ``vector``,
    and optionally ``value``, ``factor``, ``scope``, ``positions``, ``batch``), or a list of them. Returns
    ``{(layer, value): [(steps, vector, factor, positions, batch)]}`` in forward order: the steps (0 the prompt;
    ``{0}`` without generation, ``max_new_tokens=None``) at which each vector is added to the value.
    """
    if steer is None:
        return {}
    steerings = [steer] if isinstance(steer, Mapping) else list(steer)
    plan: dict[tuple[int, str], list[tuple]] = {}
    for steering in steerings:
        if not isinstance(steering, Mapping):
            raise TypeError(f"steer is a dict of steering arguments, e.g. {{'layers': 5, 'vector': v, 'factor': 4.0}}, "
                            f"or a list of them; not {type(steering).__name__}.")
        unknown = sorted(set(steering) - set(STEERING_KEYS))
        missing = [key for key in ("layers", "vector") if key not in steering]
        if unknown or missing:
            raise TypeError(f"A steering is a dict with 'layers' and 'vector', and optionally 'value', 'factor', "
                            f"'scope', 'positions', 'batch' (steered_generate's arguments): "
                            f"{f'unknown {unknown}' if unknown else f'missing {missing}'}.")
        vector = steering["vector"]
        if not isinstance(vector, torch.Tensor) or not vector.is_floating_point():
            raise TypeError(f"A steering's vector is a floating-point tensor, not {type(vector).__name__}.")
        scope = steering.get("scope", "all")
        if max_new_tokens is None:  # one forward pass: step 0 only
            if scope not in ("all", "prompt") and scope != range(0, 1):
                raise ValueError(f"scope={scope!r} steers generated steps, and this call generates nothing: pass "
                                 "max_new_tokens=N to generate, or leave scope out.")
            steps = {0}
        else:
            steps = _scope_steps(scope, max_new_tokens)
        name = value_name(steering.get("value", "layer_output"))
        positions = steering.get("positions")
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
            raise TypeError("A steering's positions are token positions (ints or a slice), not a boolean mask.")
        for layer in layer_indices(model, steering["layers"]):
            model.location(layer, name)  # unavailable on the block: refused before anything runs
            plan.setdefault((layer, name), []).append(
                (steps, vector, steering.get("factor", 1.0), positions, steering.get("batch")))
    order = {layer: model.order(layer, aliases=True) for layer, _ in plan}
    return dict(sorted(plan.items(), key=lambda item: (item[0][0], order[item[0][0]][BY_NAME[item[0][1]].key])))


def prepare_steering(model, plan: dict, step: int) -> None:
    """Inside a trace, first in a pass that reads values before it steers: read the attention mask the
    positions of step 0's steering are found with (``add_to`` reads it from the model's inputs, which come first)."""
    if step == 0 and any(positions is not None for steerings in plan.values() for _, _, _, positions, _ in steerings):
        _attention_mask(model)


def apply_steering(model, layer: int, name: str, steerings: list[tuple], step: int) -> None:
    """Inside a trace at generation step ``step``: ``steering_plan``'s additions to value ``name`` of block ``layer``,
    before the value is read (an in-place add: a read of the same value afterwards sees it steered)."""
    for steps, vector, factor, positions, batch in steerings:
        if step in steps:  # positions are the prompt's tokens: a generated step has its one new position
            add_to(model, layer, vector, name, factor, positions if step == 0 else None, batch)


def steering_identity(plan: dict) -> list:
    """What a steering plan adds, as JSON data (a digest of each vector): a collection's settings record it."""
    def digest(vector):
        data = vector.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{vector.dtype} {tuple(vector.shape)} " + hashlib.sha256(data).hexdigest()[:24]
    return [[layer, name, sorted(steps), digest(vector), float(factor), repr(positions), repr(batch)]
            for (layer, name), steerings in plan.items() for steps, vector, factor, positions, batch in steerings]


def check_new_tokens(max_new_tokens, caller: str) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{caller}: max_new_tokens is the number of tokens to generate, an int of at least 1; "
                         f"got {max_new_tokens!r}.")


def refuse_right_padding(model, prompts, caller: str = "steered_generate") -> None:
    """A batch whose shorter prompts end in padding would generate after it: refused."""
    mask = prompts.get("attention_mask") if isinstance(prompts, Mapping) else None
    if mask is None and isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts):
        mask = model.tokenizer(list(prompts), return_tensors="pt", padding=True).attention_mask
    if mask is not None and not bool(torch.as_tensor(mask)[:, -1].all()):
        raise ValueError(f"{caller}: this batch of prompts is right-padded, so its shorter prompts would "
                         "continue after their padding. Pad on the left (model.tokenizer.padding_side = 'left', "
                         "nnsight's default for decoders) or generate one prompt at a time.")


def _scope_steps(scope: str | range, max_new_tokens: int) -> set[int]:
    every = range(max_new_tokens)
    named = {"prompt": range(0, 1), "generated": range(1, max_new_tokens), "all": every}
    if isinstance(scope, range):
        outside = sorted(set(scope) - set(every))
        if outside:
            raise ValueError(f"scope {scope} asks for steps {outside}, which a generation of {max_new_tokens} new "
                             f"tokens never runs (steps 0 to {max_new_tokens - 1}; step 0 is the prompt).")
        return set(scope)
    if scope not in named:
        raise ValueError(f"scope is 'prompt', 'generated', 'all' or a range of steps, not {scope!r}.")
    return set(named[scope])


# -- activation patching ---------------------------------------------------------------------------

def logit_difference(correct, incorrect, model=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position logit of ``correct`` minus that of ``incorrect``, per batch row.

    Each is one token in any form ``nnterp.core.tokens.token_ids`` takes (an id, a 0-d tensor, a NumPy integer; a
    string that is one token where ``model`` is given, which also checks the ids against its vocabulary).
    It reads the last column of the logits: each prompt's last token in ``activation_patching`` (never
    padded) and in a left-padded batch, a pad in a right-padded one.
    """
    correct = single_token(model, correct, "The correct token")
    incorrect = single_token(model, incorrect, "The incorrect token")
    return lambda logits: logits[:, -1, correct] - logits[:, -1, incorrect]


def target_probability(token, model=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position probability of ``token``, per batch row (the last column, and the token's forms,
    as ``logit_difference``)."""
    token = single_token(model, token, "The target token")
    return lambda logits: logits[:, -1].softmax(dim=-1)[:, token]


# -- patchscopes ----------------------------------------------------------------------------------

def patchscope_lens(model, source_prompts=None, target_prompt=None, index_to_patch=-1, layers=None,
                    value: str = "layer_output", remote: bool | str = False, *, latents=None,
                    target_patch_prompts=None, layer_to_patch=None) -> torch.Tensor:
    """Next-token probabilities of ``target_prompt`` with ``value`` at ``index_to_patch`` replaced, per layer,
    by the sources' last-token ``value`` at the same layer: ``[sources, layers, vocab]``.

    The 1.x call, ``patchscope_lens(model, source_prompts, target_patch_prompts, layers, latents, remote)``
    with ``TargetPrompt`` objects (default: ``repeat_prompt()``), works too, with a DeprecationWarning.
    """
    if layer_to_patch is not None:  # the 1.x README's spelling of layers
        layers = layer_to_patch
    if target_patch_prompts is not None or latents is not None or target_prompt is None or isinstance(
            target_prompt, (TargetPrompt, TargetPromptBatch, list)):
        # the 1.x positions: (model, source_prompts, target_patch_prompts, layers, latents, remote)
        legacy_layers = layers if index_to_patch == -1 and layers is not None else (None if index_to_patch == -1
                                                                                    else index_to_patch)
        if latents is None and layers is not None and index_to_patch != -1:
            latents = layers
        return _patchscope_lens_1x(model, source_prompts, target_patch_prompts or target_prompt, legacy_layers,
                                   latents, remote if value == "layer_output" else value)
    name = value_name(value)
    sources = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
    layers = layer_indices(model, layers)
    latents = _last_token_values(model, sources, layers, remote, name)
    return _patched_next_token_probs(model, [target_prompt] * len(sources), [index_to_patch] * len(sources), layers,
                                     latents, remote, name).float()


# -- nnterp 1.x's patchscope helpers -------------------------------------------------------------

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


def _last_token_values(model, prompts, layers, remote, name: str = "layer_output") -> torch.Tensor:
    """``[layers, prompts, ...]``: value ``name`` at every prompt's last token (whichever side pads), on the CPU."""
    inputs = model.tokenizer(prompts, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(prompts)), token_index(inputs.attention_mask, -1)
    with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
        read = nnsight.save({layer: model.read_value(layer, name)[rows, last].cpu() for layer in forward_order(layers)})
        tracer.stop()  # nothing past the last layer read is needed
    return torch.stack([read[layer] for layer in layers])


def _patched_next_token_probs(model, prompts, indices, layers, latents, remote, name: str = "layer_output"
                              ) -> torch.Tensor:
    """``[prompts, layers, vocab]``: next-token probabilities with value ``name`` of row ``j`` at its own token
    ``indices[j]`` replaced by ``latents[k][j]``, one trace per layer ``k``, on the CPU."""
    inputs = model.tokenizer(prompts, return_tensors="pt", padding=True)
    rows, last = torch.arange(len(prompts)), token_index(inputs.attention_mask, -1)
    patched = torch.stack([token_index(inputs.attention_mask[j:j + 1], int(i))[0] for j, i in enumerate(indices)])
    probs = []
    for k, layer in enumerate(layers):
        with torch.no_grad(), model.trace(inputs, remote=remote):
            value = model.read_value(layer, name)
            value[rows, patched.to(value.device)] = latents[k].to(device=value.device, dtype=value.dtype)
            logits = model.logits
            layer_probs = nnsight.save(logits[rows, last.to(logits.device)].softmax(dim=-1).cpu())
        probs.append(layer_probs)  # after the trace: a remote run returns saved values, not edited lists
    return torch.stack(probs, dim=1)


def _patchscope_lens_1x(model, source_prompts, target_patch_prompts, layers, latents, remote) -> torch.Tensor:
    from ..compat.legacy import deprecated

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
        latents = _last_token_values(model, source_prompts, layers, remote)
    return _patched_next_token_probs(model, batch.prompts, batch.index_to_patch.tolist(), layers, latents, remote)


def patchscope_generate(model, prompts, target_patch_prompt: TargetPrompt, max_length: int = 50, layers=None,
                        remote: bool | str = False, max_batch_size: int = 32) -> dict[int, torch.Tensor]:
    """1.x: per layer, the generation from ``target_patch_prompt`` with its token patched by each prompt's
    last-token stream: ``{layer: [prompts, seq]}`` token ids."""
    from ..compat.legacy import deprecated

    deprecated("patchscope_generate(...)", "a model.generate trace patching model.layers[i].layer_output")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    layers = layer_indices(model, layers)
    latents = _last_token_values(model, prompts, layers, remote)
    generations = {}
    for k, layer in enumerate(layers):
        with torch.no_grad(), model.generate([target_patch_prompt.prompt] * len(prompts), max_new_tokens=max_length,
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
    from ..compat.legacy import deprecated

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


def steer(model, layers, steering_vector: torch.Tensor, factor: float = 1.0, positions=None, token_positions=None,
          batch_index=None) -> None:
    """1.x's README imported ``steer`` from here: ``model.steer`` as a function (inside a trace)."""
    from ..compat.legacy import steer as _steer

    _steer(model, layers, steering_vector, factor, positions, token_positions, batch_index)
