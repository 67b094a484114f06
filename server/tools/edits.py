"""The edit engine of the file-changing builtin tools: pure functions, no I/O.

- :func:`apply_edits` applies exact-text edits in order, all or nothing; an edit that does
  not apply raises :class:`EditError` naming its index and why (not found, or how many
  matches), so a model can correct its call.
- :func:`unified_diff` is a unified diff with git-style headers (``/dev/null`` for a file
  that does not exist yet) and the ``\\ No newline at end of file`` marker. The line
  alignment is a longest common subsequence of lines from rapidfuzz (``Indel.opcodes``, C++:
  ~25-45 ms for a 10,000-line file with changes all over it, where ``difflib.SequenceMatcher``
  takes 100-1,400 ms); difflib turns it into opcodes and hunks
  (``SequenceMatcher.get_grouped_opcodes``), printed exactly as ``difflib.unified_diff``
  prints them. Without rapidfuzz, difflib aligns too.
- :func:`change` bundles both into a :class:`FileChange` (old text, new text, diff, counts),
  which is what a permission preview and a tool output are made of.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

__all__ = ["EditError", "FileChange", "apply_edits", "unified_diff", "count_changes", "change", "split_lines"]

NO_NEWLINE = "\\ No newline at end of file\n"


class EditError(ValueError):
    """An edit that does not apply; ``index`` is its position in ``edits`` (None: the call as a whole)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def _field(edit: Any, *names: str) -> Any:
    for n in names:
        if isinstance(edit, Mapping):
            if n in edit:
                return edit[n]
        elif hasattr(edit, n):
            return getattr(edit, n)
    return None


def apply_edits(text: str, edits: Iterable[Any], max_chars: int | None = None) -> str:
    """``text`` with ``edits`` applied in order (each to the result of the ones before).

    An edit is a mapping (or object) with ``oldText``, ``newText`` and optional
    ``replaceAll`` (default false). ``oldText`` must occur exactly once, or at least once
    with ``replaceAll``. Raises :class:`EditError` for the first edit that does not apply;
    the caller then writes nothing. With ``max_chars``, an edit whose result would be longer
    is refused before it is made (a ``replaceAll`` of a common text by a long one multiplies
    the file: a 1 MB file could ask for gigabytes, which were allocated before the size
    bound of the write could refuse them)."""
    out = text
    items = list(edits)
    if not items:
        raise EditError("edits is empty: give at least one {oldText, newText}")
    for i, edit in enumerate(items):
        old = _field(edit, "oldText", "old_text")
        new = _field(edit, "newText", "new_text")
        replace_all = bool(_field(edit, "replaceAll", "replace_all") or False)
        if not isinstance(old, str) or not isinstance(new, str):
            raise EditError(f"edit {i}: oldText and newText must be strings", i)
        if old == "":
            raise EditError(f"edit {i}: oldText is empty; give the exact text to replace", i)
        n = out.count(old)
        if n == 0:
            where = " (after the edits before it)" if i else ""
            raise EditError(f"edit {i}: oldText not found in the file{where}; it must match the file's text "
                            f"exactly, whitespace and line breaks included{_line_end_hint(out, old)}", i)
        if n > 1 and not replace_all:
            raise EditError(f"edit {i}: oldText matches {n} times; include more surrounding text so it matches "
                            "exactly once, or set replaceAll", i)
        if max_chars is not None:
            size = len(out) + (n if replace_all else 1) * (len(new) - len(old))
            if size > max_chars:
                raise EditError(f"edit {i}: the text would be {size} characters long; the limit is {max_chars}", i)
        out = out.replace(old, new) if replace_all else out.replace(old, new, 1)
    return out


def _line_end_hint(text: str, old: str) -> str:
    """What to say when ``old`` is not in ``text`` only because their line ends differ (the
    file's lines end with CRLF and oldText's with LF, or the other way round): "" otherwise."""
    if "\n" not in old:
        return ""
    lf = old.replace("\r\n", "\n")
    if "\r\n" not in old and lf.replace("\n", "\r\n") in text:
        return ": the file's lines end with \\r\\n (CRLF) and oldText's with \\n; write them as the file has them"
    if "\r\n" in old and lf in text:
        return ": the file's lines end with \\n and oldText's with \\r\\n (CRLF); write them as the file has them"
    return ""


def split_lines(text: str) -> list[str]:
    """``text``'s lines, each with its ``\n`` (the last one may have none). Only ``\n`` ends a
    line, as for diff(1), git, patch and ``read_file``: a form feed, a lone ``\r`` or U+2028
    is part of its line (``str.splitlines`` breaks at those too, which put two lines on one
    line of a diff and numbered lines unlike ``read_file``); a CRLF line keeps its ``\r``."""
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def _lines(text: str) -> list[str]:
    lines = split_lines(text)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n" + NO_NEWLINE  # the marker line, as diff(1) and git print it
    return lines


class _Aligned(difflib.SequenceMatcher):
    """difflib's opcodes and hunk grouping over matching blocks computed elsewhere."""

    def __init__(self, blocks: list[tuple[int, int, int]]) -> None:
        super().__init__(None, [], [], autojunk=False)
        self.matching_blocks = blocks  # read by get_opcodes() through get_matching_blocks()


