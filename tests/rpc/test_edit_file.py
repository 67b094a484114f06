"""edit_file, diffs in outputs, diff previews in permission requests, and no lost work,
end to end over real pipes with the scripted model."""

from __future__ import annotations

from .support import TIMEOUT, scripted

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


def test_of_two_previewed_edits_of_one_file_the_second_fails_and_says_so(sidecar, tmp_path):
    """Both previews are computed from the same text before either is allowed: the first to
    run writes, the other finds the file changed and writes nothing (never overwrites)."""
    f = tmp_path / "m.txt"
    f.write_text("a\nb\nc\n")
    bid = start(sidecar, tmp_path, edits_of(edit("m.txt", ("a\n", "A\n")), edit("m.txt", ("c\n", "C\n"))),
                policy="ask", caps=PERM)
    sidecar.on_request("requestToolPermission", lambda p: {"decision": "allow_once"})
    out = outputs(operate(sidecar, bid))
    errors = [o["error"] for o in out if "error" in o]
    assert len(errors) == 1 and "changed after the change was previewed" in errors[0], out
    assert f.read_text() in ("A\nb\nc\n", "a\nb\nC\n")
