"""``InlineThoughts``: a reasoning model's ``<think>...</think>`` written into its text (what a
server that does not parse them passes on) is split off as thoughts, wherever the deltas cut
the tags. Over real servers, models and programs: tests/models/test_models_{openai,local,cli}.py."""

from __future__ import annotations

import re

import pytest

from operate_sidecar.server.models._common import InlineThoughts, opened_thought


def split(deltas: list[str], opened: str | None = None) -> tuple[list[tuple[str, str]], bool]:
    """The pieces of ``deltas`` (neighbours of one kind joined), and whether the thoughts were unclosed."""
    splitter = InlineThoughts(opened)
    pieces = [p for d in deltas for p in splitter.feed(d)] + splitter.end()
    assert all(text for _, text in pieces), pieces  # never an empty piece
    joined: list[tuple[str, str]] = []
    for kind, text in pieces:
        if joined and joined[-1][0] == kind:
            joined[-1] = (kind, joined[-1][1] + text)
        else:
            joined.append((kind, text))
    return joined, splitter.unclosed


def every_cut(text: str):
    """``text`` as one delta, one delta per character, and every cut into three deltas."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text, expected", [
    ("<think>\nThe user greets me. </thin k> not yet </think>\n\nHello!",
     [("thinking", "\nThe user greets me. </thin k> not yet "), ("text", "Hello!")]),
    ("\n  <thinking>plan</thinking> {\"a\": 1}", [("thinking", "plan"), ("text", '{"a": 1}')]),
    ("<think></think>\n\nNo thoughts today.", [("text", "No thoughts today.")]),  # Qwen3 with thinking off
])
def test_thoughts_opening_the_reply_are_split_off_wherever_the_deltas_cut_the_tags(text, expected):
    for deltas in every_cut(text):
        assert split(deltas) == (expected, False), deltas


@pytest.mark.parametrize("text", [
    "Hello <think>not at the start</think>",
    "  indented reply",
    "<thi",                              # ended while it could still have been a tag
    "<thought>other tag</thought>",
    "   ",
    "</think> a closing tag only",
])
def test_any_other_reply_passes_as_it_is(text):
    for deltas in every_cut(text):
        assert split(deltas) == ([("text", text)], False), deltas


def test_a_reply_that_ends_inside_its_thoughts_is_unclosed():
    for deltas in every_cut("<think>still thinking </thi"):
        assert split(deltas) == ([("thinking", "still thinking </thi")], True), deltas


def test_only_a_possible_tag_is_held_back():
    """Thoughts and the reply stream as they come: a delta waits only while it may be a tag."""
    splitter = InlineThoughts()
    assert splitter.feed("  <thi") == []
    assert splitter.feed("nk>Let me see") == [("thinking", "Let me see")]
    assert splitter.feed(" more </th") == [("thinking", " more ")]
    assert splitter.feed("ink>\n") == []
    assert splitter.feed("\nAnswer") == [("text", "Answer")]
    assert splitter.feed(" <think>") == [("text", " <think>")]
    assert splitter.end() == [] and not splitter.unclosed


def test_thoughts_the_prompt_opened_run_from_the_first_character_to_the_closing_tag():
    for deltas in every_cut("Let me see. <think> is not it.</think>\n\nHello"):
        assert split(deltas, "</think>") == ([("thinking", "Let me see. <think> is not it."), ("text", "Hello")], False)
    for deltas in every_cut("still thinking"):
        assert split(deltas, "</think>") == ([("thinking", "still thinking")], True)


@pytest.mark.parametrize("template, closing", [
    # DeepSeek-R1 (and QwQ): the generation prompt opens the thoughts
    ("{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
     "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}", "</think>"),
    # Qwen3 with thinking off: an empty thought block, closed in the prompt
    ("{% for m in messages %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}", None),
    # ChatML (SmolLM2): nothing opened
    ("{% for m in messages %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", None),
])
def test_the_thoughts_a_chat_template_opens_are_read_from_its_rendered_prompt(template, closing):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    prompt = Jinja2ChatFormatter(template=template, eos_token="", bos_token="")(
        messages=[{"role": "user", "content": "b"}]).prompt
    assert opened_thought(prompt) == closing, prompt


def _run(splitter, deltas):
    return [p for d in deltas for p in splitter.feed(d)] + splitter.end()


def test_the_splitter_of_a_call_follows_the_model_setting_the_template_and_a_structured_reply():
    """``InlineThoughts.of``: true looks for an opening tag; ``"opened"`` takes the reply for
    thoughts up to ``</think>``; a template that opens them does too (its own closing tag);
    neither for a structured reply; false passes every delta as text."""
    from operate_sidecar.server.core.errors import ModelError

    opened_reply = ["I will gr", "eet.</thi", "nk>\n\nHello"]
    tagged_reply = ["<think>x</think>", "Hello"]
    assert _run(InlineThoughts.of("opened"), opened_reply) == [("thinking", "I will gr"), ("thinking", "eet."), ("text", "Hello")]
    assert _run(InlineThoughts.of(True), opened_reply) == [("text", d) for d in opened_reply]
    assert _run(InlineThoughts.of(True), tagged_reply) == [("thinking", "x"), ("text", "Hello")]
    assert _run(InlineThoughts.of(True, template="</think>"), opened_reply) == _run(InlineThoughts.of("opened"), opened_reply)
    for setting in (True, "opened"):
        assert _run(InlineThoughts.of(setting, structured=True, template="</think>"), ['{"a": 1}']) == [("text", '{"a": 1}')]
    assert _run(InlineThoughts.of(False, template="</think>"), tagged_reply) == [("text", d) for d in tagged_reply]
    # the declared setting's error says the setting may be wrong; a template's, the usual one
    for splitter, words in [(InlineThoughts.of("opened"), 'set "inlineThinking" to true'),
                            (InlineThoughts.of(True, template="</think>"), "a larger maxTokens may let it finish (or")]:
        _run(splitter, ["Hello, no thoughts here."])
        with pytest.raises(ModelError, match=re.escape(words)):
            splitter.check("m")


def test_the_setting_is_true_false_or_opened():
    from operate_sidecar.server.models import ModelConfigError, make_model

    base = {"provider": "cli", "profile": "llm", "command": ["llm"]}
    assert [make_model({**base, **c}, name="m").inline_thinking for c in (
        {}, {"inlineThinking": None}, {"inlineThinking": False}, {"inlineThinking": "opened"})] == [True, True, False, "opened"]
    for wrong in ("open", 1, "true"):
        with pytest.raises(ModelConfigError, match='inlineThinking must be true, false or "opened", not'):
            make_model({**base, "inlineThinking": wrong}, name="m")


def test_turned_off_every_delta_is_text_as_it_came_and_an_unclosed_call_is_a_model_error():
    from operate_sidecar.server.core.errors import ModelError

    off = InlineThoughts("</think>", enabled=False)
    assert [p for d in ["<think>", "x</think>", "y"] for p in off.feed(d)] + off.end() == \
        [("text", "<think>"), ("text", "x</think>"), ("text", "y")]
    off.check("m")  # nothing held, nothing unclosed
    on = InlineThoughts()
    on.feed("<think>on and on")
    on.end()
    with pytest.raises(ModelError, match="'m': the reply ended inside the model's thoughts"):
        on.check("m")
