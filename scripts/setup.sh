#!/usr/bin/env bash
# Create ./.venv (once) and install what the book and the tests need. Idempotent.
# On a machine with an NVIDIA GPU the venv sees the system's packages, so a CUDA torch that is
# already installed is reused; with no GPU it installs the CPU build of torch 2.13.0 first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
. .venv/bin/activate
stamp=.venv/.installed-$(cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
if [ ! -e "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      python -m pip install -q torch
    else
      python -m pip install -q "torch==2.13.0"
    fi
  fi
  python -m pip install -q -r requirements.txt
  python -m pip install -q --no-deps -e .
  python -m ipykernel install --sys-prefix --name python3 >/dev/null
  touch "$stamp"
fi
