"""Many standard values of one forward pass, kept in memory: ``logits, cache = model.run_with_cache(prompts)``.

``cache["layer_output", 5]`` is one block's value, ``cache["layer_output"]`` the value of every
cached block stacked ``[layers, ...]``. The values are read with the engine's ``read_value`` in
forward order, inside one trace, so ``remote=True`` runs it on the remote model. The cache also
holds what the analyses need (``nnterp.analysis``): the identity's extra terms of each block and the
final norm's input and output, from which the norms' scales of the pass are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import nnsight
import torch
from nnsight.intervention.interleaver import Mediator
from transformers import BatchEncoding

from .. import analysis
from ..spec.catalog import BY_NAME
from ..spec.errors import ValueUnavailable
from ..spec.selection import forward_order, layer_indices, layer_ranges, value_name
from .steering import apply_steering, check_new_tokens, prepare_steering, refuse_right_padding, steering_plan


class ActivationCache:
    """The values of one forward pass, by ``(name, layer)``.

    ``cache[name, layer]``: one block's value (a negative layer counts from the model's end).
    ``cache[name]``: every cached block's value stacked on a new first dimension, ``[layers, ...]``,
    in the order of ``cache.layers``. A name may be ``"mlp_output"`` or ``"mlp.mlp_output"``.
    A value that has no meaning on the block raises the model's ``ValueUnavailable``, with its reason.

    Beside the values: ``cache["ln_final_input"]`` and ``cache["ln_final_output"]``, the final norm's input (the
    stream it reads) and output; ``cache["ln_final_scale"]``, ``cache["attention_norm_scale", i]`` and
    ``cache["mlp_norm_scale", i]``, the scale ``[batch, seq, 1]`` each norm divided by in the pass
    (TransformerLens's ``hook_scale``); ``cache["extra.<name>", i]``, a term of block i's identity that is no
    standard value (Falcon-H1's ``mamba``). On a routed mixture of experts (with names=None, on a forward pass):
    ``cache["expert_indices", i]`` and ``cache["expert_weights", i]`` ``[batch, seq, k]``, the experts the router
    chose for each token and its weights for them, as the experts apply them (TransformerLens's
    ``hook_expert_indices`` / ``hook_expert_weights``), ``cache["expert_input", i]`` and ``cache["expert_output", i]``,
    what the experts read and gave. ``cache["pattern", i]`` is ``attention_probabilities`` (TransformerLens's
    ``hook_pattern``), served with the attention values on (``attention_values=True``). The analysis methods are
    TransformerLens's (``nnterp.analysis``).
    """

    def __init__(self, values: dict[tuple[str, int], torch.Tensor], names: list[str], layers: list[int],
                 unavailable: dict[tuple[str, int], ValueUnavailable], num_layers: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor, model=None,
                 readout: dict[str, torch.Tensor] | None = None, prompt_length: int | None = None,
                 steered: tuple[str, ...] = ()):
        self._values, self._unavailable = values, unavailable
        self.names, self.layers, self.num_layers = names, layers, num_layers
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.model, self._readout = model, readout or {}
        # a generation's cache: the prompt's columns, then one per step after the first (run_with_cache)
        self.prompt_length = input_ids.shape[1] if prompt_length is None else prompt_length
        self.steered = steered  # where the pass was steered (run_with_cache(steer=...)): "layers[5].layer_output"

    @property
    def steps(self) -> int:
        """The forward passes the values come from: 1, or a generation's steps (step 0 the prompt)."""
        return self.input_ids.shape[1] - self.prompt_length + 1

    def step_positions(self, step: int) -> slice:
        """The positions (along seq) that generation step ``step`` ran: the prompt's for step 0, one after."""
        if isinstance(step, bool) or not isinstance(step, int) or not -self.steps <= step < self.steps:
            raise IndexError(f"Step {step!r} is not in this cache, which holds {self.steps} step(s), 0 the prompt.")
        step %= self.steps
        return slice(0, self.prompt_length) if step == 0 else slice(self.prompt_length + step - 1,
                                                                    self.prompt_length + step)

    def __getitem__(self, key) -> torch.Tensor:
        name, layer = (key if isinstance(key, tuple) and len(key) == 2 else (key, None))
        if not isinstance(name, str):
            raise TypeError(f"Index a cache with a value name, or (name, layer): cache['layer_output', 5], not {key!r}.")
        if name in READOUT or name in SCALES or name.startswith("extra."):
            return self._beside(name, layer)
        if name in analysis.ROUTING:
            return self._routing(name, layer)
        name = ALIASES.get(name, name)
        name = value_name(name)
        if name not in self.names and not any(key[0] == name for key in self._unavailable):
            raise KeyError(f"{name!r} was not cached: this cache holds {', '.join(self.names)}. Pass it in "
                           "run_with_cache(..., names=[...]), or names=None for every available value.")
        if layer is None:
            return self._stacked(name)
        return self._one(name, self._layer(layer))

    def _beside(self, name: str, layer) -> torch.Tensor:
        """The entries beside the values: the final norm's input, output and scale, the block norms' scales, and
        the identity's extra terms."""
        if name in READOUT:
            if layer is not None:
                raise TypeError(f"{name!r} is the model's, not a block's: cache[{name!r}].")
            if name == "ln_final_scale":
                norm = analysis.frozen_norm(self, None)
                if norm is None:
                    raise KeyError(f"{self.model.family.name} has no final norm: its head reads the last block's output.")
                return norm.scale
            if name not in self._readout:
                raise KeyError(f"{name!r} is not in this cache: the model has no final norm, or the cache was not made "
                               "by run_with_cache.")
            return self._readout[name]
        if layer is None:
            return torch.stack([self._beside(name, i) for i in self.layers])
        layer = self._layer(layer)
        if name in SCALES:
            return analysis.frozen_norm(self, layer, mlp_input=name == "mlp_norm_scale").scale
        if (name, layer) not in self._values:
            extras = [f"extra.{term}" for term in self.model.block_spec(layer).extra]
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: block {layer}'s identity has "
                           f"{', '.join(extras) or 'no extra terms'}, which run_with_cache caches with names=None.")
        return self._values[(name, layer)]

    def _routing(self, name: str, layer) -> torch.Tensor:
        """What a routed block's experts received and gave (``analysis.ROUTING``), ``[batch, seq, ...]``: the router's
        choice as the experts apply it, read at their input."""
        if layer is None:
            return torch.stack([self._routing(name, i) for i in self.layers])
        layer = self._layer(layer)
        if (name, layer) not in self._values:
            analysis.experts_of(self.model, layer, f"cache[{name!r}, {layer}]")  # the reason, where there are none
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: run_with_cache caches what a routed "
                           "block's experts receive with names=None, on a forward pass (not over a generation).")
        flat = self._values[(name, layer)]  # the experts read the tokens flattened, [batch * seq, ...]
        batch, seq = self.input_ids.shape
        if flat.shape[0] != batch * seq:
            raise ValueError(f"{name!r} of layer {layer} holds {flat.shape[0]} tokens, not the pass's {batch} x {seq}.")
        return flat.view(batch, seq, *flat.shape[1:])

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"The layer of cache[name, layer] is an int, not {layer!r}.")
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers.")
        layer %= self.num_layers
        if layer not in self.layers:
            raise KeyError(f"Layer {layer} was not cached: this cache holds layers {layer_ranges(sorted(self.layers))}.")
        return layer

    def _one(self, name: str, layer: int) -> torch.Tensor:
        if (name, layer) in self._unavailable:
            error = self._unavailable[(name, layer)]
            raise ValueUnavailable(error.key, error.family, error.reason)
        return self._values[(name, layer)]

    def _stacked(self, name: str) -> torch.Tensor:
        missing = [layer for layer in self.layers if (name, layer) in self._unavailable]
        if missing:
            error = self._unavailable[(name, missing[0])]
            partly = len(missing) < len(self.layers)
            raise ValueUnavailable(error.key, error.family, error.reason + (
                f" (at layers {layer_ranges(sorted(missing))}: read the layers that have it one at a time, "
                f"cache[{name!r}, layer])" if partly else ""))
        tensors = [self._values[(name, layer)] for layer in self.layers]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"{name!r} has different shapes across the cached layers ({sorted(shapes)}), so it "
                             f"cannot be stacked: read one layer at a time, cache[{name!r}, layer].")
        return torch.stack([t.to(tensors[0].device) for t in tensors])

    # -- TransformerLens's analyses (nnterp.analysis) ------------------------------------------------

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The stream as each block receives it, then as the final norm reads it (``nnterp.analysis``)."""
        return analysis.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """The stream at ``layer`` as what each block added to it, summing to it exactly (``nnterp.analysis``)."""
        return analysis.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)

    def recompose_resid(self, residual_stack: torch.Tensor, layer: int | None = None,
                        mlp_input: bool = False) -> torch.Tensor:
        """The rows of ``decompose_resid(layer, mlp_input)`` added in the family's order: the stream, bit for bit."""
        return analysis.recompose(self, residual_stack, layer, mlp_input)

    def stack_head_results(self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Every attention head's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def stack_neuron_results(self, layer: int | None, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False):
        """Every MLP neuron's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_neuron_results(self, layer, pos_slice, neuron_slice, return_labels, incl_remainder,
                                             apply_ln)

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                          incl_bias: bool = True, labels=None):
        """A stack through a norm frozen at its scale of the pass, its bias a row of its own (``nnterp.analysis``)."""
        return analysis.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                          has_batch_dim, recompute_ln, incl_bias, labels)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True, incl_bias: bool = True, labels=None,
                    before_logits_transform: bool = False):
        """Direct logit attribution of a stack's rows, summing to the logit with the biases (``nnterp.analysis``)."""
        return analysis.logit_attrs(self, residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice,
                                    has_batch_dim, incl_bias, labels, before_logits_transform)

    def keys(self) -> list[tuple[str, int]]:
        """The ``(name, layer)`` pairs that hold a value, by layer, then in the catalog's order."""
        return [(name, layer) for layer in self.layers for name in self.names if (name, layer) in self._values]

    def __contains__(self, key) -> bool:
        return key in self._values

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        batch, seq = self.input_ids.shape
        generated = f", over {self.steps} generation steps ({seq} positions)" if self.steps > 1 else ""
        return (f"ActivationCache({len(self)} tensors: {', '.join(self.names)} at layers "
                f"{layer_ranges(sorted(self.layers))}; {batch} prompt(s) of {self.prompt_length} tokens{generated})")


def run_with_cache(model, prompts: str | Sequence[str] | torch.Tensor, names: str | Iterable[str] | None = None,
                   layers: int | Iterable[int] | None = None, remote: bool | str = False, *,
                   max_new_tokens: int | None = None, steer=None, **generate_kwargs
                   ) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass: ``(logits, cache)`` with the standard values ``names`` of blocks ``layers``.

    ``prompts``: a string, a list of strings (padded as the model's traces pad them; the cache's
    ``attention_mask`` marks the real tokens) or token ids ``[batch, seq]``. ``names=None`` caches
    every value each block has (the attention internals while they are on,
    ``model.enable_attention_values()``) and the extra terms of each block's identity; a value named
    explicitly that a block lacks raises the model's ``ValueUnavailable`` before anything runs. The final
    norm's input and output are cached too. Runs without gradients.

    ``max_new_tokens=N`` generates instead (greedy unless ``generate_kwargs`` say otherwise, exactly ``N``
    steps: ``min_new_tokens`` is set to ``N``) and returns ``(ids, cache)``: the token ids ``[batch, prompt + N]``,
    prompt included, and the values over the sequence the model ran, ``[batch, prompt + N - 1, ...]``: the
    prompt's positions from step 0, then the one new position of each later step (the last token generated is
    never run). ``cache.input_ids`` is that sequence; ``cache.step_positions(k)`` the positions step ``k`` ran.
    A batch generates left-padded (a right-padded one is refused). The values inside the attention (queries to
    probabilities) are not cached over generation: a step's keys and values span the earlier steps' positions too.

    ``steer``: steering vectors added in the same pass, a dict of ``steered_generate``'s steering arguments
    (``{"layers": 5, "vector": v, "factor": 4.0, "scope": "generated"}``) or a list of them. A steered value is
    cached as steered (what the rest of the model reads); a value read before it, as it was.
    """
    explicit = names is not None
    names = list(BY_NAME) if names is None else [value_name(n) for n in ([names] if isinstance(names, str) else names)]
    names = [name for name in BY_NAME if name in names]  # the catalog's order, each once
    layers = layer_indices(model, layers)
    generating = max_new_tokens is not None
    if generating:
        check_new_tokens(max_new_tokens, "run_with_cache")
    elif generate_kwargs:
        raise TypeError(f"run_with_cache got {', '.join(sorted(generate_kwargs))}: generation settings, and it "
                        "generates only with max_new_tokens=N.")
    inputs = _inputs(model, prompts)
    if generating:
        refuse_right_padding(model, inputs, "run_with_cache(..., max_new_tokens=...)")
    steering = steering_plan(model, steer, max_new_tokens)
    plan, unavailable = {}, {}
    for layer in forward_order(layers):
        here = []
        for name in names:
            try:
                model.location(layer, name)
                if generating and name in OVER_CACHED_POSITIONS:
                    raise ValueUnavailable(BY_NAME[name].key, model.family.name, NOT_OVER_GENERATION)
            except ValueUnavailable as error:
                if explicit:
                    error.add_note(f"run_with_cache was asked for it at layer {layer}: leave it out, choose layers "
                                   "that have it, or pass names=None to cache what each layer has.")
                    raise
                unavailable[(name, layer)] = error
                continue
            here.append(name)
        keys = {BY_NAME[name].key: name for name in here}
        # forward order; the identity's extra terms too when every value is cached
        plan[layer] = [(keys.get(key, key), location) for _, key, location in model.timeline(layer)
                       if key in keys or (not explicit and key.startswith("extra."))]
    passes = _with_steering(model, plan, steering)
    steered = tuple(dict.fromkeys(f"layers[{at}].{name}" for at, name in steering))
    if not (explicit or generating):
        passes = {layer: _with_routing(model, layer, events) for layer, events in passes.items()}
    final_norm = model.family.ln_final is not None
    if not generating:
        with torch.no_grad(), model.trace(inputs, remote=remote):
            prepare_steering(model, steering, 0)
            values, readout = _read_pass(model, passes, 0, final_norm, bool(steering))
            values, readout = nnsight.save(values), nnsight.save(readout)
            logits = nnsight.save(model.logits.detach())
        names = [name for name in names if any((name, layer) in values for layer in layers)]  # those it holds
        return logits, ActivationCache(values, names, list(dict.fromkeys(layers)), unavailable, model.num_layers,
                                       inputs["input_ids"], inputs["attention_mask"], model, readout,
                                       steered=steered)
    generate_kwargs.setdefault("do_sample", False)  # greedy: reproducible, and the RNG is left as it was
    generate_kwargs["min_new_tokens"] = max_new_tokens  # every step is reached
    with torch.no_grad(), model.generate(inputs, max_new_tokens=max_new_tokens, remote=remote,
                                         **generate_kwargs) as tracer:
        steps = nnsight.save([])
        for step in tracer.iter[0:max_new_tokens]:
            prepare_steering(model, steering, step)
            steps.append(_read_pass(model, passes, step, final_norm, bool(steering)))
        ids = nnsight.save(tracer.result)
    ids = ids.cpu()
    prompt = inputs["input_ids"].shape[1]
    values = {key: _over_steps([values[key] for values, _ in steps], key, prompt) for key in steps[0][0]}
    readout = {key: _over_steps([readout[key] for _, readout in steps], key, prompt) for key in steps[0][1]}
    ran = ids[:, :-1]  # the last token generated is never run
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(ran[:, prompt:])], dim=1)
    names = [name for name in names if any((name, layer) in values for layer in layers)]
    return ids, ActivationCache(values, names, list(dict.fromkeys(layers)), unavailable, model.num_layers, ran, mask,
                                model, readout, prompt_length=prompt, steered=steered)


# the attention values that span the positions of earlier steps (its KV cache) in a generation step
OVER_CACHED_POSITIONS = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
NOT_OVER_GENERATION = ("run_with_cache(..., max_new_tokens=...) does not cache it: in a generation step the attention "
                       "reads the keys and values of earlier steps from its cache, so its internals span another "
                       "number of positions at each step. Read them step by step in a model.generate trace with "
                       "tracer.iter")


def _with_steering(model, plan: dict, steering: dict) -> dict[int, list[tuple[str, object]]]:
    """Each block's reads in forward order with its steering placed just before the read of the value it steers:
    ``{layer: [(name, location) | ("steer", (name, steerings))]}``, the steered blocks included."""
    if not steering:
        return plan
    passes = {}
    for layer in forward_order([*plan, *(layer for layer, _ in steering)]):
        reads = {name: location for name, location in plan.get(layer, [])}
        steered = {BY_NAME[name].key: (name, steerings) for (at, name), steerings in steering.items() if at == layer}
        events = []
        for _, key, _ in model.timeline(layer):
            if key in steered:
                events.append(("steer", steered[key]))
            name = key if key.startswith("extra.") else key.rpartition(".")[2]
            if name in reads:
                events.append((name, reads[name]))
        passes[layer] = events
    return passes


def _with_routing(model, layer: int, events: list) -> list:
    """A routed block's reads with what its experts receive and give (``analysis.ROUTING``, read at their input and
    output) just before the first read at or after ``mlp_output``, which holds their output; as they are elsewhere."""
    try:
        _, _, locations = analysis.experts_of(model, layer, "run_with_cache")
    except analysis.AnalysisUnavailable:  # a dense block, or experts whose place is not known: nothing to read
        return events
    later = ("mlp_output", "layer_output")
    at = next((k for k, (name, where) in enumerate(events)
               if name in later or (name == "steer" and where[0] in later)), len(events))
    return [*events[:at], *locations.items(), *events[at:]]


def _read_pass(model, passes: dict, step: int, final_norm: bool, copy: bool
               ) -> tuple[dict[tuple[str, int], torch.Tensor], dict[str, torch.Tensor]]:
    """Inside a trace, one forward pass: ``({(name, layer): value}, final norm's input and output)``, with the
    pass's steering applied on the way (``copy``: each value copied when read, as a later in-place add would
    change it)."""
    values = {}
    for layer, events in passes.items():
        for name, location in events:
            if name == "steer":
                apply_steering(model, layer, *location, step)
                continue
            value = (model.read_at(layer, location, name) if name.startswith("extra.") or name in ROUTING
                     else model.read_value(layer, name)).detach()  # detached: a server may run with autograd on
            values[(name, layer)] = value.clone() if copy else value
    return values, (_final_norm(model) if final_norm else {})


def _over_steps(tensors: list[torch.Tensor], key, prompt: int) -> torch.Tensor:
    """One value over a generation, ``[batch, prompt + steps - 1, ...]``: step 0's prompt positions, then each later
    step's one position."""
    for step, tensor in enumerate(tensors):
        if tensor.dim() < 2 or tensor.shape[1] != (prompt if step == 0 else 1):
            raise ValueError(f"{key!r} has shape {tuple(tensor.shape)} at generation step {step}, not [batch, "
                             f"{prompt if step == 0 else 1}, ...] (the positions the step ran), so it cannot be "
                             "joined over the generation: leave it out of names.")
    return torch.cat([t.to(tensors[0].device) for t in tensors], dim=1)


