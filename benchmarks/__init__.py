"""Benchmarks that make the course's numbers visible: KV fragmentation, offline throughput, prefix caching."""
