"""Activations sent as their change since the sample's last visit (AQ-SGD, Wang et al. 2022).

A fine-tuning set is seen for several epochs, and between two visits of a sample the weights move little,
so its activation at a boundary moves little too: the change quantises to a few bits with far less error
than the activation itself. Both sides of a link keep, per sample, the row they last agreed on (what the
receiver decoded, not what the sender computed, so the two copies are equal by construction); the sender
sends ``activation - row`` and both add what the receiver decodes to their row.

Per micro-batch the sender picks one mode (``pb.Cache``): DELTA when every sample's row is held on both
sides, else STORE (the activation in the link's own codec, rows kept) while the store has room, else NONE.
The sender alone decides what is held, and never evicts, so the receiver (same capacity, same order of
packets on one stream) can refuse a STORE beyond its room as bad input. What can still part them is a
packet the receiver dropped (an implausible tensor): the dropped gradient that comes back marks those
samples dirty on the sender, whose next visit is a STORE again. A new link starts both sides empty.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

import torch

from swarm.pb import wire_pb2 as pb
from swarm.wire.codecs import EncodedTensor, decode
from swarm.wire.packets import WireError
from swarm.wire.sample_store import SampleStore, StoreFull

# (tensor, the activation it changes or None) -> encoded with the codec of deltas or of the link
Encode = Callable[[torch.Tensor, torch.Tensor | None], EncodedTensor]


class NotCached(Exception):
    """A delta for a sample whose row this side does not hold: the micro-batch is dropped, not the link."""


def _samples(samples: list[int], rows: int) -> list[int]:
    if len(samples) != rows:
        raise WireError(f"{len(samples)} sample indices for a micro-batch of {rows} rows")
    if len(set(samples)) != len(samples):
        raise WireError("a sample index repeats within one micro-batch")
    return samples


class DeltaSender:
    """One downstream link's sending side: which samples the receiver holds, and their rows."""

    def __init__(self, store: SampleStore) -> None:
        self.store = store
        self._dirty: set[int] = set()  # held, but the receiver may hold another row (it dropped a packet)

    def mode(self, samples: list[int], shape: tuple[int, ...]) -> int:
        """How a micro-batch of these samples, each row of ``shape``, travels."""
        if not samples:
            return pb.CACHE_NONE
        if all(s in self.store and s not in self._dirty for s in samples) and self.store.fits(shape):
            return pb.CACHE_DELTA
        return pb.CACHE_STORE if self.store.room(samples, shape) else pb.CACHE_NONE

    def encode(self, samples: list[int], hidden: torch.Tensor, encode: Encode) -> tuple[int, EncodedTensor]:
        """The mode and encoded tensor of ``hidden`` (rows: ``samples``); the rows held become the receiver's."""
        mode = self.mode(samples, tuple(hidden.shape[1:]))
        if mode == pb.CACHE_NONE:
            return mode, encode(hidden, None)
        x = hidden.detach().to("cpu", torch.float32)
        base = self.store.get(samples) if mode == pb.CACHE_DELTA else None
        enc = encode((x - base).to(hidden.dtype), x) if base is not None else encode(x.to(hidden.dtype), None)
        seen = decode(enc, max_elements=max(1, x.numel())).float()
        self.store.put(samples, seen if base is None else seen.add_(base))
        self._dirty.difference_update(samples)
        return mode, enc

    def dropped(self, samples: list[int]) -> None:
        """The receiver dropped a micro-batch of ``samples``: it may not hold what we hold for them."""
        self._dirty.update(s for s in samples if s in self.store)


class DeltaReceiver:
    """One upstream link's receiving side: the rows agreed with its sender."""

    def __init__(self, store: SampleStore) -> None:
        self.store = store

    def rebuild(self, act: pb.Activations, x: torch.Tensor) -> torch.Tensor:
        """The activation that ``act`` (its ``hidden`` decoded as ``x``) stands for."""
        if act.cache == pb.CACHE_NONE:
            return x
        samples = _samples(list(act.mb.samples), x.shape[0] if x.dim() else 0)
        shape = tuple(x.shape[1:])
        if act.cache == pb.CACHE_STORE:
            if not self.store.room(samples, shape):
                raise WireError(f"activation rows to cache beyond the agreed room of {self.store.capacity} samples")
            return x
        if act.cache != pb.CACHE_DELTA:
            raise WireError(f"unknown cache mode {act.cache}")
        missing = [s for s in samples if s not in self.store]
        if missing or not self.store.fits(shape):
            raise NotCached(f"a delta for {len(missing) or len(samples)} sample(s) whose rows this side lacks")
        return self.store.get(samples).to(x.device).add_(x.float()).to(x.dtype)

    def commit(self, act: pb.Activations, x: torch.Tensor) -> None:
        """Hold ``x``, the accepted activation, as its samples' rows (once it passed every check)."""
        if act.cache != pb.CACHE_NONE:
            try:
                self.store.put(list(act.mb.samples), x)
            except StoreFull as e:  # rebuild checked the room: only a bug gets here
                raise WireError(str(e)) from e


class SampleDeltas:
    """A Stage's activation deltas: a sender per downstream link, a receiver per upstream link, each with its
    own store, forgotten with its link (a new link starts empty on both sides)."""

    def __init__(self, codec: str, memory_bytes: int, spill_bytes: int, spill_dir: str | None = None) -> None:
        self.codec = codec
        self._store = lambda: SampleStore(memory_bytes, spill_bytes, spill_dir)
        self._senders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._receivers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def sender(self, link: object) -> DeltaSender:
        if link not in self._senders:
            self._senders[link] = DeltaSender(self._store())
        return self._senders[link]

    def receiver(self, link: object) -> DeltaReceiver:
        if link not in self._receivers:
            self._receivers[link] = DeltaReceiver(self._store())
        return self._receivers[link]

    def lock(self, link: object) -> asyncio.Lock:
        """Held from a micro-batch's encoding to its send: the receiver sees packets in the order they were
        encoded in, which is what keeps the two sides' rows equal."""
        if link not in self._locks:
            self._locks[link] = asyncio.Lock()
        return self._locks[link]

    def held(self) -> tuple[int, int]:
        """Samples held (in all, and of those on disk) across this Stage's links."""
        stores = [d.store for d in [*self._senders.values(), *self._receivers.values()]]
        return sum(len(s) for s in stores), sum(s.spilled for s in stores)
