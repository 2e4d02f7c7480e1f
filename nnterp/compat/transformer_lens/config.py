"""TransformerLens's ``model.cfg`` and its weight attributes, read from the model's own config and parameters: ``W_U``,
``b_U``, ``W_E``, ``W_pos``, and the blocks' ``W_Q`` ... ``b_out`` in TransformerLens's layout where the modules give
them exactly (GPT-2's and Llama's shapes), refused with the reason elsewhere; ``QK``, ``OV`` as TransformerLens's
``FactoredMatrix``; ``model.blocks[i]`` with the weights and hook points of one block."""

from __future__ import annotations

import torch

from ...core.norms import norm_form
from ...core.tokens import context_length, default_prepend_bos, tokenizer_prepends_bos
from ...spec.catalog import TRANSFORMERLENS_NORMS
from ...spec.errors import NNterpError
from ...spec.locations import At
from ...tools.hook_points import has_rotary, position_table
from .factored import FactoredMatrix


class WeightRefused(NNterpError, LookupError):
    """A TransformerLens weight attribute nnterp does not give (a property that raised AttributeError would fall
    through to nnsight's attribute lookup, which loses the reason)."""


class AbsentWeight(WeightRefused, AttributeError):
    """A weight a component of ``model.blocks[i]`` does not have, as TransformerLens's has no such attribute (an
    ungated MLP's ``W_gate``, an RMSNorm's ``b``): ``getattr(component, name, None)`` gives None."""


FIELDS = ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "n_key_value_heads", "act_fn",
          "normalization_type", "positional_embedding_type", "default_prepend_bos", "tokenizer_prepends_bos",
          "device", "dtype", "model_name", "original_architecture")


class Config:
    """TransformerLens's ``model.cfg`` fields, read from the model (read-only: the model is its config's)."""

    __slots__ = FIELDS

    def __init__(self, **fields):
        for name in FIELDS:
            object.__setattr__(self, name, fields[name])

    def __setattr__(self, name, value):
        raise AttributeError(f"model.cfg is read from the model and cannot be set ({name}): nnterp runs the model as "
                             "its transformers config says. default_prepend_bos: pass prepend_bos= to the call, or "
                             "HookedTransformer.from_pretrained(..., default_prepend_bos=...).")

    def __getattr__(self, name):
        raise AttributeError(f"model.cfg has TransformerLens's fields {', '.join(FIELDS)}, not {name!r}; the "
                             "model's own config is model.config.")

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS) + ")"


def _first(config, *keys, default=None):
    return next((getattr(config, key) for key in keys if getattr(config, key, None) is not None), default)


def _normalization(model) -> str | None:
    if model.family.ln_final is None:
        return None
    try:
        centred, _ = norm_form(model.ln_final._module)
    except ValueError:
        return type(model.ln_final._module).__name__
    return "LN" if centred else "RMS"


