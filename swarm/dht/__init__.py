"""DHT record schemas, signed records and plans, DHT nodes, multiaddrs, a peer's view of the plan."""
