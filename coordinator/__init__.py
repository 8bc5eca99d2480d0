"""The coordinator (``ravn``, ``ravn-coordinator``): plans the swarm from the DHT and runs ``ravn local``."""

import swarm  # noqa: F401  (first: it sets gRPC's fork mode before anything loads gRPC)
