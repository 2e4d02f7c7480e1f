"""nnterp's tools on ``StandardizedVLLM``: those that run (each prompt its own request, vLLM batching them), and
those refused at their entry, with the reason and what to do instead.

``nnterp.logit_lens``, ``nnterp.steered_generate``, ``nnterp.run_with_cache`` and ``nnterp.collect`` run here with
their transformers signatures; what vLLM cannot honour (gradients, a padded batch in one invoke, the logits at every
position from the engine itself) is refused naming the argument.
"""

from __future__ import annotations

from pathlib import Path

import nnsight
import torch

from ..spec.catalog import ADDED, BY_NAME, STREAM
from ..spec.selection import layer_indices, value_name

# nnterp's tools that StandardizedVLLM cannot run, and why (nnterp.tools.refusals asks at each tool's entry)
REFUSED = {
    "activation_patching": "its metric reads the logits at every position of a batch of patched copies of the "
                           "corrupted prompts in one forward pass; vLLM computes the logits at the last position "
                           "only and takes one prompt per invoke. Patch by hand: one trace saves the clean value "
                           "(`clean = model.layers[i].layer_output.save()`), the next assigns it in the "
                           "corrupted run (`model.layers[i].layer_output[:, p] = clean[:, p]`; the invokes of one "
                           "trace are separate requests and share no variables)",
    "attribution_patching": "it needs gradients, and vLLM runs inference only",
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
# nnterp's tools that run on StandardizedVLLM (the tests check this table and REFUSED against nnterp's tool list):
# those with an implementation of their own here (IMPLEMENTED), and those that need only the tokenizer or a trace of
# one prompt per invoke
RUNNING = ("add_to", "steered_generate", "logit_lens", "run_with_cache", "collect", "to_str_tokens", "top_tokens")
ONE_REQUEST_EACH = "each prompt runs unpadded as its own request"


def prompt_list(prompts) -> list:
    """One prompt (a string, or a list of token ids) or a list of them, as a list of prompts."""
    many = isinstance(prompts, (list, tuple)) and bool(prompts) and not isinstance(prompts[0], int)
    return list(prompts) if many else [prompts]


def refuse_arguments(tool: str, asked: dict[str, bool], why: str) -> None:
    given = [name for name, on in asked.items() if on]
    if given:
        raise NotImplementedError(f"{tool} on StandardizedVLLM: {', '.join(given)} cannot be honoured there ({why}). "
                                  "Leave them out, or run the model with StandardizedTransformer.")


def logit_lens(model, prompts, layers=None, value: str = "layer_output", position: int | None = -1,
               remote: bool | str = False, return_inv_logits: bool = False, lens=None):
    """``nnterp.logit_lens`` on the engine: each prompt its own request (one trace, one invoke each), each layer's
    ``value`` through ``project_on_vocab`` at ``position`` of the prompt's own tokens. Returns ``[prompts, layers,
    vocab]`` as on transformers; ``position=None`` (every position) takes prompts of one length, ``[prompts,
    layers, seq, vocab]`` (transformers' padded batch has no unpadded counterpart)."""
    refuse_arguments("logit_lens", {"remote=": bool(remote), "lens=": lens is not None},
                     "it runs on the local engine with the plain readout")
    name = value.rpartition(".")[2]
    if name not in STREAM + ADDED:
        raise ValueError(f"logit_lens reads one of {', '.join(STREAM + ADDED)}, not {value!r}.")
    batch = prompt_list(prompts)
    wanted = [model.block_spec(layer) for layer in layer_indices(model, layers)]  # as asked, repeats included
    signs = (1, -1) if return_inv_logits else (1,)
    with torch.no_grad(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in batch:
            with tracer.invoke(prompt):
                per_layer = {}
                for layer in sorted(set(wanted)):  # in forward order
                    hidden = model.read_value(layer, name)
                    hidden = hidden if position is None else hidden[:, position].unsqueeze(1)
                    per_layer[layer] = [model.project_on_vocab(sign * hidden).float().softmax(dim=-1).cpu()
                                        for sign in signs]
                rows = nnsight.save({"lens": [torch.stack([per_layer[layer][k] for layer in wanted], dim=1)
                                              for k in range(len(signs))]})
    rows = rows if isinstance(rows, list) else [rows]  # one saved value per invoke
    if position is None and len({row["lens"][0].shape[2] for row in rows}) > 1:
        raise ValueError(f"logit_lens(position=None) on StandardizedVLLM takes prompts of one length ({ONE_REQUEST_EACH}"
                         "); give a position, or one prompt per call.")
    lenses = [torch.cat([row["lens"][k] for row in rows]) for k in range(len(signs))]
    lenses = [lens if position is None else lens[:, :, 0] for lens in lenses]
    return tuple(lenses) if return_inv_logits else lenses[0]


def steered_generate(model, prompts, layers, vector, *, scope="all", positions=None, batch=None, remote=False,
                     **kwargs):
    """``nnterp.steered_generate`` on the engine: its arguments that vLLM's generation has no counterpart of are
    refused; the others go to ``model.steered_generate``."""
    refuse_arguments("steered_generate", {"scope=": scope != "all", "positions=": positions is not None,
                                          "batch=": batch is not None, "remote=": bool(remote)},
                     "the vector is added at every position of every step of each prompt's own request; write other "
                     "steering in a trace, `with model.trace(prompt, max_tokens=n) as tracer: for step in "
                     "tracer.iter[0:n]: ...`")
    if "do_sample" in kwargs:  # transformers' spelling: greedy is vLLM's temperature 0
        kwargs.setdefault("temperature", 1.0 if kwargs.pop("do_sample") else 0.0)
    return model.steered_generate(prompts, layers, vector, **kwargs)


def _plan(model, names, layers) -> tuple[list[str], list[int], dict]:
    """The values to read (the family's forward order on vLLM), the blocks, and why the others are not read: a
    value named explicitly that the family has no place for raises its reason now, before anything runs."""
    family = model.vllm_family
    explicit = names is not None
    asked = list(BY_NAME) if names is None else [value_name(n) for n in ([names] if isinstance(names, str) else names)]
    unavailable = {}
    for name in asked:
        if name not in family.values and name in BY_NAME and BY_NAME[name].owner in ("block", "self_attn", "mlp"):
            error = family.refusal(name)
            if explicit:
                raise error
            unavailable[name] = error
    order = [name for name in family.values if name in asked]
    return order, sorted(set(layer_indices(model, layers))), unavailable


def read_prompts(model, batch: list, names: list[str], layers: list[int], select=None, logits: bool = False) -> list:
    """Inside one trace, each prompt its own request: ``[{"values": {(name, layer): [tokens, ...]}, "logits": [tokens,
    vocab] or None, "ids": [tokens]}]`` per prompt, each value's rows chosen by ``select[i]`` (a bool ``[tokens]``)
    where given (in the worker: only those rows come back)."""
    last = model.num_layers - 1
    with torch.no_grad(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for index, prompt in enumerate(batch):
            with tracer.invoke(prompt):
                values = {}
                for layer in layers:  # forward order
                    for name in names:
                        tensor = model.read_value(layer, name)[0]
                        values[(name, layer)] = (tensor if select is None else tensor[select[index]]).clone()
                stream = model.read_value(last, "layer_output") if logits else None
                readout = model.project_on_vocab(stream)[0] if logits else None
                row = nnsight.save({"values": values, "logits": readout,
                                    "ids": list(tracer.result.prompt_token_ids)})
    return row if isinstance(row, list) else [row]  # one saved value per invoke


PATTERNS = ("attention_scores", "attention_probabilities")  # [heads, queries, keys]: padded along both


def _padded(tensors: list[torch.Tensor], left: bool, dims: tuple[int, ...] = (0,)) -> torch.Tensor:
    """The prompts' tensors stacked as one padded batch: zeros before (``left``) or after each along ``dims``."""
    width = max(tensor.shape[dims[0]] for tensor in tensors)
    rows = []
    for tensor in tensors:
        for dim in dims:
            shape = list(tensor.shape)
            shape[dim] = width - tensor.shape[dim]
            pad = tensor.new_zeros(shape)
            tensor = torch.cat([pad, tensor] if left else [tensor, pad], dim=dim)
        rows.append(tensor)
    return torch.stack(rows)


def run_with_cache(model, prompts, names=None, layers=None, remote: bool | str = False, *, remove_batch_dim=False,
                   return_type: str | None = "logits", names_filter=None, stop_at_layer=None, prepend_bos=None,
                   padding_side=None, max_new_tokens=None, steer=None, **generate_kwargs):
    """``nnterp.run_with_cache`` on the engine: each prompt its own request, one trace; the values stacked as
    transformers' padded batch (padded on the tokenizer's side, with zeros; ``cache.attention_mask`` marks the real
    tokens), and the logits at every position read out of the last block's stream by ``project_on_vocab`` (vLLM
    computes them at the last position only)."""
    from ..tools.activation_cache import ActivationCache

    refuse_arguments("run_with_cache", {"remote=": bool(remote), "names_filter=": names_filter is not None,
                                        "stop_at_layer=": stop_at_layer is not None,
                                        "prepend_bos=": prepend_bos is not None,
                                        "padding_side=": padding_side is not None,
                                        "max_new_tokens=": max_new_tokens is not None, "steer=": steer is not None,
                                        **{f"{k}=": True for k in generate_kwargs}},
                     f"it caches the standard values of a forward pass, {ONE_REQUEST_EACH}; read TransformerLens's "
                     "hook points, a generation or a steered pass in a trace")
    if return_type not in ("logits", None):
        raise ValueError(f"run_with_cache on StandardizedVLLM returns the logits or None, not {return_type!r}.")
    batch = prompt_list(prompts)
    if remove_batch_dim and len(batch) != 1:
        raise ValueError(f"remove_batch_dim=True takes one prompt, got {len(batch)}.")
    order, blocks, unavailable = _plan(model, names, layers)
    rows = read_prompts(model, batch, order, blocks, logits=return_type == "logits")
    left = model.tokenizer.padding_side == "left"
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    ids = _padded([torch.tensor(row["ids"]) for row in rows], left)
    lengths = [len(row["ids"]) for row in rows]
    mask = _padded([torch.ones(length, dtype=torch.long) for length in lengths], left)
    ids[mask == 0] = pad
    values = {key: _padded([row["values"][key] for row in rows], left, (1, 2) if key[0] in PATTERNS else (0,))
              for key in rows[0]["values"]}
    missing = {(name, layer): error for name, error in unavailable.items() for layer in blocks}
    cache = ActivationCache(values, order, layer_indices(model, layers), missing, model.num_layers, ids, mask, model,
                            batch_removed=remove_batch_dim)
    logits = _padded([row["logits"] for row in rows], left) if return_type == "logits" else None
    return logits, cache


def collect_reader(model, features, max_new_tokens, steering, remote):
    """``nnterp.collect``'s batch reader on the engine (each prompt its own request, only the chosen rows coming
    back), after refusing what it cannot do, before anything is written."""
    refuse_arguments("collect", {"dictionaries=": bool(features), "max_new_tokens=": max_new_tokens is not None,
                                 "steer=": bool(steering), "remote=": bool(remote)},
                     f"it collects the standard values of a forward pass, {ONE_REQUEST_EACH}")

    def read_batch(batch, names, layers, positions, dtype, *_unused):
        patterns = sorted(set(names) & set(PATTERNS))
        if patterns:
            raise ValueError(f"collect gathers values token by token; {', '.join(patterns)} are [heads, queries, "
                             "keys] per prompt: read them with run_with_cache.")
        from ..collection.runner import _selection

        inputs = model.tokenizer(batch, return_tensors="pt", padding=True)  # as on transformers: the same rows
        select = _selection(inputs, positions)
        real = inputs.attention_mask.bool()
        prompts = [inputs.input_ids[i][real[i]].tolist() for i in range(len(batch))]
        chosen = [select[i][real[i]] for i in range(len(batch))]
        order = [name for name in model.vllm_family.values if name in names] or names
        rows = read_prompts(model, prompts, order, sorted(set(layers)), select=chosen)
        tensors = {}
        for name in names:
            stacked = torch.cat([torch.stack([row["values"][(name, layer)] for layer in layers], dim=1)
                                 for row in rows])  # [tokens, layers, ...], in the order asked
            tensors[name] = (stacked.to(dtype) if dtype else stacked).contiguous()
        tensors["_tokens_per_prompt"] = select.sum(dim=1).to(torch.int64)
        tensors["_token_ids"] = inputs.input_ids[select].to(torch.int64)
        return tensors

    return read_batch


def collection_writer(model, positions, dtype) -> dict:
    """The writer of a collection made on the engine: its model class, config, checkpoint (the weight files' names
    and sizes) and the values' dtype (``nnterp.collection.provenance``)."""
    from ..collection.provenance import mask_identity
    from ..spec.fingerprint import digest

    root = Path(model._nnterp_checkpoint)
    files = sorted((path.name, path.stat().st_size) for path in root.glob("*.safetensors")) if root.is_dir() else []
    kind = type(model._module)
    return {"model": f"{kind.__module__}.{kind.__qualname__}", "config": digest(model._nnterp_config.to_json_string()),
            "weights": f"vLLM {root} {digest(repr(files))}", "dtype": str(dtype or model._nnterp_dtype),
            "mask": mask_identity(positions) if callable(positions) else None}


IMPLEMENTED = {"steered_generate": steered_generate, "logit_lens": logit_lens, "run_with_cache": run_with_cache}
