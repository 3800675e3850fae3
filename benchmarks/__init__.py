"""Benchmarks of skpathkernel against its peers: ``python -m benchmarks [--quick]``."""
