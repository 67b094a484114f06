"""Builtin workspace tools (source ``builtin``), rooted at the initialize ``workspaceFolders``.

``WorkspaceTools(roots).tools()`` gives:

- ``read_file(path, offset=1, limit=2000)`` (read-only): text lines from line ``offset``
  (1-based), at most ``limit`` lines and ``max_read_bytes`` characters;
- ``list_dir(path=".")`` (read-only): the entries of a directory, capped;
- ``search_text(pattern, path=".", regex=False, ignore_case=False, max_results=100)``
  (read-only): matching lines (1-based line numbers) in text files under ``path``, with a
  result cap and a scan budget;
- ``write_file(path, content)`` (not read-only, so the default policy is ``ask``).

Paths: a relative path is relative to the first root; in a multi-root workspace a
relative path may also start with another root's folder name (``other/src/x.py``), as
editors show them. Absolute paths are accepted when inside a root. Every path is resolved
(``..`` and symlinks followed) and must end inside a root, else the call fails with
:class:`WorkspacePathError`. Paths in results are shown the same way (relative to the
first root, or ``<folder name>/...`` for another root).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..core.tools import Tool
from .errors import ToolSourceError, WorkspacePathError

__all__ = ["WorkspaceTools"]

SKIP_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".tox"})
_BINARY_SNIFF = 8192


class WorkspaceTools:
    """Factory of the builtin workspace tools for the given roots."""

    def __init__(self, roots: Iterable[str | os.PathLike[str]], *, max_read_bytes: int = 256 * 1024,
                 max_list_entries: int = 1000, max_results: int = 200, max_line_chars: int = 300,
                 max_search_file_bytes: int = 2 * 1024 * 1024, max_search_files: int = 20_000,
                 max_search_bytes: int = 64 * 1024 * 1024, max_write_bytes: int = 10 * 1024 * 1024) -> None:
        resolved: list[Path] = []
        for r in roots:
            p = Path(os.path.realpath(os.fspath(r)))
            if not p.is_dir():
                raise ToolSourceError(f"workspace folder {os.fspath(r)!r} is not a directory")
            if p not in resolved:
                resolved.append(p)
        self.roots = resolved
        self.max_read_bytes = max_read_bytes
        self.max_list_entries = max_list_entries
        self.max_results = max_results
        self.max_line_chars = max_line_chars
        self.max_search_file_bytes = max_search_file_bytes
        self.max_search_files = max_search_files
        self.max_search_bytes = max_search_bytes
        self.max_write_bytes = max_write_bytes

    def tools(self) -> list[Tool]:
        """The workspace tools; none when there is no workspace folder."""
        if not self.roots:
            return []
        where = (f"Paths are relative to the workspace root {self.roots[0]}" if len(self.roots) == 1 else
                 f"Paths are relative to the first workspace root {self.roots[0]} or start with another "
                 f"root's folder name ({', '.join(r.name for r in self.roots[1:])})")
        out = []
        for fn, read_only in ((self.read_file, True), (self.list_dir, True), (self.search_text, True),
                              (self.write_file, False)):
            t = Tool.from_function(fn, source="builtin", read_only=read_only)
            t.description = f"{t.description} {where}."
            out.append(t)
        return out

    # -- paths -----------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The real path ``path`` names, which must be inside a root, else WorkspacePathError."""
        if not self.roots:
            raise WorkspacePathError("there is no workspace folder")
        if not isinstance(path, str):
            raise WorkspacePathError(f"path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise WorkspacePathError("path contains a NUL character")
        p = Path(path or ".")
        if p.is_absolute():
            candidate = p
        else:
            candidate = self.roots[0] / p
            if len(self.roots) > 1 and p.parts and not candidate.exists():
                for root in self.roots[1:]:
                    if p.parts[0] == root.name:
                        candidate = root.joinpath(*p.parts[1:])
                        break
        real = Path(os.path.realpath(candidate))
        if self._root_of(real) is None:
            raise WorkspacePathError(f"path {path!r} is outside the workspace folders")
        return real

    def display(self, real: Path) -> str:
        root = self._root_of(real)
        if root is None:
            return str(real)
        rel = real.relative_to(root).as_posix()
        if root == self.roots[0]:
            return rel
        return root.name if rel == "." else f"{root.name}/{rel}"

    def _root_of(self, real: Path) -> Path | None:
        for root in self.roots:
            if real == root or real.is_relative_to(root):
                return root
        return None

    # -- tools -----------------------------------------------------------------

    def read_file(self, path: str, offset: int = 1, limit: int = 2000) -> dict[str, Any]:
        """Read lines of a text file in the workspace.

        Args:
            path: the file to read
            offset: the first line to return, 1-based
            limit: the maximum number of lines to return
        """
        if offset < 1:
            raise WorkspacePathError("offset must be 1 or more (line numbers are 1-based)")
        if limit < 1:
            raise WorkspacePathError("limit must be 1 or more")
        real = self.resolve(path)
        if not real.is_file():
            raise WorkspacePathError(f"{path!r} is not a file" if real.exists() else f"{path!r} does not exist")
        with open(real, "rb") as fb:
            if b"\x00" in fb.read(_BINARY_SNIFF):
                raise WorkspacePathError(f"{path!r} is a binary file")
        lines: list[str] = []
        size = 0
        truncated = False
        next_offset: int | None = None
        with open(real, encoding="utf-8", errors="replace", newline="") as f:
            for number, line in enumerate(f, start=1):
                if number < offset:
                    continue
                if len(lines) >= limit:
                    next_offset = number
                    break
                if size + len(line) > self.max_read_bytes:
                    lines.append(line[: self.max_read_bytes - size])
                    truncated = True
                    next_offset = number + 1
                    break
                lines.append(line)
                size += len(line)
        return {"path": self.display(real), "offset": offset, "lines": len(lines), "content": "".join(lines),
                "nextOffset": next_offset, "truncated": truncated}

    def list_dir(self, path: str = ".") -> dict[str, Any]:
        """List the entries of a directory in the workspace.

        Args:
            path: the directory to list
        """
        real = self.resolve(path)
        if not real.is_dir():
            raise WorkspacePathError(f"{path!r} is not a directory" if real.exists() else f"{path!r} does not exist")
        entries: list[dict[str, Any]] = []
        truncated = False
        with os.scandir(real) as it:
            items = sorted(it, key=lambda e: e.name)
        for entry in items:
            if len(entries) >= self.max_list_entries:
                truncated = True
                break
            item: dict[str, Any] = {"name": entry.name}
            try:
                if entry.is_symlink():
                    item["type"] = "symlink"
                elif entry.is_dir():
                    item["type"] = "dir"
                elif entry.is_file():
                    item["type"] = "file"
                    item["size"] = entry.stat().st_size
                else:
                    item["type"] = "other"
            except OSError:
                item["type"] = "other"
            entries.append(item)
        return {"path": self.display(real), "entries": entries, "truncated": truncated}

    def search_text(self, pattern: str, path: str = ".", regex: bool = False, ignore_case: bool = False,
                    max_results: int = 100) -> dict[str, Any]:
        """Search text files in the workspace for lines containing a string or matching a regular expression.

        Args:
            pattern: the text to find (a Python regular expression when regex is true)
            path: the directory or file to search
            regex: treat pattern as a regular expression
            ignore_case: match case-insensitively
            max_results: the maximum number of matching lines to return
        """
        if not pattern:
            raise WorkspacePathError("pattern must not be empty")
        flags = re.IGNORECASE if ignore_case else 0
        try:
            rx = re.compile(pattern if regex else re.escape(pattern), flags)
        except re.error as e:
            raise WorkspacePathError(f"invalid regular expression {pattern!r}: {e}") from None
        cap = max(1, min(max_results, self.max_results))
        real = self.resolve(path)
        if not real.exists():
            raise WorkspacePathError(f"{path!r} does not exist")
        matches: list[dict[str, Any]] = []
        files = 0
        scanned = 0
        truncated = False
        for file in self._walk_files(real):
            if files >= self.max_search_files or scanned >= self.max_search_bytes:
                truncated = True
                break
            try:
                st = file.stat()
                if st.st_size > self.max_search_file_bytes:
                    continue
                data = file.read_bytes()
            except OSError:
                continue
            files += 1
            scanned += len(data)
            if b"\x00" in data[:_BINARY_SNIFF]:
                continue
            text = data.decode("utf-8", "replace")
            for number, line in enumerate(text.splitlines(), start=1):
                if rx.search(line):
                    if len(matches) >= cap:
                        truncated = True
                        break
                    shown = line.strip()
                    if len(shown) > self.max_line_chars:
                        shown = shown[: self.max_line_chars] + "…"
                    matches.append({"path": self.display(file), "line": number, "text": shown})
            if truncated:
                break
        return {"matches": matches, "truncated": truncated, "filesSearched": files}

    def write_file(self, path: str, content: str) -> dict[str, Any]:
        """Create or overwrite a text file in the workspace (parent folders are created).

        Args:
            path: the file to write
            content: the complete new text of the file
        """
        data = content.encode("utf-8")
        if len(data) > self.max_write_bytes:
            raise WorkspacePathError(f"content is {len(data)} bytes; the limit is {self.max_write_bytes}")
        real = self.resolve(path)
        if real.is_dir():
            raise WorkspacePathError(f"{path!r} is a directory")
        created = not real.exists()
        real.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if not created:
                os.chmod(tmp, real.stat().st_mode & 0o7777)
            os.replace(tmp, real)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return {"path": self.display(real), "bytes": len(data), "created": created}

    # -- helpers ---------------------------------------------------------------

    def _walk_files(self, start: Path) -> Iterator[Path]:
        if start.is_file():
            yield start
            return
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                p = Path(dirpath, name)
                if p.is_symlink():
                    target = Path(os.path.realpath(p))
                    if self._root_of(target) is None or not target.is_file():
                        continue  # never read through a link that leaves the workspace
                yield p
