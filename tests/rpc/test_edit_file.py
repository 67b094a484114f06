"""edit_file, diffs in outputs, diff previews in permission requests, and no lost work,
end to end over real pipes with the scripted model."""

from __future__ import annotations

import json
import threading

import pytest

from .support import TIMEOUT, RpcError, scripted

PERM = {"toolPermission": True}
DENIED = "denied by governance gate"


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def edit(path: str, *edits: tuple) -> dict:
    items = []
    for e in edits:
        item = {"oldText": e[0], "newText": e[1]}
        if len(e) > 2:
            item["replaceAll"] = e[2]
        items.append(item)
    return call("edit_file", path=path, edits=items)


def operate(c, bid, **extra):
    return c.request("operate", {"branchId": bid, "instruction": "change it", "actions": True, **extra},
                     timeout=TIMEOUT)


def outputs(res):
    return [r["output"] for r in res["result"]["action_responses"]]


def start(c, ws, *responses, policy="allow", caps=None):
    c.request("initialize", {"workspaceFolders": [str(ws)], "capabilities": caps or {},
                             "settings": {"models": {"s": scripted(*responses)}, "defaultModel": "s",
                                          "toolPolicy": {"edit_file": policy, "write_file": policy}}},
              timeout=TIMEOUT)
    return c.branch()


def test_edit_file_applies_edits_in_order_and_returns_the_diff(sidecar, tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nc = 3\n")
    bid = start(sidecar, tmp_path, edit("m.py", ("a = 1", "a = 10"), ("a = 10\nb", "a = 10\nbee")))
    out = outputs(operate(sidecar, bid))[0]
    assert (tmp_path / "m.py").read_text() == "a = 10\nbee = 2\nc = 3\n"
    assert out["path"] == "m.py" and out["added"] == 2 and out["removed"] == 2
    assert out["diff"].startswith("--- a/m.py\n+++ b/m.py\n@@")
    assert "-a = 1\n" in out["diff"] and "+bee = 2\n" in out["diff"]
    tools = {t["name"]: t for t in sidecar.request("listTools", {})["tools"]}
    assert tools["edit_file"]["source"] == "builtin"
    assert tools["edit_file"]["inputSchema"]["properties"]["edits"]["items"]["required"] == ["oldText", "newText"]


def test_edit_that_does_not_apply_writes_nothing_and_names_the_edit(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_bytes(b"x = 1\nx = 1\ny = 2\n")
    bid = start(sidecar, tmp_path,
                edit("m.py", ("y = 2", "y = 3"), ("nope", "z")),          # edit 1: not found
                edit("m.py", ("x = 1", "x = 2")),                          # edit 0: 2 matches
                edit("m.py", ("x = 1", "x = 2", True)))                     # replaceAll: applies
    err = outputs(operate(sidecar, bid))[0]
    assert err["function"] == "edit_file" and "edit 1" in err["error"] and "not found" in err["error"]
    assert f.read_bytes() == b"x = 1\nx = 1\ny = 2\n"                      # all or nothing
    err = outputs(operate(sidecar, bid))[0]
    assert "edit 0" in err["error"] and "matches 2 times" in err["error"]
    assert f.read_bytes() == b"x = 1\nx = 1\ny = 2\n"
    ok = outputs(operate(sidecar, bid))[0]
    assert f.read_text() == "x = 2\nx = 2\ny = 2\n" and ok["removed"] == 2


def test_write_file_output_carries_a_diff_against_the_old_text_or_dev_null(sidecar, tmp_path):
    (tmp_path / "old.txt").write_text("one\ntwo\n")
    bid = start(sidecar, tmp_path, call("write_file", path="old.txt", content="one\n2\n"),
                call("write_file", path="new.txt", content="fresh\n"))
    out = outputs(operate(sidecar, bid))[0]
    assert out["diff"] == "--- a/old.txt\n+++ b/old.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+2\n"
    out = outputs(operate(sidecar, bid))[0]
    assert out["created"] is True and out["diff"] == "--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+fresh\n"


def test_permission_request_carries_the_diff_preview_and_deny_leaves_the_file_byte_identical(sidecar, tmp_path):
    f = tmp_path / "m.py"
    original = b"keep = True\r\nvalue = 1\r\n"  # CRLF, no edits to it must survive a denial byte for byte
    f.write_bytes(original)
    bid = start(sidecar, tmp_path, edit("m.py", ("value = 1", "value = 2")), policy="ask", caps=PERM)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "deny_once"})
    out = outputs(operate(sidecar, bid))[0]
    assert out["error"] == DENIED
    assert f.read_bytes() == original
    (p,) = asked
    preview = p["preview"]
    assert preview["kind"] == "diff" and preview["path"] == str(f.resolve())
    assert preview["oldText"] == original.decode() and preview["newText"] == "keep = True\r\nvalue = 2\r\n"
    assert "-value = 1\r\n+value = 2\r\n" in preview["diff"]
    assert p["tool"] == "edit_file" and p["callId"] == sidecar.messages(bid)[-1]["content"]["callId"]


