#!/usr/bin/env bash
# Create .venv (once) and install primus_ext with a pinned CPU torch.
# torch is installed first and pinned: an open range would make pip fetch a
# multi-GB CUDA build on a machine without a GPU.
# A later run with the same pyproject.toml and this script finds its stamp in .venv and installs
# nothing (the package is installed editable, so code changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${PRIMUS_EXT_TORCH:-2.13.0}"
say() { echo "setup.sh [${SECONDS} s]: $*" >&2; }  # elapsed time: a first run installs for a minute or more
if [ -x .venv/bin/python ]; then
  say "using the existing .venv"
else
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# What the installs below depend on: a change to either file (or to the torch pin) installs again.
STAMP=.venv/.primus-ext-setup
WANT="$TORCH $(cat pyproject.toml scripts/setup.sh | .venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  say "already installed for this pyproject.toml and $TORCH (delete $STAMP to install again)"
else
  rm -f "$STAMP"
  say "installing $TORCH (CPU build, the largest download) ..."
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH"
  say "installing primus_ext with megatron-core, test and CLI extras ..."
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[megatron,test,cli]"
  # The mask libraries FlexAttention users already have, for the tests that run their factories as
  # their docs show. --no-deps: only their mask modules are used, and their training stacks
  # (torchtitan's tyro, torchdata, ...) are large and irrelevant here.
  say "installing the mask libraries attn-gym and torchtitan (tests only, --no-deps) ..."
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps attn-gym==0.0.17 torchtitan==0.3.0
  echo "$WANT" > "$STAMP"
fi
say "ready: $(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch " + v("torch") + ", megatron-core " + v("megatron-core"))')"
