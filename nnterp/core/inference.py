"""A spec for a decoder no family serves, inferred from its module tree and proven before it is returned.

``infer_family(config)`` builds a miniature of the config (the same class, tiny sizes), finds the
blocks, the embedding, the final norm and the head, and in each block the attention, the MLP,
their norms, the attention's output projection and the MLP's activation and down projection,
by the names and classes decoders use. Each block shape it can read that way (a sequential
pre-norm block, norms after the sublayers, one norm shared by parallel sublayers) becomes a
candidate spec, and the first candidate that passes the proof every model passes at load is
returned. Norms are taken in the order a forward pass of the miniature calls them. Nothing is registered: ``register_family(infer_family(config))`` serves it. When no
candidate can be built or none holds, ``UnknownArchitecture`` names what could not be located
or what failed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, cast

import torch
from transformers import PretrainedConfig

from ..families import ROUTED, Family, Unavailable, input, output, parallel_block, pre_norm_block
from ..spec.errors import UnknownArchitecture

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # its module imports the model machinery: not at import

ATTENTION = ("self_attn", "attn", "attention", "self_attention", "multi_head_attention")
MLP = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
OUT_PROJECTION = ("o_proj", "out_proj", "dense", "c_proj", "wo", "Wo", "out")
ACTIVATION = ("act_fn", "act", "activation_fn", "activation")
DOWN_PROJECTION = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "w2", "fc_out", "down")
NO_NORM = Unavailable("no norm before this sublayer: it reads the stream itself")


def _is_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _child(module: torch.nn.Module, names: tuple[str, ...], kind: str | None = None) -> str | None:
    children = dict(module.named_children())
    for name in names:
        if name in children:
            return name
    if kind:
        matches = [name for name, child in children.items() if kind in type(child).__name__.lower()]
        if len(matches) == 1:
            return matches[0]
    return None


class _ModelLevel(TypedDict):
    """The model-level paths of a decoder (``Family``'s fields of the same names)."""

    layers: str
    embed_tokens: str
    ln_final: str
    lm_head: str


def _model_level(model: PreTrainedModel, layers: int, vocab: int) -> _ModelLevel:
    """Where the blocks, the embedding, the final norm and the head are, or what could not be found."""
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == layers and name]
    if len(lists) != 1:
        found = ", ".join(f"{name} ({len(m)})" for name, m in model.named_modules()
                          if isinstance(m, torch.nn.ModuleList)) or "none"
        raise LookupError(f"one list of {layers} blocks (num_hidden_layers); the module lists are: {found}")
    blocks = lists[0][0]
    backbone = blocks.rpartition(".")[0]
    embeddings = [name for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Embedding) and m.num_embeddings == vocab and name.startswith(backbone)]
    head = model.get_output_embeddings()
    head_name = next((name for name, m in model.named_modules() if m is head), None)
    norms = [name for name, m in model.get_submodule(backbone).named_children() if _is_norm(m)] if backbone else []
    missing = [what for what, found in (("the token embedding (an Embedding of vocab_size rows)", embeddings),
                                        ("the head (get_output_embeddings())", head_name),
                                        (f"one final norm among {backbone}'s children", len(norms) == 1))
               if not found]
    if missing:
        raise LookupError(", ".join(missing))
    assert head_name is not None  # it is among the missing otherwise
    return _ModelLevel(layers=blocks, embed_tokens=embeddings[0], ln_final=f"{backbone}.{norms[0]}", lm_head=head_name)


def _norms_in_call_order(model: torch.nn.Module, layers: str, vocab: int) -> list[list[str]]:
    """Each block's norm children, in the order one forward pass of the miniature calls them."""
    blocks = cast(torch.nn.ModuleList, model.get_submodule(layers))  # ``layers``: the list _model_level found
    order: list[list[str]] = [[] for _ in blocks]
    handles = [norm.register_forward_pre_hook(lambda *_, i=i, name=name: order[i].append(name))
               for i, block in enumerate(blocks)
               for name, norm in block.named_children() if _is_norm(norm)]
    try:
        with torch.no_grad():
            model(torch.arange(1, 6).remainder(vocab).unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    return [list(dict.fromkeys(names)) for names in order]


def _block_shape(block: torch.nn.Module, norms: list[str]) -> dict:
    """The names inside one block, or a LookupError naming what is not there."""
    attention, mlp = _child(block, ATTENTION, "attention"), _child(block, MLP, "mlp")
    if attention is None or mlp is None:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in block.named_children())
        raise LookupError(f"{'an attention' if attention is None else 'an MLP'} module in {type(block).__name__} "
                          f"(its children: {children})")
    attention_module, mlp_module = block.get_submodule(attention), block.get_submodule(mlp)
    o_proj = _child(attention_module, OUT_PROJECTION)
    if o_proj is None:
        raise LookupError(f"the attention's output projection in {type(attention_module).__name__} "
                          f"(tried {', '.join(OUT_PROJECTION)})")
    routed = any("expert" in name or "router" in name for name, _ in mlp_module.named_modules())
    act, down = _child(mlp_module, ACTIVATION), _child(mlp_module, DOWN_PROJECTION)
    if not routed and (act is None or down is None):
        raise LookupError(f"the MLP's activation and down projection in {type(mlp_module).__name__} "
                          f"(tried {', '.join(ACTIVATION)} and {', '.join(DOWN_PROJECTION)})")
    return dict(attention=attention, mlp=mlp, o_proj=f"{attention}.{o_proj}", routed=routed, norms=norms,
                act=f"{mlp}.{act}" if act else "", down_proj=f"{mlp}.{down}" if down else "")


