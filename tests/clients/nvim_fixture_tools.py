"""Python tools for tests/clients/test_nvim.py (loaded by the server via settings.toolModules)."""

import sys
from pathlib import Path


def fixture_echo(text: str) -> str:
    """Echo the text back (and say so on stderr, which the plugin logs to a file)."""
    print(f"fixture_echo called with {text}", file=sys.stderr, flush=True)
    return f"echo:{text}"


def mark_file(path: str, text: str) -> str:
    """Write text to path (so a test can tell whether the tool really ran)."""
    Path(path).write_text(text, encoding="utf-8")
    return f"wrote:{text}"
