"""operate-sidecar: a JSON-RPC stdio sidecar running composed LLM operations (docs/PIPELINE.md)."""

__version__ = "0.2.0"