def test_write_file_preview_of_a_new_file_has_null_old_text(sidecar, tmp_path):
    bid = start(sidecar, tmp_path, call("write_file", path="n.txt", content="hi\n"), policy="ask", caps=PERM)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    out = outputs(operate(sidecar, bid))[0]
    assert asked[0]["preview"]["oldText"] is None and asked[0]["preview"]["diff"].startswith("--- /dev/null")
    assert out["created"] is True and (tmp_path / "n.txt").read_text() == "hi\n"


def test_a_call_that_cannot_apply_is_never_put_to_the_user(sidecar, tmp_path):
    (tmp_path / "m.py").write_text("a\n")
    bid = start(sidecar, tmp_path, edit("m.py", ("missing", "x")), policy="ask", caps=PERM)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    out = outputs(operate(sidecar, bid))[0]
    assert asked == []
    assert "edit 0" in out["error"] and "not found" in out["error"] and out["function"] == "edit_file"
    assert [e["event"] for e in sidecar.of("toolEvent")] == ["pre", "error"]
    assert (tmp_path / "m.py").read_text() == "a\n"


def test_a_path_outside_the_workspace_is_refused_before_any_prompt(sidecar, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("s\n")
    bid = start(sidecar, ws, edit(str(outside), ("s", "x")), call("write_file", path="../secret.txt", content="x"),
                policy="ask", caps=PERM)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    for _ in range(2):
        out = outputs(operate(sidecar, bid))[0]
        assert "outside the workspace" in out["error"]
    assert asked == [] and outside.read_text() == "s\n"


def test_a_file_changed_after_the_preview_is_not_overwritten(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("value = 1\n")
    bid = start(sidecar, tmp_path, edit("m.py", ("value = 1", "value = 2")), policy="ask", caps=PERM)

    def user_types_then_allows(p):
        f.write_text("value = 1\n# typed while the prompt was open\n")  # the concurrent change
        return {"decision": "allow_once"}

    sidecar.on_request("requestToolPermission", user_types_then_allows)
    out = outputs(operate(sidecar, bid))[0]
    assert "changed after the change was previewed" in out["error"] and "nothing was written" in out["error"]
    assert f.read_text() == "value = 1\n# typed while the prompt was open\n"   # the concurrent change survives


def test_allowed_preview_writes_exactly_the_previewed_text(sidecar, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("value = 1\n")
    bid = start(sidecar, tmp_path, edit("m.py", ("value = 1", "value = 2")), policy="ask", caps=PERM)
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    out = outputs(operate(sidecar, bid))[0]
    assert f.read_text() == asked[0]["preview"]["newText"] == "value = 2\n"
    assert out["diff"] == asked[0]["preview"]["diff"]


def edits_of(*calls: dict) -> dict:
    return {"json": {"action_requests": [c["json"]["action_requests"][0] for c in calls]}}


def test_two_edits_of_one_file_made_at_once_both_land(sidecar, tmp_path):
    """No lost work: two edit_file calls of one reply (run concurrently) and two operates on two
    branches at once, each changing another line of one file: every change is on disk (one
    of each pair overwrote the other, and both said they succeeded)."""
    f = tmp_path / "m.txt"
    f.write_text("a\nb\nc\nd\n")
    bid = start(sidecar, tmp_path, edits_of(edit("m.txt", ("a\n", "A\n")), edit("m.txt", ("c\n", "C\n"))),
                edit("m.txt", ("b\n", "B\n")), edit("m.txt", ("d\n", "D\n")))
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert f.read_text() == "A\nb\nC\nd\n"
    other = sidecar.branch()
    pending = [sidecar.request_async("operate", {"branchId": b, "instruction": "change it", "actions": True})
               for b in (bid, other)]
    results = [outputs(p.result(timeout=TIMEOUT)) for p in pending]
    assert all("error" not in o for r in results for o in r), results
    assert f.read_text() == "A\nB\nC\nD\n"


class User:
    """A user at the permission prompt: each request is logged with the file's text on disk
    when it came; ``answer(params)`` decides (allow_once unless told)."""

    def __init__(self, c, f, answer=None) -> None:
        self.f = f
        self.asked: list[tuple[dict, str]] = []
        self.answer = answer or (lambda p: {"decision": "allow_once"})
        self.cond = threading.Condition()
        c.on_request("requestToolPermission", self)

    def __call__(self, p):
        with self.cond:
            self.asked.append((p, self.f.read_text() if self.f.exists() else None))
            self.cond.notify_all()
        return self.answer(p)

    def wait(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.asked) >= n, TIMEOUT), self.asked

    def previews(self) -> list[dict]:
        return [p["preview"] for p, _ in self.asked]


def test_a_second_edit_of_one_file_is_previewed_after_the_first_is_written(sidecar, tmp_path):
    """Two edit_file calls of one reply on one file, the second building on the first, under
    ask: the second is planned and put to the user only once the first is written, from the
    file as it then is (it failed 'not found' at once: both were planned from the old text)."""
    f = tmp_path / "notes.txt"
    f.write_text("one\n")
    chain = edits_of(edit("notes.txt", ("one\n", "two\n")), edit("notes.txt", ("two\n", "three\n")))
    bid = start(sidecar, tmp_path, chain, chain, chain, policy="ask", caps=PERM)
    user = User(sidecar, f)
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert f.read_text() == "three\n"
    assert [(p["oldText"], p["newText"]) for p in user.previews()] == [("one\n", "two\n"), ("two\n", "three\n")]
    assert [disk for _, disk in user.asked] == ["one\n", "two\n"]  # the second asked after the first landed
    # run one after the other (one task): the same, the first denied included
    f.write_text("one\n")
    user.answer = lambda p: {"decision": "deny_once" if len(user.asked) == 4 else "allow_once"}
    out = outputs(operate(sidecar, bid, actionStrategy="sequential"))
    assert "error" not in out[0] and out[1]["error"] == DENIED and f.read_text() == "two\n", out
    f.write_text("one\n")
    out = outputs(operate(sidecar, bid, actionStrategy="sequential"))
    assert all("error" not in o for o in out) and f.read_text() == "three\n", out


def test_two_independent_previewed_edits_of_one_file_both_land(sidecar, tmp_path):
    """Both approved, both written (the second failed 'changed after the change was previewed':
    the user approved a change that could never land); each preview is the file as it is."""
    f = tmp_path / "m.txt"
    f.write_text("a\nb\nc\n")
    bid = start(sidecar, tmp_path, edits_of(edit("m.txt", ("a\n", "A\n")), edit("m.txt", ("c\n", "C\n"))),
                edits_of(edit("m.txt", ("A\n", "a\n")), edit("m.txt", ("C\n", "c\n"))), policy="ask", caps=PERM)
    user = User(sidecar, f)
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert f.read_text() == "A\nb\nC\n"
    assert [p["oldText"] for p in user.previews()] == ["a\nb\nc\n", "A\nb\nc\n"]
    assert all(p["oldText"] == disk for p, disk in zip(user.previews(), [d for _, d in user.asked]))
    # the first denied: the second is previewed from the file as it still is, and lands alone
    user.answer = lambda p: {"decision": "deny_once" if len(user.asked) == 3 else "allow_once"}
    out = outputs(operate(sidecar, bid))
    assert out[0]["error"] == DENIED and "error" not in out[1], out
    assert user.previews()[3]["oldText"] == "A\nb\nC\n" and f.read_text() == "A\nb\nc\n"


def test_write_file_then_edit_file_of_one_file_in_one_reply(sidecar, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("old\n")
    bid = start(sidecar, tmp_path,
                edits_of(call("write_file", path="notes.txt", content="x\ny\n"), edit("notes.txt", ("y\n", "Y\n"))),
                edits_of(edit("notes.txt", ("x\n", "X\n")), call("write_file", path="notes.txt", content="fresh\n"),
                         call("write_file", path="other.txt", content="o\n")),
                policy="ask", caps=PERM)
    user = User(sidecar, f)
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert f.read_text() == "x\nY\n"
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert f.read_text() == "fresh\n" and (tmp_path / "other.txt").read_text() == "o\n"
    mine = [p for p in user.previews() if p["path"] == str(f.resolve())]
    assert [p["oldText"] for p in mine] == ["old\n", "x\ny\n", "x\nY\n", "X\nY\n"]


def test_previewed_edits_of_one_file_on_two_branches_both_land(sidecar, tmp_path):
    f = tmp_path / "m.txt"
    f.write_text("a\nb\n")
    bid = start(sidecar, tmp_path, edit("m.txt", ("a\n", "A\n")), edit("m.txt", ("b\n", "B\n")),
                policy="ask", caps=PERM)
    other = sidecar.branch()
    actions = threading.Event()

    def on_progress(p):
        if p["token"] == "second" and p["value"].get("phase") == "actions":
            actions.set()

    sidecar.on_notification("$/progress", on_progress)
    # the first prompt is answered once the second operate is at its actions: its call is
    # then planned at once, or waits for the first call's turn
    user = User(sidecar, f, lambda p: {"decision": "allow_once" if len(user.asked) > 1 or actions.wait(TIMEOUT)
                                       else "deny_once"})
    first = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True})
    user.wait(1)
    second = sidecar.request_async("operate", {"branchId": other, "instruction": "x", "actions": True,
                                               "workDoneToken": "second"})
    results = [outputs(p.result(timeout=TIMEOUT)) for p in (first, second)]
    assert all("error" not in o for r in results for o in r), results
    assert f.read_text() == "A\nB\n"
    assert [disk for _, disk in user.asked] == ["a\nb\n", "A\nb\n"]


def test_previewed_edits_of_different_files_are_put_to_the_user_at_once(sidecar, tmp_path):
    """Turns are per file: a prompt nobody answers yet holds back no other file's call."""
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "b.txt").write_text("b\n")
    bid = start(sidecar, tmp_path, edits_of(edit("a.txt", ("a\n", "A\n")), edit("b.txt", ("b\n", "B\n"))),
                policy="ask", caps=PERM)
    user = User(sidecar, tmp_path / "a.txt")
    user.answer = lambda p: user.wait(2) or {"decision": "allow_once"}  # both open at once
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert (tmp_path / "a.txt").read_text() == "A\n" and (tmp_path / "b.txt").read_text() == "B\n"