def cfg(model) -> Config:
    """``model.cfg``: TransformerLens's names for the model's sizes and settings."""
    config = model._nnterp_text_config
    parameter = next(model._module.parameters())
    heads = model.num_heads
    d_model = model.hidden_size
    d_head = _first(config, "head_dim", default=d_model // heads if heads else None)
    kv_heads = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    return Config(
        n_layers=model.num_layers, d_model=d_model, n_heads=heads, d_head=d_head,
        d_mlp=_first(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * d_model),
        d_vocab=model.vocab_size, n_ctx=context_length(model),
        n_key_value_heads=kv_heads if kv_heads is not None and kv_heads != heads else None,
        act_fn=_first(config, "hidden_act", "activation_function"),
        normalization_type=_normalization(model),
        positional_embedding_type=("standard" if position_table(model) else "rotary" if has_rotary(model) else
                                   "alibi" if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt")
                                   else None),
        default_prepend_bos=default_prepend_bos(model), tokenizer_prepends_bos=tokenizer_prepends_bos(model.tokenizer),
        device=parameter.device, dtype=parameter.dtype,
        model_name=getattr(model._module, "name_or_path", None) or getattr(config, "_name_or_path", None),
        original_architecture=type(model._module).__name__,
    )


# -- weights -------------------------------------------------------------------------------------------------


def W_U(model) -> torch.Tensor:
    """The unembedding ``[d_model, d_vocab]``: the head's weight, transposed."""
    return model.lm_head._module.weight.T


def b_U(model) -> torch.Tensor:
    """The unembedding's bias ``[d_vocab]`` (zeros where the head has none, as TransformerLens gives them)."""
    head = model.lm_head._module
    return _bias(head, head.weight.shape[0], head.weight)


def W_E(model) -> torch.Tensor:
    """The token embeddings ``[d_vocab, d_model]``."""
    return model._module.get_input_embeddings().weight


def W_pos(model) -> torch.Tensor:
    """The learned position embeddings ``[n_ctx, d_model]``; refused where positions are not looked up in a table."""
    path = position_table(model)
    if path is None:
        raise WeightRefused(f"model.W_pos: {model.family.name} has no learned position embeddings (a table added to "
                             "the token embeddings): its positions are rotary or ALiBi, inside the attention.")
    return model._module.get_submodule(path).weight


# -- the blocks' weights, in TransformerLens's layout ------------------------------------------------------------

def _conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"  # GPT-2's projections: x @ weight [in, out] + bias


class ReadOnlyWeight(torch.Tensor):
    """A weight as TransformerLens gives it that no parameter of the model holds as such: read as any tensor, and an
    in-place edit refused, since no weight of the model would change (``why`` says what it stands for)."""

    why = ""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or (name.endswith("_") and not name.endswith("__") and name != "requires_grad_") or (
                name.startswith("__i") and name.endswith("__")):
            raise WeightRefused(cls.why)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        # every result a plain tensor (an op that gives the same tensor back, .float(), too)
        return result.as_subclass(torch.Tensor) if isinstance(result, ReadOnlyWeight) else result


class AbsentBias(ReadOnlyWeight):
    """Zeros standing for a bias the module does not have, as TransformerLens gives them."""

    why = ("This bias is zeros standing for one the module does not have (as TransformerLens gives it): an edit of it "
           "would change nothing in the model. Edit the module's weights, or add to the sublayer's output in a trace "
           "or a hook.")


class OffsetGain(ReadOnlyWeight):
    """A norm's gain where the norm applies ``1 + weight`` (Gemma's RMSNorm): TransformerLens's ``w`` is that sum."""

    why = ("This norm weight is the module's weight plus 1, the gain the norm applies (as TransformerLens gives it): "
           "an edit of it would change nothing in the model. Edit the module's own weight, which the norm adds 1 to.")


def _bias(module, size: int, like: torch.Tensor) -> torch.Tensor:
    bias = getattr(module, "bias", None)
    if bias is None:
        return torch.zeros(size, dtype=like.dtype, device=like.device).as_subclass(AbsentBias)
    return bias


def _native(model, layer: int, what: str) -> str:
    block = model.layers[layer]._module
    names = [key for key, _ in block.named_parameters()]
    return (f"block {layer} holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''} "
            f"(model.layers[{layer}]._module.named_parameters())")


def attention_weights(model, layer: int) -> dict[str, torch.Tensor]:
    """Block ``layer``'s attention weights in TransformerLens's layout: ``W_Q`` ``[heads, d_model, d_head]``, ``W_K``
    and ``W_V`` ``[kv_heads, d_model, d_head]`` (grouped-query attention's own key-value heads: TransformerLens's
    ``_W_K``), ``W_O`` ``[heads, d_head, d_model]`` and their biases (zeros where the module has none). Read from
    GPT-2's fused ``c_attn`` (Conv1D) or from ``q_proj``/``k_proj``/``v_proj`` (nn.Linear), with the output projection
    the one that mixes ``attention_premix``; refused elsewhere, naming the block's parameters."""
    from ...spec.attention import _output_projection

    heads, d_model = model.num_heads, model.hidden_size
    if model.family.attention is None:
        raise WeightRefused(f"model.W_Q: {model.family.name}'s blocks have no attention.")
    attention = model.layers[layer]._module.get_submodule(model.family.attention)
    try:
        out_path = _output_projection(model, layer).path
    except AttributeError as error:  # ValueUnavailable
        raise WeightRefused(f"The attention weights of block {layer}: {getattr(error, 'reason', error)}; "
                            f"{_native(model, layer, 'attention')}.") from None
    out = model.layers[layer]._module.get_submodule(out_path)
    fused = getattr(attention, "c_attn", None)
    projections = [getattr(attention, f"{x}_proj", None) for x in "qkv"]
    if _conv1d(fused) and fused.weight.shape == (d_model, 3 * d_model) and not hasattr(attention, "q_attn"):
        d_head = d_model // heads
        w, b = fused.weight, _bias(fused, 3 * d_model, fused.weight)
        wq, wk, wv = (w[:, i * d_model:(i + 1) * d_model].reshape(d_model, heads, d_head).permute(1, 0, 2)
                      for i in range(3))
        bq, bk, bv = (b[i * d_model:(i + 1) * d_model].reshape(heads, d_head) for i in range(3))
    elif all(isinstance(p, torch.nn.Linear) for p in projections):
        q, k, v = projections
        d_head = q.out_features // heads
        kv = k.out_features // d_head
        if q.out_features != heads * d_head or k.out_features != kv * d_head or v.out_features != kv * d_head or (
                heads % kv):
            raise WeightRefused(f"The attention weights of block {layer}: its projections ({q.out_features}, "
                                f"{k.out_features}, {v.out_features} outputs) do not split into {heads} query heads "
                                "and a divisor of them as key-value heads.")
        wq = q.weight.reshape(heads, d_head, d_model).transpose(1, 2)
        wk = k.weight.reshape(kv, d_head, d_model).transpose(1, 2)
        wv = v.weight.reshape(kv, d_head, d_model).transpose(1, 2)
        bq = _bias(q, heads * d_head, q.weight).reshape(heads, d_head)
        bk = _bias(k, kv * d_head, k.weight).reshape(kv, d_head)
        bv = _bias(v, kv * d_head, v.weight).reshape(kv, d_head)
    else:
        raise WeightRefused(
            f"The attention weights of block {layer} in TransformerLens's layout: nnterp splits GPT-2's fused c_attn "
            f"and separate q_proj/k_proj/v_proj linear projections; {model.family.name}'s attention "
            f"({type(attention).__name__}) has neither; {_native(model, layer, 'attention')}.")
    if _conv1d(out):
        wo = out.weight.reshape(heads, d_head, d_model)
    elif isinstance(out, torch.nn.Linear):
        wo = out.weight.T.reshape(heads, d_head, d_model)
    else:  # _output_projection accepts only these two
        raise WeightRefused(f"The attention output of block {layer} is no linear projection.")
    return {"W_Q": wq, "W_K": wk, "W_V": wv, "W_O": wo, "b_Q": bq, "b_K": bk, "b_V": bv,
            "b_O": _bias(out, d_model, wo)}


def mlp_weights(model, layer: int) -> dict[str, torch.Tensor]:
    """Block ``layer``'s MLP weights in TransformerLens's layout: ``W_in`` ``[d_model, d_mlp]`` (a gated MLP's up
    projection, with ``W_gate`` its gate), ``W_out`` ``[d_mlp, d_model]``, ``b_in``, ``b_out`` (zeros where the module
    has none). Read from GPT-2's ``c_fc``/``c_proj`` (Conv1D) or a gated MLP's ``gate_proj``/``up_proj``/``down_proj``
    (nn.Linear); refused elsewhere."""
    if model.family.mlp is None:
        raise WeightRefused(f"model.W_in: {model.family.name}'s MLP layers are not one module; "
                            f"{_native(model, layer, 'mlp')}.")
    mlp = model.layers[layer]._module.get_submodule(model.family.mlp)
    up, down = getattr(mlp, "c_fc", None), getattr(mlp, "c_proj", None)
    if _conv1d(up) and _conv1d(down) and up.weight.shape[1] == down.weight.shape[0]:
        return {"W_in": up.weight, "b_in": _bias(up, up.weight.shape[1], up.weight), "W_out": down.weight,
                "b_out": _bias(down, down.weight.shape[1], down.weight)}
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if all(isinstance(p, torch.nn.Linear) for p in (gate, up, down)):
        return {"W_in": up.weight.T, "W_gate": gate.weight.T, "b_in": _bias(up, up.out_features, up.weight),
                "W_out": down.weight.T, "b_out": _bias(down, down.out_features, down.weight)}
    raise WeightRefused(
        f"The MLP weights of block {layer} in TransformerLens's layout: nnterp reads GPT-2's c_fc/c_proj and a gated "
        f"MLP's gate_proj/up_proj/down_proj; {model.family.name}'s MLP ({type(mlp).__name__}) has neither; "
        f"{_native(model, layer, 'mlp')}.")


def _repeated(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's key-value heads repeated to one per query head (TransformerLens's ``W_K``)."""
    return weight if weight.shape[0] == heads else weight.repeat_interleave(heads // weight.shape[0], dim=0)


def block_weight(model, layer: int, name: str) -> torch.Tensor:
    """One of TransformerLens's per-block weights (``W_Q`` ... ``b_out``; ``_W_K``, ``_W_V``, ``_b_K``, ``_b_V`` the
    key-value heads of grouped-query attention as the model holds them)."""
    own = name.lstrip("_")
    if own in ATTENTION:
        weight = attention_weights(model, layer)[own]
        return weight if name.startswith("_") or own not in ("W_K", "W_V", "b_K", "b_V") else _repeated(
            weight, model.num_heads)
    weights = mlp_weights(model, layer)
    if own not in weights:
        raise WeightRefused(f"model.{name}: block {layer}'s MLP has no gate (TransformerLens's W_gate is a gated MLP's).")
    return weights[own]


ATTENTION = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
MLP = ("W_in", "W_gate", "b_in", "W_out", "b_out")


def stacked(model, name: str) -> torch.Tensor:
    """``model.W_Q`` and the rest: the blocks' weights stacked, ``[n_layers, ...]``, as TransformerLens stacks them."""
    return torch.stack([block_weight(model, layer, name) for layer in range(model.num_layers)])


