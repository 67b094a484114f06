"""Tool module for the over-the-wire operate +actions scenario (settings `toolModules`).

The same sync `add` as bench/peers/inproc_common.py (duplicated: a tool module's
tools must be defined in the module itself)."""

__all__ = ["add"]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b