def test_a_prompt_that_times_out_or_is_cancelled_gives_the_file_back(sidecar, tmp_path):
    """The first call's prompt is never answered: it times out (deny) and only then is the
    second put to the user; a cancelled operate leaves the file free for the next one."""
    f = tmp_path / "m.txt"
    f.write_text("a\nb\n")
    sidecar.request("initialize", {"workspaceFolders": [str(tmp_path)], "capabilities": PERM,
                                   "settings": {"models": {"s": scripted(
                                       edits_of(edit("m.txt", ("a\n", "A\n")), edit("m.txt", ("b\n", "B\n"))),
                                       edits_of(edit("m.txt", ("a\n", "1\n")), edit("m.txt", ("B\n", "2\n"))),
                                       edit("m.txt", ("B\n", "3\n")))},
                                       "permissionTimeoutMs": 1500,
                                       "toolPolicy": {"edit_file": "ask"}}}, timeout=TIMEOUT)
    bid = sidecar.branch()
    never = threading.Event()
    user = User(sidecar, f, lambda p: {"decision": "allow_once"} if len(user.asked) > 1 else never.wait(TIMEOUT))
    try:
        out = outputs(operate(sidecar, bid))
    finally:
        never.set()
    assert out[0]["error"] == DENIED and out[0]["reason"] == "permission request timed out", out
    assert "error" not in out[1] and f.read_text() == "a\nB\n"
    cancels = [p["id"] for p in sidecar.of("$/cancelRequest")]
    assert len(cancels) == 1 and len(user.asked) == 2  # the second was asked after the first timed out

    hold = threading.Event()
    user.asked.clear()
    user.answer = lambda p: {"decision": "allow_once"} if len(user.asked) > 1 else hold.wait(TIMEOUT)
    try:
        pending = sidecar.request_async("operate", {"branchId": bid, "instruction": "x", "actions": True})
        user.wait(1)
        sidecar.cancel(pending.id)
        with pytest.raises(RpcError) as ei:
            pending.result(timeout=TIMEOUT)
        assert ei.value.code == -32800
    finally:
        hold.set()
    assert len(user.asked) == 1 and f.read_text() == "a\nB\n"  # the second call was never put to the user
    out = outputs(operate(sidecar, bid))  # the file is free again
    assert "error" not in out[0] and f.read_text() == "a\n3\n"


