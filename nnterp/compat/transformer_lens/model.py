"""``HookedTransformer``: a ``StandardizedTransformer`` with TransformerLens's semantics where they differ from
nnsight's: ``from_pretrained``, ``model(input, return_type=...)`` outside a trace, ``model.generate(text)`` returning
text, strings with a BOS token first by default, and ``run_with_cache`` caching every hook point."""

from __future__ import annotations

import torch
from nnsight import Envoy
from nnsight.modeling.transformers import TransformersModel

from ...core.standardized import StandardizedTransformer
from ...core.tokens import tl_attention_mask, tokenized
from ...tools.activation_cache import _refuse_foreign_arguments, run_with_cache
from .hooks import context_hooks, forward
from .saes import attached_saes

# TransformerLens's weight processing, which nnterp never applies: each argument, and how its numbers compare
PROCESSING = {
    "fold_ln": "folds each norm's weight and bias into the next layer's weights, so its hook_normalized values and "
               "weights differ from the checkpoint's (the logits are the same)",
    "center_writing_weights": "centres every weight writing to the stream, so its residual values are the "
                              "checkpoint's less their mean over the stream's width (the logits are the same)",
    "center_unembed": "centres the unembedding, so its logits are the checkpoint's less their mean over the "
                      "vocabulary (the probabilities are the same)",
    "fold_value_biases": "folds the value biases into the output bias, so its hook_v, hook_z and hook_result differ "
                         "(the stream is the same)",
    "refactor_factored_attn_matrices": "rewrites the query, key, value and output weights, so the per-head values "
                                       "differ (the stream is the same)",
}
# TransformerLens's loading arguments nnterp has no use for, with what to do instead
LOADING = {
    "device": "load with device_map= (transformers' argument, e.g. device_map='cuda'), or move the model after",
    "n_devices": "load with device_map='auto' to spread the model over the devices",
    "move_to_device": "the weights load where device_map= says",
    "first_n_layers": "nnterp wraps the whole checkpoint",
    "checkpoint_index": "load the checkpoint's own revision (revision=...)",
    "checkpoint_value": "load the checkpoint's own revision (revision=...)",
    "hf_config": "pass the model as a transformers model object (hf_model=...) built from that config",
}