def _matching_blocks(a: list[str], b: list[str]) -> list[tuple[int, int, int]]:
    """A longest common subsequence of lines as difflib matching blocks ``(i, j, n)``, ending
    with the ``(len(a), len(b), 0)`` sentinel. The common head and tail are matched directly;
    in the middle, lines absent from the other side cannot match, so they are left out before
    rapidfuzz aligns the rest (which also makes totally rewritten files cheap)."""
    try:
        from rapidfuzz.distance import Indel
    except ImportError:  # pragma: no cover - rapidfuzz is a dependency
        return difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    n, m = len(a), len(b)
    head = 0
    while head < n and head < m and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and tail < m - head and a[n - 1 - tail] == b[m - 1 - tail]:
        tail += 1
    blocks: list[list[int]] = [[0, 0, head]] if head else []
    mid_a, mid_b = a[head:n - tail], b[head:m - tail]
    in_a, in_b = set(mid_a), set(mid_b)
    ia = [i + head for i, line in enumerate(mid_a) if line in in_b]
    jb = [j + head for j, line in enumerate(mid_b) if line in in_a]
    if ia and jb:
        for op in Indel.opcodes([a[i] for i in ia], [b[j] for j in jb]):
            tag, i1, i2, j1, _ = tuple(op)
            if tag != "equal":
                continue
            k = i2 - i1
            if ia[i1 + k - 1] - ia[i1] == k - 1 and jb[j1 + k - 1] - jb[j1] == k - 1:
                pairs: Iterable[tuple[int, int, int]] = ((ia[i1], jb[j1], k),)  # one contiguous run
            else:
                pairs = ((ia[i1 + t], jb[j1 + t], 1) for t in range(k))
            for i, j, size in pairs:
                last = blocks[-1] if blocks else None
                if last is not None and last[0] + last[2] == i and last[1] + last[2] == j:
                    last[2] += size
                else:
                    blocks.append([i, j, size])
    if tail:
        i, j = n - tail, m - tail
        last = blocks[-1] if blocks else None
        if last is not None and last[0] + last[2] == i and last[1] + last[2] == j:
            last[2] += tail
        else:
            blocks.append([i, j, tail])
    return [(i, j, k) for i, j, k in blocks] + [(n, m, 0)]


def _unified(a: list[str], b: list[str], fromfile: str, tofile: str, n: int) -> Iterator[str]:
    """``difflib.unified_diff``'s output, over the blocks of :func:`_matching_blocks`."""
    fmt = difflib._format_range_unified  # type: ignore[attr-defined]
    started = False
    for group in _Aligned(_matching_blocks(a, b)).get_grouped_opcodes(n):
        if not started:
            started = True
            yield f"--- {fromfile}\n"
            yield f"+++ {tofile}\n"
        first, last = group[0], group[-1]
        yield f"@@ -{fmt(first[1], last[2])} +{fmt(first[3], last[4])} @@\n"
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                for line in a[i1:i2]:
                    yield " " + line
                continue
            if tag in ("replace", "delete"):
                for line in a[i1:i2]:
                    yield "-" + line
            if tag in ("replace", "insert"):
                for line in b[j1:j2]:
                    yield "+" + line


def unified_diff(old: str | None, new: str, path: str, *, context: int = 3) -> str:
    """A unified diff from ``old`` (None: the file does not exist) to ``new``; "" when equal."""
    if old == new:
        return ""
    a = _lines(old or "")
    b = _lines(new)
    fromfile = "/dev/null" if old is None else _diff_name("a/", path)
    return "".join(_unified(a, b, fromfile, _diff_name("b/", path), context))


#: what a path's name in a diff header escapes (git's quoting): a newline would split the header
_DIFF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _diff_name(prefix: str, path: str) -> str:
    """``prefix + path`` as a diff header names it: quoted with C escapes, as git quotes it,
    when it holds a control character, a quote or a backslash."""
    name = prefix + path
    quoted = "".join(_DIFF_ESCAPES.get(c) or (f"\\{ord(c):03o}" if ord(c) < 32 or ord(c) == 127 else c) for c in name)
    return name if quoted == name else f'"{quoted}"'


def count_changes(diff: str) -> tuple[int, int]:
    """(added, removed) line counts of a unified diff."""
    added = removed = 0
    lines = diff.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("@@")), len(lines))
    for line in lines[start:]:  # after the ---/+++ header
        if line.startswith("+"):
            added += 1
        elif line.startswith("-"):
            removed += 1
    return added, removed


@dataclass(slots=True, frozen=True)
class FileChange:
    """What a file-changing call does: ``old_text`` None means the file does not exist."""

    path: str
    old_text: str | None
    new_text: str
    diff: str
    added: int
    removed: int

    def preview(self, path: str | None = None) -> dict[str, Any]:
        """The ``preview`` of a permission request (``path`` overrides the shown path)."""
        return {"kind": "diff", "path": path or self.path, "oldText": self.old_text, "newText": self.new_text,
                "diff": self.diff}


def change(path: str, old_text: str | None, new_text: str) -> FileChange:
    diff = unified_diff(old_text, new_text, path)
    added, removed = count_changes(diff)
    return FileChange(path, old_text, new_text, diff, added, removed)
