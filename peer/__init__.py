"""The peer daemon (``ravn-peer``): lends one machine to a swarm and runs the block the signed plan gives it."""

import swarm  # noqa: F401  (first: it sets gRPC's fork mode before anything loads gRPC)
