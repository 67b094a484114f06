"""stdout is the wire: prints and child processes of tools cannot corrupt it;
tool subprocesses read /dev/null, never the protocol stream."""

from __future__ import annotations

from .support import TIMEOUT, scripted


def test_tool_that_prints_and_spawns_children_leaves_the_stream_intact(sidecar):
    sidecar.init(models={"s": scripted({"json": {"action_requests": [
        {"function": "noisy", "arguments": {"text": "hi"}}]}})}, toolModules=["noisy_tools"])
    bid = sidecar.branch()
    out = sidecar.request("operate", {"branchId": bid, "instruction": "be noisy", "actions": True},
                          timeout=TIMEOUT)
    responses = out["result"]["action_responses"]
    assert responses == [{"function": "noisy", "arguments": {"text": "hi"}, "output": "ok:hi:stdin=0"}]
    assert sidecar.request("ping") == {}
    assert sidecar.close() == 0
    assert sidecar.stream_errors == []
    err = sidecar.stderr_text()
    for text in ("PRINTED TO STDOUT hi", "sys.stdout write", "raw fd 1 write", "child echo to its stdout"):
        assert text in err


def test_nothing_but_frames_on_stdout_at_startup_and_exit(sidecar):
    sidecar.init(models={"s": scripted("x")})
    assert sidecar.close() == 0
    assert sidecar.stream_errors == []