def test_with_the_clients_file_system_changes_of_one_file_are_proposed_one_after_the_other(sidecar, tmp_path):
    """capabilities.fs: the same turns; the second call reads the buffer only after the
    first wrote it, and nothing touches the disk."""
    path = str((tmp_path / "notes.txt").resolve())
    (tmp_path / "notes.txt").write_text("disk\n")
    buffers = {path: "one\na\n"}
    log: list[tuple[str, str]] = []
    lock = threading.Lock()

    def read(p):
        with lock:
            log.append(("read", p["callId"]))
            return {"text": buffers[p["path"]]}

    def write(p):
        with lock:
            log.append(("write", p["callId"]))
            buffers[p["path"]] = p["text"]
            return {}

    sidecar.on_request("fs/readTextFile", read)
    sidecar.on_request("fs/writeTextFile", write)
    bid = start(sidecar, tmp_path, edits_of(edit("notes.txt", ("one\n", "two\n")), edit("notes.txt", ("two\n", "three\n")),
                                            edit("notes.txt", ("a\n", "A\n"))),
                policy="ask", caps={"fs": True, **PERM})
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    out = outputs(operate(sidecar, bid))
    assert all("error" not in o for o in out), out
    assert buffers[path] == "three\nA\n" and (tmp_path / "notes.txt").read_text() == "disk\n"
    assert [p["preview"]["oldText"] for p in asked] == ["one\na\n", "two\na\n", "three\na\n"]
    calls = [p["callId"] for p in asked]
    for before, after in zip(calls, calls[1:]):  # each call's first read after the one before wrote
        assert log.index(("write", before)) < log.index(("read", after)), log


