"""Per-sender limits on a peer's gRPC server: call rate, calls in flight, bytes per second, sizes.

A stranger (or a buggy member) must not be able to make a peer buffer without bound, hold all its
streams, or keep its event loop busy. Every limit here refuses with RESOURCE_EXHAUSTED and a reason
that names the limit, so an honest operator who hits one knows which knob it was.

* :class:`ServerLimits` (a grpc.aio server interceptor, installed after :class:`swarm.security.auth.ServerAuth`)
  refuses calls beyond a per-sender token bucket or over the per-sender / total in-flight caps, and for
  framed methods (``Stage.Link``, ``Control.UploadState``) checks every incoming ``Frame`` *before* the
  handler's Reassembler sees it: frame size, the announced packet size, a small cap on the first packet
  of a link (the Hello: nothing large is buffered for an unauthenticated-by-Hello stranger) and a
  per-sender byte rate (throttled up to ``max_wait_s``, refused beyond).
* :func:`check_elements` / :func:`stage_limits` bound tensor sizes from the stage's own assignment,
  for use before a codec decodes anything.

A "sender" is the peer id of a verified proof with the key that signed it when auth is on (a planned
peer's id only its key holder can use; a token holder can still mint unplanned ids and keys, which the
total cap bounds), else the remote IP address.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc

from swarm.pb import wire_pb2 as pb
from swarm.security.auth import authenticated_peer, deny_handler
from swarm.security.identity import caller_key
from swarm.wire.packets import DEFAULT_MAX_ELEMENTS, MAX_DIMS, MAX_FRAME_BYTES, WireError
from swarm.wire.transport import MAX_GRPC_MESSAGE

MAX_GRPC_MESSAGE_BYTES = MAX_GRPC_MESSAGE
MAX_HELLO_BYTES = 4096  # a Hello is ~100 bytes; the first packet of a link may not be larger
DEFAULT_MAX_PACKET_BYTES = 256 << 20
STAGE_LINK = "/ravn.wire.Stage/Link"
UPLOAD_STATE = "/ravn.control.Control/UploadState"

# Server options that bound what one connection may hold; append them to swarm.wire.transport.GRPC_OPTIONS.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_concurrent_streams", 16),  # per HTTP/2 connection; one link needs one
    ("grpc.max_metadata_size", 16 * 1024),  # auth metadata is ~250 bytes
    ("grpc.max_connection_idle_ms", 300_000),  # no call for 5 min: drop the connection
]


class LimitExceeded(WireError):
    """A sender went over a limit; ``code`` is the gRPC status to end its call with."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def status_code_for(exc: BaseException, default: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> grpc.StatusCode:
    """The status a refused stream should end with: the exception's own ``code`` when it has one."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, grpc.StatusCode) else default


# ---------------------------------------------------------------------------------------------------
# Sizes.


def check_elements(shape: Iterable[int], max_elements: int = DEFAULT_MAX_ELEMENTS) -> int:
    """The element count of ``shape`` (a wire header), or LimitExceeded before anything is allocated."""
    dims = list(shape)
    if len(dims) > MAX_DIMS:
        raise WireError(f"tensor has {len(dims)} dimensions; at most {MAX_DIMS} are accepted")
    if any(d < 0 for d in dims):
        raise WireError(f"negative dimension in shape {dims}")
    n = math.prod(dims)
    if n > max_elements:
        raise LimitExceeded(f"tensor of {n} elements exceeds the limit of {max_elements}")
    return n


@dataclass(frozen=True)
class StageLimits:
    """What one stage ever needs to accept: derived from its assignment, not from the sender."""

    max_elements: int  # elements of the largest tensor in one packet
    max_packet_bytes: int  # serialised packet, fp32 on the wire plus headroom


def stage_limits(micro_batch_size: int, context: int, d_model: int, *, headroom: float = 1.5) -> StageLimits:
    """Limits for activations/gradients of ``(micro_batch_size, context, d_model)``.

    fp32 is the widest codec, so its size bounds every codec; ``headroom`` covers targets, headers
    and protobuf overhead.
    """
    elements = micro_batch_size * context * d_model
    packet = int(elements * 4 * headroom) + micro_batch_size * context * 8 + 64 * 1024
    return StageLimits(max_elements=elements, max_packet_bytes=packet)


# ---------------------------------------------------------------------------------------------------
# Token buckets.


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; starts full."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    stamp: float = field(default=-1.0)

    def _refill(self, now: float) -> None:
        if self.stamp < 0:
            self.tokens, self.stamp = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def try_take(self, cost: float, now: float) -> bool:
        """Take ``cost`` tokens if they are there; never goes into debt."""
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def reserve(self, cost: float, now: float, max_wait: float) -> float | None:
        """Take ``cost`` tokens, going into debt; the seconds to wait before using them, or None
        (nothing taken) when that wait would exceed ``max_wait``."""
        self._refill(now)
        wait = max(0.0, cost - self.tokens) / self.rate if self.rate > 0 else math.inf
        if wait > max_wait:
            return None
        self.tokens -= cost
        return wait


class KeyedBuckets:
    """One :class:`TokenBucket` per sender, the least recently used forgotten beyond ``max_keys``.

    Forgetting a sender refills its bucket, so ``max_keys`` should comfortably exceed the swarm size.
    """

    def __init__(self, rate: float, burst: float, max_keys: int = 4096) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def get(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def __len__(self) -> int:
        return len(self._buckets)


class InflightLimiter:
    """Counts calls (or micro-batches) in flight per sender and in total."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key, self.total = per_key, total
        self.counts: dict[str, int] = {}
        self.active = 0

    def acquire(self, key: str) -> None:
        """Count one more for ``key``, or LimitExceeded naming the cap that was hit."""
        if self.active >= self.total:
            raise LimitExceeded(f"this peer already serves {self.active} calls (limit {self.total}); retry later")
        held = self.counts.get(key, 0)
        if held >= self.per_key:
            raise LimitExceeded(f"sender {key!r} already has {held} calls in flight here (limit {self.per_key})")
        self.counts[key] = held + 1
        self.active += 1

    def release(self, key: str) -> None:
        held = self.counts.get(key, 0)
        if held <= 1:
            self.counts.pop(key, None)
        else:
            self.counts[key] = held - 1
        self.active = max(0, self.active - 1)

    @contextlib.contextmanager
    def hold(self, key: str):
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)


