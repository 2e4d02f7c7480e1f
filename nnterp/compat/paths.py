"""The module paths nnterp had before its packages (``nnterp.engine``, ``nnterp.nnsight_utils``, ...), kept working.

``import nnterp.lens`` gives the module ``nnterp.tools.lens`` itself (the same object, so a name monkeypatched
on one is patched on the other); nothing is imported until an old path is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {
    **{name: f"spec.{name}" for name in "attention catalog errors identity locations selection sourced views".split()},
    **{name: f"proof.{name}" for name in "cache coverage miniature".split()},
    **{name: f"core.{name}" for name in ("allocator attention_values edits engine envoys inference inputs loading "
                                         "order readout registry remote remote_env standardized structure tokens "
                                         "validation").split()},
    "splicing": "dictionaries.splicing",
    **{name: f"tools.{name}" for name in "activation_cache embedded lens patching plots prompts tuned_lens".split()},
    **{name: f"compat.{name}" for name in ("display interventions legacy nnsight_utils prompt_utils rename_utils "
                                           "utils").split()},
    "doctest_runner": "documentation.doctest_runner",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``nnterp.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "nnterp" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"nnterp.{MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets this alias's spec on the module: kept to undo it
        return module

    def exec_module(self, module):
        # the module at the new path is already executed; it keeps its own spec (its relative imports read it)
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
