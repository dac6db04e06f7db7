"""A floor on a prompt's tokens from the sizes of its parts, before any template or tokenizer
runs: a body that cannot fit the context is refused for the cost of counting it.

One token stands for at most `max_token_chars` characters (engine/tokenizer.py: the longest
vocabulary entry), so a text of n characters is at least ceil(n / max_token_chars) tokens;
every chat message is at least one token (its role marker, in every chat template), and the
chat template writes each tool's name and description into the prompt. A floor is never more
than the true count, so a refusal on it is as right as one after tokenizing, and it costs one
pass over the messages, stopped early once the floor passes the context.
"""

from __future__ import annotations

from typing import Any

from api.server.errors import invalid_request


def _tokens(chars: int, max_token_chars: int) -> int:
    return -(-chars // max_token_chars)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(getattr(p, "text", None) or "") for p in content or ())


def chat_floor(messages: Any, tools: Any, max_token_chars: int, stop_above: int) -> tuple[int, int]:
    """(floor of the messages' tokens, floor of the tools'), each counted only until their sum
    passes `stop_above` (the caller refuses beyond it; the rest need not be looked at)."""
    tool_floor = 0
    for tool in tools or ():
        fn = getattr(tool, "function", None)
        chars = len(getattr(fn, "name", "") or "") + len(getattr(fn, "description", "") or "")
        tool_floor += _tokens(chars, max_token_chars)
        if tool_floor > stop_above:
            return 0, tool_floor
    if len(messages) + tool_floor > stop_above:  # at least one token a message
        return len(messages), tool_floor
    floor = 0
    for m in messages:
        floor += max(1, _tokens(_content_chars(m.content), max_token_chars))
        if floor + tool_floor > stop_above:
            break
    return floor, tool_floor


def refuse_chat_that_cannot_fit(
    messages: Any, tools: Any, max_tokens: int | None, limit: int, max_token_chars: int
) -> None:
    """400 before templating when the messages (and tools) cannot fit the context, with the
    request's max_tokens (or one token, without it) after them."""
    room = limit - max(max_tokens or 1, 1)
    floor, tool_floor = chat_floor(messages, tools, max_token_chars, room)
    if floor + tool_floor <= room:
        return
    param = "tools" if tool_floor > room else "messages"
    what = "tools' names and descriptions" if param == "tools" else "messages"
    raise invalid_request(
        f"This model's maximum context length is {limit} tokens; your {what} alone come to "
        f"at least {floor + tool_floor} tokens (counted from their size: each message is at "
        f"least one token, and a token at most {max_token_chars} characters){_asks(max_tokens)}. "
        f"Shorten the {param}.",
        param,
    )


def refuse_text_that_cannot_fit(
    text: str, max_tokens: int | None, limit: int, max_token_chars: int
) -> None:
    """400 before tokenizing when a prompt's characters cannot fit the context."""
    floor = _tokens(len(text), max_token_chars)
    if floor + max(max_tokens or 1, 1) <= limit:
        return
    raise invalid_request(
        f"This model's maximum context length is {limit} tokens; your prompt of {len(text)} "
        f"characters is at least {floor} tokens (a token is at most {max_token_chars} "
        f"characters){_asks(max_tokens)}. Shorten the prompt.",
        "prompt",
    )


def _asks(max_tokens: int | None) -> str:
    return f", and max_tokens asks for {max_tokens} more" if max_tokens else ""