def QK(model):
    """TransformerLens's ``model.QK``: ``FactoredMatrix(W_Q, W_K^T)``, ``[n_layers, n_heads, d_model, d_model]``."""
    return FactoredMatrix(stacked(model, "W_Q"), stacked(model, "W_K").transpose(-2, -1))


def OV(model):
    """TransformerLens's ``model.OV``: ``FactoredMatrix(W_V, W_O)``, ``[n_layers, n_heads, d_model, d_model]``."""
    return FactoredMatrix(stacked(model, "W_V"), stacked(model, "W_O"))


def W_E_pos(model) -> torch.Tensor:
    """The token embeddings and the position table, ``[d_vocab + n_ctx, d_model]``."""
    return torch.cat([W_E(model), W_pos(model)])


# -- model.blocks[i], model.embed, model.unembed: the weights where TransformerLens's modules hold them ----------

class HookHandle:
    """``model.blocks[i].attn.hook_z``: ``add_hook(fn)`` adds a hook on that hook point (``model.add_hook``)."""

    def __init__(self, model, name: str):
        self._model, self.name = model, name

    def add_hook(self, hook, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False) -> None:
        self._model.add_hook(self.name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False) -> None:
        """Remove the hooks added on this hook point by name (those of a predicate stay)."""
        installed = self._model.__dict__.get("_nnterp_installed_hooks", [])
        from .installed import _publish

        _publish(self._model, [hook for hook in installed if not (
            hook.names == self.name and (including_permanent or not hook.permanent))])

    def __repr__(self) -> str:
        return f"HookHandle({self.name!r})"


