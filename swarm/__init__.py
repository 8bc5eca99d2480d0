"""Ravn's library: the DHT, the wire, the stage runtime and the planner that peers and coordinators share.

Importing it first turns gRPC's fork support off, before anything loads gRPC. Ravn forks hivemind's DHT
process from processes whose gRPC servers are busy (a peer restarts its node as a NAT client). gRPC
then skips its pre-fork step, because other threads are inside it, but still restarts its thread pools
in the child, where they segfault: about half of the DHT processes forked so died before they were
ready. No child of Ravn's uses gRPC, so the support buys nothing. gRPC reads the setting once, when it
is loaded: ``peer``, ``coordinator`` and the tests import this package before anything else.
"""

import os as _os
import sys as _sys

if "grpc" not in _sys.modules:  # once loaded, gRPC keeps what it read
    _os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
GRPC_FORK_SUPPORT_OFF: bool = _os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").lower() in ("false", "0", "no", "off")