class HookedTransformer(StandardizedTransformer):
    """A ``StandardizedTransformer`` that runs TransformerLens code unchanged but for its load line.

    ``HookedTransformer.from_pretrained(name_or_folder)`` loads the checkpoint's own weights, unprocessed
    (TransformerLens's ``from_pretrained_no_processing``); ``model(input, return_type="logits" | "loss" | "both" |
    None)`` runs a forward pass outside a trace; ``model.generate(input, max_new_tokens=10)`` samples as
    TransformerLens does (``do_sample=True``, temperature 1) and returns text for text and tokens for tokens;
    strings get a BOS token first by default (``cfg.default_prepend_bos`` is True); ``run_with_cache(input)``
    caches every hook point (and every standard value), turning the attention values on for the call. The
    standard names, ``model.trace`` and every nnterp tool work as on a ``StandardizedTransformer``.
    """

    _nnterp_default_prepend_bos = True
    _nnterp_hook_cache = True

    @classmethod
    def from_pretrained(cls, model_name, *, hf_model=None, tokenizer=None, default_prepend_bos: bool | None = None,
                        default_padding_side: str | None = None, fold_ln: bool = False,
                        center_writing_weights: bool = False, center_unembed: bool = False,
                        fold_value_biases: bool = False, refactor_factored_attn_matrices: bool = False,
                        **kwargs) -> HookedTransformer:
        """The checkpoint ``model_name`` (a hub name or a folder), or the transformers model ``hf_model``, with the
        checkpoint's own weights. TransformerLens's weight processing (``fold_ln`` and the rest) is refused: nnterp's
        values are the checkpoint's. ``dtype=`` and the other keywords go to transformers' ``from_pretrained``."""
        processing = {"fold_ln": fold_ln, "center_writing_weights": center_writing_weights,
                      "center_unembed": center_unembed, "fold_value_biases": fold_value_biases,
                      "refactor_factored_attn_matrices": refactor_factored_attn_matrices}
        asked = [name for name, on in processing.items() if on]
        if asked:
            raise ValueError(
                f"HookedTransformer.from_pretrained({', '.join(f'{name}=True' for name in asked)}): nnterp keeps the "
                "checkpoint's own weights and never processes them. TransformerLens's "
                + "; ".join(f"{name} {PROCESSING[name]}" for name in asked)
                + ". nnterp's numbers are TransformerLens's from_pretrained_no_processing numbers: leave these out "
                "(or pass False).")
        for name in kwargs:
            if name in LOADING:
                raise TypeError(f"HookedTransformer.from_pretrained got {name}=, TransformerLens's loading argument: "
                                f"{LOADING[name]}.")
        if "torch_dtype" in kwargs:
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        if hf_model is not None:
            if kwargs:
                raise TypeError(f"HookedTransformer.from_pretrained(hf_model=...) wraps the model as it is built: "
                                f"{', '.join(sorted(kwargs))} apply only when loading by name or folder.")
            model = cls(hf_model, tokenizer=tokenizer)
        else:
            model = cls(model_name, tokenizer=tokenizer, **kwargs)
        if default_prepend_bos is not None:
            model.__dict__["_nnterp_default_prepend_bos"] = bool(default_prepend_bos)
        side = "right" if default_padding_side is None else default_padding_side  # TransformerLens's default
        if side not in ("left", "right"):
            raise ValueError(f"default_padding_side is 'left' or 'right', not {default_padding_side!r}.")
        model.tokenizer.padding_side = side  # the model's own copy of the tokenizer
        return model

    @classmethod
    def from_pretrained_no_processing(cls, model_name, **kwargs) -> HookedTransformer:
        """``from_pretrained``: nnterp never processes the weights."""
        return cls.from_pretrained(model_name, **kwargs)

    def __call__(self, *args, return_type: str | None = "logits", loss_per_token: bool = False,
                 prepend_bos: bool | None = None, padding_side: str | None = None, stop_at_layer: int | None = None,
                 **kwargs):
        """Outside a trace: one forward pass (TransformerLens's ``model(input)``), with the hooks of ``with
        model.hooks(...)``; inside one, nnsight's call of the module."""
        if self.interleaver.interleaving:
            return Envoy.__call__(self, *args, **kwargs)
        if len(args) != 1:
            raise TypeError("model(input) takes one input: a text, a list of texts, or token ids [batch, seq].")
        _refuse_foreign_arguments(kwargs, False, "model(input)", "return_type, loss_per_token, prepend_bos, "
                                  "padding_side and stop_at_layer")
        return forward(self, args[0], context_hooks(self), return_type, loss_per_token, prepend_bos, stop_at_layer,
                       padding_side)

    forward = __call__

    def to(self, device_or_dtype, print_details: bool = True) -> HookedTransformer:
        """Move the model to a device or dtype (in place) and return it, printing what TransformerLens's ``to``
        prints (``Moving model to device:  cpu``, ``Changing model dtype to torch.float16``) unless
        ``print_details=False``."""
        if print_details:
            if isinstance(device_or_dtype, torch.device):
                print("Moving model to device: ", device_or_dtype.type)
            elif isinstance(device_or_dtype, str):
                print("Moving model to device: ", device_or_dtype)
            elif isinstance(device_or_dtype, torch.dtype):
                print("Changing model dtype to", device_or_dtype)
        self._module.to(device_or_dtype)
        return self

    def cuda(self, device=None) -> HookedTransformer:
        """TransformerLens's ``cuda``: ``to("cuda")`` (``cuda:<n>`` for a device number), printing as it does."""
        if isinstance(device, int):
            return self.to(f"cuda:{device}")
        return self.to("cuda" if device is None else device)

    def cpu(self) -> HookedTransformer:
        """TransformerLens's ``cpu``: ``to(torch.device("cpu"))``, printing as it does."""
        return self.to(torch.device("cpu"))

    def run_with_cache(self, input, *args, **kwargs):
        """``run_with_cache`` (every hook point by default); with SAEs attached (``add_sae``), their own values too,
        under SAELens's names (``f"{hook}.hook_sae_acts_post"``), as SAELens's ``HookedSAETransformer`` caches them."""
        from .saes import attached_saes, run_with_cache_with_saes

        if attached_saes(self) and not args and kwargs.get("max_new_tokens") is None:
            return run_with_cache_with_saes(self, input, **kwargs)
        return run_with_cache(self, input, *args, **kwargs)

    def generate(self, input="", max_new_tokens: int = 10, stop_at_eos: bool = True, eos_token_id=None,
                 do_sample: bool = True, top_k: int | None = None, top_p: float | None = None,
                 temperature: float = 1.0, freq_penalty: float = 0.0, use_past_kv_cache: bool = True,
                 prepend_bos: bool | None = None, padding_side: str | None = None, return_type: str = "input",
                 verbose: bool = True, **kwargs):
        """TransformerLens's ``generate``: ``max_new_tokens`` tokens after ``input`` (a text, a list of texts, or
        token ids), sampled at ``temperature`` with ``top_k`` / ``top_p`` (``do_sample=False``: greedy), stopping
        where every prompt has given ``eos_token_id`` (the tokenizer's EOS by default; never with
        ``stop_at_eos=False``). ``return_type="input"`` gives text for text (the prompt and what follows, special
        tokens left out) and ids for ids; ``"str"`` or ``"tokens"`` choose. A list of texts is padded on the left
        (``padding_side`` applies to one text), ids padded on the left have their leading pads masked, and a finished
        row goes on with the EOS, as in TransformerLens. Runs through transformers' ``generate`` (nnsight's
        generation tracer is ``TransformersModel.generate(model, ...)``); with SAEs attached (``add_sae``) or hooks
        on the model (``add_hook``, ``with model.hooks(...)``), one forward pass per token instead, so that they
        run in every step, as in TransformerLens and SAELens."""
        if kwargs:
            raise TypeError(f"generate got {', '.join(sorted(kwargs))}: its arguments are TransformerLens's "
                            "(max_new_tokens, stop_at_eos, eos_token_id, do_sample, top_k, top_p, temperature, "
                            "prepend_bos, padding_side, return_type). For transformers' generation settings, trace "
                            "it: with TransformersModel.generate(model, input, ...) (nnsight.modeling.transformers).")
        if freq_penalty:
            raise TypeError("generate(freq_penalty=...): TransformerLens's frequency penalty has no counterpart in "
                            "transformers' generation; use repetition_penalty in a TransformersModel.generate(model, ...) trace.")
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type is 'input', 'str' or 'tokens', not {return_type!r} (nnterp does not "
                             "return embeddings).")
        text = isinstance(input, str) or (isinstance(input, list) and all(isinstance(t, str) for t in input))
        if text:  # a batch of texts is padded on the left whatever padding_side says, as TransformerLens pads it
            ids, mask = tokenized(self, input, prepend_bos, "left" if isinstance(input, list) and len(input) > 1
                                  else padding_side)
        else:  # ids: their leading pads masked as TransformerLens masks them
            ids = torch.as_tensor(input)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            mask = tl_attention_mask(self, ids, prepend_bos).to(ids.device)
        device = next(self._module.parameters()).device
        eos = self.tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        # a finished row goes on with this token: TransformerLens's (the EOS, the tokenizer's among several)
        filler = (eos if isinstance(eos, int) else self.tokenizer.eos_token_id if self.tokenizer.eos_token_id
                  is not None else list(eos)[0]) if stop_at_eos else self.tokenizer.pad_token_id
        if attached_saes(self) or context_hooks(self):  # the SAEs and hooks in every step: a forward pass a token
            out = sampled(self, ids.to(device), mask.to(device), max_new_tokens, eos if stop_at_eos else None,
                          filler, do_sample, top_k, top_p, temperature)
            return self._generated(out, ids, text, return_type)
        settings = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "use_cache": use_past_kv_cache,
                    "pad_token_id": filler if filler is not None else eos}
        if do_sample:
            settings.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
        else:  # greedy: the checkpoint's sampling settings do not apply
            settings.update(temperature=None, top_k=None, top_p=None)
        if stop_at_eos:
            if eos is None:
                raise ValueError("generate(stop_at_eos=True) needs an eos_token_id: the tokenizer has none.")
            settings["eos_token_id"] = eos
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        config = self._module.generation_config
        checkpoint_eos = config.eos_token_id
        if not stop_at_eos:  # transformers stops at the checkpoint's EOS unless its generation config has none
            config.eos_token_id = None
        try:
            with torch.no_grad():
                out = TransformersModel.generate(self, inputs, **settings)
        finally:
            config.eos_token_id = checkpoint_eos
        return self._generated(out, ids, text, return_type)

    def _generated(self, out: torch.Tensor, ids: torch.Tensor, text: bool, return_type: str):
        out = out.cpu() if ids.device.type == "cpu" else out
        if return_type == "tokens" or (return_type == "input" and not text):
            return out
        decoded = [self.tokenizer.decode(row, skip_special_tokens=True) for row in out.tolist()]
        return decoded[0] if len(decoded) == 1 else decoded