def test_an_edit_whose_line_ends_differ_from_the_files_says_so_and_writes_nothing(sidecar, tmp_path):
    """A CRLF file and an oldText written with \\n (what a model usually writes): the edit does
    not apply (matching is exact), and the error says why, so the next round can correct it;
    it used to say only "not found". The other way round too."""
    crlf, lf = tmp_path / "w.txt", tmp_path / "u.txt"
    crlf.write_bytes(b"a = 1\r\nb = 2\r\n")
    lf.write_bytes(b"a = 1\nb = 2\n")
    bid = start(sidecar, tmp_path, edit("w.txt", ("a = 1\nb = 2", "c = 3")), edit("u.txt", ("a = 1\r\nb = 2", "c")),
                edit("w.txt", ("a = 1\r\nb = 2", "c = 3")))
    err = outputs(operate(sidecar, bid))[0]["error"]
    assert "edit 0: oldText not found" in err and "the file's lines end with \\r\\n (CRLF) and oldText's with \\n" in err
    err = outputs(operate(sidecar, bid))[0]["error"]
    assert "the file's lines end with \\n and oldText's with \\r\\n (CRLF)" in err
    assert crlf.read_bytes() == b"a = 1\r\nb = 2\r\n" and lf.read_bytes() == b"a = 1\nb = 2\n"
    assert outputs(operate(sidecar, bid))[0]["removed"] == 2 and crlf.read_bytes() == b"c = 3\r\n"


def test_a_path_ending_with_a_slash_is_never_taken_for_a_file(sidecar, tmp_path):
    """``docs/`` names a directory (open(2) refuses it): write_file used to drop the slash and
    create, or replace, the *file* ``docs``; edit_file edited ``m.py`` for ``m.py/``. Both are
    refused before anything is written or anybody is asked."""
    (tmp_path / "docs").write_text("keep\n")
    (tmp_path / "m.py").write_text("a\n")
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})
    bid = start(sidecar, tmp_path, call("write_file", path="docs/", content="x\n"),
                call("write_file", path="new/", content="x\n"), edit("m.py/", ("a", "b")), policy="ask", caps=PERM)
    for path in ("docs/", "new/", "m.py/"):
        out = outputs(operate(sidecar, bid))[0]
        assert out["error"] == f"{path!r} ends with a slash, so it names a directory, not a file; give the file's path"
    assert (tmp_path / "docs").read_text() == "keep\n" and (tmp_path / "m.py").read_text() == "a\n"
    assert not (tmp_path / "new").exists() and asked == []


