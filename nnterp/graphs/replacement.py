"""The local replacement model of one prompt, as circuit-tracer defines it, run as one forward pass with gradients.

The pass is the model's own, on ``batch`` copies of the prompt, with its values unchanged bit for bit and its
gradients those of the replacement (circuit-tracer's linearization), so one backward pass per batch of targets
gives their rows:

- every attention pattern is detached (``attention_probabilities``, edited inside the trace: nnterp's eager
  attention values); circuit-tracer detaches them too;
- every norm's scale is frozen at the pass's value, as circuit-tracer detaches its norms' scales: a PyTorch hook on
  each norm module gives its output back unchanged, with the gradient of ``(x - mean(x)) / scale * gain`` at the
  detached ``scale`` (``y.detach() + (L(x) - L(x).detach())``: an exact zero added); a norm that is not that map
  in the pass is refused;
- each MLP's output (``mlp_output``, a module's output: read and replaced by a hook) is the transcoder's decoded
  features plus the skip connection plus the error node ``mlp_output - decoded - skip``, what the transcoder misses
  (circuit-tracer's error vector); the value passed on is the model's own (that sum), a leaf whose gradient dotted
  with a source's vector (``activation * W_dec``, or the error) is its edge; the MLP's own computation is cut off,
  the skip connection ``x @ W_skip.T`` the only gradient through it, as in circuit-tracer;
- the transcoder's input (``mlp_input``, ``layer_mid`` or the MLP norm's output, read by a hook after the norms'
  own hooks) keeps its autograd graph: a feature's row is its gradient against the encoder's row (the effect on
  the pre-activation);
- the token embeddings are leaves (a token node's vector is its embedding row, as the embedding module gives it);
  the head runs on the last position alone (a pre-hook hands it that position: the other positions' logits,
  ``[batch, seq, vocab]``, are never made), and its output is kept, for the logit rows.

After the pass, autograd's graph from the targets back to the sources is checked to be linear (no nonlinear
function, no product of two varying tensors): a gate, an activation or a norm the freezing missed is refused,
naming its autograd node, rather than giving edges that do not add up.

Position 0 (the BOS) follows circuit-tracer: its features are zeroed (never active) and its error node is zero;
its MLP output still reaches the stream, as a constant of the pass.

The model's weights do not require gradients during the pass (their ``requires_grad`` is restored after it), every
hook is removed and the attention implementation restored: the model is left as it was found.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..analysis import AnalysisUnavailable
from ..analysis.blocks import added_factor
from ..analysis.norms import _norm_form
from ..core.norms import is_norm
from ..spec.errors import ValueUnavailable
from ..spec.sourced import sourced
from .transcoders import Transcoders


class GraphUnavailable(AnalysisUnavailable):
    """An attribution graph that would not be exact on this family or these transcoders; the message says why."""


def _refuse(model, reason: str):
    raise GraphUnavailable(f"attribution_graph is unavailable on {model.family.name}: {reason}.")


@sourced
@dataclass(eq=False)
class ReplacementPass:
    """One pass of the replacement model on ``batch`` copies of the prompt (one per target of a backward pass).

    Per layer: ``inputs[l]`` the transcoder's input (in the autograd graph: a target feature's row is its gradient
    against the encoder's row), ``sites[l]`` the leaf the MLP's output is (a source's edge is the gradient there
    dotted with its vector), ``features[l]`` ``[seq, d_transcoder]`` and ``errors[l]`` ``[seq, d_model]`` (row 0
    zero), ``embeddings`` the token embeddings' leaf ``[batch, seq, d]``, ``readout`` the head's output at the
    last position ``[batch, vocab]`` (before any soft-cap or scaling the model applies after it: a logit row is
    the demeaned logit as it leaves the head), ``logits`` ``[1, vocab]`` the model's real logits at the last
    position (a copy, for one copy of the prompt)."""

    inputs: list[torch.Tensor]
    sites: list[torch.Tensor]
    features: list[torch.Tensor]
    pre_activations: list[torch.Tensor]
    errors: list[torch.Tensor]
    embeddings: torch.Tensor
    readout: torch.Tensor
    logits: torch.Tensor
    values: dict = field(default_factory=dict)


def _first_tensor(value):
    return value[0] if isinstance(value, (tuple, list)) else value


class _FrozenNorms:
    """Forward hooks that freeze every norm's scale at the pass's value (value unchanged, gradient linear)."""

    def __init__(self, model, skip_prefixes: tuple[str, ...]):
        self.model, self.handles, self.forms = model, [], {}
        for name, module in model._module.named_modules():
            if not is_norm(module) or any(name == p or name.startswith(p + ".") for p in skip_prefixes):
                continue
            self.handles.append(module.register_forward_hook(
                lambda m, args, kwargs, out, name=name: self.freeze(name, m, args, kwargs, out), with_kwargs=True))

    def freeze(self, name, module, args, kwargs, out):
        x = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        y = _first_tensor(out)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.shape != y.shape:
            _refuse(self.model, f"the norm {name} ({type(module).__name__}) does not map a stream to a stream of its "
                                "shape, so its scale cannot be frozen")
        if name not in self.forms:
            try:
                self.forms[name] = _norm_form(self.model, module, x.detach(), name)
            except AnalysisUnavailable as error:
                _refuse(self.model, f"its norm {name} cannot be frozen ({str(error).partition(': ')[2].rstrip('.')})")
        centred, offset = self.forms[name]
        dtype = torch.promote_types(x.dtype, torch.float32)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        gain = None if weight is None else weight.detach().to(dtype) + offset
        bias = None if bias is None else bias.detach().to(dtype)

        def linear(v):
            v = v.to(dtype)
            v = v - v.mean(-1, keepdim=True) if centred else v
            return v if gain is None else v * gain

        with torch.no_grad():  # the scale of this pass, per position: y = linear(x) / scale + bias
            u = linear(x)
            r = y.to(dtype) if bias is None else y.to(dtype) - bias
            numerator, denominator = (u * u).sum(-1, keepdim=True), (u * r).sum(-1, keepdim=True)
            scale = numerator / torch.where(denominator == 0, 1, denominator)
            scale = torch.where(denominator == 0, 1, scale)  # a flat input: no direction to pass on
            predicted = u / scale + (0 if bias is None else bias)
            far = (predicted - y.to(dtype)).abs().max() / y.to(dtype).abs().max().clamp(min=1e-30)
        if far > (1e-4 if torch.finfo(y.dtype).bits >= 32 else 3e-2):
            _refuse(self.model, f"its norm {name} ({type(module).__name__}) is not, in this pass, its input normed at "
                                f"one scale per position (relative difference {far.item():.2g}), so it cannot be frozen")
        frozen = linear(x) / scale  # the gradient of the norm at its frozen scale
        value = y.detach() + (frozen - frozen.detach()).to(y.dtype)  # y itself: an exact zero is added
        return (value, *out[1:]) if isinstance(out, tuple) else value

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _value(model, layer: int, key: str):
    owner, _, name = key.rpartition(".")
    where = getattr(model.layers[layer], owner) if owner else model.layers[layer]
    return getattr(where, name)


def _set_value(model, layer: int, key: str, tensor):
    owner, _, name = key.rpartition(".")
    where = getattr(model.layers[layer], owner) if owner else model.layers[layer]
    setattr(where, name, tensor)


def _key(model, layer: int, name: str) -> str:
    keys = [key for key in model.order(layer, aliases=True, where_present=True) if key.rpartition(".")[2] == name]
    if not keys:
        _refuse(model, f"block {layer} has no {name}")
    return keys[0]


def check_family(model, transcoders: Transcoders) -> None:
    """Refuse, with the reason, a model on which the replacement would not be exact."""
    from ..analysis import block_sum

    transcoders.check_fits(model)
    if model.family.stream_readout or model.family.before_final_norm or model.family.readout_unavailable:
        _refuse(model, "the model changes the last block's output before its head reads it")
    for layer in range(model.num_layers):
        try:
            block_sum(model, layer, "attribution_graph")
        except AnalysisUnavailable as error:
            _refuse(model, str(error).partition(": ")[2].rstrip("."))


def _check_patterns(model) -> None:
    for layer in range(model.num_layers):
        try:
            model.location(layer, "self_attn.attention_probabilities")
        except ValueUnavailable as error:
            _refuse(model, f"block {layer}'s token mixer has no attention pattern to freeze ({error.reason})")


@contextlib.contextmanager
def _attention_values_on(model):
    was_on = getattr(model, "_nnterp_attention_on", False)
    if not was_on:
        try:
            model.enable_attention_values()
        except ValueUnavailable as error:
            _refuse(model, f"its attention patterns cannot be read to be frozen ({error.reason})")
    try:
        yield
    finally:
        if not was_on:
            model.disable_attention_values()


@contextlib.contextmanager
def _no_weight_gradients(module: nn.Module):
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _site(model, layer: int, name: str):
    """``(module, location, factor)`` of value ``name`` of block ``layer``: a module boundary, where a hook reads it,
    and the factor the block multiplies the module's tensor by to give the value (Granite's contributions: 1
    elsewhere)."""
    location = model.location(layer, name)
    if location.op or any(type(view).__name__ not in ("Unflatten", "Times") for view in location.views):
        _refuse(model, f"block {layer}'s {name} is read inside a module's code or through a view, where a hook does "
                       "not reach it")
    return model._module.get_submodule(model.block_path(layer, location.path)), location, added_factor(model, layer, name)


def _as_stream(tensor: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, hidden]``: a module that runs on the tokens flattened (OPT's MLP) gives ``[batch * seq, ...]``."""
    return tensor.reshape(*ids.shape, -1)


