"""A check the provider tests share (tests/models): a reasoning model's inline thoughts were split
off its text."""

from __future__ import annotations


def assert_thoughts_then_reply(chunks: list, reply_start: str = "Hello") -> tuple[str, str]:
    """``chunks`` (a provider's stream) are thoughts (``thinking``, no tag left in them), then a
    reply beginning ``reply_start`` (``text``, no tag in it), then the result. Answers (thoughts, reply)."""
    kinds = [c.type for c in chunks]
    thoughts = "".join(c.text for c in chunks if c.type == "thinking")
    text = "".join(c.text for c in chunks if c.type == "text")
    assert thoughts.strip() and "<" not in thoughts and ">" not in thoughts, chunks
    assert text.startswith(reply_start) and "think>" not in text, chunks
    assert kinds.index("text") > max(i for i, k in enumerate(kinds) if k == "thinking") and kinds[-1] == "result"
    return thoughts, text
