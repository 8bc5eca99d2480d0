#!/usr/bin/env bash
# One-command install: a virtual environment in .venv holding torch, Ravn and its dev tools.
#
# By default torch is the CPU build 2.13.0. For an NVIDIA GPU, pass the torch requirement (and the
# wheel index of your CUDA version from PyTorch's install selector) in TORCH_SPEC, for example:
#   TORCH_SPEC="torch==2.13.0 --index-url <PyTorch's CUDA 12.x wheel index>" scripts/install.sh
#
# Run as root on Debian/Ubuntu, it also installs the system tools the lab tests (`pytest -m lab`) use:
# nftables (the NAT test's home router) and iproute2 (network namespaces, veth, tc), when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

lab_tools_missing() {
    for tool in nft ip tc; do
        command -v "$tool" >/dev/null || return 0
    done
    return 1
}
if lab_tools_missing; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2 >/dev/null
    else
        echo "note: the lab tests (pytest -m lab) need root and nft/ip/tc: sudo apt-get install nftables iproute2"
    fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
.venv/bin/python -m pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install --quiet -e '.[dev,hf]'
echo "Ravn installed in .venv; try: .venv/bin/ravn local --peers 3"