class Component:
    """A TransformerLens component of block ``layer`` (``blocks[i]``, ``.attn``, ``.mlp``, ``.ln1`` ...): its weights
    and hook points by TransformerLens's names."""

    def __init__(self, model, layer: int | None, prefix: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        model, layer, prefix = self._model, self._layer, self._prefix
        if prefix == "" and name in ("attn", "mlp", *TRANSFORMERLENS_NORMS):
            return Component(model, layer, name)
        if name.startswith("hook_"):
            full = ".".join(part for part in (f"blocks.{layer}", prefix, name) if part)
            from ...tools.hook_points import point

            point(model, full)  # an unknown name, or one the family has no value for, says so
            return HookHandle(model, full)
        if prefix == "mlp" and name == "W_gate":
            try:
                return block_weight(model, layer, name)
            except WeightRefused as error:
                raise AbsentWeight(str(error)) from None
        if (prefix == "attn" and name.lstrip("_") in ATTENTION) or (prefix == "mlp" and name in MLP):
            return block_weight(model, layer, name)
        if prefix in TRANSFORMERLENS_NORMS and name in ("w", "b"):
            return norm_weight(model, layer, prefix, name)
        raise AttributeError(f"blocks[{layer}]{'.' + prefix if prefix else ''} has TransformerLens's hook points "
                             f"(hook_...) and weights ({', '.join(ATTENTION if prefix == 'attn' else MLP)}), not "
                             f"{name!r}; the native module is model.layers[{layer}]._module.")

    def __setattr__(self, name, value):
        raise AttributeError(f"model.blocks[...] reads the model's own parameters; set them on the native module "
                             f"(model.layers[{self._layer}]._module).")


class Blocks:
    """``model.blocks``: block ``i``'s weights and hook points by TransformerLens's names (``model.blocks[3].attn.W_Q``,
    ``model.blocks[3].attn.hook_z.add_hook(fn)``)."""

    def __init__(self, model):
        self._model = model

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, layer: int) -> Component:
        if isinstance(layer, slice):
            return [self[i] for i in range(self._model.num_layers)[layer]]
        count = self._model.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -count <= layer < count:
            raise IndexError(f"model.blocks has {count} blocks, not {layer!r}.")
        return Component(self._model, layer % count, "")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


