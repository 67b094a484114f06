"""Crash-safe branch state: a SQLite store per ``stateDir`` (see ``store.py``); the 0.1 JSONL
journal is only read, to import it once (``jsonl_import.py``)."""

from .store import DB_FILE, LoadedBranch, StateNotSaved, StateStore, UnavailableStore, no_collection

__all__ = ["DB_FILE", "LoadedBranch", "StateNotSaved", "StateStore", "UnavailableStore", "no_collection"]
