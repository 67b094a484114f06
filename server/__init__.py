"""operate-sidecar: a JSON-RPC stdio sidecar running composed LLM operations (ADR-0022)."""

__version__ = "0.1.0"