def sampled(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos, filler, do_sample: bool,
            top_k: int | None, top_p: float | None, temperature: float) -> torch.Tensor:
    """TransformerLens's generation loop, one forward pass of the model per token (so that the model's edits, the
    attached SAEs, run in each step): the next token sampled from the last position's logits (greedy without
    ``do_sample``), a finished row (it gave ``eos``) going on with ``filler``, stopping where every row has
    finished."""
    eos = None if eos is None else torch.as_tensor([eos] if isinstance(eos, int) else list(eos), device=ids.device)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = forward(model, {"input_ids": ids, "attention_mask": mask}, context_hooks(model))[:, -1].float()
        token = _sample(logits, top_k, top_p, temperature) if do_sample else logits.argmax(-1)
        if eos is not None:
            token[finished] = filler
            finished |= torch.isin(token, eos)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos is not None and bool(finished.all()):
            break
    return ids


def _sample(logits: torch.Tensor, top_k: int | None, top_p: float | None, temperature: float) -> torch.Tensor:
    """One token per row, sampled at ``temperature`` among the ``top_k`` most likely and the smallest set of
    probability ``top_p`` (TransformerLens's ``sample_logits``)."""
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative > top_p
        drop[:, 1:] = drop[:, :-1].clone()  # keep the token that crosses top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.distributions.Categorical(logits=logits).sample()

