"""Replay protection for call proofs, accounted per member so one member can never refuse another's.

A nonce accepted at local time ``t`` can be replayed only while its timestamp is in the clock window,
i.e. until ``t + 2 * skew``; it is kept that long. Memory is bounded, so a full cache evicts its oldest
entry and raises a *floor* to that entry's timestamp: a proof stamped at or before the floor is refused,
so an evicted nonce can never be replayed.

One shared cache let a member lock everyone out: 65,536 cheap proofs stamped up to 299 s ahead pushed
the floor past every honest clock for minutes. Hence :class:`NonceBook`:

* each member whose key the plan pins (an identity: :mod:`swarm.security.identity`) has its own cache and floor.
  Evicting its entries raises only its own floor, to one of its own earlier stamps, so its own next
  proof (stamped later) still passes and nobody else's is touched;
* callers that no plan pins (``ravn status``, a peer measuring its link before it is planned, anyone
  with a key of their own) share one cache whose floor never rises above the server's clock minus
  ``SHARED_FLOOR_LAG_S``: however it is flooded, a proof stamped by a clock less than that behind the
  server's still passes. The price: an evicted nonce stamped later than that (the server's clock minus
  the lag) can be replayed while its stamp is in the window. Such calls name no peer (read-only
  status, a dial-back, a bandwidth probe; every call that names a peer is checked against the plan's
  key by its handler), so a replay does nothing a fresh call by any token holder could not.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_NONCE_CACHE = 65536  # proofs remembered within the window for callers no plan pins (about 6 MiB)
DEFAULT_PER_MEMBER = 16384  # per pinned member: far above what a peer sends one server in 10 minutes
DEFAULT_MAX_MEMBERS = 4096  # a plan holds at most 128 stages x 32 peers
SHARED_FLOOR_LAG_S = 60.0  # an unpinned caller's clock may lag the server's this much under a flood
_LATE = "proof is older than the replay cache can vouch for (server under load); retry"


class NonceCache:
    """Nonces of accepted proofs of one caller (or of all unpinned callers), bounded by ``capacity``.

    ``floor_lag_s``: keep the floor at least this far below the server's clock (the shared cache, see the
    module doc); None: the floor follows the evicted stamps (a member's own cache).
    """

    def __init__(self, skew_s: float, capacity: int, *, floor_lag_s: float | None = None) -> None:
        if capacity < 1:
            raise ValueError("nonce cache capacity must be at least 1")
        self.hold_s = 2.0 * skew_s
        self.capacity = capacity
        self.floor_lag_s = floor_lag_s
        self.floor_ms = -1
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()  # nonce -> (expiry, ts_ms)

    def __len__(self) -> int:
        return len(self._seen)

    def expire(self, now: float) -> None:
        """Forget nonces that can no longer pass the clock window."""
        while self._seen:
            first = next(iter(self._seen.values()))
            if first[0] > now:
                break
            self._seen.popitem(last=False)

    def add(self, nonce: str, ts_ms: int, now: float) -> str | None:
        """Record ``nonce``; returns why it must be refused, or None when it is fresh."""
        self.expire(now)
        if nonce in self._seen:
            return "replayed proof: this nonce was already used"
        if ts_ms <= self.floor_ms:
            return _LATE
        if len(self._seen) >= self.capacity:
            _, (_, evicted_ts) = self._seen.popitem(last=False)
            if self.floor_lag_s is not None:
                evicted_ts = min(evicted_ts, int((now - self.floor_lag_s) * 1000))
            self.floor_ms = max(self.floor_ms, evicted_ts)
            if ts_ms <= self.floor_ms:
                return _LATE
        self._seen[nonce] = (now + self.hold_s, ts_ms)
        return None


class NonceBook:
    """A :class:`NonceCache` per pinned member, and one shared by everyone else."""

    def __init__(
        self,
        skew_s: float,
        capacity: int = DEFAULT_NONCE_CACHE,
        *,
        per_member: int = DEFAULT_PER_MEMBER,
        max_members: int = DEFAULT_MAX_MEMBERS,
    ) -> None:
        self.skew_s, self.per_member, self.max_members = skew_s, min(per_member, capacity), max_members
        self.shared = NonceCache(skew_s, capacity, floor_lag_s=SHARED_FLOOR_LAG_S)
        self.members: dict[str, NonceCache] = {}

    def __len__(self) -> int:
        return len(self.shared) + sum(len(c) for c in self.members.values())

    def add(self, member: str | None, nonce: str, ts_ms: int, now: float) -> str | None:
        """Record ``nonce`` for ``member`` (an identity the plan pins; None: not pinned)."""
        cache = self.shared if member is None else self._cache(member, now)
        return cache.add(nonce, ts_ms, now)

    def _cache(self, member: str, now: float) -> NonceCache:
        cache = self.members.get(member)
        if cache is not None:
            return cache
        if len(self.members) >= self.max_members:
            self._forget_idle(now)
        if len(self.members) >= self.max_members:  # more pinned members than any plan holds: share
            return self.shared
        cache = self.members[member] = NonceCache(self.skew_s, self.per_member)
        return cache

    def _forget_idle(self, now: float) -> None:
        """Drop caches whose every entry expired: whatever they evicted expired before, so no floor is lost."""
        for member, cache in list(self.members.items()):
            cache.expire(now)
            if len(cache) == 0:
                del self.members[member]
