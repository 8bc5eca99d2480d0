#!/usr/bin/env bash
# One-command install: a virtual environment in .venv holding torch, Ravn and its dev tools.
#
# By default torch is the CPU build 2.13.0. For an NVIDIA GPU, pass the torch requirement (and the
# wheel index of your CUDA version from PyTorch's install selector) in TORCH_SPEC, for example:
#   TORCH_SPEC="torch==2.13.0 --index-url <PyTorch's CUDA 12.x wheel index>" scripts/install.sh
#
# Run as root on Debian/Ubuntu, it also installs, when missing, jemalloc (peers run on it instead of glibc's
# malloc, which keeps what training frees: swarm/allocator.py) and the system tools the lab tests
# (`pytest -m lab`) use: nftables (the NAT test's home router) and iproute2 (network namespaces, veth, tc).
set -euo pipefail
cd "$(dirname "$0")/.."

system_packages_missing() {
    for tool in nft ip tc; do
        command -v "$tool" >/dev/null || return 0
    done
    case "$(ldconfig -p 2>/dev/null)" in  # not a pipe into grep -q: under pipefail its early exit fails the test
        *libjemalloc*) return 1 ;;
        *) return 0 ;;
    esac
}
if system_packages_missing; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 nftables iproute2 >/dev/null
    else
        echo "note: peers want jemalloc, and the lab tests (pytest -m lab) root and nft/ip/tc:"
        echo "      sudo apt-get install libjemalloc2 nftables iproute2"
    fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
.venv/bin/python -m pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install --quiet -e '.[dev,hf]'
echo "Ravn installed in .venv; try: .venv/bin/ravn local --peers 3"
