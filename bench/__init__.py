"""Benchmark harness for operate-sidecar. Entry point: python -m bench.run."""
