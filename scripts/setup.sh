#!/usr/bin/env bash
# Create .venv (once) and install primus_ext with a pinned CPU torch.
# torch is installed first and pinned: an open range would make pip fetch a
# multi-GB CUDA build on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${PRIMUS_EXT_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[megatron,test,cli]"
