"""Swarm lab: emulated home-internet links between namespaced hosts on one machine.

See docs/lab.md. `relay` and `probe` are run as `python -m` helpers inside namespaces and are not
imported here (so `-m` does not find them already imported).
"""

from benchmarks.lab.lab import Endpoint, Host, Lab, lab_hosts_from_env
from benchmarks.lab.links import PRESETS, LinkProfile, parse_duration_ms, parse_link, parse_rate_mbit
from benchmarks.lab.netns import PREFIX, LabError, cleanup_stale, list_netns, netns_pids, unavailable_reason
from benchmarks.lab.procs import lab_env

__all__ = [
    "PREFIX",
    "PRESETS",
    "Endpoint",
    "Host",
    "Lab",
    "LabError",
    "LinkProfile",
    "cleanup_stale",
    "lab_env",
    "lab_hosts_from_env",
    "list_netns",
    "netns_pids",
    "parse_duration_ms",
    "parse_link",
    "parse_rate_mbit",
    "unavailable_reason",
]
