"""The proof of a family spec: the residual identity and the values' shapes, checked per block.

Part of the core: it works on a wrapped model (or wraps a miniature with the class it is given)
and imports nothing above it. ``nnterp.core.validation`` is its public face.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, cast

import nnsight
import torch

from ..families import Proving, family_of, for_config
from ..families.base import ROUTED
from ..spec.catalog import ADDED, BY_NAME, CATALOG, IDENTITY_TERMS, STREAM
from ..spec.errors import NNterpError
from ..spec.fingerprint import fingerprint
from ..spec.identity import SEQUENTIAL, Name, Scaled, Sum, addends, evaluate, names_in
from ..spec.locations import At, SameAs
from ..spec.selection import block_calls
from ..spec.sourced import sourced
from ..version import __version__
from .cache import cache_root
from .miniature import build_miniature, miniature_config, quiet_transformers


@sourced
@dataclass(frozen=True)
class IdentityResult:
    layer: int
    formula: str
    exact: bool  # the family's formula, in the code's order of addition, gives layer_output bit for bit
    max_abs_diff: float
    run: int | None = None  # the run of a block that runs several times per pass

    def __str__(self) -> str:
        status = "exact" if self.exact else f"MISMATCH (max |diff| {self.max_abs_diff:.3g})"
        return f"{_label(self.layer, self.run)}: {self.formula}: {status}"


def _label(layer: int, run: int | None) -> str:
    return f"layer {layer}" + ("" if run is None else f" (run {run})")


def read_blocks(model, inputs, names=None, remote: bool | str = False) -> list[dict[str, torch.Tensor]]:
    """One trace reading, per block call in forward order (``model.schedule``: per block, where each runs once),
    the values named (all, with None) and the identity extras."""
    calls = block_calls(model, None)
    with torch.no_grad(), model.trace(inputs, remote=remote):
        read = nnsight.save([{} for _ in calls])
        for n, (i, run) in enumerate(calls):
            for _, key, location in model.timeline(i):
                name = key.rpartition(".")[2]
                if names is None or key.startswith("extra.") or name in names:
                    read[n][name] = model.read_at(i, location, run=run)
    return read


def identity_of(model, layer: int, values: dict[str, torch.Tensor], run: int | None = None) -> IdentityResult:
    """Recompute block ``layer``'s output from its values with the family's formula, and compare."""
    return IdentityResult(layer, model.block_spec(layer).formula, *_recompute(model, layer, values), run)


def _recompute(model, layer: int, values: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(exact, max |diff|): plain data, so it travels back from a remote run."""
    recomputed = model.block_spec(layer).combine(values, model.layers[layer]._module)
    diff = (recomputed.float() - values["layer_output"].float()).abs().max().item()
    return torch.equal(recomputed, values["layer_output"]), diff


def check_identity(model, inputs=None, remote: bool | str = False) -> list[IdentityResult]:
    """Read every block's values in forward order in one trace and recompute ``layer_output``.

    The recomputation runs inside the trace, with the block's own parameters where the formula
    has them (a gate, a scalar), so it runs remotely too (``remote=True``).
    """
    if inputs is None:
        inputs = torch.arange(1, 9).remainder(model.vocab_size).unsqueeze(0)
    calls = block_calls(model, None)
    with torch.no_grad(), model.trace(inputs, remote=remote):
        results = nnsight.save([])
        for i, run in calls:
            values = {key.rpartition(".")[2]: model.read_at(i, location, run=run)
                      for _, key, location in model.timeline(i)
                      if key.startswith("extra.") or key.rpartition(".")[2] in IDENTITY_TERMS}
            results.append(_recompute(model, i, values))
    return [IdentityResult(i, model.block_spec(i).formula, exact, diff, run)
            for (i, run), (exact, diff) in zip(calls, results)]


# -- validation at load, on a miniature of the config ------------------------------------

class ValidationError(NNterpError):
    """The family spec does not hold on this model's architecture."""