def _final_norm(model) -> dict[str, torch.Tensor]:
    """Inside a trace, after the blocks: the final norm's input and output, at its call after them (a model may norm
    its embeddings with the same module first: NanoChat)."""
    mediator = Mediator.current("run_with_cache's final norm")
    norm, pinned = model.ln_final, mediator.iteration
    mediator.iteration = mediator.occurrence(f"{norm.path}.input")  # its next call, whichever it is in the pass
    try:
        return {"ln_final_input": norm.input.detach(), "ln_final_output": norm.output.detach()}
    finally:
        mediator.iteration = pinned


def _inputs(model, prompts) -> BatchEncoding:
    """The batch a trace runs on: strings tokenized as the model's traces tokenize them, or ids as given (a tensor,
    or a tokenizer's output: a mapping with ``input_ids`` and, for a padded batch, ``attention_mask``)."""
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            raise TypeError(f"A mapping of inputs holds 'input_ids' (and 'attention_mask'), as a tokenizer returns; "
                            f"this one has {sorted(prompts)}.")
        ids = _inputs(model, prompts["input_ids"])["input_ids"]
        mask = prompts.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}: give one "
                             "mask entry per token.")
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})
    if isinstance(prompts, torch.Tensor):
        ids = prompts.unsqueeze(0) if prompts.dim() == 1 else prompts
        if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"Token ids are an integer tensor [batch, seq] or [seq], not {ids.dtype} {tuple(ids.shape)}.")
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts is a string, a non-empty list of strings, or a tensor of token ids.")
    return model.tokenizer(prompts, return_tensors="pt", padding=True)


READOUT = ("ln_final_input", "ln_final_output", "ln_final_scale")
ROUTING = analysis.ROUTING  # a plain tuple: the trace's code ships it, not the analysis module
# TransformerLens's names of a cache's entries that are standard values under other names
ALIASES = {"pattern": "attention_probabilities", "hook_pattern": "attention_probabilities",
           "attn.hook_pattern": "attention_probabilities"}
SCALES = ("attention_norm_scale", "mlp_norm_scale")

__all__ = ["ActivationCache", "run_with_cache"]
