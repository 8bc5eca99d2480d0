"""The lab: one namespace per host, all joined to a bridge, each link capped with `tc`.

Topology (all inside namespaces this lab creates; the root namespace is never touched):

    <lab>-br:   bridge br0, one port per host (the bridge end of that host's veth; download cap here)
    <lab>-pN:   peer N, eth0 = 10.77.0.(10+N)/24 (upload cap here), lo
    <lab>-co:   the coordinator (optional), eth0 = 10.77.0.2/24

Hosts have no default route and no link to the root namespace, so traffic can only go between lab
hosts. Teardown (context exit, SIGTERM/SIGHUP, atexit, or a failed setup) stops every process the
lab started, kills anything else left in its namespaces and deletes them, which removes the veths
and the bridge with them.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import NamedTuple

from benchmarks.lab import netns as ns
from benchmarks.lab import procs
from benchmarks.lab.cpu import CpuShare, cleanup_stale_shares
from benchmarks.lab.links import LinkProfile, shape_command

READY_TIMEOUT = 15.0
_BRIDGE = "br0"
_HOST_DEV = "eth0"


class Endpoint(NamedTuple):
    """An address/port pair a client inside the lab connects to."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Host:
    """One emulated machine: its namespace, lab address and link, and a way to run things in it."""

    name: str
    role: str
    netns: str
    address: str
    link: LinkProfile
    _lab: Lab = field(repr=False)
    cpu: CpuShare | None = field(default=None, repr=False)  # its own CPU share (`Lab(cpu_per_peer=...)`)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` wrapped to run inside this host's namespace."""
        return procs.netns_argv(self.netns, cmd)

    def popen(self, cmd: Sequence[str], die_with_parent: bool = True, **popen_kwargs) -> subprocess.Popen:
        """Start `cmd` inside this host (own session); the lab stops it at teardown if still running."""
        join = self.cpu.join_before_exec if self.cpu else None
        return self._lab.adopt(procs.spawn(self.argv(cmd), die_with_parent, join, **popen_kwargs))

    def run(self, cmd: Sequence[str], timeout: float | None = 60.0, check: bool = False, **popen_kwargs
            ) -> subprocess.CompletedProcess:  # fmt: skip
        """Run `cmd` inside this host to completion (like `subprocess.run`); killed on timeout."""
        popen_kwargs.setdefault("stdout", subprocess.PIPE)
        popen_kwargs.setdefault("stderr", subprocess.PIPE)
        proc = self.popen(cmd, **popen_kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            procs.stop(proc, grace=0.5)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def describe(self) -> dict:
        """JSON-friendly description (what `RAVN_LAB_HOSTS` carries)."""
        link = self.link
        return {"name": self.name, "role": self.role, "netns": self.netns, "address": self.address,
                "down_mbit": link.down_mbit, "up_mbit": link.up_mbit, "rtt_ms": link.rtt_ms,
                "link": link.describe(), "cpu_cores": self.cpu.cores if self.cpu else None}  # fmt: skip


class Lab:
    """Context manager that builds the emulated swarm network and always tears it down.

    `peers` is a list of link profiles (or a count, for uncapped links); `coordinator` adds a host
    named `co` (True: uncapped, or give its `LinkProfile`). `cpu_per_peer` caps every peer host's
    processes at that many cores of their own (`benchmarks.lab.cpu`); None: all share the machine.
    """

    def __init__(
        self,
        peers: Sequence[LinkProfile] | int,
        coordinator: bool | LinkProfile = False,
        subnet: str = "10.77.0.0/24",
        prefix: str = ns.PREFIX,
        handle_signals: bool = True,
        cpu_per_peer: float | None = None,
    ) -> None:
        if cpu_per_peer is not None and not cpu_per_peer > 0:
            raise ValueError(f"cpu_per_peer must be more than 0 cores, got {cpu_per_peer}")
        self.cpu_per_peer = cpu_per_peer
        profiles = [LinkProfile(name="lan")] * peers if isinstance(peers, int) else list(peers)
        if not profiles and not coordinator:
            raise ValueError("a lab needs at least one host")
        net = ipaddress.ip_network(subnet)
        if not net.is_private:
            raise ValueError(f"lab subnet must be private, got {subnet}")
        addrs = list(net.hosts())
        if len(profiles) + 10 > len(addrs):
            raise ValueError(f"{subnet} is too small for {len(profiles)} peers")
        self.id = ns.new_lab_id()
        self.prefix = prefix
        self.prefixlen = net.prefixlen
        self.bridge_netns = ns.netns_name(prefix, self.id, "br")
        self.peers = [
            Host(f"p{i}", "peer", ns.netns_name(prefix, self.id, f"p{i}"), str(addrs[9 + i]), p, self)
            for i, p in enumerate(profiles)
        ]
        self.coordinator: Host | None = None
        if coordinator:
            link = coordinator if isinstance(coordinator, LinkProfile) else LinkProfile(name="lan")
            self.coordinator = Host("co", "coordinator", ns.netns_name(prefix, self.id, "co"), str(addrs[1]),
                                    link, self)  # fmt: skip
        self.hosts = [*([self.coordinator] if self.coordinator else []), *self.peers]
        self._handle_signals = handle_signals
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._shares: list[CpuShare] = []
        self._lock = threading.RLock()
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        self._pending_signal: int | None = None

    # ---- lookup -------------------------------------------------------------------------------

    def host(self, key: int | str) -> Host:
        """Peer by index (`lab.host(0)`), or any host by name (`"p0"`, `"co"`)."""
        if isinstance(key, int):
            return self.peers[key]
        for h in self.hosts:
            if h.name == key:
                return h
        raise KeyError(f"no host {key!r} in lab {self.id}")

    def describe(self) -> dict:
        """Everything a child process needs to use the lab (what the CLI exports as JSON)."""
        return {"id": self.id, "prefixlen": self.prefixlen, "bridge_netns": self.bridge_netns,
                "hosts": [h.describe() for h in self.hosts]}  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.describe())

    @property
    def namespaces(self) -> list[str]:
        """Names of every namespace this lab owns (created or about to be)."""
        return [self.bridge_netns, *(h.netns for h in self.hosts)]

    # ---- latency --------------------------------------------------------------------------------

    def pair_rtt_ms(self, a: Host, b: Host) -> float:
        """RTT between two hosts through a relay: the mean of their links' RTTs (see `LinkProfile`)."""
        return (a.link.rtt_ms + b.link.rtt_ms) / 2

    def delayed_endpoint(
        self,
        host: int | str | Host,
        port: int,
        rtt_ms: float | None = None,
        target_host: str | None = None,
        buffer_bytes: int | None = None,
    ) -> Endpoint:
        """Put a delaying relay in front of `host`'s `port` and return the endpoint clients should use.

        The relay runs in `host`'s namespace and forwards to `target_host:port` (default: the host's
        own lab address, so the server must listen on it or on 0.0.0.0). With `rtt_ms` every client
        sees that RTT; without it each lab client sees its pair RTT from the link profiles, and
        clients inside `host` itself see `host`'s own `rtt_ms`.
        """
        h = host if isinstance(host, Host) else self.host(host)
        argv = ["--listen", f"{h.address}:0", "--target", f"{target_host or h.address}:{port}"]
        if rtt_ms is not None:
            argv += ["--delay-ms", str(rtt_ms / 2)]
        else:
            argv += ["--delay-ms", str(h.link.rtt_ms / 2)]
            for other in self.hosts:
                if other is not h:
                    argv += ["--source-delay", f"{other.address}={self.pair_rtt_ms(h, other) / 2}"]
        if buffer_bytes is not None:
            argv += ["--buffer", str(buffer_bytes)]
        proc = h.popen(procs.python_module_argv("benchmarks.lab.relay", *argv), env=procs.lab_env(),
                       cwd=procs.REPO_ROOT, stdout=subprocess.PIPE)  # fmt: skip
        line = procs.read_line(proc, READY_TIMEOUT)
        if not line.startswith("READY "):
            raise ns.LabError(f"relay in {h.name} said {line!r}")
        return Endpoint(h.address, int(line.split()[1]))

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()

    def start(self) -> None:
        """Build the network; on any failure tear down what was built and re-raise."""
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            ns.cleanup_stale(self.prefix)  # leftovers of crashed runs; live labs are left alone
            cleanup_stale_shares(self.prefix)
        except ns.LabError:
            pass  # not ours to fail on: a stale lab must not stop a new one from starting
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._add_netns(self.bridge_netns)
        run = ns.run_cmd
        b = self.bridge_netns
        run(["ip", "-n", b, "link", "set", "lo", "up"])
        run(["ip", "-n", b, "link", "add", _BRIDGE, "type", "bridge"])
        run(["ip", "-n", b, "link", "set", _BRIDGE, "addrgenmode", "none"])
        run(["ip", "-n", b, "link", "set", _BRIDGE, "up"])
        for h in self.hosts:
            self._add_netns(h.netns)
            # both veth ends are created directly in lab namespaces: nothing ever exists in the root one
            run(["ip", "-n", b, "link", "add", h.name, "type", "veth", "peer", "name", _HOST_DEV, "netns", h.netns])
            run(["ip", "-n", b, "link", "set", h.name, "addrgenmode", "none"])
            run(["ip", "-n", b, "link", "set", h.name, "master", _BRIDGE, "up"])
            run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            run(["ip", "-n", h.netns, "link", "set", _HOST_DEV, "addrgenmode", "none"])
            run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/{self.prefixlen}", "dev", _HOST_DEV])
            run(["ip", "-n", h.netns, "link", "set", _HOST_DEV, "up"])
            for cmd in (shape_command(h.netns, _HOST_DEV, h.link.up_mbit, h.link.queue_ms),
                        shape_command(b, h.name, h.link.down_mbit, h.link.queue_ms)):  # fmt: skip
                if cmd:
                    run(cmd)
        if self.cpu_per_peer is not None:
            for h in self.peers:
                h.cpu = CpuShare.create(h.netns, self.cpu_per_peer)
                self._shares.append(h.cpu)
        self._wait_links_up()

    def _add_netns(self, name: str) -> None:
        ns.run_cmd(["ip", "netns", "add", name])
        self._created.append(name)

    def _wait_links_up(self, timeout: float = 10.0) -> None:
        """veth carrier comes up asynchronously; wait for it so the first packet is not lost."""
        deadline = time.monotonic() + timeout
        pending = list(self.hosts)
        while pending:
            pending = [h for h in pending if not self._carrier(h)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ns.LabError(f"links of {[h.name for h in pending]} did not come up in {timeout}s")
            time.sleep(0.01)

    def _carrier(self, h: Host) -> bool:
        out = ns.run_cmd(["ip", "-j", "-n", h.netns, "link", "show", _HOST_DEV]).stdout
        state = json.loads(out)[0]
        return "LOWER_UP" in state.get("flags", []) and state.get("operstate") in ("UP", "UNKNOWN")

    def adopt(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Make the lab stop `proc` at teardown (for processes started outside `Host.popen`)."""
        with self._lock:
            if self._closed:
                procs.stop(proc)
                raise ns.LabError("lab is closed")
            self._procs.append(proc)
        return proc

    def namespace_pids(self) -> list[int]:
        """Every process now running in one of this lab's namespaces, however it was started."""
        return [pid for name in self._created for pid in ns.netns_pids(name)]

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Processes started through this lab (running or finished)."""
        return list(self._procs)

    def close(self) -> None:
        """Stop processes and delete namespaces. Idempotent; safe from atexit and signal paths.

        Signals arriving during teardown are held back and re-raised once it is done, so a second
        Ctrl-C cannot leave half a lab behind.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._defer_signals()
        errors: list[Exception] = []
        try:
            for proc in reversed(self._procs):
                try:
                    procs.stop(proc)
                except Exception as exc:  # keep going: the namespaces must still be removed
                    errors.append(exc)
            for name in reversed(self._created):
                try:
                    ns.delete_netns(name)
                except Exception as exc:
                    errors.append(exc)
            for share in self._shares:  # empty now: their processes were in the namespaces
                try:
                    share.remove()
                except Exception as exc:
                    errors.append(exc)
        finally:
            self._restore_signal_handlers()
            atexit.unregister(self.close)
        if self._pending_signal == signal.SIGINT:
            raise KeyboardInterrupt
        if self._pending_signal is not None:
            raise SystemExit(128 + self._pending_signal)
        if errors:
            raise ns.LabError(f"lab {self.id} teardown had errors: {errors}")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:
            self._pending_signal = self._pending_signal or signum
        else:
            raise SystemExit(128 + signum)

    def _install_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit so `with` blocks unwind and tear the lab down."""
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _defer_signals(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous = signal.signal(sig, self._on_signal)
            self._old_handlers.setdefault(sig, previous)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()


def lab_hosts_from_env(env: Mapping[str, str]) -> list[dict]:
    """Parse `RAVN_LAB_HOSTS` as exported by `python -m benchmarks.lab` (for commands run under it)."""
    return json.loads(env["RAVN_LAB_HOSTS"])