def _candidates(shapes: list[dict]) -> list[tuple[str, Callable]]:
    """(description, block function) for every block shape the names allow."""
    def make(build):
        def block(config, i):
            shape = shapes[i]
            routed = {"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if shape["routed"] else {}
            return build(shape, routed)
        return block

    candidates = []
    counts = {len(shape["norms"]) for shape in shapes}
    if counts == {2}:
        candidates.append(("sequential pre-norm", make(lambda s, routed: pre_norm_block(
            input_norm=s["norms"][0], attention=s["attention"], o_proj=s["o_proj"], post_norm=s["norms"][1],
            mlp=s["mlp"], act=s["act"], down_proj=s["down_proj"], **routed))))
    if counts == {2}:  # no norm before either sublayer: each norm follows one (OLMo-2's block)
        candidates.append(("norms after the sublayers only", make(lambda s, routed: pre_norm_block(
            input_norm="", attention=s["attention"], o_proj=s["o_proj"], post_norm="", mlp=s["mlp"], act=s["act"],
            down_proj=s["down_proj"], attention_norm_output=NO_NORM, mlp_norm_output=NO_NORM,
            layer_mid=input(s["mlp"], shared=True), mlp_input=input(s["mlp"], copy=True),
            attention_output=output(s["norms"][0]), mlp_output=output(s["norms"][1]), **routed))))
    if counts == {4}:  # called before the attention, after it, before the MLP, after it
        candidates.append(("norms after the sublayers", make(lambda s, routed: pre_norm_block(
            input_norm=s["norms"][0], attention=s["attention"], o_proj=s["o_proj"], post_norm=s["norms"][2],
            mlp=s["mlp"], act=s["act"], down_proj=s["down_proj"], attention_output=output(s["norms"][1]),
            mlp_output=output(s["norms"][3]), **routed))))
    if counts == {1}:
        for order in ("(x + a) + m", "(a + m) + x", "(m + a) + x"):
            candidates.append((f"parallel, {order}", make(lambda s, routed, order=order: parallel_block(
                input_norm=s["norms"][0], attention=s["attention"], o_proj=s["o_proj"], mlp=s["mlp"], act=s["act"],
                down_proj=s["down_proj"], order=order, **routed))))
    if not candidates:
        raise LookupError(f"a block shape for blocks with {sorted(counts)} norms (2: pre-norm, 4: norms after the "
                          "sublayers, 1: parallel)")
    return candidates


def infer_family(config: PretrainedConfig, architecture: type | None = None, *, name: str | None = None) -> Family:
    """A proven spec for ``config``'s decoder, inferred from its module tree; ``UnknownArchitecture`` if none holds."""
    from transformers import AutoModelForCausalLM  # its first use reads transformers' model folders: not at import

    from .. import proof
    from .registry import _placeholder_tokenizer, _wrapper

    architecture = architecture or AutoModelForCausalLM._model_mapping.get(type(config), None)
    if architecture is None:
        raise UnknownArchitecture(f"transformers maps no causal-LM class to {type(config).__name__}: pass "
                                  "infer_family(config, architecture=MyForCausalLM).")
    text = config.get_text_config()
    label = name or f"{architecture.__name__} (inferred)"
    try:
        model = proof.build_miniature(config, architecture)
        where = _model_level(model, text.num_hidden_layers, model.get_output_embeddings().weight.shape[0])
        vocab = model.get_output_embeddings().weight.shape[0]
        norms = _norms_in_call_order(model, where["layers"], vocab)
        shapes = [_block_shape(block, names) for block, names in zip(model.get_submodule(where["layers"]), norms)]
        candidates = _candidates(shapes)
    except LookupError as error:
        raise UnknownArchitecture(f"No spec could be inferred for {architecture.__name__}: could not locate {error}. "
                                  "Write its spec and register it (see register_family).") from None
    except Exception as error:  # noqa: BLE001 - a config the class cannot build
        raise UnknownArchitecture(f"No spec could be inferred for {architecture.__name__}: its miniature could not "
                                  f"be built ({type(error).__name__}: {error}).") from None
    shape = shapes[0]
    failures = []
    for description, block in candidates:
        family = Family(name=label, model_types=(config.model_type,), **where, attention=shape["attention"],
                        mlp=shape["mlp"], block=block, tiny_config=lambda: copy.deepcopy(config))
        problems, _ = proof.prove(config, architecture, _placeholder_tokenizer(), _wrapper(), family=family)
        if not problems:
            return family
        failures.append(f"{description}: {problems[0]}")
    raise UnknownArchitecture(f"No spec could be inferred for {architecture.__name__}: no block shape holds on its "
                              "miniature:\n  " + "\n  ".join(failures))


__all__ = ["infer_family"]
