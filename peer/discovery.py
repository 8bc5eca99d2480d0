"""How a peer finds its swarm: DHT first, then the signed plan, then the coordinator it names.

The peer trusts only plans signed by the coordinator key it was given in its join command; the
plan tells it where the coordinator's control service is and which block it holds. Its own record
is re-announced every heartbeat with an expiry of three, so a crashed peer drops out by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from swarm.config import PROTOCOL_VERSION
from swarm.dht.keys import load_public_key
from swarm.dht.node import HANG_ATTEMPTS, DHTStartError, OwnedDHT, start_dht
from swarm.dht.records import announce_peer, dht_record_validators, fetch_plan, withdraw_peer
from swarm.dht.refresh import refresh_every
from swarm.dht.schema import PeerRecord, Plan, validate_swarm_name
from swarm.dht.signing import new_key

log = logging.getLogger(__name__)

RESTART_FIRST_DELAY_S = 1.0  # a failed restart as a client is retried after this, then twice as long...
RESTART_MAX_DELAY_S = 8.0  # ...up to this
MAX_ANNOUNCING = 4  # stores in flight: a stalled one lasts two DHT RPC waits (6 s), 3 heartbeats of 2 s


class DiscoveryError(RuntimeError):
    """The peer cannot find or enter its swarm; the message says what to fix."""


@dataclass(frozen=True)
class DiscoverySettings:
    swarm: str
    initial_peers: tuple[str, ...]
    coordinator_key: str
    heartbeat: float = 5.0
    find_timeout: float = 60.0
    dht_host: str = "127.0.0.1"
    dht_port: int = 0


def check_initial_peers(maddrs: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Each initial peer must be a full libp2p multiaddr ending in /p2p/<peer id>."""
    from multiaddr import Multiaddr

    checked = []
    for m in maddrs:
        try:
            parsed = Multiaddr(m)
            parsed.value_for_protocol("p2p")
        except Exception as e:  # noqa: BLE001 - multiaddr raises several types
            raise DiscoveryError(
                f"initial peer {m!r} is not a multiaddr like /ip4/1.2.3.4/tcp/31338/p2p/12D3KooW... ({e})"
            ) from None
        checked.append(str(parsed))
    return tuple(checked)


