"""What a family spec is: data that places every standard value on a block.

A ``Family`` says where the blocks, the final norm and the head live, and, for each
block, a ``Block``: the location of every catalog value (or why it is unavailable)
and the residual identity in the code's own order of addition. The engine reads
nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from ..spec.attention import STANDARD, WITH_SINKS, EagerAttention
from ..spec.catalog import ADDED, ATTENTION_INTERNALS, CATALOG, QK_NORM_VALUES
from ..spec.identity import SEQUENTIAL, A, Custom, Expr, Identity, M, Plus, PostNorm, Scaled, Sum, Terms, X, native
from ..spec.locations import At, Location, SameAs, Unavailable, input, output
from ..spec.sourced import sourced
from ..spec.views import HeadsFirst, HeadWidth, Times


class FrozenDict(dict):
    """A dict that cannot change, so that a spec holding one is hashable (a block's ``{value name: location}``, a
    variant's config changes)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self):
        return FrozenDict, (dict(self),)

    def _unchanged(self, *args, **kwargs):
        raise TypeError("a spec does not change: build another one (dataclasses.replace)")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _unchanged  # type: ignore


NO_QK_NORM = ("the family's attention norms no queries or keys of its own before using them (no query or key norm), "
              "or nnterp places none on this family yet")


def is_norm_path(path: str) -> bool:
    """Whether a module's name says it is a norm (``post_attention_layernorm``, ``post_norm1``)."""
    return "norm" in path.rpartition(".")[2].lower()


def _resolved(values: dict, name: str):
    location, seen = values.get(name), {name}
    while isinstance(location, SameAs) and location.name not in seen:
        seen.add(location.name)
        location = values.get(location.name)
    return location


def where_present_defaults(values: dict) -> dict[str, Location]:
    """The places of the ``WHERE_PRESENT`` values a block spec does not give: the q/k norms' values unavailable
    (with the attention's reason where it has none); a contribution before its norm the input of the norm whose output
    it is, else the contribution itself; the router's logits
    unavailable (not placed on a routed mixture, no router on a dense MLP); the activation's input the input of
    the module whose output is ``mlp_activation``, where that is a plain module output."""
    defaults: dict[str, Location] = {}
    attention = _resolved(values, "attention_premix")
    no_attention = attention if isinstance(attention, Unavailable) else None
    for name in QK_NORM_VALUES:
        defaults[name] = no_attention or Unavailable(NO_QK_NORM)
    for name in ("attention_output", "mlp_output"):
        where = _resolved(values, name)
        # a contribution read as the output of a norm after its sublayer (a sandwich block): before the norm, it is
        # what the norm reads (the proof checks that no other contribution is a norm's output)
        after_norm = isinstance(where, At) and where.side == "output" and not where.op and is_norm_path(where.path)
        defaults[f"{name}_before_norm"] = At(where.path, "input") if after_norm else SameAs(name)
    mlp = _resolved(values, "mlp_output")
    activation = _resolved(values, "mlp_activation")
    if isinstance(mlp, Unavailable):
        defaults["router_logits"] = mlp
    elif activation is ROUTED:
        defaults["router_logits"] = Unavailable("a routed mixture whose router nnterp does not place on this family "
                                                "yet: read the router module's output natively")
    else:
        defaults["router_logits"] = Unavailable("a dense MLP: no router")
    defaults["mlp_up_output"] = activation if isinstance(activation, Unavailable) else Unavailable(
        "no up projection multiplies the activation here (an MLP that is not gated), or nnterp does not place it on "
        "this family yet")
    if isinstance(activation, Unavailable):
        defaults["mlp_pre_activation"] = activation
    elif (isinstance(activation, At) and activation.side == "output" and not activation.op and activation.path
          and not (activation.copy or activation.join or activation.shared or activation._fresh)):
        # an activation is elementwise: its input has its output's shape, read through the same views
        defaults["mlp_pre_activation"] = At(activation.path, "input", views=activation.views)
    else:
        where = activation.describe() if isinstance(activation, At) else "no module"
        defaults["mlp_pre_activation"] = Unavailable(
            f"the activation is read at {where}, not a module's output, so its input is not placed on this family "
            "yet")
    return defaults


@sourced
@dataclass(frozen=True)
class Block:
    """One block shape: every catalog value placed, and the identity that ties them.

    ``mixer_output`` is the same place as ``attention_output`` unless the spec places it (a hybrid's
    blocks that mix tokens with something else than attention: ``families.hybrid``).
    ``identity`` (``nnterp.spec.identity``: a ``Sum``, a ``PostNorm`` or a ``Custom``) recomputes ``layer_output``
    from the values (and the ``extra`` tensors, read like values) in the order the model's code adds them, and
    gives the formula shown for it; ``ulps`` is 0 where the plain sum ``layer_input + attention_output +
    mlp_output`` is exact, else how far it is (in ulps of the block's dtype).
    """

    values: dict[str, Location]
    identity: Identity
    extra: dict[str, At] = field(default_factory=dict)
    ulps: int = 0

    def __post_init__(self):
        if "mixer_output" not in self.values:  # a block whose token mixer is its attention
            object.__setattr__(self, "values", {**self.values, "mixer_output": SameAs("attention_output")})
        object.__setattr__(self, "values", {**where_present_defaults(self.values), **self.values})
        object.__setattr__(self, "values", FrozenDict(self.values))
        object.__setattr__(self, "extra", FrozenDict(self.extra))
        structural = {v.name for v in CATALOG} - set(ATTENTION_INTERNALS)  # the engine places the internals
        missing = structural - set(self.values)
        unknown = set(self.values) - {v.name for v in CATALOG}
        if missing or unknown:
            raise ValueError(f"block spec: missing values {sorted(missing)}, unknown values {sorted(unknown)}")

    def resolve(self, name: str) -> At | Unavailable:
        location = self.values[name]
        seen = {name}
        while isinstance(location, SameAs):
            if location.name in seen:
                raise ValueError(f"SameAs cycle through {sorted(seen)}")
            seen.add(location.name)
            location = self.values[location.name]
        return location

    @property
    def formula(self) -> str:
        """The identity, for people: what the family's page shows, from the same declaration the proof runs."""
        return self.identity.formula

    def combine(self, terms: Terms, block: torch.nn.Module) -> torch.Tensor:
        """``layer_output`` recomputed from the values, in the code's order of addition."""
        return self.identity.combine(terms, block)

    @property
    def mid(self) -> Callable[[Terms, torch.nn.Module], torch.Tensor] | None:
        """``layer_mid`` recomputed from the values, where the identity is not a sum that says it (a cast before the
        add, a stream that restarts or is moved rather than added to, a norm after the add); None otherwise."""
        return self.identity.mid


@sourced
@dataclass(frozen=True, kw_only=True)
class Family:
    """A decoder family: module paths, the block spec(s) and a tiny test config.

    Every field is given by name. The module paths default to Llama's layout (``model.layers``,
    ``model.embed_tokens``, ``model.norm``, ``self_attn``, ``mlp``, ``lm_head``): a spec names the ones its
    family moves (a path that is not in the model fails the proof, naming what is there)."""

    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"  # the ModuleList of blocks, from the *ForCausalLM root
    embed_tokens: str = "model.embed_tokens"
    # the final norm; None where the head reads the last block's output directly (OpenAI GPT)
    ln_final: str | None = "model.norm"
    # the attention module, relative to a block; None where no block has one (recurrent)
    attention: str | None = "self_attn"
    # the MLP module, relative to a block; None where its layers sit on the block (OPT), or where no block has an
    # MLP (a block with no MLP has its MLP values unavailable: then ``layers[i].mlp`` is, with their reason).
    # ``attention`` and ``mlp`` name the same module where it is the attention on some blocks and the MLP on others
    # (Nemotron-H's ``mixer``): ``sublayer_classes`` then says which by the module's class
    mlp: str | None = "mlp"
    block: Callable[[PretrainedConfig, int], Block]
    tiny_config: Callable[[], PretrainedConfig]
    lm_head: str = "lm_head"
    check_config: Callable[[PretrainedConfig], None] = lambda config: None
    # where the model's eager attention computes queries, keys, scores and probabilities (``.source``
    # operations), or why the values inside the attention are unavailable
    # (or a function of the config giving either)
    attention_internals: EagerAttention | Unavailable | Callable[[PretrainedConfig], EagerAttention | Unavailable] = STANDARD
    # why attention_premix is not attention_probabilities · values, where it is not (None: it is)
    premix_is_not_mixed_values: str | None = None
    # the readout after the last block: a module that collapses parallel streams before the final
    # norm (DeepSeek-V4's hc_head), and what the model does to the head's output (softcapping, scales)
    stream_readout: str | None = None
    # what a skipped block returns, given the stream and the block's envoy (None: the stream itself)
    skip_output: Callable | None = None
    logits_transform: Callable[[torch.Tensor, PretrainedConfig], torch.Tensor] | None = None
    # what the model does to the normed stream before the head (MiniCPM3 divides it by logits_scaling)
    head_input_transform: Callable[[torch.Tensor, PretrainedConfig], torch.Tensor] | None = None
    # the number of query heads of block i, where the layers' attentions differ (Inkling's sliding-window layers);
    # None: the config's per-layer values where it has them (``per_layer_config``, ``num_attention_heads_per_layer``)
    heads: Callable[[PretrainedConfig, int], int] | None = None
    # where the head is several modules: the one the model runs after ``lm_head`` to project on the vocabulary
    # (ModernBERT-decoder's ``decoder``, after its prediction head ``lm_head``)
    vocab_projection: str | None = None
    # what the model does to the last block's output before the final norm, given the stream and the causal LM
    # module (None: a stream of another dtype than the norm's weight is cast to it, as ZAYA's model does)
    before_final_norm: Callable[[torch.Tensor, torch.nn.Module], torch.Tensor] | None = None
    # the configurations whose blocks differ, for the documentation: (label, changes to the tiny config),
    # the test config first with no changes; empty where every config of the family has the same blocks
    variants: tuple[tuple[str, dict], ...] = ()
    # where the causal LM's weights are in the checkpoints of the type, when transformers does not rename them for it
    # (an image-text checkpoint keeps its text model under a prefix): (pattern, replacement) pairs that loading by
    # name passes as ``key_mapping``
    checkpoint_keys: tuple[tuple[str, str], ...] = ()
    # {module class: "self_attn" or "mlp"} (a function giving it, imported when asked): where one native name holds
    # a different sublayer from block to block, the standard name binds by the class of the module a block holds
    sublayer_classes: Callable[[], dict[type, str]] | None = None
    # the blocks in the order one forward pass calls them, where some run more than once (a looped section, as in
    # Dory): a function of the (text) config giving block indices; None: every block once, in order. A block that
    # runs several times serves its values per run (``layers[i].run(k)``)
    schedule: Callable[[PretrainedConfig], tuple[int, ...]] | None = None
    # further block lists, whose blocks follow those of ``layers`` in ``model.layers`` (HRM-Text's two stacks)
    stacks: tuple[str, ...] = ()
    # why no stream can be read out as the model reads its last block's output (a readout that mixes earlier blocks'
    # outputs in too): project_on_vocab and the logit lens refuse with it; None: they read out through the head
    readout_unavailable: str | None = None
    # a module the model runs on the normed stream before the head (OPT's project_out, where word_embed_proj_dim is
    # not hidden_size); None: the head reads the final norm's output (or the last block's, with no final norm)
    head_input: str | None = None
    # the fields of this spec that differ on one (text) config, where the modules around the blocks depend on it (OPT:
    # no final norm on a post-norm config, project_out where the embeddings are narrower than the stream); None: none
    per_config: Callable[[PretrainedConfig], dict] | None = None

    def __post_init__(self):
        object.__setattr__(self, "variants", tuple((label, FrozenDict(changes)) for label, changes in self.variants))

    @property
    def block_lists(self) -> tuple[str, ...]:
        """Every ModuleList of blocks, in the order their blocks are numbered."""
        return (self.layers, *self.stacks)

    def attention_of(self, config: PretrainedConfig) -> EagerAttention | Unavailable:
        """Where the attention internals are read on a model with this (text) config, or why they are unavailable."""
        spec = self.attention_internals
        return spec if isinstance(spec, (EagerAttention, Unavailable)) else spec(config)

    def rename(self) -> dict[str | type, str | list[str]]:
        """nnsight aliases that give every family the same module names (``model.layers`` too: the backbone
        is ``model`` on every family, and its blocks ``model.layers``)."""
        shared = self.attention == self.mlp  # one native name, a different sublayer per block: bound by class
        names: dict[str | type, str | list[str]] = {
            self.layers: "layers",
            self.embed_tokens: "embed_tokens",
            **({self.ln_final: "ln_final"} if self.ln_final else {}),
            **({self.attention: "self_attn"} if self.attention and not shared else {}),
            self.lm_head: "lm_head",
            **({self.mlp: "mlp"} if self.mlp and not shared else {}),
            **(self.sublayer_classes() if self.sublayer_classes else {}),
        }
        backbone, _, last = self.layers.rpartition(".")
        top = backbone.partition(".")[0]
        if top and top != "model":
            names[top] = "model"
        if top and (backbone != top or last != "layers"):
            names[self.layers] = ["layers", f"{top}.layers"]  # a dotted alias binds on the envoy its prefix names
        return {native: alias for native, alias in names.items() if native != alias}


def stream_and_none(stream, block):
    """A skipped block of a family whose blocks return ``(hidden, extra)`` and whose model reads ``[0]``."""
    return (stream, None)


def softcap_logits(logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """Gemma's final-logit softcapping, ``tanh(logits / cap) * cap``, in the model's order."""
    cap = config.get_text_config().final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


# -- shared shapes ----------------------------------------------------------------


def pre_norm_block(
    *,
    input_norm: str,
    attention: str,
    o_proj: str,
    post_norm: str,
    mlp: str,
    act: str,
    down_proj: str,
    up: str | Location | None = None,
    identity: Identity = SEQUENTIAL,
    ulps: int = 0,
    **overrides: Location,
) -> Block:
    """The sequential pre-norm block, ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``.

    ``overrides`` place the values a family reads elsewhere (or marks unavailable). ``up``: a gated MLP's up
    projection, whose output the activation's multiplies (a module path, or a location).
    """
    values = {
        "layer_input": input("", arg=0),
        "attention_norm_output": output(input_norm),
        "attention_premix": input(o_proj, heads=True),
        "attention_output": output(attention, index=0),
        "layer_mid": input(post_norm, shared=True),  # also the residual of the MLP add
        "mlp_norm_output": output(post_norm),
        "mlp_input": input(mlp),
        "mlp_activation": output(act),
        "mlp_neurons": input(down_proj),
        "mlp_output": output(mlp, index=0),
        "layer_output": output("", index=0),
        **({"mlp_up_output": output(up) if isinstance(up, str) else up} if up else {}),
    }
    return Block(
        values={**values, **overrides},
        identity=identity,
        ulps=ulps,
    )


def post_norm_block(*, first_norm: str, second_norm: str, attention: str, o_proj: str, mlp_input: Location,
                    mlp_activation: Location, mlp_neurons: Location, mlp_output: Location, why: str = "") -> Block:
    """A post-norm block, ``n = first_norm(x + attn(x)); y = second_norm(n + mlp(n))``: the norms are in the identity
    (recomputed with their own forward), ``layer_mid`` is ``n``, which the MLP reads and the second add adds to, and
    no norm sits before either sublayer. ``mlp_input`` should be a copy of ``n`` handed to the MLP alone
    (``copy=True``): an edit of it reaches the MLP, one of ``layer_mid`` the stream too. ``why`` names the config
    that makes the block post-norm, in the reasons."""
    post_norm = f"a post-norm block{why}"
    return Block(
        values={
            "layer_input": input("", arg=0),
            "attention_norm_output": Unavailable(
                f"{post_norm}: the attention reads layer_input itself, and the block norms the stream after the "
                f"attention's add ({first_norm}, whose output is layer_mid)"),
            "attention_premix": input(o_proj, heads=True),
            "attention_output": output(attention, index=0),
            "layer_mid": output(first_norm),
            "mlp_norm_output": Unavailable(
                f"{post_norm}: no norm sits on the MLP's branch alone; the MLP reads the stream after {first_norm} "
                "(layer_mid), which is also the residual of the MLP's add"),
            "mlp_input": mlp_input, "mlp_activation": mlp_activation, "mlp_neurons": mlp_neurons,
            "mlp_output": mlp_output,
            "layer_output": output("", index=0),
        },
        identity=PostNorm(first_norm, second_norm),  # the proof checks layer_mid is the first norm's output
    )


def added_times(block: Block, factor: str) -> Block:
    """``block``, whose code adds each contribution to the stream times the block attribute ``factor`` (Granite's
    ``residual_multiplier``), with its contributions read as the products the stream receives (the ``Times`` view:
    live, an edit handed back through the factor) and its identity the plain sum of its spec without the factor.
    The module's own output stays at its native path (``layers[i].self_attn.output[0]``)."""
    def unscaled(node: Expr) -> Expr:
        if isinstance(node, Plus):
            return Plus(unscaled(node.left), unscaled(node.right))
        if isinstance(node, Scaled) and node.by == factor and node.how == "value * factor":
            return node.of
        return node

    if not isinstance(block.identity, Sum):
        raise ValueError(f"added_times rewrites a Sum identity, not {type(block.identity).__name__}")
    scaled = times(block, **dict.fromkeys(ADDED, factor))
    return dataclasses.replace(scaled, identity=dataclasses.replace(block.identity, tree=unscaled(block.identity.tree)))


def times(block: Block, **factors: str) -> Block:
    """``block`` with each value named in ``factors`` that is read at a location read as the product of that location's
    tensor and the block attribute given (the ``Times`` view): what the block's code adds to the stream."""
    values = {name: dataclasses.replace(where, views=(*where.views, Times(factors[name])))
              if name in factors and isinstance(where, At) else where for name, where in block.values.items()}
    return dataclasses.replace(block, values=values)


def qk_norms(attention: str = "self_attn", q: str = "q_norm", k: str = "k_norm", width: int | None = None,
             heads_first: bool = False) -> dict[str, At]:
    """The inputs and outputs of an attention's query and key norms (modules ``q`` and ``k`` of ``attention``),
    per head. ``width``: where the norms read a projection's whole output (``[batch, seq, heads * width]``, OLMo-2),
    a head's width, to view them per head; None where they read it per head already (Qwen3), ``heads_first``
    where that is ``[batch, heads, seq, head_dim]`` (Gemma-3)."""
    views = (HeadWidth(width),) if width else (HeadsFirst(),) if heads_first else ()
    return {f"{which}_norm_{side}": At(f"{attention}.{module}", side, views=views)
            for which, module in (("query", q), ("key", k)) for side in ("input", "output")}


def shared_kv_qk_norms(config: PretrainedConfig, i: int) -> dict[str, Location]:
    """The q/k norms of a family whose layers ``kv_sharing_modes[i] == "reuse"`` take the keys of an earlier layer
    (Gemma-3n, Gemma-4), each head's ``[batch, seq, heads, head_dim]``: on those layers the key norm is not run."""
    norms: dict[str, Location] = dict(qk_norms())
    if config.kv_sharing_modes[i] == "reuse":
        why = Unavailable("this layer reuses the keys of an earlier layer (kv_sharing_modes 'reuse'): it has no key "
                          "projection or key norm of its own")
        norms |= {"key_norm_input": why, "key_norm_output": why}
    return norms


def router(path: str, op: str = "F_linear_0") -> dict[str, At]:
    """A routed mixture's router logits, over the tokens flattened or not: the output of the operation ``op`` of its
    router's forward (``path``) that computes them, before the router chooses from them, so an edit of them reaches
    the choice (as it does on vLLM, whose experts choose from the router's output); ``op=""``: the output of the
    module at ``path`` (a linear layer the router calls)."""
    return {"router_logits": At(path, "output", op=op, unflatten=True)}


def head_dim(config: PretrainedConfig) -> int:
    """A head's width: the config's ``head_dim``, else the stream's width over the heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


OWN_ATTENTION = Unavailable(
    "this family computes attention in its own code, outside transformers' attention interface, so its queries, "
    "keys, scores and probabilities are not at any module boundary"
)

PARALLEL_NO_MID = Unavailable(
    "a parallel block: the attention and the MLP both read the block input, so no stream exists between them"
)


def parallel_block(*, input_norm: str, attention: str, o_proj: str, mlp: str, act: str, down_proj: str,
                   order: str, mlp_norm: str | None = None, up: str | None = None, **overrides: Location) -> Block:
    """A parallel block, ``y = x + attn(norm(x)) + mlp(norm'(x))``, summed in the code's ``order``.

    ``order`` is one of ``"(a + m) + x"``, ``"(m + a) + x"``, ``"(x + a) + m"``. With one shared
    norm (``mlp_norm`` None) ``mlp_norm_output`` is ``attention_norm_output``. The plain sum
    ``layer_input + attention_output + mlp_output`` is within one ulp of ``layer_output``.
    """
    sums = {"(a + m) + x": (A + M) + X, "(m + a) + x": (M + A) + X, "(x + a) + m": (X + A) + M}
    return pre_norm_block(
        input_norm=input_norm, attention=attention, o_proj=o_proj, post_norm=mlp_norm or input_norm, mlp=mlp,
        act=act, down_proj=down_proj, up=up,
        identity=Sum(sums[order]),
        ulps=0 if order == "(x + a) + m" else 1,
        layer_mid=PARALLEL_NO_MID,
        # one norm feeds both sublayers: what the MLP receives is read as a copy swapped in for the MLP alone,
        # so an edit (or a gradient) of mlp_input is the MLP's, not the attention's too
        **({"mlp_norm_output": SameAs("attention_norm_output"), "mlp_input": input(mlp, copy=True)}
           if mlp_norm is None else {}),
        **overrides,
    )


ROUTED = Unavailable(
    "a routed mixture of experts: each token runs its own experts, so there is no single activation tensor"
)


__all__ = ["qk_norms", "shared_kv_qk_norms", "router", "head_dim", "OWN_ATTENTION", "STANDARD", "native", "Sum", "PostNorm", "Custom", "X", "A", "M", "SEQUENTIAL", "post_norm_block", "WITH_SINKS", "EagerAttention", "Block", "Family", "pre_norm_block", "parallel_block", "PARALLEL_NO_MID", "ROUTED", "At", "SameAs", "Unavailable", "input", "output"]
