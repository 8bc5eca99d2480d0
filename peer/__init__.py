"""The peer daemon (``ravn-peer``): lends one machine to a swarm and runs the block the signed plan gives it."""
