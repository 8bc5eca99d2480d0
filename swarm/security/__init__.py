"""Swarm tokens and signed calls, TLS, identities, replay nonces, size limits."""