# ---------------------------------------------------------------------------------------------------
# Frames.


@dataclass(frozen=True)
class FrameRules:
    """Size rules for one framed method. ``first_packet_bytes``: cap of the first packet (the Hello)."""

    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES
    first_packet_bytes: int = MAX_HELLO_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES


LINK_RULES = FrameRules()
UPLOAD_RULES = FrameRules(first_packet_bytes=DEFAULT_MAX_PACKET_BYTES)


class FrameGuard:
    """Checks the frames of one stream before they are reassembled; raises LimitExceeded.

    Mirrors the Reassembler's packet boundaries (a packet starts with a frame after ``last``), so it
    knows which announced ``total_size`` and which running byte count apply.
    """

    def __init__(self, rules: FrameRules) -> None:
        self.rules = rules
        self.packets = 0
        self._in_packet = False
        self._size = 0
        self._cap = rules.first_packet_bytes

    def check(self, frame: pb.Frame) -> int:
        """Admit ``frame``; returns its payload size (what the byte rate is charged)."""
        n = len(frame.data)
        if n > self.rules.max_frame_bytes:
            raise LimitExceeded(f"frame of {n} bytes exceeds the limit of {self.rules.max_frame_bytes}")
        if not self._in_packet:
            self._cap = min(
                self.rules.first_packet_bytes if self.packets == 0 else self.rules.max_packet_bytes,
                self.rules.max_packet_bytes,
            )
            if frame.total_size > self._cap:
                what = "first packet (the hello)" if self.packets == 0 else "packet"
                raise LimitExceeded(f"{what} of {frame.total_size} bytes exceeds the limit of {self._cap}")
            self._in_packet, self._size = True, 0
        self._size += n
        if self._size > self._cap:
            raise LimitExceeded(f"packet grew past the limit of {self._cap} bytes")
        if frame.last:
            self._in_packet = False
            self.packets += 1
        return n


# ---------------------------------------------------------------------------------------------------
# The interceptor.


@dataclass(frozen=True)
class LimitSettings:
    calls_per_s: float = 20.0  # new calls per sender (a link is one long call)
    call_burst: float = 40.0
    inflight_per_sender: int = 4
    inflight_total: int = 64
    bytes_per_s: float = 256e6  # per sender, after the burst; a home uplink is far below this
    byte_burst: float = 512e6
    max_wait_s: float = 5.0  # throttle a fast sender up to this long, then refuse
    max_senders: int = 4096
    framed: dict[str, FrameRules] = field(default_factory=lambda: {STAGE_LINK: LINK_RULES, UPLOAD_STATE: UPLOAD_RULES})


