"""What the test files that check a run leaves no process behind share: the processes of a run,
found by a marker in their environment (every process the run starts inherits it)."""

from __future__ import annotations

from pathlib import Path


def marked_processes(mark: str) -> dict[int, str]:
    """Every live process (not a zombie) whose environment holds ``mark`` (a ``NAME=value`` entry,
    or part of one): pid -> command line, in the order of ``/proc``."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if mark.encode() not in (d / "environ").read_bytes():
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found
