"""The simulated engine replica (no GPU) and the launcher that starts replicas, gateways and peers as
processes on loopback: used by `prefix-gateway demo`, the tests and the load tests."""