NORM_VALUES = TRANSFORMERLENS_NORMS  # the catalog's: ln1 before the attention, ln2 before the MLP


def norm_module(model, layer: int, which: str):
    """Block ``layer``'s norm ``which`` (``ln1`` before the attention, ``ln2`` before the MLP), or None where no norm
    module's output is that value."""
    location = model.block_spec(layer).resolve(NORM_VALUES[which])
    if not isinstance(location, At) or location.side != "output" or location.op or location.views:
        return None
    return model.layers[layer]._module.get_submodule(location.path)


def norm_gain(model, module, label: str) -> torch.Tensor | None:
    """The gain a norm module applies, as TransformerLens's ``w`` is: its weight, or ``1 + weight`` where the norm
    adds 1 to it (Gemma's; measured on the module, ``nnterp.analysis.norms``); None where it has no weight."""
    from ...analysis import AnalysisUnavailable
    from ...analysis.norms import _norm_form

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    try:
        offset = _norm_form(model, module, weight.new_zeros(1, 1, weight.shape[-1]), label)[1]
    except AnalysisUnavailable as error:
        raise WeightRefused(f"{label}.w: {str(error).partition(': ')[2] or error}") from None
    return weight if not offset else (weight.detach() + offset).as_subclass(OffsetGain)


def norm_weight(model, layer: int, which: str, name: str) -> torch.Tensor:
    """``blocks[layer].ln1.w`` and the rest: the gain the norm module applies (``w``: its weight, or ``1 + weight``
    where it adds 1, as TransformerLens's conversion gives it) or its bias (``b``)."""
    module = norm_module(model, layer, which)
    label = f"blocks[{layer}].{which}"
    tensor = None if module is None else norm_gain(model, module, label) if name == "w" else getattr(module, "bias",
                                                                                                      None)
    if not isinstance(tensor, torch.Tensor):
        raise AbsentWeight(f"blocks[{layer}].{which}.{name}: block {layer}'s {which} has no "
                           f"{'weight' if name == 'w' else 'bias'}" + (" (no norm module)" if module is None else ""))
    return tensor


