#!/usr/bin/env bash
# One-command install: a virtual environment in .venv holding torch, Ravn and its dev tools.
#
# By default torch is the CPU build 2.13.0. For an NVIDIA GPU, pass the torch requirement (and the
# wheel index of your CUDA version from PyTorch's install selector) in TORCH_SPEC, for example:
#   TORCH_SPEC="torch==2.13.0 --index-url <PyTorch's CUDA 12.x wheel index>" scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
.venv/bin/python -m pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install --quiet -e '.[dev,hf]'
echo "Ravn installed in .venv; try: .venv/bin/ravn local --peers 3"
