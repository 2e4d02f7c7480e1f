#!/usr/bin/env bash
# circuit-tracer 0.5.0 for tests/graphs/test_circuit_tracer.py, installed once in its own venv (.circuit-tracer-venv):
# it needs transformers >= 4.56, <= 4.57.3 and TransformerLens 2.x (numpy < 2), nnsight 0.6.3 (0.5.0 imports
# nnsight.intervention.tracing.tracer.Barrier, gone in 0.7+) and pyarrow 21.0.0 (numpy < 2); torch is the client's.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the checkout's root
CLIENT=${NNTERP_VENV:-.venv}
VENV=${CIRCUIT_TRACER_VENV:-.circuit-tracer-venv}
if [ ! -x "$CLIENT/bin/python" ]; then
  echo "tests/graphs/circuit_tracer/setup.sh: no client venv at $CLIENT (./run.sh test makes it first)" >&2
  exit 1
fi
python=$("$CLIENT/bin/python" -c "import sys; print(sys._base_executable)")
torch_pin=$("$CLIENT/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch').split('+')[0])")
want=$({ cat tests/graphs/circuit_tracer/setup.sh; echo "$python $torch_pin"; } | sha256sum | cut -d' ' -f1)
marker="$VENV/.nnterp-circuit-tracer-setup"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then exit 0; fi

rm -rf "$VENV"
"$python" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$torch_pin"  # first: the local CPU build
"$VENV/bin/python" -m pip install -q "circuit-tracer==0.5.0" "transformers==4.57.3" "transformer-lens==2.18.0" \
  "nnsight==0.6.3" "pyarrow==21.0.0"
echo "$want" > "$marker"
