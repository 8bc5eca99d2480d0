"""A quick measure of the link to the coordinator before joining: one upload, one download.

Real traffic with neighbours refines it later; this first number only has to rank peers roughly.
"""

from __future__ import annotations

import logging
import time

import grpc

from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 20


async def measure_bandwidth(
    channel: grpc.aio.Channel, nbytes: int = PROBE_BYTES, timeout: float = 20.0
) -> tuple[float, float]:
    """(upload, download) bytes/s over ``channel`` to the coordinator; (0, 0) if it cannot be measured."""
    try:
        async with channel:
            stub = cgrpc.ControlStub(channel)
            await stub.Probe(cpb.ProbeRequest(), timeout=timeout)  # connect and warm up
            t0 = time.perf_counter()
            await stub.Probe(cpb.ProbeRequest(payload=bytes(nbytes)), timeout=timeout)
            up = nbytes / max(time.perf_counter() - t0, 1e-6)
            t0 = time.perf_counter()
            await stub.Probe(cpb.ProbeRequest(reply_bytes=nbytes), timeout=timeout)
            down = nbytes / max(time.perf_counter() - t0, 1e-6)
            return up, down
    except grpc.aio.AioRpcError as e:
        log.warning("could not measure the link to the coordinator: %s", e.details())
        return 0.0, 0.0
