"""Crash-safe branch state: an append-only journal per branch with snapshots."""

from .journal import Journal, LoadedBranch

__all__ = ["Journal", "LoadedBranch"]
