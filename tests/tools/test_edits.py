"""The edit engine (server/tools/edits.py): edits in order, all or nothing, precise errors;
unified diffs that apply back to the new text."""

from __future__ import annotations

import difflib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operate_sidecar.server.tools.edits import EditError, apply_edits, change, count_changes, unified_diff


def test_edits_apply_in_order_each_to_the_result_of_the_ones_before():
    text = "a = 1\nb = 2\n"
    out = apply_edits(text, [{"oldText": "a = 1", "newText": "a = 10"}, {"oldText": "a = 10\nb", "newText": "x"}])
    assert out == "x = 2\n"


def test_not_found_names_the_edit_index():
    with pytest.raises(EditError) as ei:
        apply_edits("a\nb\n", [{"oldText": "a", "newText": "A"}, {"oldText": "zzz", "newText": "y"}])
    assert ei.value.index == 1 and str(ei.value).startswith("edit 1: oldText not found")


def test_several_matches_say_how_many_unless_replace_all():
    with pytest.raises(EditError) as ei:
        apply_edits("x x x", [{"oldText": "x", "newText": "y"}])
    assert ei.value.index == 0 and "matches 3 times" in str(ei.value)
    assert apply_edits("x x x", [{"oldText": "x", "newText": "y", "replaceAll": True}]) == "y y y"


@pytest.mark.parametrize("edits", [[], [{"oldText": "", "newText": "y"}], [{"oldText": 1, "newText": "y"}]])
def test_empty_or_malformed_edits_are_refused(edits):
    with pytest.raises(EditError):
        apply_edits("abc", edits)


def test_diff_headers_dev_null_and_no_newline_marker():
    assert unified_diff(None, "x\n", "n.txt") == "--- /dev/null\n+++ b/n.txt\n@@ -0,0 +1 @@\n+x\n"
    d = unified_diff("a\nb", "a\nc", "f")
    assert d.endswith("-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n")
    assert unified_diff("same\n", "same\n", "f") == ""


def test_change_counts_lines_not_headers():
    ch = change("f", "--x\n++y\n", "++x\n--y\n")
    assert (ch.added, ch.removed) == (2, 2) == count_changes(ch.diff)
    assert ch.preview("/abs/f") == {"kind": "diff", "path": "/abs/f", "oldText": "--x\n++y\n",
                                    "newText": "++x\n--y\n", "diff": ch.diff}


def test_a_single_region_edit_prints_exactly_what_difflib_prints():
    old = "".join(f"line {i}\n" for i in range(300))
    new = old.replace("line 150\n", "line one-fifty\nand more\n")
    ref = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/f", "b/f"))
    assert unified_diff(old, new, "f") == ref


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _apply(old: str, diff: str) -> str:
    """Apply a unified diff (as patch(1) would) to ``old``."""
    src = old.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    lines = diff.splitlines(keepends=True)[2:]
    k = 0
    while k < len(lines):
        m = _HUNK.match(lines[k])
        assert m, lines[k]
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        out += src[pos:start]
        pos = start
        k += 1
        while k < len(lines) and not lines[k].startswith("@@"):
            line = lines[k]
            nxt = lines[k + 1] if k + 1 < len(lines) else ""
            body = line[1:]
            if nxt.startswith("\\ No newline"):
                body = body[:-1]
                k += 1
            if line[0] == " ":
                assert src[pos] == body
                out.append(body)
                pos += 1
            elif line[0] == "-":
                assert src[pos] == body
                pos += 1
            else:
                out.append(body)
            k += 1
    return "".join(out + src[pos:])


lines_st = st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n", "", "e"]), max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(old=lines_st, new=lines_st)
def test_the_diff_applies_back_to_the_new_text(old, new):
    diff = unified_diff(old, new, "f")
    assert _apply(old, diff) == new
    added, removed = count_changes(diff)
    assert added - removed == len(new.splitlines()) - len(old.splitlines())  # counts agree with the texts
    assert (diff == "") == (old == new)