class Discovery:
    def __init__(self, settings: DiscoverySettings) -> None:
        validate_swarm_name(settings.swarm)
        self.s = settings
        self.initial_peers = check_initial_peers(settings.initial_peers)
        try:
            self.trusted_key = load_public_key(settings.coordinator_key)
        except Exception as e:  # noqa: BLE001
            raise DiscoveryError(f"--coordinator-key is not a public key printed by ravn-coordinator ({e})") from None
        self.dht: OwnedDHT | None = None
        self.record: PeerRecord | None = None
        self.signing_key = new_key()  # this process's identity: every record it announces is signed
        # stalled stores wait here, not in the loop's shared pool, where they would hold up other work
        self._announcer = ThreadPoolExecutor(MAX_ANNOUNCING, thread_name_prefix="announce")
        self._plan_version = 0

    def start(self, client_mode: bool = False) -> None:
        """Start the DHT node; fails fast when no initial peer answers.

        ``client_mode``: for a peer behind NAT, which cannot accept the DHT's inbound connections; it then
        only asks and stores, and other nodes do not wait on it.
        """
        try:
            self._start_node(client_mode)
        except (P2PDaemonError, DHTStartError) as e:
            raise DiscoveryError(
                f"cannot reach any initial peer ({self._initial_peers_text()}): {_first_line(e)}; "
                "check the address and that the coordinator runs"
            ) from None

    def _start_node(self, client_mode: bool, attempts: int = HANG_ATTEMPTS) -> None:
        ip = "ip6" if ":" in self.s.dht_host else "ip4"
        self.dht = start_dht(
            attempts=attempts,
            initial_peers=list(self.initial_peers),
            host_maddrs=[f"/{ip}/{self.s.dht_host}/tcp/{self.s.dht_port}"],
            record_validators=dht_record_validators(),
            client_mode=client_mode,
        )

    def _initial_peers_text(self) -> str:
        return ", ".join(self.initial_peers)

    async def restart_as_client(self) -> None:
        """Behind NAT after all: rejoin the DHT as a client (keeps the pinned key and the plan version).

        The initial peers answered seconds ago, so a failed start here is taken as passing: it is retried
        with a doubling delay, each failure logged with its reason, until ``find_timeout`` has passed.
        Each start runs on this (the main) thread, blocking the loop for a moment: see swarm/dht/node.py.
        """
        self.shutdown()
        deadline = time.monotonic() + self.s.find_timeout
        delay, attempt = RESTART_FIRST_DELAY_S, 0
        while True:
            attempt += 1
            try:
                self._start_node(True, attempts=1)  # this loop retries every failure, a hang included
                if attempt > 1:
                    log.info("DHT node restarted as a client (attempt %d)", attempt)
                return
            except (P2PDaemonError, DHTStartError) as e:
                reason = f"{_first_line(e)} (initial peers: {self._initial_peers_text()})"
            if time.monotonic() + delay > deadline:
                raise DiscoveryError(
                    f"could not restart the DHT node as a client in {attempt} attempts over "
                    f"{self.s.find_timeout:.0f} s: {reason}; check that the coordinator runs"
                )
            log.warning(
                "restarting the DHT node as a client failed (attempt %d): %s; retrying in %.1f s",
                attempt,
                reason,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, RESTART_MAX_DELAY_S)

    async def find_swarm(self) -> Plan:
        """The coordinator's current plan; proof that the swarm exists and who coordinates it."""
        deadline = time.monotonic() + self.s.find_timeout
        while time.monotonic() < deadline:
            plan = await self.fetch()
            if plan is not None:
                if plan.protocol_version != PROTOCOL_VERSION:
                    raise DiscoveryError(
                        f"swarm {self.s.swarm!r} speaks protocol version {plan.protocol_version}, "
                        f"this peer speaks {PROTOCOL_VERSION}; install a matching ravn-swarm"
                    )
                return plan
            await asyncio.sleep(min(1.0, self.s.heartbeat))
        raise DiscoveryError(
            f"no coordinator of swarm {self.s.swarm!r} answered through the initial peers within "
            f"{self.s.find_timeout:.0f} s: check --swarm and --coordinator-key "
            "(ravn-coordinator serve prints the exact join command)"
        )

    async def fetch(self) -> Plan | None:
        """The newest trusted plan, or None: none yet, or the DHT did not answer in time (callers ask again)."""
        try:
            body = await asyncio.to_thread(
                fetch_plan, self.dht, self.s.swarm, self.trusted_key, min_version=self._plan_version
            )
        except TimeoutError as e:
            log.warning("%s; asking again", e)
            return None
        if body is None:
            return None
        plan = Plan.model_validate(body)
        self._plan_version = plan.version
        return plan

    async def wait_for_block(self, peer_id: str, timeout: float) -> Plan:
        """Wait for a signed plan that gives this peer a block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            plan = await self.fetch()
            if plan is not None and any(p.peer_id == peer_id for st in plan.stages for p in st.peers):
                return plan
            await asyncio.sleep(min(1.0, self.s.heartbeat))
        raise DiscoveryError(
            f"the coordinator of swarm {self.s.swarm!r} gave this peer no block within {timeout:.0f} s "
            "(the swarm may be full)"
        )

    @property
    def ttl(self) -> float:
        """How long an announcement lives: three heartbeats, so one lost heartbeat does not drop the peer."""
        return 3 * self.s.heartbeat

    async def announce(self, record: PeerRecord) -> None:
        self.record = record
        try:
            ok = await asyncio.get_running_loop().run_in_executor(
                self._announcer,
                partial(announce_peer, self.dht, self.s.swarm, record, self.ttl, signing_key=self.signing_key),
            )
        except TimeoutError:  # a stalled DHT: one missed heartbeat, never the end of the heartbeat task
            ok = False
        if not ok:
            log.warning("announcing this peer in the DHT failed; retrying at the next heartbeat")

    async def heartbeat(self) -> None:
        """Announce the record every heartbeat, each store on its own clock (swarm/dht/refresh.py)."""
        await refresh_every(
            self.s.heartbeat, lambda: None if self.record is None else self.announce(self.record), MAX_ANNOUNCING
        )

    async def rejoin(self) -> bool:
        """After a coordinator restart: ping its DHT node again, then re-announce this peer at once.

        Our DHT node dropped the coordinator's from its routing table when it stopped answering, and the
        restarted node (same identity and port) starts with an empty table; a ping puts each in the
        other's table, so the coordinator sees our record again and we see its new plans.
        """
        if self.dht is None:
            return False
        try:
            answered = await asyncio.to_thread(
                self.dht.run_coroutine, partial(_ping_initial_peers, tuple(self.initial_peers))
            )
        except Exception as e:  # noqa: BLE001 - the DHT is best effort here; the record expiry grace covers it
            log.warning("could not reconnect to the swarm's DHT: %s", e)
            answered = 0
        if self.record is not None:
            await self.announce(self.record)
        return answered > 0

    async def leave(self) -> None:
        """Graceful leave: a 'leaving' record hides this peer at once.

        The heartbeat stops announcing first: an announcement after the tombstone would expire later than it
        and show the peer again (one started before expires earlier, and the DHT keeps the later one).
        """
        record, self.record = self.record, None
        if self.dht is not None and record is not None:
            await asyncio.to_thread(
                withdraw_peer, self.dht, self.s.swarm, record, self.ttl, signing_key=self.signing_key
            )

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


async def _ping_initial_peers(maddrs: tuple[str, ...], _dht: object, node: object) -> int:
    """Runs inside the DHT process: reconnect to and ping each initial peer; how many answered."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    answered = 0
    for maddr in maddrs:
        full = Multiaddr(maddr)
        peer_id = PeerID.from_base58(full["p2p"])
        try:
            await node.p2p._client.connect(peer_id, [full.decapsulate(Multiaddr(f"/p2p/{full['p2p']}"))])
        except Exception:  # noqa: BLE001, S110 - the ping below says whether it is reachable
            pass
        if await node.protocol.call_ping(peer_id, validate=False, strict=False) is not None:
            answered += 1
    if answered:
        await node.find_nearest_nodes([node.node_id])
    return answered
