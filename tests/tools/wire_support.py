"""What the file-tool tests over the wire share: a scripted reply calling one tool, a server
started on a workspace with the file tools allowed, and the output of the one call an operate
made."""

from __future__ import annotations

from rpc.support import TIMEOUT, scripted  # tests/ is on sys.path


def call(function: str, **arguments) -> dict:
    return {"json": {"action_requests": [{"function": function, "arguments": arguments}]}}


def start(c, ws, *responses, caps=None, policy="allow", **settings):
    c.request("initialize", {"workspaceFolders": [str(ws)], "capabilities": caps or {},
                             "settings": {"models": {"s": scripted(*responses)}, "defaultModel": "s",
                                          "toolPolicy": {"edit_file": policy, "write_file": policy}, **settings}},
              timeout=TIMEOUT)
    return c.branch()


def output(c, bid):
    res = c.request("operate", {"branchId": bid, "instruction": "go", "actions": True}, timeout=TIMEOUT)
    (out,) = [r["output"] for r in res["result"]["action_responses"]]
    return out
