#!/usr/bin/env bash
# The real NDIF server's pieces for tests/remote/test_ndif_real.py, installed once:
#   a venv (.ndif-venv) on Python 3.12 from pyenv (NDIF needs >=3.12,<3.14) with ndif[api,ray], moto[server]
#   (the S3-compatible object store) and the client's own torch, transformers and nnsight versions;
#   Debian's redis-server.
# Without a Python 3.12 it says so and exits 0 leaving no venv: the test then skips, printing why.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the checkout's root
CLIENT=${NNTERP_VENV:-.venv}
VENV=${NDIF_VENV:-.ndif-venv}

install_redis() {
  command -v redis-server >/dev/null 2>&1 && return
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  if ! command -v apt-get >/dev/null 2>&1 || \
     ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server; } >/dev/null 2>&1; then
    echo "tests/remote/ndif/setup.sh: could not install redis-server (apt-get); tests/remote/test_ndif_real.py will be skipped" >&2
  fi
}

python312=$(ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$python312" ]; then
  echo "tests/remote/ndif/setup.sh: no Python 3.12 under $HOME/.pyenv/versions (NDIF needs 3.12 or 3.13);" \
       "tests/remote/test_ndif_real.py will be skipped" >&2
  exit 0
fi
install_redis

if [ ! -x "$CLIENT/bin/python" ]; then
  echo "tests/remote/ndif/setup.sh: no client venv at $CLIENT (./run.sh test makes it first)" >&2
  exit 1
fi
# the client's versions, without a local tag (the client may have torch's +cpu build; PyPI's works on the CPU too)
pins=$("$CLIENT/bin/python" -c "import importlib.metadata as m
print(' '.join(f'{p}=={m.version(p).split(\"+\")[0]}' for p in ('torch', 'transformers', 'nnsight')))")
want=$({ cat tests/remote/ndif/setup.sh; echo "$python312 $pins"; } | sha256sum | cut -d' ' -f1)
marker="$VENV/.nnterp-ndif-setup"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then exit 0; fi

rm -rf "$VENV"
"$python312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # the pins are three words
"$VENV/bin/python" -m pip install -q "ndif[api,ray]==0.1.2" "moto[server]" $pins
echo "$want" > "$marker"
