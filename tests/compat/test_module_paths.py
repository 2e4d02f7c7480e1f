"""The module paths of before the packages still import, as the very module at the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from nnterp.compat.paths import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old):
    assert importlib.import_module(f"nnterp.{old}") is importlib.import_module(f"nnterp.{MOVED[old]}")


def test_old_paths_work_in_a_fresh_process_in_every_import_form():
    code = (
        "from nnterp.nnsight_utils import get_layer_output\n"
        "import nnterp.rename_utils, nnterp.engine\n"
        "from nnterp import interventions, display\n"
        "import nnterp.core.engine as engine, nnterp.compat.display as new_display\n"
        "assert nnterp.engine is engine and display is new_display\n"
        "assert interventions.__name__ == 'nnterp.compat.interventions' and callable(get_layer_output)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_path_that_never_was_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nnterp.no_such_module")
