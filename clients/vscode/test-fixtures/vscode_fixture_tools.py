"""Python tools for the VS Code client's tests (loaded through settings.toolModules)."""

import time


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper() + "!"


def nap(seconds: float, note: str = "") -> str:
    """Sleep, then answer (``note``: what the nap is for; only shown in the call)."""
    time.sleep(seconds)
    return "rested"