def tl_parameters(model) -> dict[str, torch.Tensor]:
    """TransformerBridge's ``tl_parameters()``: the weights by TransformerLens's names (``blocks.0.attn.W_Q``, ...), in
    its layout and order (TransformerBridge's): the embeddings, each block's attention, MLP and norm weights, the
    final norm's, the unembedding."""
    params = {"embed.W_E": W_E(model)}
    if position_table(model):
        params["pos_embed.W_pos"] = W_pos(model)
    for layer in range(model.num_layers):
        for name, weight in attention_weights(model, layer).items():
            params[f"blocks.{layer}.attn.{name}"] = _repeated(weight, model.num_heads) if name in (
                "W_K", "W_V", "b_K", "b_V") else weight
        weights = mlp_weights(model, layer)
        for name in ("W_in", "W_out", "b_in", "b_out", "W_gate"):  # TransformerBridge's order
            if name in weights:
                params[f"blocks.{layer}.mlp.{name}"] = weights[name]
        for which in TRANSFORMERLENS_NORMS:
            module = norm_module(model, layer, which)
            gain = None if module is None else norm_gain(model, module, f"blocks[{layer}].{which}")
            for name, tensor in (("w", gain), ("b", getattr(module, "bias", None))):
                if isinstance(tensor, torch.Tensor):
                    params[f"blocks.{layer}.{which}.{name}"] = tensor
    final = model._module.get_submodule(model.family.ln_final) if model.family.ln_final else None
    gain = None if final is None else norm_gain(model, final, "ln_final")
    for name, tensor in (("w", gain), ("b", getattr(final, "bias", None))):
        if isinstance(tensor, torch.Tensor):
            params[f"ln_final.{name}"] = tensor
    params.update({"unembed.W_U": W_U(model), "unembed.b_U": b_U(model)})
    return params


def tl_named_parameters(model):
    """TransformerBridge's ``tl_named_parameters()``: ``tl_parameters()``'s ``(name, tensor)`` pairs."""
    return iter(tl_parameters(model).items())


class _Holder:
    """``model.embed`` / ``model.unembed``: TransformerLens's ``W_E`` / ``W_U``, ``b_U`` where its modules hold them."""

    def __init__(self, model, names: dict):
        self._model, self._names = model, names

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"{name!r}: this TransformerLens module gives {', '.join(self._names)}.")
        return self._names[name](self._model)


PROPERTIES = {
    "cfg": property(cfg, doc=cfg.__doc__), "W_U": property(W_U, doc=W_U.__doc__), "b_U": property(b_U, doc=b_U.__doc__),
    "W_E": property(W_E, doc=W_E.__doc__), "W_pos": property(W_pos, doc=W_pos.__doc__),
    "W_E_pos": property(W_E_pos, doc=W_E_pos.__doc__),
    **{name: property(lambda model, name=name: stacked(model, name), doc=f"TransformerLens's {name}, stacked over the "
                      "blocks (nnterp.compat.transformer_lens.config.attention_weights, mlp_weights).")
       for name in (*ATTENTION, *MLP)},
    "QK": property(QK, doc=QK.__doc__), "OV": property(OV, doc=OV.__doc__),
    "blocks": property(Blocks, doc=Blocks.__doc__),
    "tl_parameters": tl_parameters, "tl_named_parameters": tl_named_parameters,
    "embed": property(lambda model: _Holder(model, {"W_E": W_E}), doc="TransformerLens's embed: W_E."),
    "unembed": property(lambda model: _Holder(model, {"W_U": W_U, "b_U": b_U}), doc="TransformerLens's unembed."),
}

__all__ = ["AbsentWeight", "Config", "PROPERTIES", "WeightRefused", "attention_weights", "cfg", "mlp_weights", "stacked"]
