"""CLI: build a lab, run a command (or the self-check) against it, tear it down.

    python -m benchmarks.lab --peers 4 --link cable:200/20 --rtt 40ms -- python my_bench.py
    python -m benchmarks.lab --peers 2 --link 50mbit --selftest
    python -m benchmarks.lab --peers 3 --cpu-per-peer 0.6 -- python my_bench.py   # a CPU share each
    python -m benchmarks.lab --cleanup-stale

The command runs in the root namespace (or inside a lab host with `--in p0`) and finds the lab in
`RAVN_LAB_ID` and `RAVN_LAB_HOSTS` (JSON list: name, role, netns, address, caps, rtt_ms and, with
`--relay PORT`, `relays: {"PORT": relay_port}`); it reaches hosts with `ip netns exec <netns> ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from benchmarks.lab import procs
from benchmarks.lab.cpu import cleanup_stale_shares
from benchmarks.lab.lab import Lab
from benchmarks.lab.links import LinkProfile, parse_duration_ms, parse_link
from benchmarks.lab.netns import PREFIX, LabError, cleanup_stale, unavailable_reason
from benchmarks.lab.selftest import format_table, run_selftest


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--peers", type=int, default=2, help="number of peer hosts (default 2)")
    p.add_argument("--link", action="append", default=[], metavar="SPEC",
                   help="peer link: 50mbit, 200/20, cable, cable:200/20, dsl:16/1@30ms, lan; give once for "
                        "all peers or once per peer")  # fmt: skip
    p.add_argument("--rtt", type=parse_duration_ms, default=0.0, metavar="TIME",
                   help="RTT between hosts through relays, for links without @RTT (e.g. 40ms)")  # fmt: skip
    p.add_argument("--cpu-per-peer", type=float, default=None, metavar="CORES",
                   help="cap each peer host's processes at this many cores of its own (cgroups, e.g. 0.6)")  # fmt: skip
    p.add_argument("--coordinator", action="store_true", help="add a coordinator host `co`")
    p.add_argument("--coordinator-link", default="lan", metavar="SPEC", help="coordinator link (default lan)")
    p.add_argument("--relay", type=int, action="append", default=[], metavar="PORT",
                   help="start a delaying relay in front of PORT on every host (repeatable)")  # fmt: skip
    p.add_argument("--in", dest="in_host", metavar="HOST", help="run the command inside this lab host")
    p.add_argument("--selftest", action="store_true", help="measure throughput and RTT, print a table")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per self-check transfer")
    p.add_argument("--cleanup-stale", action="store_true", help="delete leftovers of dead labs and exit")
    p.add_argument("--force", action="store_true", help="with --cleanup-stale: also labs of live processes")
    return p


def profiles_from_args(args: argparse.Namespace) -> list[LinkProfile]:
    """One profile per peer from repeated/single `--link` and the default `--rtt`."""
    specs = args.link or ["lan"]
    if len(specs) not in (1, args.peers):
        raise SystemExit(f"give --link once or {args.peers} times, not {len(specs)}")
    if len(specs) == 1:
        specs = specs * args.peers
    return [parse_link(s, rtt_ms=args.rtt) for s in specs]


def _run_command(lab: Lab, args: argparse.Namespace, command: Sequence[str]) -> int:
    hosts = [h.describe() for h in lab.hosts]
    for info, h in zip(hosts, lab.hosts, strict=True):
        if args.relay:
            info["relays"] = {str(port): lab.delayed_endpoint(h, port).port for port in args.relay}
    env = procs.lab_env()
    env.update(RAVN_LAB_ID=lab.id, RAVN_LAB_HOSTS=json.dumps(hosts))
    if args.in_host:
        proc = lab.host(args.in_host).popen(command, env=env)
    else:
        proc = lab.adopt(procs.spawn(command, env=env))
    return proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if reason := unavailable_reason():
        print(f"lab unavailable: {reason}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        for name in cleanup_stale(PREFIX, include_live=args.force):
            print(f"removed {name}")
        for name in cleanup_stale_shares(PREFIX, include_live=args.force):
            print(f"removed CPU share {name}")
        return 0
    if not command and not args.selftest:
        print("nothing to do: give --selftest or `-- command ...`", file=sys.stderr)
        return 2
    try:
        coordinator = parse_link(args.coordinator_link, rtt_ms=args.rtt) if args.coordinator else False
        profiles = profiles_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with Lab(profiles, coordinator=coordinator, cpu_per_peer=args.cpu_per_peer) as lab:
            for h in lab.hosts:
                cpu = f", {h.cpu.cores:g} cores" if h.cpu else ""
                print(f"lab {lab.id}: {h.name:<3} {h.address:<12} {h.link.describe()}{cpu}  (netns {h.netns})",
                      file=sys.stderr, flush=True)  # fmt: skip
            rc = 0
            if args.selftest:
                checks = run_selftest(lab, args.duration)
                print(format_table(checks), flush=True)
                rc = 0 if all(c.ok for c in checks) else 1
            if command:
                rc = _run_command(lab, args, command) or rc
            return rc
    except LabError as exc:
        print(f"lab error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