def _expected_dims(model, layer: int, name: str) -> tuple[int | None, ...]:
    """The shape a value of block ``layer`` must have for the validation input ``[1, SEQ]``, from the catalog's
    dimensions (None: any size; a key may count more positions than the tokens, kv heads and widths vary)."""
    sizes = {"batch": 1, "seq": SEQ, "query": SEQ, "hidden_size": model.hidden_size, "num_heads": model.num_heads_of(layer)}
    # the stream may also be [1, SEQ, streams, hidden]: see _shape_problem
    return tuple(sizes.get(dim) for dim in BY_NAME[name].dims)


def _shape_problem(model, layer: int, name: str, shape: tuple[int, ...]) -> str | None:
    expected = _expected_dims(model, layer, name)
    if name in STREAM and len(shape) == 4:
        expected = (1, SEQ, None, model.hidden_size)  # parallel streams
    if name in STREAM and len(shape) == 3 and shape[-1] % model.hidden_size == 0:
        expected = (1, SEQ, None)  # a widened stream: copies of the hidden size side by side (Qwen4-Exp)
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
        readable = ["*" if e is None else e for e in expected]
        return f"has shape {list(shape)}, expected {readable}"
    return None


SEQ = 5
CACHE_FORMAT = 5  # bump when what a validation checks or records changes (5: the token mixer's add)
_VALIDATED: dict[str, dict[tuple[str, str], int]] = {}


# the fields of a family spec no proof reads: its name and types, what tests and docs build, what loading by name,
# skipping a block and the readout use (``per_config``'s and ``check_config``'s effect is in the spec proven)
NOT_PROVEN = frozenset({"name", "model_types", "tiny_config", "check_config", "per_config", "variants",
                        "checkpoint_keys", "skip_output", "logits_transform", "head_input_transform",
                        "before_final_norm", "readout_unavailable"})


def validation_key(config, architecture: type, attention: bool = False, family=None) -> str:
    """(architecture, miniature config, family spec, library versions, which proof): what a validation result
    depends on. ``family``: the spec proven (by default the one served for the config)."""
    import nnsight as _nnsight
    import transformers

    text_config = config.get_text_config()
    family = family_of(config, architecture.__name__) if family is None else for_config(family, config)
    blocks = [(sorted((key, fingerprint(value)) for key, value in block.values.items()), fingerprint(block.extra),
               block.formula, fingerprint(block.combine), fingerprint(block.mid))
              for block in (family.block(text_config, i) for i in range(text_config.num_hidden_layers))]
    # every other field, where a field added to Family counts until it is named here as one no proof reads
    spec = {field.name: fingerprint(getattr(family, field.name)) for field in dataclasses.fields(family)
            if field.name not in NOT_PROVEN | {"block"}}
    with quiet_transformers():
        mini = miniature_config(config).to_json_string(use_diff=False)
    text = json.dumps([CACHE_FORMAT, attention, architecture.__name__, mini, blocks, spec, torch.__version__,
                       transformers.__version__, _nnsight.__version__, __version__])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def problems_of(model) -> list[str]:
    """Every way the family spec fails on ``model``: shapes of the values, and the identity."""
    problems = []
    ids = torch.arange(1, SEQ + 1).remainder(model.vocab_size).unsqueeze(0)
    for (i, run), values in zip(block_calls(model, None), read_blocks(model, ids)):
        label = _label(i, run)
        for value in CATALOG:
            if value.name in values:
                problem = _shape_problem(model, i, value.name, tuple(values[value.name].shape))
                if problem:
                    problems.append(f"{label}: '{value.key}' {problem}")
        if problems:
            continue
        if "attention_probabilities" in values and not model.family.premix_is_not_mixed_values:
            problems += _attention_problems(label, values)
        if "attention_scores" in values:
            problems += _prescaled_queries(model, i, label, values)
        result = identity_of(model, i, values, run)
        if not result.exact:
            problems.append(f"{label}: the identity fails (max |diff| {result.max_abs_diff:.3g}): {result.formula}; "
                            + _suspects(model.block_spec(i), values))
        problems += _placement_problems(model, i, values, label)
        problems += _scaled_contributions(model.block_spec(i), label)
    return problems + _run_problems(model, ids)