def sender_key(context: grpc.aio.ServicerContext) -> str:
    """Who to charge: the peer id of a verified proof (behind ServerAuth), else the remote address."""
    peer = authenticated_peer(context)
    if peer:  # with the key that signed it: a name only its key holder shares (swarm/security/identity.py)
        return f"peer:{peer}:{caller_key(context) or ''}"
    remote = context.peer() or "unknown"  # "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"
    host = remote.split(":", 1)[-1].rsplit(":", 1)[0]
    return f"addr:{host}"


class _GuardedContext:
    """The servicer context, with every ``read()`` passed through a FrameGuard and the byte bucket."""

    def __init__(self, context: grpc.aio.ServicerContext, admit: Callable[[object], Awaitable[None]]) -> None:
        self._context = context
        self._admit = admit

    async def read(self) -> object:
        message = await self._context.read()
        if message is not grpc.aio.EOF:
            await self._admit(message)
        return message

    def __getattr__(self, name: str) -> object:
        return getattr(self._context, name)


class ServerLimits(grpc.aio.ServerInterceptor):
    """Per-sender call rate and in-flight caps for every method; frame checks for framed methods."""

    def __init__(
        self,
        settings: LimitSettings | None = None,
        *,
        key: Callable[[grpc.aio.ServicerContext], str] = sender_key,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.s = settings or LimitSettings()
        self.key = key
        self.clock = clock
        self.calls = KeyedBuckets(self.s.calls_per_s, self.s.call_burst, self.s.max_senders)
        self.bytes = KeyedBuckets(self.s.bytes_per_s, self.s.byte_burst, self.s.max_senders)
        self.inflight = InflightLimiter(self.s.inflight_per_sender, self.s.inflight_total)
        self.refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        rules = self.s.framed.get(handler_call_details.method)
        names = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        shape = names[2 * handler.request_streaming + handler.response_streaming]
        behavior = getattr(handler, shape)
        if behavior is None:  # pragma: no cover - grpc always fills the field matching the flags
            return deny_handler(handler, grpc.StatusCode.INTERNAL, "malformed handler")
        return handler._replace(**{shape: self._wrap(behavior, rules if handler.request_streaming else None)})

    # ---- per call ---------------------------------------------------------------------------------
    async def _enter(self, context: grpc.aio.ServicerContext) -> str:
        key = self.key(context)
        if not self.calls.get(key).try_take(1.0, self.clock()):
            self.refused += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls from {key} (limit {self.s.calls_per_s:g}/s); slow down",
            )
        try:
            self.inflight.acquire(key)
        except LimitExceeded as e:
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return key

    def _admitter(self, context: grpc.aio.ServicerContext, key: str, rules: FrameRules):
        guard = FrameGuard(rules)
        bucket = self.bytes.get(key)

        async def admit(message: object) -> None:
            try:
                if not isinstance(message, pb.Frame):
                    raise LimitExceeded(f"expected Frame messages, got {type(message).__name__}")
                n = guard.check(message)
                wait = bucket.reserve(float(n), self.clock(), self.s.max_wait_s)
                if wait is None:
                    raise LimitExceeded(f"sender {key} exceeds {self.s.bytes_per_s / 1e6:g} MB/s")
            except LimitExceeded as e:
                self.refused += 1
                await context.abort(e.code, str(e))
            if wait > 0:
                await asyncio.sleep(wait)

        return admit

    def _wrap(self, behavior, rules: FrameRules | None):
        def prepare(request, context, key):
            if rules is None:
                return request, context
            admit = self._admitter(context, key, rules)

            async def guarded_requests() -> AsyncIterator[object]:
                async for message in request:
                    await admit(message)
                    yield message

            return guarded_requests(), _GuardedContext(context, admit)

        if inspect.isasyncgenfunction(behavior):

            async def stream_wrapper(request, context):
                key = await self._enter(context)
                try:
                    request, inner = prepare(request, context, key)
                    async for item in behavior(request, inner):
                        yield item
                finally:
                    self.inflight.release(key)

            return stream_wrapper

        async def wrapper(request, context):
            key = await self._enter(context)
            try:
                request, inner = prepare(request, context, key)
                result = behavior(request, inner)
                return await result if inspect.isawaitable(result) else result
            finally:
                self.inflight.release(key)

        return wrapper
