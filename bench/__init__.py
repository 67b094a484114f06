"""Benchmark harness for operate-sidecar (issue 6). Entry point: python -m bench.run."""
