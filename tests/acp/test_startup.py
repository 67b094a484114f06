"""What ``operate-sidecar --acp`` does to answer ``initialize`` and ``session/new`` soon and to
make the first prompt cost what a warm one does (server/acp/run.py ``import_sdk``,
server/acp/agent.py ``warm_up``). Each test runs in a child process: both change
process-wide state (the SDK's imported models, the interpreter's warmed code, the collector)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import call_count
from acp_support import agent_env

SDK_IMPORT = r'''
import json
from pydantic import BaseModel
from pydantic._internal import _config, _fields
from operate_sidecar.server.acp.run import import_sdk

docstrings = _fields._update_fields_from_docstrings
import_sdk()
import acp.schema as S

out = {"deferred": S.PromptRequest.__pydantic_complete__ is False,
       "description": S.PromptRequest.model_fields["session_id"].description,
       "restored": _fields._update_fields_from_docstrings is docstrings
                   and _config.config_defaults["defer_build"] is False}
r = S.PromptRequest.model_validate({"sessionId": "s", "prompt": [{"type": "text", "text": "hi"}]})
out["parsed"] = [r.session_id, r.prompt[0].text]
try:
    S.PromptRequest.model_validate({"sessionId": 1, "prompt": "no"})
    out["rejected"] = False
except Exception:
    out["rejected"] = True
out["built_on_use"] = S.PromptRequest.__pydantic_complete__
out["dumped"] = S.PromptResponse(stop_reason="end_turn").model_dump(by_alias=True, exclude_none=True)


class Later(BaseModel):
    x: int
    """an attribute docstring"""

    model_config = {"use_attribute_docstrings": True}


out["later"] = [Later.__pydantic_complete__, Later.model_fields["x"].description]
print(json.dumps(out))
'''


def test_the_sdk_is_imported_without_docstrings_and_with_models_built_on_first_use(tmp_path):
    """``import_sdk``: the SDK's models are not built at import (``defer_build``) and their
    attribute docstrings are not read; each is built on its first use and then validates and
    serializes as pydantic always does. Models declared afterwards are untouched (the probe
    is a file: pydantic reads attribute docstrings from the source)."""
    probe = tmp_path / "probe.py"
    probe.write_text(SDK_IMPORT)
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120,
                         env=agent_env())
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["deferred"] is True          # not built by the import
    assert res["description"] is None       # the docstring was not read
    assert res["restored"] is True          # pydantic's own settings are back
    assert res["parsed"] == ["s", "hi"] and res["rejected"] is True and res["built_on_use"] is True
    assert res["dumped"] == {"stopReason": "end_turn"}
    assert res["later"] == [True, "an attribute docstring"]


WARM_UP = r'''
import asyncio, json, os, sys, threading
import acp
from operate_sidecar.server.acp import agent as A
from operate_sidecar.server.rpc import settings as S

prompts, sent = [], []
real_prompt = A.OperateAgent.prompt


async def spy(self, *args, **kw):
    prompts.append([type(self).__name__, threading.get_ident() == threading.main_thread().ident])
    return await real_prompt(self, *args, **kw)


A.OperateAgent.prompt = spy


class Client:
    async def session_update(self, session_id, update, **kw):
        sent.append(update.session_update)


def fds():
    return {f for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")}


async def main():
    a = A.OperateAgent(S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted",
        "responses": [{"json": {"message": "hi"}}]}}, "defaultModel": "s"})))
    a.on_connect(Client())
    before = fds()
    await a.initialize(protocol_version=1)
    await a._ready(warm=True)
    await asyncio.sleep(0.2)
    left_open = sorted(fds() - before)
    warm = list(prompts)
    sid = (await a.new_session(cwd=sys.argv[1])).session_id
    r = await a.prompt(prompt=[acp.text_block("go")], session_id=sid)
    await a.aclose()
    print(json.dumps({"warm": warm, "sent": sent, "after": prompts[len(warm):], "stop": r.stop_reason,
                      "left_open": left_open}))


asyncio.run(main())
'''


def test_the_warm_up_runs_prompt_turns_through_the_sdk_on_the_serving_thread(ws):
    """Before ``session/new`` is answered, ``warm_up`` has sent ``WARM_PROMPTS`` prompt turns
    through the SDK's connection to a throwaway agent, on the event loop's thread (the one
    that serves the real prompts), none of their updates reached the real client, and the
    pipes it used are closed."""
    from operate_sidecar.server.acp.agent import WARM_PROMPTS

    out = subprocess.run([sys.executable, "-c", WARM_UP, str(ws)], capture_output=True, text=True, timeout=120,
                         env=agent_env())
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert WARM_PROMPTS >= 8
    assert res["warm"] == [["_WarmAgent", True]] * WARM_PROMPTS
    assert res["after"] == [["OperateAgent", True]] and res["stop"] == "end_turn"
    assert res["sent"] == ["agent_message_chunk"]  # the real prompt's reply, and nothing of the warm-up
    assert res["left_open"] == []  # every pipe it opened is closed


HUNG_WARM_UP = r'''
import asyncio, json, sys
import acp
from operate_sidecar.server.acp import agent as A
from operate_sidecar.server.rpc import settings as S


async def never(sidecar):
    await asyncio.sleep(3600)


A.warm_up, A.WARM_TIMEOUT_S = never, 0.5


class Client:
    async def session_update(self, session_id, update, **kw):
        pass


async def main():
    a = A.OperateAgent(S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted",
        "responses": [{"json": {"message": "hi"}}]}}, "defaultModel": "s"})))
    a.on_connect(Client())  # a connected agent warms up
    await a.initialize(protocol_version=1)
    sid = (await asyncio.wait_for(a.new_session(cwd=sys.argv[1]), 30)).session_id
    r = await asyncio.wait_for(a.prompt(prompt=[acp.text_block("go")], session_id=sid), 30)
    await a.aclose()
    print(json.dumps({"stop": r.stop_reason}))


asyncio.run(main())
'''


def test_a_warm_up_that_never_ends_holds_session_new_up_only_until_its_time_out(ws):
    out = subprocess.run([sys.executable, "-c", HUNG_WARM_UP, str(ws)], capture_output=True, text=True,
                         timeout=120, env=agent_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"stop": "end_turn"}


NOT_CONNECTED = r'''
import asyncio, json, sys
from operate_sidecar.server.acp import agent as A
from operate_sidecar.server.rpc import settings as S

started = []
real = A.warm_up


async def spy(sidecar):
    started.append(True)
    await real(sidecar)


A.warm_up = spy


async def main():
    a = A.OperateAgent(S.finalize(S.merge(S.DEFAULTS, {})))
    await a.initialize(protocol_version=1)
    await asyncio.wait_for(a._ready(warm=True), 60)  # settled without a warm-up


asyncio.run(main())  # returns at once: no warm-up left to outlive the loop
print(json.dumps({"started": started}))
'''


def test_an_agent_with_no_connection_does_not_warm_up():
    """In-process use with no client (and an agent that is closing): there is no first prompt to
    prepare, and a warm-up started as the loop ends would leave a worker thread that keeps the
    interpreter from exiting. ``_ready(warm=True)`` is settled without it."""
    out = subprocess.run([sys.executable, "-c", NOT_CONNECTED], capture_output=True, text=True, timeout=120,
                         env=agent_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"started": []}


CALLS = r'''
import asyncio, json, sys
import acp
from call_count import counted
from operate_sidecar.server.acp import agent as A
from operate_sidecar.server.rpc import settings as S


class Client:
    async def session_update(self, session_id, update, **kw):
        pass


async def main():
    a = A.OperateAgent(S.finalize(S.merge(S.DEFAULTS, {"models": {"s": {"provider": "scripted",
        "responses": [{"json": {"message": "hi"}}] * 8}}, "defaultModel": "s"})))
    a.on_connect(Client())  # a connected agent warms up
    await a.initialize(protocol_version=1)
    sid = (await asyncio.wait_for(a.new_session(cwd=sys.argv[1]), 60)).session_id
    calls = []
    for _ in range(6):  # the turn's task, the outbox and the client run on this thread: all counted
        r, n = await counted(a.prompt(prompt=[acp.text_block("go")], session_id=sid))
        assert r.stop_reason == "end_turn", r
        calls.append(n)
    await a.aclose()
    print(json.dumps(calls))


asyncio.run(main())
'''


def test_the_first_prompt_after_session_new_runs_the_calls_a_warm_one_does(ws):
    """What the target "the first prompt no slower than a warm one" asks of the code, counted
    instead of timed: the first prompt after ``session/new`` calls as many Python functions as
    the later ones, so no schema, model, converter or import is built in it (the warm-up and
    ``Service.prime`` did that). Allowed: the few per-session objects made on first use (the
    outbox and its pump, the branch lock, the tool pool), about 15 calls. Without the warm-up
    the first prompt makes ~140 calls more, without the priming ~800, without both ~15,000.
    The time it takes is measured in ``bench/`` (``python -m bench.run --only acp``)."""
    env = agent_env()
    env["PYTHONPATH"] += os.pathsep + call_count.HERE
    out = subprocess.run([sys.executable, "-c", CALLS, str(ws)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    call_count.assert_first_as_warm(json.loads(out.stdout.strip().splitlines()[-1]), "prompt")
