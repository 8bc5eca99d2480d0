"""Give each lab host a CPU share of its own: one cgroup per host, capped at a number of cores.

On one machine the lab's peers share its cores, so while one stage waits on the network another runs
on the core it left: a pipeline bubble costs little, and a schedule that fills bubbles (async) gains
less than between separate machines, where a waiting GPU simply idles. With each host capped at its
own share (3 peers at 0.6 of 2 cores), a waiting peer's share idles, as at home.

cgroup v2 (``cpu.max``) where its cpu controller is available, else v1's (``cpu.cfs_quota_us``).
Every process a host starts joins before it execs, so its children (the DHT's process, p2pd) count
against the same share. Names follow the namespaces' (``<prefix>-<pid>x<rand>-<host>``), so a dead
lab's groups are found and removed like its namespaces.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lab.netns import LabError, owner_alive

PERIOD_US = 10_000  # short, so a capped process waits at most ~10 ms for its next slice, not 100 ms


def cpu_controller() -> tuple[Path, bool] | None:
    """(mount point, is v2) of a cgroup hierarchy with the cpu controller, v2 first; None without one."""
    v1 = None
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, fstype, options, *_ = line.split()
            if fstype == "cgroup2":
                controllers = Path(mount, "cgroup.controllers")
                if controllers.exists() and "cpu" in controllers.read_text().split():
                    return Path(mount), True
            elif fstype == "cgroup" and "cpu" in options.split(",") and v1 is None:
                v1 = Path(mount)
    return (v1, False) if v1 else None


def unavailable_reason() -> str | None:
    """Why hosts cannot get CPU shares here, or None when they can."""
    if os.geteuid() != 0:
        return "CPU shares need root (cgroups)"
    if cpu_controller() is None:
        return "no cgroup hierarchy with the cpu controller is mounted (v2 cpu.max or v1 cpu)"
    return None


@dataclass
class CpuShare:
    """One host's cgroup: at most ``cores`` CPUs for every process in it, together."""

    path: Path
    cores: float
    v2: bool

    @classmethod
    def create(cls, name: str, cores: float) -> CpuShare:
        if not cores > 0:
            raise ValueError(f"a CPU share must be more than 0 cores, got {cores}")
        found = cpu_controller()
        if found is None:
            raise LabError(unavailable_reason() or "no cpu controller")
        root, v2 = found
        quota = max(1000, round(cores * PERIOD_US))  # the kernel's smallest quota is 1 ms
        path = root / name
        try:
            if v2 and "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                (root / "cgroup.subtree_control").write_text("+cpu")
            path.mkdir()
            if v2:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            raise LabError(f"cannot give {name} a CPU share of {cores} cores in {root}: {exc}") from exc
        return cls(path, cores, v2)

    def join_before_exec(self) -> None:
        """Move the calling process into the share (a ``preexec_fn``: runs in the child before exec)."""
        fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def throttled_fraction(self) -> float:
        """Share of the scheduler's periods so far in which the cap held a process back."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("nr_throttled", 0)) / max(int(stat.get("nr_periods", 0)), 1)

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the group once its processes are gone (the lab kills them first). Missing is fine."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
            except FileNotFoundError:
                return
            except OSError as exc:  # EBUSY: a killed process not yet reaped
                if time.monotonic() > deadline:
                    raise LabError(f"CPU share {self.path} still holds {self.pids()}: {exc}") from exc
                time.sleep(0.02)


def cleanup_stale_shares(prefix: str, include_live: bool = False) -> list[str]:
    """Remove CPU shares left by labs whose owner died (their processes died with the namespaces)."""
    found = cpu_controller()
    if found is None or os.geteuid() != 0:
        return []
    removed = []
    for path in sorted(found[0].glob(f"{prefix}-*")):
        if not path.is_dir() or (not include_live and owner_alive(path.name)):
            continue
        try:
            CpuShare(path, 0.0, found[1]).remove(timeout=1.0)
            removed.append(path.name)
        except LabError:
            pass  # still busy: a later cleanup gets it
    return removed