def test_new_text_that_is_not_unicode_is_refused_in_words_before_anyone_is_asked(sidecar, tmp_path):
    """A lone surrogate (a JSON escape can carry one, a file cannot) in write_file's content or
    an edit's newText: refused before the user is asked, saying what is wrong (it used to be
    Python's codec message), and nothing is written."""
    (tmp_path / "m.py").write_text("a\n")
    asked = []
    sidecar.on_request("requestToolPermission", lambda p: asked.append(p) or {"decision": "allow_once"})

    def written_by_the_model(function: str, **arguments) -> dict:  # its reply text holds the escape
        return {"text": json.dumps(call(function, **arguments)["json"]).replace("SURROGATE", "\\ud800")}

    bid = start(sidecar, tmp_path, written_by_the_model("write_file", path="n.py", content="xSURROGATEy"),
                written_by_the_model("edit_file", path="m.py", edits=[{"oldText": "a", "newText": "bSURROGATE"}]),
                policy="ask", caps=PERM)
    for _ in ("write_file", "edit_file"):
        err = outputs(operate(sidecar, bid))[0]["error"]
        assert err == "the new text is not Unicode text: character 1 is '\\ud800', half of a surrogate pair; " \
                      "nothing written", err
    assert (tmp_path / "m.py").read_text() == "a\n" and not (tmp_path / "n.py").exists() and asked == []


def test_a_replace_all_that_would_multiply_the_file_past_the_write_limit_is_refused_before_it_is_made(
        sidecar, tmp_path):
    """Each of 1,000,000 a's replaced by 300 b's is 300 MB of text (the write limit is 10 MB):
    the edit is refused naming the size and the limit, nothing is written, and the text is never
    built (the server's peak memory does not grow by it; it was built, then refused)."""
    (tmp_path / "a.txt").write_text("a" * 1_000_000)

    def peak_kib() -> int:
        status = open(f"/proc/{sidecar.proc.pid}/status").read()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1])

    bid = start(sidecar, tmp_path, edit("a.txt", ("nowhere", "x")), edit("a.txt", ("a", "b" * 300, True)))
    assert "not found" in outputs(operate(sidecar, bid))[0]["error"]  # (the core and the tools in)
    before = peak_kib()
    out = outputs(operate(sidecar, bid))[0]
    assert peak_kib() - before < 100 * 1024, (before, peak_kib())
    assert "300000000 characters" in out["error"] and "the limit is 10485760" in out["error"], out
    assert "nothing was written" in out["error"], out
    assert (tmp_path / "a.txt").read_text() == "a" * 1_000_000


def test_a_file_deeper_than_the_system_s_path_limit_is_created_edited_and_previewed_as_it_is(sidecar, tmp_path):
    """A file whose absolute path is longer than PATH_MAX (4096) in a deep tree of the workspace:
    the tools reach it a folder at a time, but the check whether it exists looked at its whole
    name, failed (ENAMETOOLONG) and took that for "no file": edit_file said it did not exist and
    a write over it was previewed, and reported, as a new file (against /dev/null) while it
    replaced the text there."""
    import os

    deep = "/".join(f"d{i:02d}" + "x" * 200 for i in range(25)) + "/f.txt"  # 5,105 characters
    bid = start(sidecar, tmp_path, call("write_file", path=deep, content="precious 1\nprecious 2\n"),
                edit(deep, ("precious 1", "kept 1")), call("write_file", path=deep, content="replacement\n"), caps=PERM)
    assert outputs(operate(sidecar, bid))[0]["created"] is True
    out = outputs(operate(sidecar, bid))[0]
    assert "error" not in out and out["removed"] == 1, out
    sidecar.request("authorizeTool", {"tool": "write_file", "decision": "ask"}, timeout=TIMEOUT)
    seen = []
    sidecar.on_request("requestToolPermission", lambda p: seen.append(p["preview"]) or {"decision": "allow_once"})
    out = outputs(sidecar.request("operate", {"branchId": bid, "instruction": "again", "actions": True},
                                  timeout=TIMEOUT))
    assert seen and seen[0]["oldText"] == "kept 1\nprecious 2\n" and not seen[0]["diff"].startswith("--- /dev/null")
    assert out[0]["created"] is False and "-kept 1\n" in out[0]["diff"], out
    fd = os.open(tmp_path, os.O_RDONLY)
    for part in deep.split("/")[:-1]:
        fd, old = os.open(part, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    try:
        with open(os.open("f.txt", os.O_RDONLY, dir_fd=fd), "rb") as f:
            assert f.read() == b"replacement\n"
    finally:
        os.close(fd)
