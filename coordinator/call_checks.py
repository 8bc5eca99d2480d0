"""Who may make a Control call that names a peer, and which state it may upload.

The proof of every call is checked by :class:`swarm.security.auth.ServerAuth`; what it cannot know is what the
request body says. A member could otherwise report, fetch or upload in another member's name, or
upload a block it does not hold at a version the run never reached: a fake high version then became
the "latest complete" checkpoint and pruned the real ones. So, before a handler touches the run:

* the caller is the peer the request names (its proof is signed by the key the plan pins for it);
* an upload is for the block (layers and stage) the current plan gives that peer, and a periodic one
  carries a version between the restore point and a little past the newest step the run has heard of.

Refusals are PERMISSION_DENIED (not that peer, not its block) or INVALID_ARGUMENT (a version the run
does not expect), raised before anything is stored. Without a swarm token nobody is authenticated
(tests only) and the identity check is skipped; the block and version checks always apply.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from swarm.pb import control_pb2 as cpb
from swarm.security.identity import IdentityError, check_caller

# How far past the newest reported step a stage's checkpoint may be: reports arrive once a second and a
# stage may run ahead of the step reports by its staleness bound; a real upload is never this far ahead.
CHECKPOINT_LEAD = 64


class CallRefused(Exception):
    """A call the run must not act on; ``code`` and the text go back to the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def caller_is(
    swarm_token: str, peer_key: Callable[[str], str | None], context: grpc.aio.ServicerContext, peer_id: str
) -> None:
    """CallRefused unless the call was made by ``peer_id`` itself (``peer_key``: the key its plan pins)."""
    if not swarm_token:
        return
    try:
        check_caller(context, peer_id, peer_key(peer_id))
    except IdentityError as e:
        raise CallRefused(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None


def checkpoint_window(
    restore_version: int, last_step: int, total_steps: int, checkpoint_every: int, staleness: int
) -> tuple[int, int]:
    """The versions a periodic checkpoint may carry now (inclusive): never before the restore point, never
    past the run's end, never far past the newest step reported."""
    heard = max(last_step + 1, restore_version)
    return restore_version, min(total_steps, heard + checkpoint_every + staleness + CHECKPOINT_LEAD)


def upload_allowed(held: tuple[int, int, int] | None, chunk: cpb.StateChunk, window: tuple[int, int]) -> None:
    """CallRefused unless ``chunk`` is its sender's own block of the current plan, at an expected version.

    ``held``: (stage, layer_start, layer_end) the plan gives the sender (None: no block); ``window``: the
    versions a periodic checkpoint may carry now (:func:`checkpoint_window`)."""
    if held is None:
        raise CallRefused(
            grpc.StatusCode.PERMISSION_DENIED, f"peer {chunk.peer_id!r} holds no block in the current plan"
        )
    sent = (chunk.stage, chunk.layer_start, chunk.layer_end)
    if sent != held:
        raise CallRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"peer {chunk.peer_id!r} holds stage {held[0]} layers [{held[1]}, {held[2]}) in the current plan, "
            f"not stage {sent[0]} layers [{sent[1]}, {sent[2]})",
        )
    if chunk.periodic:
        low, high = window
        if not low <= chunk.version <= high:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"checkpoint version {chunk.version} is not one this run expects now ({low}..{high})",
            )