def _scaled_contributions(block, label: str) -> list[str]:
    """A contribution is what the block adds to the stream: an identity that adds one scaled (``A * r``) serves the
    sublayer's output in its place. With the identity and ``layer_mid`` checked bit for bit, a sum of plain
    contributions makes each exactly what its add adds (``layer_mid - layer_input`` on a sequential block)."""
    if not isinstance(block.identity, Sum):
        return []
    return [f"{label}: the identity adds {term}, not {term.of}: a contribution is what the block adds to the stream "
            "(read the product, e.g. with the view nnterp.spec.views.Times)"
            for term in addends(block.identity.tree)
            if isinstance(term, Scaled) and isinstance(term.of, Name) and term.of.name in ADDED]


def _run_problems(model, ids) -> list[str]:
    """Where blocks run several times per pass, a run is read at the same occurrence of each place: every module a
    block's values are read at must run once per run of the block (not, say, once per query, key and value on
    some runs), or a run's value would be another call's."""
    if model.family.schedule is None:
        return []
    counts: dict[str, int] = {}
    handles = [module.register_forward_pre_hook(lambda *_, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
               for name, module in model._module.named_modules()]
    try:
        with torch.no_grad():
            model._module(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    problems = []
    for i in range(model.num_layers):
        block = model.block_spec(i)
        for name, location in (*block.values.items(), *block.extra.items()):
            path = model.block_path(i, location.path) if isinstance(location, At) else None
            if path is not None and counts.get(path, 0) != model.runs_of(i):
                problems.append(f"layer {i}: '{name}' is read at {path}, which runs {counts.get(path, 0)} times in a "
                                f"pass, not once per run of the block ({model.runs_of(i)}): its runs cannot be told apart")
    return problems


def _placement_problems(model, layer: int, values, label: str) -> list[str]:
    """What the identity alone cannot see: a value placed where another tensor of the right shape lives.

    On a block whose identity is a sum that adds the MLP's output last, the stream after the token mixer's add is
    the rest of that sum (``layer_input + attention_output`` on a sequential block); the MLP is called with the
    output of the norm before it; a block labelled a routed mixture of experts has experts, and a dense one has none.
    """
    block = model.block_spec(layer)
    problems = []
    module = model._module.get_submodule(model.block_path(layer))
    first = block.identity.layer_mid()
    if (first is not None and "layer_mid" in values and names_in(first) <= set(values)
            and not torch.equal(values["layer_mid"], evaluate(first, values, module))):
        problems.append(f"{label}: 'layer_mid' is not {first}, the stream the identity adds the MLP's output to")
    if block.mid and "layer_mid" in values and not torch.equal(values["layer_mid"], block.mid(values, module)):
        problems.append(f"{label}: 'layer_mid' is not what the spec's mid() computes from the values")
    if "mlp_norm_output" in values and "mlp_input" in values and not torch.equal(
            values["mlp_norm_output"], values["mlp_input"].reshape(values["mlp_norm_output"].shape)):
        problems.append(f"{label}: 'mlp_norm_output' is not what the MLP is called with ('mlp_input')")
    # the attention's own modules are not experts (on a block that has attention: the path may hold an MLP elsewhere)
    attention = model.family.attention if isinstance(block.resolve("attention_output"), At) else None
    names = [name for name, _ in (*module.named_modules(), *module.named_parameters())
             if not (attention and name.startswith(attention + "."))]
    # experts, or a router over them (not AltUp's, under ``altup``: it weighs Gemma-3n's streams, not experts)
    has_experts = any("expert" in name or "router" in name for name in names if not name.startswith("altup."))
    labelled_routed = block.values.get("mlp_activation") is ROUTED
    # the label is the block's one MLP's: a block whose MLP contribution is unavailable (LongCat-Flash's two dense
    # pairs and routed shortcut) has none to label
    if labelled_routed != has_experts and isinstance(block.resolve("mlp_output"), At):
        problems.append(f"{label}: the spec labels the MLP {'routed' if labelled_routed else 'dense'}, but the "
                        f"block ({type(module).__name__}) has {'experts' if has_experts else 'no experts'}")
    return problems + _where_present_problems(model, layer, values, label)


def _where_present_problems(model, layer: int, values, label: str) -> list[str]:
    """The values placed by default (``families.base.where_present_defaults``) where the block's modules say
    otherwise: a contribution read at a norm's output (by the norm's class) with nothing before that norm; an
    activation's input that the activation module does not turn into ``mlp_activation``."""
    block = model.block_spec(layer)
    problems = []
    for name in ("attention_output", "mlp_output"):
        where = block.resolve(name)
        if isinstance(where, At) and isinstance(block.resolve(f"{name}_before_norm"), At) and isinstance(
                block.values[f"{name}_before_norm"], SameAs):
            module = model._module.get_submodule(model.block_path(layer, where.path))
            if "norm" in type(module).__name__.lower():
                problems.append(f"{label}: '{name}' is the output of a norm ({where.path}, "
                                f"{type(module).__name__}), but '{name}_before_norm' is the same place: place it at "
                                "the norm's input")
    pre, activation = block.resolve("mlp_pre_activation"), block.resolve("mlp_activation")
    if "mlp_pre_activation" in values and "mlp_activation" in values and isinstance(pre, At) and not pre.op \
            and isinstance(activation, At) and activation.path == pre.path and activation.side == "output":
        module = model._module.get_submodule(model.block_path(layer, pre.path))
        with torch.no_grad():
            recomputed = module(values["mlp_pre_activation"])
        if not torch.equal(recomputed, values["mlp_activation"]):
            problems.append(f"{label}: {pre.path} applied to 'mlp.mlp_pre_activation' is not 'mlp.mlp_activation'")
    if {"mlp_up_output", "mlp_activation", "mlp_neurons"} <= set(values) and not torch.equal(
            values["mlp_activation"] * values["mlp_up_output"], values["mlp_neurons"]):
        problems.append(f"{label}: 'mlp.mlp_activation' * 'mlp.mlp_up_output' is not 'mlp.mlp_neurons', what the "
                        "down projection sums")
    return problems


def _attention_problems(label: str, values) -> list[str]:
    """The attention internals must compose to the heads' outputs: probabilities · values == attention_premix."""
    probabilities, v = values["attention_probabilities"], values["values"].transpose(1, 2)  # [b, kv_heads, k, d]
    groups = probabilities.shape[1] // v.shape[1]
    mixed = torch.matmul(probabilities, v.repeat_interleave(groups, dim=1)[:, :, : probabilities.shape[-1]])
    premix = values["attention_premix"]
    if mixed.transpose(1, 2).shape != premix.shape or not torch.allclose(mixed.transpose(1, 2), premix, atol=1e-5):
        return [f"{label}: attention_probabilities · values != 'self_attn.attention_premix'"]
    return []


def _prescaled_queries(model, layer: int, label: str, values) -> list[str]:
    """The queries must be the attention's queries before its scaling: where the attention's ``scaling`` is not 1,
    scores equal to queries · keysᵀ unscaled mean the queries were read after the model scaled them (OPT scales
    q_proj's output, then passes its attention function ``scaling=1.0``)."""
    attention = model.family.attention
    module = model._module.get_submodule(model.block_path(layer, attention)) if attention else None
    scaling = getattr(module, "scaling", None)
    if not isinstance(scaling, (int, float)) or scaling == 1:
        return []
    q, k, scores = values["queries"].transpose(1, 2), values["keys"].transpose(1, 2), values["attention_scores"]
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1] or k.shape[2] != scores.shape[-1]:
        return []
    unscaled = q.float() @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float().transpose(-1, -2)
    kept = torch.isfinite(scores) & (scores > torch.finfo(scores.dtype).min / 2)  # the positions the mask keeps
    if unscaled.shape == scores.shape and torch.allclose(scores.float()[kept], unscaled[kept], rtol=1e-4, atol=1e-6):
        return [f"{label}: the attention scores are queries · keysᵀ unscaled while the attention scales by {scaling:.3g}: "
                "'self_attn.queries' is read after the model scaled the queries"]
    return []


def _suspects(block, values) -> str:
    """Which values a failed identity points at, from the attention half where it can be checked alone."""
    x, a, mid = values["layer_input"], values.get("mixer_output"), values.get("layer_mid")
    if mid is None or a is None or block.identity != SEQUENTIAL:
        return ("one of 'layer_input', 'self_attn.attention_output' (or 'mixer_output'), 'mlp.mlp_output', "
                "'layer_output' is misplaced")
    if torch.equal(mid, x + a):
        return "layer_mid == layer_input + attention_output holds, so 'mlp.mlp_output' or 'layer_output' is misplaced"
    return "layer_mid != layer_input + attention_output, so 'self_attn.attention_output', 'layer_input' or 'layer_mid' is misplaced"


def missing_paths(family, config, model: torch.nn.Module) -> list[str]:
    """Every module path of the family spec that is not a module of ``model``, each named with what is there."""
    problems = []

    def check(what: str, path: str, root: torch.nn.Module, prefix: str = "") -> bool:
        try:
            root.get_submodule(path)
            return True
        except AttributeError:
            parent = path.rpartition(".")[0]
            while parent:
                try:
                    near = root.get_submodule(parent)
                    break
                except AttributeError:
                    parent = parent.rpartition(".")[0]
            else:
                near = root
            children = ", ".join(f"{prefix}{parent + '.' if parent else ''}{name}" for name, _ in near.named_children())
            problems.append(f"{what} '{prefix}{path}' is not a module of {type(model).__name__} "
                            f"(modules there: {children or 'none'})")
            return False

    for what in ("layers", "embed_tokens", "ln_final", "lm_head", "stream_readout", "vocab_projection", "head_input"):
        if getattr(family, what):
            check(what, getattr(family, what), model)
    for path in family.stacks:
        check("stacks", path, model)
    if problems:
        return problems
    text_config = config.get_text_config()
    blocks = [(f"{path}.{j}.", block) for path in family.block_lists
              for j, block in enumerate(cast(torch.nn.ModuleList, model.get_submodule(path)))]
    for i, (prefix, block) in enumerate(blocks):
        spec = family.block(text_config, i)
        has_attention = isinstance(spec.resolve("attention_output"), At)  # not a hybrid's other blocks
        has_mlp = isinstance(spec.resolve("mlp_output"), At)  # not a recurrent block
        places = {**({"the attention": family.attention} if has_attention and family.attention else {}),
                  **({"the MLP": family.mlp} if family.mlp and has_mlp else {}),
                  **{f"'{name}'": location.path for name, location in {**spec.values, **spec.extra}.items()
                     if isinstance(location, At) and location.path}}
        for what, path in places.items():
            check(f"layer {i}: {what}", path, block, prefix=prefix)
        if problems:  # the first block that misses a path says it all
            return problems
    return problems


def prove(config, architecture: type, tokenizer, wrap, attention: bool = False, family=None) -> tuple[list[str], Any]:
    """(every way the family spec fails on a miniature of ``config``, the wrapped miniature or None).

    ``family``: the spec to prove, served for its model types while the proof wraps and checks the miniature,
    without being registered (by default the one served for the config)."""
    if family is not None and config.model_type not in family.model_types:
        raise ValueError(f"The {family.name} spec does not list the config's model_type {config.model_type!r} "
                         f"(model_types={family.model_types}): it cannot be proven on this config.")
    candidate, family = family, family_of(config, architecture.__name__) if family is None else for_config(family, config)
    try:
        model = build_miniature(config, architecture)
    except Exception as error:  # noqa: BLE001 - a config the architecture cannot build proves nothing
        return [f"the miniature of the config could not be built: {type(error).__name__}: {error}"], None
    problems = missing_paths(family, config, model)
    if problems:
        return problems, None
    try:
        with Proving(candidate) if candidate is not None else contextlib.nullcontext():
            mini = wrap(model, tokenizer=tokenizer, validate=False, attention_values=attention)
            return problems_of(mini), mini
    except NNterpError as error:
        return [f"{type(error).__name__}: {error}"], None
    except Exception as error:  # noqa: BLE001 - any failure here means the spec is not proven
        return [f"the miniature could not be traced: {type(error).__name__}: {error}"], None


def validate(config, architecture: type, tokenizer, wrap, use_cache: bool = True,
             attention: bool = False, family=None) -> dict[tuple[str, str], int]:
    """Prove the family spec of ``architecture`` with ``config`` on a miniature; raise ``ValidationError`` if it fails.

    No weight is read or allocated at the real size: the miniature has the same classes and
    options with tiny sizes. ``wrap`` is the wrapper class (``StandardizedTransformer``). With
    ``attention=True`` the values inside the attention are proven too (when they are turned on):
    a family whose eager attention differs on this architecture then loses only those values.
    Results are cached per (architecture, config shape, family spec, library versions), in memory and in
    the cache folder. ``family``: the spec to prove (by default the one served for the config).
    """
    key = validation_key(config, architecture, attention, family)
    marker = cache_root() / "validated" / f"{key}.json"
    if use_cache and key not in _VALIDATED:
        cached = _read_marker(marker, key)
        if cached is not None:
            _VALIDATED[key] = cached
    if use_cache and key in _VALIDATED:
        return _VALIDATED[key]
    problems, mini = prove(config, architecture, tokenizer, wrap, attention, family)
    family = family_of(config, architecture.__name__) if family is None else family
    if problems:
        raise ValidationError(
            f"The {family.name} spec does not hold on {architecture.__name__} "
            f"(checked on a miniature of its config):\n  " + "\n  ".join(problems) +
            "\nThe standard values would be wrong on this model. Please report it with the model's config; "
            "StandardizedTransformer(..., validate=False) skips this check at your own risk."
        )
    _VALIDATED[key] = events = mini._forward_events
    ordered = [list(event) for event in sorted(events, key=events.get)]
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        temporary = marker.with_name(f".{marker.name}.tmp")
        temporary.write_text(json.dumps({"architecture": architecture.__name__, "family": family.name,
                                         "events": ordered, "digest": _digest(key, ordered)}))
        temporary.replace(marker)
    except OSError as error:
        warnings.warn(f"nnterp could not write its validation cache ({error}); the result is kept in memory for "
                      "this process only. Set NNTERP_CACHE to a writable folder to keep it.", stacklevel=3)
    return events


def _digest(key: str, events: list) -> str:
    return hashlib.sha256(json.dumps([key, events]).encode()).hexdigest()


def _read_marker(marker, key: str) -> dict[tuple[str, str], int] | None:
    """A cached validation, verified (its digest covers the key and the events, in order); None to validate again."""
    try:
        if not marker.is_file():
            return None
        saved = json.loads(marker.read_text())
        events = saved["events"]
        if saved["digest"] != _digest(key, events) or not all(isinstance(e, list) and len(e) == 2 for e in events):
            raise ValueError("its digest does not match its content")
        return {(name, side): i for i, (name, side) in enumerate(events)}
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"nnterp ignores an unusable validation cache entry {marker} ({type(error).__name__}: {error}) "
                      "and validates again.", stacklevel=4)
        return None
