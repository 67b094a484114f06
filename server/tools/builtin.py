"""Builtin workspace tools (source ``builtin``), rooted at the initialize ``workspaceFolders``.

``WorkspaceTools(roots).tools()`` gives:

- ``read_file(path, offset=1, limit=2000)`` (read-only): text lines from line ``offset``
  (1-based), at most ``limit`` lines and ``max_read_bytes`` bytes (characters, of the client's
  text), and fewer where the output's JSON writes them longer (:func:`page_json_chars`: a
  control character as six characters), so that the output fits in its bound (a page
  full of short known secrets may still be cut into a preview: one of 4 to 9 characters
  becomes the 10 of ``[REDACTED]`` after the page is sized);
- ``list_dir(path=".")`` (read-only): the entries of a directory by name, the first
  ``max_list_entries`` (kept while reading: a huge directory is never held in full);
- ``search_text(pattern, path=".", regex=False, ignore_case=False, max_results=100)``
  (read-only): matching lines (1-based line numbers, as ``read_file`` numbers them) in text
  files under ``path``, with a result cap and a scan budget (files and bytes read, entries
  walked); a file over ``max_search_file_bytes`` or unreadable is counted in ``filesSkipped``,
  never read;
- ``write_file(path, content)`` (not read-only, so the default policy is ``ask``); its
  output carries a unified ``diff`` against the old text (or ``/dev/null``);
- ``edit_file(path, edits)`` (not read-only): exact-text edits ``{oldText, newText,
  replaceAll?}`` applied in order, all or nothing (``server.tools.edits``); output
  ``{path, diff, added, removed}``.

The file tools read and write through a file port (``server.tools.file_tools``): the disk,
or the client's buffers (``fs/readTextFile`` / ``fs/writeTextFile``) when ``files`` is given.
The file-changing ones can be previewed (a diff, computed without writing) before they run,
and never overwrite a file that changed after the text their change was computed from.

Paths: a relative path is relative to the first root; in a multi-root workspace a
relative path may also start with another root's folder name (``other/src/x.py``), as
editors show them. Absolute paths are accepted when inside a root. Every path is resolved
(``..`` and symlinks followed) and must end inside a root, else the call fails with
:class:`WorkspacePathError`; a ``..`` must follow a directory (``notes.txt/../x`` and
``missing/../x`` are refused, as open(2) refuses them), and a path the file tools take for a
file must not end with ``/``, ``.`` or ``..`` (:meth:`WorkspaceTools.resolve_file`). Paths in results are shown the same way (relative to the
first root, or ``<folder name>/...`` for another root).

Every disk read and write goes through one read path and one write path (``_read_text`` /
``_read_bytes`` / ``_open_file`` and ``_write_text``), which re-walk the resolved path from the
root's directory descriptor without following symlinks (``server.tools.safe_fs``): a directory
swapped for a symlink after the check makes the call fail instead of reaching outside.
Directories are listed the same way (``list_dir`` through ``_open_dir``, search_text's walk
from each parent's descriptor): a swapped one is refused or left out, never listed. Only
regular files are read (a FIFO never blocks a call, a device is never opened), and reads stop
at their caps. When the client's editor reads and writes the files instead
(``file_tools.ClientFiles``), the path is walked the same way right before each request
(:meth:`WorkspaceTools.check_file`), and a request is never made for a path that now goes
through a symlink, nor for a directory, a FIFO, a socket or a device. A read or write the file
system refuses is said in words, naming the path as the tools show it
(:meth:`WorkspaceTools.fs_error`), never as ``[Errno N] ...: '<absolute path>'``.
``search_text`` matches with RE2 (linear time, no backreferences or lookaround), so no pattern
can hang it.

A tool's output has the known secrets masked after it returns (docs/SECURITY.md G6); where a
tool cuts what it shows, it masks them first: a matching line longer than ``max_line_chars``
is masked, then cut (``redaction.redact_cut``), and a read_file page's first line, longer than
the page and so read only so far, ends before the piece of a secret the cut may have left
(:func:`page_end`). What ``write_file`` and ``edit_file`` write is never masked.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import heapq
import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .. import redaction
from ..core.tools import Tool
from . import safe_fs
from .edits import EditError, apply_edits, change, split_lines, unified_diff
from .errors import ToolCallError, ToolSourceError, WorkspacePathError

__all__ = ["BINARY_SNIFF", "WorkspaceTools", "resolve_roots", "scoped_roots"]

#: The folders the builtin tools are confined to while an operate runs on a branch that has
#: its own (an ACP session's ``cwd`` and additional directories: ``Service.set_branch_folders``),
#: in place of the workspace's; ``None`` (the default): the workspace folders. Set by the
#: service for the operate's task; tool calls, run in tasks and threads that copy the context,
#: see it.
scoped_roots: contextvars.ContextVar[tuple[Path, ...] | None] = contextvars.ContextVar("scoped_roots",
                                                                                       default=None)


def resolve_roots(folders: Iterable[str | os.PathLike[str]]) -> tuple[Path, ...]:
    """Folders as real paths, duplicates dropped, in order; ToolSourceError for one that is not
    a directory."""
    resolved: list[Path] = []
    for r in folders:
        p = Path(os.path.realpath(os.fspath(r)))
        if not p.is_dir():
            raise ToolSourceError(f"workspace folder {os.fspath(r)!r} is not a directory")
        if p not in resolved:
            resolved.append(p)
    return tuple(resolved)


def _compile_pattern(pattern: str, regex: bool, ignore_case: bool) -> Any:
    """A linear-time matcher (RE2): no pattern a model writes can hang the search, and the
    GIL is never held for long. Plain text is matched literally."""
    import re2  # google-re2; imported on first search only

    opts = re2.Options()
    opts.log_errors = False
    opts.case_sensitive = not ignore_case
    if not regex:
        opts.literal = True
    try:
        return re2.compile(pattern, options=opts)
    except Exception as e:  # re2.error
        msg = e.args[0] if e.args else e
        if isinstance(msg, bytes):
            msg = msg.decode("utf-8", "replace")
        raise WorkspacePathError(f"invalid regular expression {pattern!r}: {msg}") from None


def _entry_name(entry: os.DirEntry[str]) -> str:
    return entry.name


SKIP_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".tox"})
#: the directory descriptors search_text's walk holds at most (one per level; deeper ones are
#: opened from the root again), far below the process's limit on open files
_HELD_DIRS = 32


def _is_link(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False


def _list_for_walk(dfd: int) -> tuple[list[str], list[tuple[str, bool]]] | None:
    """The directory ``dfd`` as search_text walks it: its subdirectories to walk (by name;
    ``SKIP_DIRS`` and links to directories left out) and its other entries (by name, each with
    whether it is a symlink), told apart as ``os.walk`` tells them; None when it cannot be
    listed (``os.walk`` leaves such a directory out)."""
    dirs: list[str] = []
    files: list[tuple[str, bool]] = []
    try:
        with os.scandir(dfd) as it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                if not is_dir:
                    files.append((entry.name, _is_link(entry)))
                elif entry.name not in SKIP_DIRS and not _is_link(entry):
                    dirs.append(entry.name)
    except OSError:
        return None
    return sorted(dirs), sorted(files)


#: the first bytes of a file looked at for a NUL: one there makes it a binary file (read_file, the
#: changing tools; the client's text of a file alike, ``file_tools.ClientFiles``)
BINARY_SNIFF = 8192

#: edit_file's arguments (hand-written: camelCase edit fields, no $defs, so grammars stay simple)
EDIT_FILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "the file to edit"},
        "edits": {
            "type": "array", "minItems": 1,
            "description": "replacements applied in order; each oldText must match exactly once unless replaceAll",
            "items": {
                "type": "object",
                "properties": {
                    "oldText": {"type": "string", "description": "the exact text to replace"},
                    "newText": {"type": "string", "description": "the text to put in its place"},
                    "replaceAll": {"type": "boolean", "description": "replace every occurrence", "default": False},
                },
                "required": ["oldText", "newText"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["path", "edits"],
    "additionalProperties": False,
}


#: the most of a file one read_file call returns (bytes; the service lowers it to what fits in
#: a tool output, see ``Service``'s workspace tools)
MAX_READ_BYTES = 256 * 1024
#: the builtin workspace tools, in the order they are offered (each a method of WorkspaceTools)
TOOL_NAMES = ("read_file", "list_dir", "search_text", "write_file", "edit_file")


#: the file system's refusals in plain words (its own, ``strerror``, for any other)
_PLAIN_ERRORS = {
    errno.ENAMETOOLONG: "a name in the path is longer than the file system allows",
    errno.EFBIG: "the file would be larger than the file system (or a limit set on this process) allows",
    errno.ENOSPC: "there is no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.ENXIO: "it is not a file (a socket, or a device)",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
    errno.EROFS: "it is on a read-only file system",
    errno.ELOOP: "a symlink is in the way",
    errno.ENOTDIR: "a file is where a directory is needed",
    errno.EIO: "the device reported an input/output error",
}


def _reason(e: OSError) -> str:
    """Why ``e`` failed, in words and without a path: the text our own checks gave it
    (``safe_fs``: "'sub' is a symlink or not a directory", a component's name only), or the
    plain words for its error number (``str(e)`` of the OS's error names the absolute path)."""
    if not e.errno:
        return e.strerror or str(e) or type(e).__name__
    if e.strerror and e.strerror != os.strerror(e.errno):  # the text one of our checks gave it
        return e.strerror
    return _PLAIN_ERRORS.get(e.errno) or e.strerror or os.strerror(e.errno)


def page_end(lines: list[str], cut: str, number: int) -> tuple[int, bool]:
    """A read_file page's end at line ``number``, which does not fit in what is left of the
    page (``cut``: the part that does): it starts the next page (``nextOffset``), whole; only a
    page's first line, longer than a page, is cut (``truncated``), the rest of it never shown.
    (Cut at the end of a page, its rest was skipped by the next page, which began after it.)
    That cut comes before the output is masked (the disk's line is read only so far): the piece
    of a known secret it may end in is left out (``redaction.redact_piece``), the rest of the
    line masked as the output is. Both read_file's, the disk's and the client's."""
    if lines:
        return number, False
    lines.append(redaction.redact_piece(cut, cut_after=True))
    return number + 1, True


#: the bytes of UTF-8 text that JSON writes as themselves (a character past ASCII is written
#: as itself: each of its bytes is one of these)
_PLAIN_BYTES = bytes(b for b in range(256) if b >= 0x20 and b not in b'"\\')
#: the characters JSON writes as two characters (``\\n``, ``\\"``); another control character takes six
_SHORT_ESCAPES = b'\b\t\n\f\r"\\'


def json_chars(text: str) -> int:
    """How many characters ``text`` takes in a tool output's JSON, its quotes left out, as
    the output's bound (``maxToolOutputChars``) counts them: a newline, a carriage return, a
    tab, a backspace, a form feed, a quote or a backslash is written as two characters, another
    control character as six (``\\u001b``), any other character as itself. Counted in passes
    over its bytes at C speed (a copy of it as UTF-8, then only the characters JSON escapes),
    not by writing its JSON: a page of text is counted in a fraction of a millisecond."""
    escaped = text.encode("utf-8", "surrogatepass").translate(None, _PLAIN_BYTES)
    if not escaped:
        return len(text)
    return len(text) + len(escaped) + 4 * len(escaped.translate(None, _SHORT_ESCAPES))


def fit_json(text: str, room: int) -> str:
    """The longest start of ``text`` that takes at most ``room`` characters in JSON
    (:func:`json_chars`; found by halving, so a line of control characters is not walked
    character by character)."""
    if json_chars(text) <= room:
        return text
    lo, hi = 0, min(len(text), max(room, 0))  # (each character takes at least one)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if json_chars(text[:mid]) <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def page_json_chars(page: int, shown: str, offset: int, limit: int) -> int:
    """The most characters a read_file page's ``content`` may take in its output's JSON
    (:func:`json_chars`), ``page`` being ``max_read_bytes``: twice that (the service makes a
    page half of ``maxToolOutputChars``), less what the rest of the output takes (its path
    and numbers, at their longest: a null ``nextOffset`` is as long as a number of four
    digits), so that the whole output is never over the bound and cut into a preview without
    its ``nextOffset``. What the rest takes is counted up to half a
    page (a page of a few bytes, or a tool output bound of a few hundred characters, would
    hold no line at all)."""
    rest = len(json.dumps({"path": shown, "offset": offset, "lines": limit, "content": "",
                           "nextOffset": max(offset + limit, 1000), "truncated": False}, ensure_ascii=False))
    return 2 * page - min(rest, page // 2)


def read_page(items: Iterable[tuple[Any, int]], *, first: int, limit: int, page: int, chars: int,
              text: Callable[[Any], str] | None, cut: Callable[[Any, int], str]) -> tuple[str, int, int | None, bool]:
    """A read_file page, the disk's and the client's alike: the lines ``items`` gives from line
    ``first`` on, each with its size in the page's units (bytes of the disk's file, characters
    of the client's text; a line may be given cut a unit over ``page``), at most ``limit`` of
    them, ``page`` units, and ``chars`` characters in the output's JSON (:func:`page_json_chars`).
    ``text(item)`` is an item's line (None: the item is it); ``cut(item, n)`` its first ``n``
    units, for a first line longer than a page. Returns the content, its number of lines,
    ``nextOffset`` and ``truncated`` (:func:`page_end`).

    The lines are taken by their size, then the page is counted in JSON once (one pass over
    it); only a page over ``chars`` (lines of control characters) is counted line by line, and
    ends before the first line that does not fit: counting every line in JSON made reading
    ordinary text (a quote or a tab in most lines of code) over twice as slow."""
    lines: list[str] = []
    size = 0
    number = first
    next_offset: int | None = None
    truncated = False
    for item, n in items:
        if len(lines) >= limit:
            next_offset = number
            break
        if size + n > page:
            piece = "" if lines else fit_json(cut(item, page), chars)  # (only a first line is cut)
            next_offset, truncated = page_end(lines, piece, number)
            break
        lines.append(item if text is None else text(item))
        size += n
        number += 1
    content = "".join(lines)
    if not truncated and json_chars(content) > chars:
        left = chars
        kept = 0
        for line in lines:
            left -= json_chars(line)
            if left < 0:
                break
            kept += 1
        if kept:
            del lines[kept:]
            next_offset = first + kept
        else:
            whole = lines[0]
            lines.clear()
            next_offset, truncated = page_end(lines, fit_json(whole, chars), first)
        content = "".join(lines)
    return content, len(lines), next_offset, truncated


class WorkspaceTools:
    """Factory of the builtin workspace tools for the given roots."""

    def __init__(self, roots: Iterable[str | os.PathLike[str]], *, max_read_bytes: int = MAX_READ_BYTES,
                 max_list_entries: int = 1000, max_results: int = 200, max_line_chars: int = 300,
                 max_search_file_bytes: int = 2 * 1024 * 1024, max_search_files: int = 20_000,
                 max_search_bytes: int = 64 * 1024 * 1024, max_search_entries: int = 200_000,
                 max_write_bytes: int = 10 * 1024 * 1024,
                 files: Any = None, per_branch: bool = False) -> None:
        self._roots = resolve_roots(roots)
        #: branches bring their own folders (``scoped_roots``): the descriptions name none
        self.per_branch = per_branch
        self.max_read_bytes = max_read_bytes
        self.max_list_entries = max_list_entries
        self.max_results = max_results
        self.max_line_chars = max_line_chars
        self.max_search_file_bytes = max_search_file_bytes
        self.max_search_files = max_search_files
        self.max_search_bytes = max_search_bytes
        self.max_search_entries = max_search_entries
        self.max_write_bytes = max_write_bytes
        self.files = files  # a file_tools.FileAccess (e.g. the client's buffers); None = the disk

    @property
    def roots(self) -> tuple[Path, ...]:
        """The folders in force: the running operate's branch's own (``scoped_roots``), else
        the workspace's."""
        return scoped_roots.get() or self._roots

    def tools(self) -> list[Tool]:
        """The workspace tools; none when there is no workspace folder."""
        if not self.roots:
            return []
        if self.per_branch:
            where = ("Paths are relative to the working directory (absolute paths inside it work too; "
                     "a path may also start with the folder name of an additional directory)")
        elif len(self.roots) == 1:
            where = f"Paths are relative to the workspace root {self.roots[0]}"
        else:
            where = (f"Paths are relative to the first workspace root {self.roots[0]} or start with another "
                     f"root's folder name ({', '.join(r.name for r in self.roots[1:])})")
        from .file_tools import FILE_CHANGING, FileTools

        out = []
        for name in TOOL_NAMES:
            t = Tool.from_function(getattr(self, name), source="builtin", read_only=name not in FILE_CHANGING)
            if name == "edit_file":
                t.input_schema, t._validator = EDIT_FILE_SCHEMA, None  # camelCase edits, checked by jsonschema
            t.description = f"{t.description} {where}."
            out.append(t)

        return FileTools(self, self.files).wrap(out)

    # -- paths -----------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The real path ``path`` names, which must be inside a root, else WorkspacePathError."""
        if not self.roots:
            raise WorkspacePathError("there is no workspace folder")
        if not isinstance(path, str):
            raise WorkspacePathError(f"path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise WorkspacePathError("path contains a NUL character")
        try:
            os.fsencode(path)  # a name listed from the disk holds its non-UTF-8 bytes as \udc80-\udcff
        except UnicodeEncodeError as e:
            raise WorkspacePathError(f"path is not a file name: character {e.start} is {path[e.start]!r}, "
                                     "half of a surrogate pair") from None
        p = Path(path or ".")
        if p.is_absolute():
            candidate = p
        else:
            candidate = self.roots[0] / p
            if len(self.roots) > 1 and p.parts and not os.path.exists(candidate):
                for root in self.roots[1:]:
                    if p.parts[0] == root.name:
                        other = root.joinpath(*p.parts[1:])
                        # the first root's own folder of that name keeps a new file whose
                        # folder it has (it went to the other root, away from its siblings)
                        if os.path.exists(other) or not os.path.isdir(candidate.parent):
                            candidate = other
                        break
        real = Path(os.path.realpath(candidate))
        if self._root_of(real) is None:
            raise WorkspacePathError(f"path {path!r} is outside the workspace folders")
        self._check_ups(path, candidate)
        return real

    def _check_ups(self, path: str, candidate: Path) -> None:
        """Refuse a ``..`` that follows something that is not a directory, as open(2) does
        (ENOTDIR, ENOENT): ``realpath`` takes ``notes.txt/../other.txt`` and
        ``missing/../other.txt`` for ``other.txt``, which no program could open. Only what is
        before a ``..`` inside the workspace folders is looked at (the path as a whole is
        already confined): the error never tells what is outside."""
        parts = candidate.parts
        for i, part in enumerate(parts):
            if part != ".." or i == 0:
                continue
            before = Path(*parts[:i])
            if os.path.isdir(before) or self._root_of(Path(os.path.realpath(before))) is None:
                continue
            what = "is not a directory" if os.path.lexists(before) else "does not exist"
            shown = self.display(Path(os.path.realpath(before)))
            raise WorkspacePathError(f"path {path!r} goes up ('..') from {shown!r}, which {what}")

    def resolve_file(self, path: str) -> Path:
        """:meth:`resolve` of a path that must name a file (read_file, write_file, edit_file):
        one that ends with ``/``, or whose last component is ``.`` or ``..``, names a directory
        (open(2) says EISDIR or ENOTDIR; ``notes.txt/.`` is not the file ``notes.txt``)."""
        real = self.resolve(path)
        if path.endswith("/"):
            raise WorkspacePathError(f"{path!r} ends with a slash, so it names a directory, not a file; "
                                     "give the file's path")
        last = path.rsplit("/", 1)[-1]
        if last in (".", ".."):
            raise WorkspacePathError(f"{path!r} ends with {last!r}, so it names a directory, not a file; "
                                     "give the file's path")
        return real

    def display(self, real: Path) -> str:
        """``real`` as the tools show it: relative to the first root, ``<folder name>/...`` for
        another root, or absolute when that name would lead elsewhere (the first root has an
        entry of the same name); :meth:`resolve` of what is shown is ``real`` again."""
        root = self._root_of(real)
        if root is None:
            return str(real)
        rel = real.relative_to(root).as_posix()
        if root == self.roots[0]:
            return rel
        shown = root.name if rel == "." else f"{root.name}/{rel}"
        if os.path.lexists(self.roots[0] / root.name):
            try:
                if self.resolve(shown) != real:
                    return str(real)
            except WorkspacePathError:
                return str(real)
        return shown

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
        real = self.resolve_file(path)
        shown = self.display(real)
        content, count, next_offset, truncated = "", 0, None, False
        # caps applied while reading: at most max_read_bytes kept, at most max_search_bytes
        # scanned to reach ``offset``, never a whole line of unbounded length in memory
        with self._open_file(real, path) as f:
            if b"\x00" in f.peek(BINARY_SNIFF)[:BINARY_SNIFF]:
                raise WorkspacePathError(f"{path!r} is a binary file")
            scanned = 0
            number = 0
            while number + 1 < offset:
                raw = f.readline(1 << 20)
                if not raw:
                    break
                scanned += len(raw)
                if not raw.endswith(b"\n") and len(raw) == (1 << 20):  # a long line being skipped
                    if scanned > self.max_search_bytes:
                        truncated = True
                        break
                    continue
                number += 1
                if scanned > self.max_search_bytes:
                    truncated = True
                    next_offset = number + 1
                    break
            else:
                page = self.max_read_bytes

                def raws() -> Iterator[tuple[bytes, int]]:
                    while raw := f.readline(page + 1):  # (a line over the page: a byte over it)
                        yield raw, len(raw)

                # what the page may take in the output's JSON: a control character takes six
                # characters there (\u001b), so a page of max_read_bytes bytes of them was cut into a preview
                content, count, next_offset, truncated = read_page(
                    raws(), first=offset, limit=limit, page=page,
                    chars=page_json_chars(page, shown, offset, limit),
                    text=lambda raw: raw.decode("utf-8", "replace"),
                    cut=lambda raw, n: raw[:n].decode("utf-8", "ignore"))
        return {"path": shown, "offset": offset, "lines": count, "content": content,
                "nextOffset": next_offset, "truncated": truncated}

    def list_dir(self, path: str = ".") -> dict[str, Any]:
        """List the entries of a directory in the workspace.

        Args:
            path: the directory to list
        """
        real = self.resolve(path)
        try:  # opened first: a look before the open would be one more moment for a swap to fail it
            dfd = self._open_dir(real, path)
        except WorkspacePathError:  # what is there, for the message: nothing, or no directory
            st = self._lstat(real, path)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise WorkspacePathError(f"{path!r} is not a directory" if st is not None
                                         else f"{path!r} does not exist") from None
            raise
        entries: list[dict[str, Any]] = []
        try:
            # the first max_list_entries by name, kept while reading (a directory of 300,000
            # entries is never held, nor sorted, in full); one more tells that there were more
            with os.scandir(dfd) as it:
                items = heapq.nsmallest(self.max_list_entries + 1, it, key=_entry_name)
            truncated = len(items) > self.max_list_entries
            for entry in items[: self.max_list_entries]:
                item: dict[str, Any] = {"name": entry.name}
                try:  # looked at in the directory listed (dfd), never through a link
                    if entry.is_symlink():
                        item["type"] = "symlink"
                    elif entry.is_dir(follow_symlinks=False):
                        item["type"] = "dir"
                    elif entry.is_file(follow_symlinks=False):
                        item["type"] = "file"
                        item["size"] = entry.stat(follow_symlinks=False).st_size
                    else:
                        item["type"] = "other"
                except OSError:
                    item["type"] = "other"
                entries.append(item)
        finally:
            os.close(dfd)
        return {"path": self.display(real), "entries": entries, "truncated": truncated}

    def search_text(self, pattern: str, path: str = ".", regex: bool = False, ignore_case: bool = False,
                    max_results: int = 100) -> dict[str, Any]:
        """Search text files in the workspace for lines containing a string or matching a regular expression.

        Args:
            pattern: the text to find (an RE2 regular expression when regex is true: Python syntax without backreferences or lookaround)
            path: the directory or file to search
            regex: treat pattern as a regular expression
            ignore_case: match case-insensitively
            max_results: the maximum number of matching lines to return
        """
        if not pattern:
            raise WorkspacePathError("pattern must not be empty")
        rx = _compile_pattern(pattern, regex, ignore_case)
        cap = max(1, min(max_results, self.max_results))
        real = self.resolve(path)
        if self._lstat(real, path) is None:
            raise WorkspacePathError(f"{path!r} does not exist")
        matches: list[dict[str, Any]] = []
        files = skipped = visited = 0
        scanned = 0
        truncated = False
        # bounded work: every directory and file the walk visits counts (max_search_entries),
        # every byte read counts (max_search_bytes); a file over max_search_file_bytes is
        # skipped by its size, never read. A walk stopped early is closed here: its directory
        # descriptors (up to _HELD_DIRS + 1) are not left to the garbage collector
        with contextlib.closing(self._walk_files(real)) as walk:
            for file in walk:
                visited += 1
                if (files >= self.max_search_files or scanned >= self.max_search_bytes
                        or visited > self.max_search_entries):
                    truncated = True
                    break
                if file is None:  # a directory, or a link that is not followed
                    continue
                try:  # regular files only (a FIFO would block), opened without following a swapped link
                    src = Path(os.path.realpath(file)) if file.is_symlink() else file  # checked by _walk_files
                    data = self._read_small(src, self.max_search_file_bytes)
                except (OSError, WorkspacePathError):
                    data = None
                if data is None:
                    skipped += 1
                    continue
                files += 1
                scanned += len(data)
                if b"\x00" in data[:BINARY_SNIFF]:
                    continue
                text = data.decode("utf-8", "replace")
                for number, line in enumerate(split_lines(text), start=1):  # numbered as read_file numbers them
                    line = line.rstrip("\n").removesuffix("\r")
                    if rx.search(line):
                        if len(matches) >= cap:
                            truncated = True
                            break
                        shown = line.strip()
                        if len(shown) > self.max_line_chars:  # (masked before the cut, as the output is)
                            shown = redaction.redact_cut(shown, self.max_line_chars, more="…")
                        matches.append({"path": self.display(file), "line": number, "text": shown})
                if truncated:
                    break
        return {"matches": matches, "truncated": truncated, "filesSearched": files, "filesSkipped": skipped}

    def write_file(self, path: str, content: str) -> dict[str, Any]:
        """Create or overwrite a text file in the workspace (parent folders are created).

        Args:
            path: the file to write
            content: the complete new text of the file
        """
        data = content.encode("utf-8")
        if len(data) > self.max_write_bytes:
            raise WorkspacePathError(f"content is {len(data)} bytes; the limit is {self.max_write_bytes}")
        real = self.resolve_file(path)
        old = self._read_text(real) if self.check_file(real, path, writing=True) else None
        created = self._write_bytes(real, data, path)
        return {"path": self.display(real), "bytes": len(data), "created": created,
                "diff": unified_diff(old, content, self.display(real))}

    def edit_file(self, path: str, edits: list[dict[str, Any]]) -> dict[str, Any]:
        """Change a text file in the workspace by exact-text replacements, applied in order, all or nothing.
        Each edit's oldText must match the file's current text exactly once (whitespace included), unless
        replaceAll is true. On any failure nothing is written.

        Args:
            path: the file to edit
            edits: the replacements, as [{"oldText": ..., "newText": ..., "replaceAll": false}]
        """
        real = self.resolve_file(path)
        old = self._read_text(real, strict=True)
        try:
            new = apply_edits(old, edits, self.max_write_bytes)
        except EditError as e:
            raise ToolCallError(f"{e}; nothing was written to {self.display(real)}") from None
        ch = change(self.display(real), old, new)
        self._write_text(real, new)
        return {"path": ch.path, "diff": ch.diff, "added": ch.added, "removed": ch.removed}

    # -- the one read path and the one write path --------------------------------
    # Every read and write of a workspace file goes through these: the resolved path is
    # re-walked from the root's directory descriptor without following symlinks (safe_fs),
    # so a directory swapped for a symlink after ``resolve`` cannot redirect the access.

    def _where(self, real: Path) -> tuple[Path, list[str]]:
        root = self._root_of(real)
        if root is None:
            raise WorkspacePathError(f"path {str(real)!r} is outside the workspace folders")
        return root, safe_fs.relative_to_root(root, real)

    def _open_file(self, real: Path, shown: str | None = None) -> Any:
        """A buffered binary reader of the regular file ``real`` (resolved, inside a root)."""
        import io

        root, rel = self._where(real)
        try:
            fd, _ = safe_fs.open_regular(root, rel)
        except (safe_fs.NotRegularFileError, IsADirectoryError):
            raise WorkspacePathError(f"{shown or self.display(real)!r} is not a file") from None
        except FileNotFoundError:
            raise WorkspacePathError(f"{shown or self.display(real)!r} does not exist") from None
        except OSError as e:
            raise self.fs_error(e, real, shown) from None
        return io.BufferedReader(io.FileIO(fd, "rb", closefd=True), buffer_size=1 << 16)

    def _open_dir(self, real: Path, shown: str | None = None) -> int:
        """A descriptor of the directory ``real`` (resolved, inside a root) to list with
        ``os.scandir``, opened as files are: re-walked from the root's descriptor, no symlink
        followed, so a directory swapped for a symlink after ``resolve`` is refused, never
        listed. The caller closes it."""
        root, rel = self._where(real)
        try:
            return safe_fs.open_dir(root, rel)
        except FileNotFoundError:
            raise WorkspacePathError(f"{shown or self.display(real)!r} does not exist") from None
        except OSError as e:
            raise self.fs_error(e, real, shown) from None

    def _lstat(self, real: Path, shown: str | None = None) -> os.stat_result | None:
        """The ``lstat`` of ``real`` (resolved, inside a root), looked at from the root's
        descriptor as the reads are (``Path.exists`` named the absolute path in the error of a
        name too long); None when there is nothing there."""
        root, rel = self._where(real)
        try:
            return safe_fs.lstat(root, rel)
        except FileNotFoundError:
            return None
        except safe_fs.UnsafePathError as e:
            if e.errno == errno.ENOTDIR:  # a file on the way: nothing there, as ``Path.exists`` says
                return None
            raise self.fs_error(e, real, shown) from None
        except OSError as e:
            raise self.fs_error(e, real, shown) from None

    def check_file(self, real: Path, shown: str | None = None, *, writing: bool = False) -> bool:
        """Whether there is a file at ``real`` (resolved, inside a root) now: True for a regular
        file, False for nothing (nor, maybe, its directory); looked at from the root's
        descriptor, no symlink followed, nothing opened (``safe_fs.regular_or_missing``).
        Anything else is refused with the error the disk's read (``writing``: write) gives: a
        directory, a symlink, a FIFO, a socket, a device, a directory on the way that is now a
        symlink or not a directory. Made right before the client's editor is asked to read or
        write ``real`` (``file_tools.FileTools``), which opens the path by its name and follows
        what it finds: a directory swapped for a symlink while the user was asked would have
        taken its write outside the workspace, and a FIFO handed to it blocked its read."""
        name = shown or self.display(real)
        root, rel = self._where(real)
        try:
            return safe_fs.regular_or_missing(root, rel) is not None  # (the root: IsADirectoryError)
        except (IsADirectoryError, safe_fs.NotRegularFileError) as e:
            if writing and isinstance(e, IsADirectoryError):
                raise WorkspacePathError(f"{name!r} is a directory") from None
            raise WorkspacePathError(f"{name!r} is not a file") from None
        except OSError as e:
            raise (self._write_error(e, real, shown) if writing else self.fs_error(e, real, shown)) from None

    def _read_bytes(self, real: Path, max_bytes: int | None = None) -> tuple[bytes, bool]:
        """At most ``max_bytes`` bytes of the regular file ``real`` and whether it had more."""
        with self._open_file(real) as f:
            if max_bytes is None:
                return f.read(), False
            data = f.read(max_bytes + 1)
        return (data[:max_bytes], True) if len(data) > max_bytes else (data, False)

    def _read_small(self, real: Path, max_bytes: int) -> bytes | None:
        """The bytes of the regular file ``real``, or None when it holds more than ``max_bytes``
        (told by its size before anything is read, or by reading one byte past the cap)."""
        root, rel = self._where(real)
        fd, size = safe_fs.open_regular(root, rel)
        with open(fd, "rb", closefd=True) as f:
            if size > max_bytes:
                return None
            data = f.read(max_bytes + 1)
        return None if len(data) > max_bytes else data

    def _read_text(self, real: Path | str, max_bytes: int | None = None, *, strict: bool = False) -> str:
        """The text of the regular file ``real`` (a resolved Path, or a workspace path that
        is resolved first); WorkspacePathError when it is binary or longer than
        ``max_bytes`` (default: max_write_bytes), and, with ``strict``, when it is not UTF-8
        (an edit of text decoded with replacement characters would corrupt the other bytes)."""
        if not isinstance(real, Path):
            real = self.resolve(real)
        cap = self.max_write_bytes if max_bytes is None else max_bytes
        data, more = self._read_bytes(real, cap)
        if more:
            raise self._too_large(real, cap)
        if b"\x00" in data[:BINARY_SNIFF]:
            raise WorkspacePathError(f"{self.display(real)!r} is a binary file")
        if strict:
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise WorkspacePathError(f"{self.display(real)!r} is not UTF-8 text (byte {e.start}); "
                                         "it cannot be changed safely by this tool") from None
        return data.decode("utf-8", "replace")

    def _too_large(self, real: Path, cap: int) -> WorkspacePathError:
        return WorkspacePathError(f"{self.display(real)!r} is larger than {cap} bytes")

    def check_text_size(self, real: Path, text: str) -> None:
        """The size check :meth:`_read_text` makes of a file's bytes, made of a text that did
        not come from the disk (the client's buffer of ``real``): longer than max_write_bytes in
        UTF-8, it is refused with the same error."""
        cap = self.max_write_bytes
        if len(text) > cap or (len(text) * 4 > cap and len(text.encode("utf-8", "surrogatepass")) > cap):
            raise self._too_large(real, cap)

    def _write_bytes(self, real: Path, data: bytes, shown: str | None = None) -> bool:
        root, rel = self._where(real)
        if not rel:
            raise WorkspacePathError(f"{shown or self.display(real)!r} is a directory")
        try:
            return safe_fs.write_bytes_atomic(root, rel, data)
        except OSError as e:
            raise self._write_error(e, real, shown) from None

    def _check_writable(self, real: Path, shown: str | None = None) -> None:
        """Fail as writing ``real`` would, without writing: a read-only file, a directory, a
        file where a directory is needed, a directory we may not write to (checked before a
        call is put to the user; the write checks again)."""
        root, rel = self._where(real)
        if not rel:
            raise WorkspacePathError(f"{shown or self.display(real)!r} is a directory")
        try:
            safe_fs.check_writable(root, rel)
        except OSError as e:
            raise self._write_error(e, real, shown) from None

    def _write_error(self, e: OSError, real: Path, shown: str | None) -> WorkspacePathError:
        """The tool error for a write that failed (or is bound to) with ``e``: the file system's
        refusal in words (:meth:`fs_error`), and that nothing was written (a failed write
        leaves the old file as it was, and nothing new: ``safe_fs.write_bytes_atomic``)."""
        name = shown or self.display(real)
        if isinstance(e, IsADirectoryError):
            return WorkspacePathError(f"{name!r} is a directory")
        if isinstance(e, safe_fs.ReadOnlyFileError):
            return WorkspacePathError(f"{name!r} is read-only; nothing written")
        return WorkspacePathError(f"{name!r}: {_reason(e)}; nothing written")

    def fs_error(self, e: OSError, real: Path, shown: str | None = None) -> WorkspacePathError:
        """The tool error for a read (or a look) of ``real`` that failed with ``e``, naming the
        path as the tools show it: ``str(e)`` is "[Errno 36] File name too long: '<the absolute
        path>'", which tells the model little and the path outside the workspace folders."""
        name = shown or self.display(real)
        if isinstance(e, FileNotFoundError):
            return WorkspacePathError(f"{name!r} does not exist")
        if isinstance(e, (IsADirectoryError, safe_fs.NotRegularFileError)):
            return WorkspacePathError(f"{name!r} is not a file")
        return WorkspacePathError(f"{name!r}: {_reason(e)}")

    def _write_text(self, real: Path | str, text: str) -> bool:
        """Atomically replace (or create) the file ``real`` (a resolved Path, or a workspace
        path resolved first) with ``text``; True when it was created. A new file is renamed
        over it, so its other hard links, if any, keep the old text (docs/PROTOCOL.md §9)."""
        if not isinstance(real, Path):
            real = self.resolve(real)
        data = text.encode("utf-8")
        if len(data) > self.max_write_bytes:
            raise WorkspacePathError(f"content is {len(data)} bytes; the limit is {self.max_write_bytes}")
        return self._write_bytes(real, data)

    # -- helpers ---------------------------------------------------------------

    def _walk_files(self, start: Path) -> Iterator[Path | None]:
        """The files to search under ``start``, in order; None for each directory entered and
        each link left out, so that the caller can count the whole walk.

        The walk ``os.walk`` made (a directory's files by name, then its subdirectories by
        name, each walked whole; one that cannot be listed left out), but each directory is
        opened from its parent's descriptor without following symlinks (``safe_fs``) and
        listed by that descriptor: a directory swapped for a symlink mid-walk is left out,
        never walked (by path, ``os.walk`` walked the folder the link led to, outside the
        workspace). One descriptor is held per level, for the first ``_HELD_DIRS`` levels;
        a directory deeper down is opened from the root again."""
        if os.path.isfile(start):  # (never raises: a path past PATH_MAX is walked, and fails, as a directory)
            yield start
            return
        root, rel = self._where(start)
        try:
            fd: int | None = safe_fs.open_dir(root, rel)
        except OSError:
            return
        # the directories being walked, deepest last: each one's descriptor (None when not
        # held), path, components below the root, and subdirectories still to walk
        stack: list[tuple[int | None, Path, list[str], Iterator[str]]] = []
        path, parts = start, rel
        try:
            while fd is not None:
                listed = None
                try:
                    listed = _list_for_walk(fd)
                finally:
                    if listed is None or len(stack) >= _HELD_DIRS:
                        os.close(fd)
                        fd = None
                if listed is not None:
                    subdirs, files = listed
                    stack.append((fd, path, parts, iter(subdirs)))
                    yield None
                    for name, link in files:
                        p = path / name
                        if link:
                            target = Path(os.path.realpath(p))
                            if self._root_of(target) is None or not target.is_file():
                                yield None  # never read through a link that leaves the workspace
                                continue
                        yield p
                fd = None
                while fd is None and stack:  # the next directory to walk
                    pfd, ppath, pparts, pending = stack[-1]
                    name = next(pending, None)
                    if name is None:
                        stack.pop()
                        if pfd is not None:
                            os.close(pfd)
                        continue
                    path, parts = ppath / name, [*pparts, name]
                    try:
                        fd = safe_fs.open_subdir(pfd, name) if pfd is not None else safe_fs.open_dir(root, parts)
                    except OSError:
                        pass  # a symlink now, gone, or unreadable: not walked
        finally:
            for pfd, *_ in stack:
                if pfd is not None:
                    os.close(pfd)
