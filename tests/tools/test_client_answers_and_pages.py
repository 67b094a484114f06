"""What the client's file system answers, taken as docs/PROTOCOL.md §10 says, and read_file
pages that fit in a tool output whatever their characters (§9), driven through the real server
over real pipes with the scripted model: a write answered with anything but a write done is a
failed write, a read the client never answers fails saying so, and a page of control
characters is paged, never cut into a preview."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from rpc.support import TIMEOUT  # tests/ is on sys.path
from tools.wire_support import call, output, start

#: what an editor whose save failed may answer fs/writeTextFile with instead of an error response
NOT_WRITTEN = ["failed to save", False, 0, {"error": "disk full"}]
#: what a write done is answered with: the schema's {}, an object, a void answer, or true (an
#: editor whose handler returns its save's success)
WRITTEN = [{}, {"saved": True}, None, True]


def test_a_write_answered_with_anything_but_a_write_done_fails_the_call(sidecar, tmp_path):
    """A client answering ``fs/writeTextFile`` with ``"failed to save"``, ``false``, ``0`` or
    ``{"error": ...}`` had its edit reported done, with its diff, while the file kept its old
    text. Now the call fails naming what the client answered; ``{}``, another object, null and
    ``true`` are a write done."""
    answers = NOT_WRITTEN + WRITTEN
    buffers = {str(tmp_path.resolve() / f"f{i}.txt"): "a\nb\n" for i in range(len(answers))}
    lock = threading.Lock()

    def read(p):
        with lock:
            return {"text": buffers[p["path"]]}

    def write(p):
        i = int(p["path"].rsplit("f", 1)[1].split(".")[0])
        with lock:
            if answers[i] in WRITTEN:
                buffers[p["path"]] = p["text"]
        return answers[i]

    sidecar.on_request("fs/readTextFile", read)
    sidecar.on_request("fs/writeTextFile", write)
    reply = {"json": {"action_requests": [
        {"function": "edit_file", "arguments": {"path": f"f{i}.txt", "edits": [{"oldText": "a", "newText": "A"}]}}
        for i in range(len(answers))]}}
    bid = start(sidecar, tmp_path, reply, caps={"fs": True})
    res = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    outs = [r["output"] for r in res["result"]["action_responses"]]
    assert len(outs) == len(answers)
    for i, (answer, out) in enumerate(zip(answers, outs)):
        path = str(tmp_path.resolve() / f"f{i}.txt")
        if answer in WRITTEN:
            assert out.get("added") == 1 and "error" not in out, (answer, out)
            assert buffers[path] == "A\nb\n"
        else:
            shown = json.dumps(answer)
            assert out == {"error": f"the client could not write {path}: it answered fs/writeTextFile with "
                                    f"{shown} (a write done is answered with {{}})", "function": "edit_file",
                           "arguments": {"path": f"f{i}.txt", "edits": [{"oldText": "a", "newText": "A"}]}}, out
            assert buffers[path] == "a\nb\n"


@pytest.mark.parametrize("function", ["read_file", "edit_file"])
def test_a_read_the_client_never_answers_fails_saying_so(sidecar, tmp_path, function):
    """docs/PROTOCOL.md §10: a request with no answer fails the call saying the client did not
    answer. The call's own time-out (the same length, started first) always ended it first,
    with ``tool read_file timed out after 3 s``, which did not say what was waited for."""
    (tmp_path / "f.txt").write_text("a\n")
    asked, release = threading.Event(), threading.Event()
    sidecar.on_request("fs/readTextFile", lambda p: (asked.set(), release.wait(TIMEOUT), {"text": "a\n"})[2])
    arguments = {"path": "f.txt"} if function == "read_file" else \
        {"path": "f.txt", "edits": [{"oldText": "a", "newText": "A"}]}
    try:
        bid = start(sidecar, tmp_path, call(function, **arguments), caps={"fs": True}, toolTimeoutMs=3000)
        out = output(sidecar, bid)
    finally:
        release.set()
    assert asked.is_set()
    path = re.escape(str(tmp_path.resolve() / "f.txt"))
    assert re.fullmatch(rf"the client did not answer fs/readTextFile for {path}: no answer within [0-9.]+ s, "
                        r"before the call's own time-out", out["error"]), out
    assert (tmp_path / "f.txt").read_text() == "a\n"


#: lines of terminal control codes (a log of a coloured terminal): each ESC is six characters
#: in the output's JSON (\u001b), so a page of half of maxToolOutputChars bytes is over it
ANSI = "".join(f"{i:03d}" + "\x1b[0m\x1b[1m" * 5 + "\n" for i in range(60))
LIMIT = 1000


@pytest.mark.parametrize("caps", [{}, {"fs": True}], ids=["disk", "client"])
def test_a_page_of_control_characters_is_paged_never_cut_into_a_preview(sidecar, tmp_path, caps):
    """A read_file page is at most half of maxToolOutputChars bytes, but a control character
    takes six characters in the output's JSON: a page of them was over the bound and replaced
    by ``{truncated, originalChars, preview}``, no ``nextOffset`` in it, so the model could not
    page on. Now every page's output fits in the bound, the pages join into the file, and a first
    line of control characters longer than a page is cut where it fits."""
    (tmp_path / "ansi.log").write_text(ANSI)
    (tmp_path / "esc.txt").write_text("\x1b" * 2000 + "\n" + "after\n")
    texts = {"ansi.log": ANSI, "esc.txt": "\x1b" * 2000 + "\n" + "after\n"}
    sidecar.on_request("fs/readTextFile", lambda p: {"text": texts[p["path"].rsplit("/", 1)[1]]})
    offsets = range(1, ANSI.count("\n") + 1)
    reply = {"json": {"action_requests": [{"function": "read_file", "arguments": {"path": "ansi.log", "offset": n}}
                                          for n in offsets] + [
        {"function": "read_file", "arguments": {"path": "esc.txt"}}]}}
    bid = start(sidecar, tmp_path, reply, caps=caps, maxToolOutputChars=LIMIT)
    res = sidecar.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    outs = [r["output"] for r in res["result"]["action_responses"]]
    assert len(outs) == len(offsets) + 1
    for out in outs:
        assert "preview" not in out and "error" not in out, str(out)[:300]
        assert len(json.dumps(out, ensure_ascii=False)) <= LIMIT
    pages, offset = [], 1
    while offset is not None:
        out = outs[offset - 1]
        assert out["lines"] >= 1 and not out["truncated"], out
        pages.append(out["content"])
        offset = out["nextOffset"]
    assert "".join(pages) == ANSI and len(pages) > 1
    esc = outs[-1]
    assert esc["truncated"] is True and esc["nextOffset"] == 2 and set(esc["content"]) == {"\x1b"}, str(esc)[:300]


def test_a_long_wait_is_said_in_plain_seconds():
    """The read's wait, shortened to end before the call's own time-out, is said in plain
    seconds: a time-out of half an hour was said as ``1.8e+03 s``."""
    import anyio

    from operate_sidecar.server.core.tools import ToolCallContext
    from operate_sidecar.server.tools.errors import ToolCallError
    from operate_sidecar.server.tools.file_tools import ClientFiles

    waits = []

    async def request(method, params, timeout):
        waits.append(timeout)
        raise TimeoutError()

    async def main():
        with anyio.fail_after(1800):
            with pytest.raises(ToolCallError) as e:
                await ClientFiles(request, timeout=None).read_text(Path("/w/a.txt"), ToolCallContext("b", "c"))
        return str(e.value)

    error = anyio.run(main)
    assert 1799 < waits[0] < 1800
    assert re.fullmatch(r"the client did not answer fs/readTextFile for /w/a\.txt: no answer within 179\d\.\d s, "
                        r"before the call's own time-out", error), error


def test_json_chars_counts_what_json_writes():
    """:func:`json_chars` (a count over the text's bytes, not its JSON) is the length of the
    JSON ``maxToolOutputChars`` counts, for every character, and for text mixing them."""
    import random

    from operate_sidecar.server.tools.builtin import json_chars

    every = "".join(chr(i) for i in range(0x30000))  # (surrogates included: a JSON escape can carry one)
    assert json_chars(every) == len(json.dumps(every, ensure_ascii=False)) - 2
    for i in range(0x80):
        assert json_chars(chr(i)) == len(json.dumps(chr(i), ensure_ascii=False)) - 2, i
    rnd = random.Random(7)
    alphabet = 'ab"\\\t\r\n\x00\x1b\x08\x0c\x0b\x1f\x7fé漢😀\u2028\ud800'
    for _ in range(2000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 30)))
        assert json_chars(text) == len(json.dumps(text, ensure_ascii=False)) - 2, repr(text)
