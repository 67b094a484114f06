"""Python tools for the VS Code client's tests (loaded through settings.toolModules)."""

import time


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper() + "!"


def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "rested"
