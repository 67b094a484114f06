"""What a tool's name may not be, wherever the tool comes from (a client's registration, an MCP
server's list): the model calls a tool by its name, and log lines, events and permission prompts
show it, so a name no model could call (``""``, ``"a b/../\\n"``) or one shown as another
(``"write_file\\u200b"``, ``"rm\\u202efdp"``) is refused."""

from __future__ import annotations

import unicodedata

#: the longest name a tool may have (characters)
MAX_TOOL_NAME = 128

#: the Unicode categories a tool's name may not hold, whitespace aside: control characters (C0,
#: DEL, C1), format characters (U+200B zero width space, U+202E right-to-left override: a
#: permission prompt would show another name than the one called), line and paragraph separators
UNSEEN_CATEGORIES = {"Cc": "a control character", "Cf": "an invisible format character",
                     "Zl": "a line separator", "Zp": "a paragraph separator"}


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tool's name (``"is empty"``, ``"holds ..."``), or None."""
    if not name:
        return "is empty"
    if len(name) > MAX_TOOL_NAME:
        return f"is {len(name)} characters long; the limit is {MAX_TOOL_NAME}"
    for c in name:
        what = UNSEEN_CATEGORIES.get(unicodedata.category(c)) or ("whitespace" if c.isspace() else None)
        if what is not None:
            return f"holds {what} ({c!r}, U+{ord(c):04X})"
    return None
