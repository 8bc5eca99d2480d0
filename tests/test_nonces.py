"""Replay protection accounted per member: one member's proofs can never refuse another member's.

Before, one shared cache evicted its oldest nonce and raised a floor to that proof's timestamp, which a
member could stamp up to 299 s ahead: a cache-full of future-stamped proofs pushed the floor past every
honest clock and locked the whole swarm out for minutes.
"""

from __future__ import annotations

from swarm.dht.signing import new_key
from swarm.security import auth
from swarm.security.identity import CallSigner
from swarm.security.nonces import NonceBook, NonceCache

TOKEN = auth.generate_token()
KEY = auth.SwarmKey.from_token(TOKEN)
CAPACITY = 256  # the defaults behave the same, only slower to fill
METHOD = "/ravn.control.Control/Report"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def proof(peer: str, signer: CallSigner, at: float):
    return auth.proof_metadata(KEY, peer, "coordinator", METHOD, signer=signer, now=at)


def test_a_flood_of_future_stamped_proofs_from_one_member_refuses_no_other_caller() -> None:
    clock = Clock()
    mallory, honest = CallSigner(new_key()), CallSigner(new_key())
    pins = {"mallory": mallory.public_key, "honest": honest.public_key}
    v = auth.Verifier(TOKEN, audiences=["coordinator"], keys=pins.get, nonce_capacity=CAPACITY, clock=clock)
    accepted = 0
    for i in range(3 * CAPACITY):  # as its own member, and under unplanned names with keys of its own
        for md in (proof("mallory", mallory, clock.now + 299), proof(f"m{i}", CallSigner(new_key()), clock.now + 299)):
            try:
                v.verify(md, METHOD)
                accepted += 1
            except auth.AuthError as e:  # once its own cache is full, its own floor refuses it
                assert "older than the replay cache" in str(e)
    assert accepted >= 2 * CAPACITY
    assert v.verify(proof("honest", honest, clock.now), METHOD) == "honest"
    clock.now += 1.0  # an unplanned caller (`ravn status`) is not refused for minutes either
    assert v.verify(proof("operator", CallSigner(new_key()), clock.now), METHOD) == "operator"
    late = proof("mallory", mallory, clock.now)  # its own floor is its own doing
    try:
        v.verify(late, METHOD)
        raise AssertionError("mallory's floor did not rise")
    except auth.AuthError as e:
        assert "older than the replay cache" in str(e)


def test_per_member_caches_still_refuse_every_replay() -> None:
    book = NonceBook(skew_s=10, capacity=4, max_members=2)
    assert book.add("a", "n1", 1000, now=1.0) is None
    for i in range(4):  # evicts n1: the floor refuses it from now on
        assert book.add("a", f"m{i}", 2000 + i, now=2.0) is None
    assert book.add("a", "n1", 1000, now=3.0) is not None
    assert book.add("b", "n1", 1000, now=3.0) is None  # b's nonces are b's own
    assert book.add("c", "x", 5000, now=3.0) is None  # a third member beyond max_members shares the common cache
    assert "c" not in book.members and len(book.shared) == 1
    assert book.add("c", "x", 5000, now=3.0) is not None  # and is still protected there
    assert book.add("d", "y", 30_000, now=30.0) is None  # a and b expired: their caches make room
    assert set(book.members) == {"d"}


def test_the_shared_floor_stays_below_the_servers_clock() -> None:
    cache = NonceCache(skew_s=300, capacity=2, floor_lag_s=60)
    for i in range(3):
        assert cache.add(f"f{i}", 1_299_000, now=1000.0) is None  # stamped 299 s ahead
    assert cache.floor_ms == 940_000
    assert cache.add("honest", 1_000_000, now=1000.5) is None  # a full cache of future stamps refuses no clock
    assert cache.add("lagging", 950_000, now=1000.5) is None  # not even one 50 s behind
    assert cache.add("f0", 1_299_000, now=1000.5) is None  # the price: an evicted nonce within the lag replays