class _Sites:
    """The hooks at each block's transcoder input (read, with its graph) and MLP output (replaced)."""

    def __init__(self, model, transcoders: Transcoders, ids: torch.Tensor):
        self.model, self.transcoders, self.ids = model, transcoders, ids
        self.inputs, self.pres, self.features, self.sites, self.errors = {}, {}, {}, {}, {}
        self.forms = {}
        self.handles = []
        for layer in range(model.num_layers):
            module, location, factor = _site(model, layer, transcoders.input_value)
            if factor != 1.0:
                _refuse(model, f"block {layer}'s {transcoders.input_value} is a product the block computes, not what "
                               "a module gives")
            if location.side == "output":
                self.handles.append(module.register_forward_hook(
                    lambda m, args, out, layer=layer, index=location.index: self.read(layer, _element(out, index), m)))
            else:
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, layer=layer, at=location: self.read(
                        layer, args[at.arg] if len(args) > at.arg else kwargs[at.kwarg], m), with_kwargs=True))
            module, location, factor = _site(model, layer, transcoders.output_value)
            if location.side != "output":
                _refuse(model, f"block {layer}'s {transcoders.output_value} is not a module's output")
            self.handles.append(module.register_forward_hook(
                lambda m, args, out, layer=layer, index=location.index, factor=factor: self.replace(
                    layer, out, index, factor)))

    def read(self, layer: int, x: torch.Tensor, module: nn.Module) -> None:
        x = _as_stream(x, self.ids)
        if self.transcoders.normalized_input:
            x = self.unweighted(layer, x, module)
        self.inputs[layer] = x
        pre = self.transcoders.pre_activation(layer, x[0]).detach()
        pre[0] = 0  # circuit-tracer: position 0 never has active features
        self.pres[layer] = pre
        self.features[layer] = self.transcoders.activate(layer, pre)

    def unweighted(self, layer: int, y: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """TransformerLens's ``hook_normalized``: the norm's output with its weight (as it applies it: Gemma's
        ``1 + w``) and its bias undone."""
        if layer not in self.forms:
            try:
                self.forms[layer] = _norm_form(self.model, norm, y.detach(), f"block {layer}'s MLP norm")
            except AnalysisUnavailable as error:
                _refuse(self.model, f"the transcoders read ln2.hook_normalized, and {str(error).partition(': ')[2]}")
        offset = self.forms[layer][1]
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if bias is not None:
            y = y - bias.detach()
        if weight is not None:
            gain = weight.detach() + offset
            if not gain.all():
                _refuse(self.model, f"block {layer}'s MLP norm has a zero weight, so its normalized input "
                                    "(ln2.hook_normalized) cannot be read off its output")
            y = y / gain
        return y

    def replace(self, layer: int, out, index: int, factor: float = 1.0):
        """The MLP's output replaced by the site; ``factor``: the block adds the module's output times it (Granite),
        so the transcoder's output and the site are the product, handed back through it."""
        if layer not in self.inputs:
            _refuse(self.model, f"block {layer}'s {self.transcoders.output_value} comes before its "
                                f"{self.transcoders.input_value}")
        value = _element(out, index)
        own = _as_stream(value, self.ids)
        stream = own * factor if factor != 1.0 else own
        x = self.inputs[layer]
        decoded = self.transcoders.decode(layer, [self.features.get(i) for i in range(layer + 1)])
        skip = self.transcoders.skip(layer, x)
        skip_value = skip.detach() if isinstance(skip, torch.Tensor) else 0
        error = stream.detach() - decoded - skip_value  # what the transcoder misses: the error node
        # the output keeps the model's own value (decoded + skip + error, exactly that sum): the site is a leaf
        # (the gradient there dotted with a source's vector is its edge), and the skip path (an exact zero in value)
        # is the MLP's only gradient; the MLP's own computation is cut off
        site = stream.detach().clone().requires_grad_(True)
        # (never the leaf itself: a block may add to its MLP's output in place, as Falcon's parallel blocks do)
        replaced = site + (skip - skip_value) if isinstance(skip, torch.Tensor) else site.clone()
        node = error[0].clone()
        node[0] = 0  # circuit-tracer: no error node at position 0
        self.sites[layer], self.errors[layer] = site, node
        if factor != 1.0:  # the block multiplies what it is handed: its own tensor, the site's gradient through it
            handed = replaced / factor
            replaced = own.detach() + (handed - handed.detach())
        replaced = replaced.reshape(value.shape)
        if isinstance(out, tuple):
            return (*out[:index], replaced, *out[index + 1:])
        return replaced

    def remove(self):
        for handle in self.handles:
            handle.remove()


# autograd's nodes of functions that are not linear in their input: on a path from a source to a target, the
# replacement would not be the linear map its edges describe
NONLINEAR = ("Softmax", "LogSoftmax", "Rsqrt", "Sqrt", "Pow", "Exp", "Log", "Tanh", "Sigmoid", "Gelu", "Silu", "Relu",
             "Threshold", "Elu", "Softplus", "Abs", "Sign", "Clamp", "Max", "Min", "Erf", "Sin", "Cos", "Reciprocal",
             "NativeLayerNorm", "NativeGroupNorm", "Norm", "LinalgVectorNorm", "Var", "Std", "Hardtanh", "Mish")
PRODUCTS = ("Mul", "Div", "Mm", "Bmm", "Matmul", "Baddbmm", "Addbmm", "Addcmul", "Addcdiv", "Einsum", "Dot")


def _not_linear(roots: list[torch.Tensor]) -> str | None:
    """The first autograd node between the leaves and ``roots`` that is not linear in the varying tensors it reads
    (a nonlinear function, or a product or quotient of two varying tensors), as ``"name"``; None where there is none.
    A product's factor that is constant (a weight, a frozen scale, a detached pattern) has no autograd input."""
    seen, stack = set(), [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__.removesuffix("Backward0").removesuffix("Backward1").removesuffix("Backward")
        varying = [fn for fn, _ in node.next_functions if fn is not None]
        if name in NONLINEAR or (name in PRODUCTS and len(varying) > 1):
            return type(node).__name__
        stack.extend(varying)
    return None


def _element(out, index: int):
    return out[index] if isinstance(out, (tuple, list)) else out


def replacement_pass(model, input_ids: torch.Tensor, transcoders: Transcoders, batch: int = 1,
                     reads: tuple[tuple[int, str], ...] = (), linear: tuple[tuple[int, str], ...] = ()) -> ReplacementPass:
    """The replacement model on ``batch`` copies of ``input_ids`` (``[seq]``), with its autograd graph kept.
    ``reads``: ``(layer, value name)`` pairs of values before the block's pattern, in forward order, read in the pass
    (``values``); those also in ``linear`` are proven linear in the stream with the targets."""
    import warnings

    check_family(model, transcoders)
    if not model.dispatched:  # the real weights first: dispatching swaps the modules the hooks go on
        model.dispatch()
    hf = model._module
    n = model.num_layers
    ids = input_ids.reshape(1, -1).repeat(batch, 1)
    mlp_paths = tuple(model.block_path(layer, model.location(layer, transcoders.output_value).path)
                      for layer in range(n))
    captured: dict[str, torch.Tensor] = {}
    values: dict[tuple[int, str], torch.Tensor] = {}

    def embeddings_leaf(module, args, out):
        captured["embeddings"] = out.detach().requires_grad_(True)
        return captured["embeddings"]

    def last_position(module, args):  # the head reads the last position only: logits [batch, 1, vocab]
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            _refuse(model, f"its head ({type(module).__name__}) does not read a [batch, seq, hidden] stream")
        return (args[0][:, -1:], *args[1:])

    def readout(module, args, out):  # sliced here, in grad mode: the view keeps its place in autograd's graph
        captured["readout"] = _first_tensor(out)[:, -1]

    with contextlib.ExitStack() as stack:
        stack.enter_context(_attention_values_on(model))
        _check_patterns(model)
        patterns = [_key(model, layer, "attention_probabilities") for layer in range(n)]
        stack.enter_context(_no_weight_gradients(hf))
        norms = _FrozenNorms(model, mlp_paths)  # first: the hooks below read the norms' frozen outputs
        stack.callback(norms.remove)
        sites = _Sites(model, transcoders, ids)
        stack.callback(sites.remove)
        head = hf.get_output_embeddings()
        handles = [hf.get_input_embeddings().register_forward_hook(embeddings_leaf),
                   head.register_forward_pre_hook(last_position), head.register_forward_hook(readout)]
        stack.callback(lambda: [handle.remove() for handle in handles])
        stack.enter_context(torch.enable_grad())
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*carries a forward (pre-)?hook.*")
        with model.trace(ids):
            for layer, key in enumerate(patterns):  # circuit-tracer: attention patterns are constants of the pass
                for read in [read for read in reads if read[0] == layer]:  # before the pattern, in forward order
                    values[read] = _value(model, layer, _key(model, layer, read[1])).save()
                _set_value(model, layer, key, _value(model, layer, key).detach())
            logits = model.logits[:1, -1].detach().clone().save()  # a copy: no view of the batch's logits
    missing = [layer for layer in range(n) if layer not in sites.sites]
    if missing:
        _refuse(model, f"the MLP output of block {missing[0]} was not computed in the pass")
    inputs = [sites.inputs[i] for i in range(n)]
    found = _not_linear([*inputs, captured["readout"], *(values[read] for read in linear)])
    if found:
        _refuse(model, f"with its attention patterns and norm scales frozen and its MLPs replaced, the model still "
                       f"computes a function that is not linear in the stream ({found} in autograd's graph: a gate, "
                       "an activation or a norm nnterp does not freeze), so the direct effects would not add up")
    return ReplacementPass(inputs, [sites.sites[i] for i in range(n)],
                           [sites.features[i] for i in range(n)], [sites.pres[i] for i in range(n)],
                           [sites.errors[i] for i in range(n)], captured["embeddings"], captured["readout"], logits,
                           dict(values))


