#!/usr/bin/env bash
# Create .venv (once) and install primus_ext with a pinned CPU torch.
# torch is installed first and pinned: an open range would make pip fetch a
# multi-GB CUDA build on a machine without a GPU.
# A first run takes about 3 minutes on a 2-core machine; later runs about 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${PRIMUS_EXT_TORCH:-2.13.0}"
say() { echo "setup.sh: $*" >&2; }
if [ -x .venv/bin/python ]; then
  say "using the existing .venv"
else
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
say "installing $TORCH (CPU build; about 2 minutes on a first run) ..."
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH"
say "installing primus_ext with megatron-core, test and CLI extras (about 1 minute on a first run) ..."
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[megatron,test,cli]"
# The mask libraries FlexAttention users already have, for the tests that run their factories as
# their docs show. --no-deps: only their mask modules are used, and their training stacks
# (torchtitan's tyro, torchdata, ...) are large and irrelevant here.
say "installing the mask libraries attn-gym and torchtitan (tests only, --no-deps) ..."
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps attn-gym==0.0.17 torchtitan==0.3.0
say "ready: $(.venv/bin/python -W ignore -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")' 2>/dev/null)"
