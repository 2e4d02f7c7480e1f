"""``import nnterp`` loads no transformers model's modules: a family imports its own when it is used.

Proven on what a fresh interpreter holds in ``sys.modules``, never by timing. The model packages'
configuration modules count too: importing all of them at once is what made ``import nnterp`` slow.
"""

import json
import os
import subprocess
import sys

ALLOWED: dict[str, str] = {}  # model packages `import nnterp` may load, each with its reason: none


def _model_packages(statements: str) -> set[str]:
    """The ``transformers.models`` packages a fresh interpreter has loaded after ``statements``."""
    code = f"import json, sys\n{statements}\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    return {name.split(".")[2] for name in modules if name.startswith("transformers.models.")} - set(ALLOWED)


def test_import_nnterp_loads_no_model_package():
    assert _model_packages("import nnterp") == set()


def test_import_nnterp_loads_no_model_machinery():
    """transformers.modeling_utils (PreTrainedModel) pulls in torch.distributed, dynamo and the quantizers: the
    first model nnterp wraps or loads imports it, not the import."""
    code = "import sys, nnterp; print('transformers.modeling_utils' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_family_loads_only_its_own_model_package_when_used():
    used = _model_packages(
        "import nnterp\n"
        "from nnterp.families import BY_MODEL_TYPE, family_of\n"
        "family_of(BY_MODEL_TYPE['bloom'].tiny_config())")
    assert used - {"auto"} == {"bloom"}  # (auto: transformers' tables of names, which placing a family reads)
