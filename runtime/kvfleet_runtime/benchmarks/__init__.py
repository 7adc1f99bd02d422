"""Benchmarks: `kvfleet bench throughput | latency | serve`, and their plots."""
