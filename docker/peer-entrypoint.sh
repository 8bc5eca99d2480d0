#!/usr/bin/env bash
# Peer container entrypoint (installed as ravn-docker-peer): wait for the coordinator's join file, turn it
# into the variables ravn-peer reads (RAVN_SWARM, RAVN_INITIAL_PEERS, RAVN_COORDINATOR_KEY), then join.
#
# Why a file: the coordinator's DHT peer id (in its multiaddr) is only known once it runs, so
# `ravn-coordinator serve --join-file PATH` writes it to a volume shared with the peers.
# Variables already set in the container's environment win over the file. Extra arguments go to
# `ravn-peer join` and win over everything (e.g. --name peer1 --device cpu).
set -euo pipefail

join_file="${RAVN_JOIN_FILE:-/shared/join.toml}"
wait_s="${RAVN_JOIN_WAIT:-300}"

waited=0
until [[ -s "$join_file" ]]; do
    if ((waited >= wait_s)); then
        echo "error: no join file at $join_file after ${wait_s} s; is the coordinator running with --join-file $join_file?" >&2
        exit 2
    fi
    sleep 1
    waited=$((waited + 1))
done

# The join file is TOML; print shell-quoted exports for the values not already in the environment.
exports="$(python - "$join_file" <<'PY'
import os
import shlex
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    join = tomllib.load(f)
values = {
    "RAVN_SWARM": join["swarm"],
    "RAVN_INITIAL_PEERS": " ".join(join["initial_peers"]),
    "RAVN_COORDINATOR_KEY": join["coordinator_key"],
}
for name, value in values.items():
    if not os.environ.get(name):
        print(f"export {name}={shlex.quote(value)}")
PY
)"
eval "$exports"

# Other peers dial this container at the address the compose network gave it.
announce="${RAVN_ANNOUNCE:-$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}"

exec ravn-peer join \
    --host "${RAVN_HOST:-0.0.0.0}" \
    --announce "$announce" \
    --port "${RAVN_PORT:-31400}" \
    "$@"
