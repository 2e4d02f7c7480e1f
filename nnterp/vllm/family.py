"""The vocabulary of a placement of the standard values in vLLM's code: a family's entry (``VLLMFamily``) and the
places a value has besides the core's ``At``: the fused stream (``FusedStream``), the values vLLM's attention kernel
never materializes (``FromKernel``). The entries themselves are ``nnterp.vllm.places`` (vLLM's own model code) and
``nnterp.vllm.backend`` (its Transformers backend)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec.catalog import value_named
from ..spec.errors import ValueUnavailable
from ..spec.locations import At

FUSED, PLAIN = "fused", "plain"


@dataclass(frozen=True)
class FusedStream:
    """The stream of a fused block between its sublayers: elements ``parts`` of a boundary (outputs, or positional
    inputs) added, the first alone where the second is None (block 0's residual). Read as their sum, written back as
    ``(0, stream)`` (``nnterp.vllm.stream``)."""

    path: str
    side: str  # "input" | "output"
    parts: tuple[int, int] = (0, 1)
    copy = shared = heads = False  # as an ``At`` says them: the stream is a new tensor, handed back as a whole
    views = ()  # read as [1, tokens, width], the stream's own layout

    def describe(self) -> str:
        where = (self.path or "<block>") + "." + self.side
        kind = "output" if self.side == "output" else "input"
        return f"{where} {kind}s {list(self.parts)} added (the fused stream: written back as (0, stream))"


@dataclass(frozen=True)
class FromKernel:
    """A value vLLM's attention kernel computes and never materializes (the scores, the probabilities): recomputed
    from the queries and keys entering the kernel's module ``path`` (``Attention(q, k, v)``), with the kernel's own
    scale, softcap, sliding window, ALiBi slopes and causal mask (``nnterp.vllm.attention``). Read-only."""

    path: str
    side = "input"  # read at the kernel's input
    copy = shared = heads = False
    views = ()

    def describe(self) -> str:
        return (f"recomputed from {self.path}.input (the queries and keys entering vLLM's attention kernel) with "
                "its scale, softcap, sliding window, ALiBi and causal mask: read-only, on the prompt's pass")


Place = At | FusedStream | FromKernel  # where a value is read in vLLM's code


@dataclass(frozen=True)
class VLLMFamily:
    """One family in vLLM's code: the module paths (from the causal LM root), the block shape, and each standard
    value's place on a block (or why it has none)."""

    name: str
    shape: str  # FUSED | PLAIN
    values: dict[str, Place]  # in forward order: the order run_with_cache and collect read them in
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    ln_final: str = "model.norm"
    attention: str = "self_attn"
    # the MLP module, relative to a block; None where its layers sit on the block (OPT): ``layers[i].mlp`` is then
    # the block itself, which holds the MLP's values too
    mlp: str | None = "mlp"
    unavailable: dict[str, str] = field(default_factory=dict)
    # vLLM's model classes ("<module>.<Class>" under vllm.model_executor.models) whose code these places describe:
    # a checkpoint is served only where vLLM's registry resolves its architecture to one of them
    classes: tuple[str, ...] = ()
    # the config values vLLM's code for the family assumes: a config with others is refused before any engine starts
    requires: dict[str, object] = field(default_factory=dict)
    # transformers' own modules (vLLM's Transformers backend, ``nnterp.vllm.backend``): activations are
    # [1, tokens, ...] per request, as on transformers, and the values are read and written by the core's ``At``
    batched: bool = False

    def reason(self, name: str) -> str:
        """Why the standard value ``name`` has no place in vLLM's code for this family."""
        return self.unavailable.get(name, "it has no place in vLLM's code for this family")

    def refusal(self, name: str) -> ValueUnavailable:
        """The error reading the value ``name`` raises on this family, with its reason."""
        return ValueUnavailable(value_named(name).key, f"{self.name} (vLLM)", self.reason(name))

    def rename(self) -> dict[str, str]:
        """nnsight aliases giving the standard module names (``model.layers``, ``layers[i].self_attn``, ...)."""
        names = {self.layers: "layers", self.embed_tokens: "embed_tokens", self.ln_final: "ln_final"}
        top = self.layers.partition(".")[0]
        if top != "model":
            names[top] = "model"
        if self.mlp is not None and self.mlp != "mlp":
            names[self.mlp] = "mlp"
        if self.attention != "self_attn":  # a one-name key binds on every block (GPT-2's attention's own `attn` too)
            names[self.attention] = "self_attn"
        return names
