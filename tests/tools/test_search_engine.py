"""search_text's matcher: RE2, linear time whatever the pattern; literal text stays literal."""

import time

import pytest

from operate_sidecar.server.tools import WorkspacePathError, WorkspaceTools


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 40 + "!\nHello World\nprice: $5 (net)\n" + "a" * 30 + "\n")
    return WorkspaceTools([tmp_path])


def test_catastrophic_backtracking_patterns_finish_at_once(ws):
    started = time.monotonic()
    for pattern in ("(a+)+$", "(a|aa)*$", "(a*)*b", "^(a|a)*$"):
        ws.search_text(pattern, regex=True)
    assert time.monotonic() - started < 5        # a backtracking engine takes hours on the first one


def test_regex_and_literal_and_case(ws):
    assert [m["line"] for m in ws.search_text("^a+$", regex=True)["matches"]] == [4]
    assert [m["line"] for m in ws.search_text("$5 (net)")["matches"]] == [3]   # literal: no regex meaning
    assert ws.search_text("hello world")["matches"] == []
    assert [m["line"] for m in ws.search_text("hello world", ignore_case=True)["matches"]] == [2]


def test_unsupported_or_invalid_patterns_are_a_clear_error(ws):
    with pytest.raises(WorkspacePathError, match="invalid regular expression"):
        ws.search_text(r"(a)\1", regex=True)               # backreferences are not linear-time
    with pytest.raises(WorkspacePathError, match="invalid regular expression"):
        ws.search_text("(unclosed", regex=True)
