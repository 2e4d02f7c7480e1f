"""No import circle among nnterp's modules: every import of an nnterp module counts, at module level, under
``if TYPE_CHECKING:`` and inside functions (a circle that only a function-level import closes still ties the two
modules into one concern)."""

from __future__ import annotations

import ast
from pathlib import Path

import nnterp

PACKAGE = Path(nnterp.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The nnterp modules ``path`` imports, anywhere in it. ``from X import a`` imports module ``X.a`` where that is
    a module, and ``X`` itself where ``a`` is a name defined in it (a package above a module is imported first in
    any case: that is not an edge)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(target)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every module below it is cycle-free
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_imports_at_every_level():
    graph = import_graph()
    # module level (nnterp/__init__.py), a TYPE_CHECKING block's import, and a function-level one
    assert "nnterp.core.standardized" in graph["nnterp"]
    assert "nnterp.core.standardized" in graph["nnterp.core.registry"]  # inside _wrapper()
    assert "nnterp.families.base" in graph["nnterp.families"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# nnterp's packages, lowest first: each imports only the packages before it (and itself). ``nnterp`` (the public
# names) and ``nnterp.__main__`` (the command line) sit above them all.
LAYERS = (
    "version",  # the release, read by the proof's cache key
    "spec",  # the vocabulary a family is written in: values, locations, views, identities, errors
    "families",  # one spec per family
    "proof",  # a spec proven on a miniature of its config; the census
    "core",  # StandardizedTransformer: loading, the engine, the envoys, order, readout, remote
    "dictionaries",  # sparse dictionaries by standard name, and their splice
    "analysis",  # TransformerLens's analyses over a cache
    "tools",  # the research tools: lens, patching, steering, caches, plots, prompts
    "graphs",  # attribution graphs with transcoders (circuit-tracer's), pruning and graph files
    "collection",  # activations to disk at dataset scale
    # StandardizedVLLM: the standard names on a vLLM engine, and the tools run its way (an extra: vLLM is imported
    # by it alone)
    "vllm",
    "compat",  # nnterp 1.x's names and module paths
    "documentation",  # the generated pages
)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = []
    for module, imported in sorted(graph.items()):
        if (layer := layer_of(module)) is None:
            continue
        for target in sorted(imported):
            if (other := layer_of(target)) is not None and rank[other] > rank[layer]:
                found.append(f"{module} ({layer}) imports {target} ({other})")
    return found


def test_every_module_lives_in_a_layer():
    outside = [module for module in import_graph() if layer_of(module) is None]
    assert sorted(outside) == ["nnterp", "nnterp.__main__"]


def test_each_layer_imports_only_the_layers_below_it():
    violations = layer_violations(import_graph())
    assert not violations, "\n".join(violations)


def test_the_layer_check_sees_a_core_module_importing_a_tool():
    graph = {"nnterp.core.engine": {"nnterp.tools.lens", "nnterp.spec.catalog"}, "nnterp.tools.lens": set()}
    assert layer_violations(graph) == ["nnterp.core.engine (core) imports nnterp.tools.lens (tools)"]


def test_the_model_class_is_the_cores_own():
    """The 1.x layer is installed onto the class from outside the core: none of its bases come from compat."""
    from nnterp import StandardizedTransformer

    foreign = [base for base in StandardizedTransformer.__mro__ if not base.__module__.startswith(("nnterp.core", "nnsight", "builtins", "torch", "typing", "abc"))]
    assert not foreign, foreign
