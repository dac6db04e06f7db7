"""OpenAI request bodies -> engine inputs: token ids and SamplingParams.

Every refusal is a 400 whose message says what to change and whose `param` names the field,
e.g. "This model's maximum context length is 2048 tokens; your prompt has 2100 tokens and
max_tokens asks for 256 more (2356 in total). Shorten the prompt or lower max_tokens."
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import fields as dc_fields
from typing import Any

from jinja2 import TemplateError

from api.openai.context_bound import refuse_text_that_cannot_fit
from api.openai.schemas import ChatMessage
from api.server.errors import invalid_request, model_not_found
from api.server.offload import messages_cost
from engine.protocol import EngineClient
from engine.sampling_params import MAX_N, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_PARAM_NAMES = {f.name for f in dc_fields(SamplingParams)}
_CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def check_model(requested: str, engine: EngineClient) -> None:
    if requested != engine.model_name:
        raise model_not_found(requested)


def check_stream_options(data: Any) -> None:
    if data.stream_options is not None and not data.stream:
        raise invalid_request("stream_options is only allowed with stream: true.", "stream_options")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's (Hugging Face) form: {"role", "content": str},
    plus "tool_calls" (arguments as objects, as templates expect) on assistant turns and
    "tool_call_id" on tool results."""
    if not messages:
        raise invalid_request("messages must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(messages):
        role = _CHAT_ROLES.get(m.role)
        if role is None:
            raise invalid_request(
                f"messages[{i}].role must be system, developer, user, assistant or tool; "
                f"got {m.role!r}.",
                f"messages[{i}].role",
            )
        message: dict[str, Any] = {"role": role, "content": _text(i, m.content)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise invalid_request(
                    f"messages[{i}]: only assistant messages carry tool_calls.",
                    f"messages[{i}].tool_calls",
                )
            message["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            if not m.tool_call_id:
                raise invalid_request(
                    f"messages[{i}] is a tool result without tool_call_id.",
                    f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid_request(
                f"messages[{i}].content[{j}] is of type {part.type!r}; only text parts "
                "are supported.",
                f"messages[{i}].content",
            )
        parts.append(part.text)
    return "\n".join(parts)


def _tool_call(i: int, j: int, call: Any) -> dict[str, Any]:
    if call.type != "function":
        raise invalid_request(
            f"messages[{i}].tool_calls[{j}].type must be 'function'.",
            f"messages[{i}].tool_calls",
        )
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:  # templates render the arguments object (`| tojson`): give them one
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {
        "id": call.id or f"call_{i}_{j}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


# Names the chat template call sets itself: chat_template_kwargs may not override them.
_TEMPLATE_RESERVED = {
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "tokenize",
    "chat_template",
    "continue_final_message",
}


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def template_extras(data: Any) -> dict[str, Any]:
    """vLLM's chat_template_kwargs and documents, as variables for the chat template."""
    extras = dict(data.chat_template_kwargs or {})
    clash = sorted(_TEMPLATE_RESERVED & extras.keys())
    if clash:
        raise invalid_request(
            f"chat_template_kwargs may not set {', '.join(clash)}.", "chat_template_kwargs"
        )
    if data.documents is not None:
        extras["documents"] = data.documents
    effort = getattr(data, "reasoning_effort", None)
    if effort is not None:  # OpenAI's levels, as a template variable (gpt-oss reads it)
        if effort not in REASONING_EFFORTS:
            raise invalid_request(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}.",
                "reasoning_effort",
            )
        extras.setdefault("reasoning_effort", effort)
    if getattr(data, "chat_template", None) is not None:  # allowed by the route's flag check
        extras["chat_template"] = data.chat_template
    return extras


async def completion_prompts(
    prompt: Any,
    tokenizer: Any,
    max_prompts: int,
    pool: Any,
    max_tokens: int | None = None,
    limit: int | None = None,
    param: str = "prompt",
) -> tuple[list[list[int]], list[str | None]]:
    """The prompt field -> (token ids per prompt, text per prompt or None for token prompts).
    With `limit` (max_model_len), a text that cannot fit it with `max_tokens` after it is
    refused from its length, before it is tokenized. `param`: the field's name (/v1/embeddings'
    `input` takes the same forms)."""
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
        token_prompts = None
    elif not prompt:
        raise invalid_request(f"{param} must not be empty.", param)
    elif all(isinstance(p, str) for p in prompt):
        texts, token_prompts = list(prompt), None
    elif all(isinstance(p, int) for p in prompt):
        texts, token_prompts = None, [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        texts, token_prompts = None, [list(p) for p in prompt]
    else:
        raise invalid_request(
            f"{param} must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (not a mix).",
            param,
        )
    count = len(texts if texts is not None else token_prompts)
    if count > max_prompts:
        raise invalid_request(
            f"{param} holds {count} prompts; at most {max_prompts} are allowed per request.",
            param,
        )
    if token_prompts is not None:
        vocab = tokenizer.vocab_size
        for p in token_prompts:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid_request(
                    f"Token id {bad} in the {param} is out of range: the vocabulary has {vocab} "
                    f"tokens (ids 0..{vocab - 1}).",
                    param,
                )
        return token_prompts, [None] * len(token_prompts)
    assert texts is not None
    if limit is not None:
        for t in texts:
            refuse_text_that_cannot_fit(t, max_tokens, limit, tokenizer.max_token_chars)
    ids = [await pool.tokenizer_call(len(t), encode_text, t, True) for t in texts]
    return ids, list(texts)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """A prompt's token ids (a module-level function: the worker processes run it)."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def fit_context(n_prompt: int, max_tokens: int | None, limit: int, param: str) -> int:
    """max_tokens to ask of the engine: the request's, or what the context leaves."""
    what = "messages" if param == "messages" else "prompt"
    if n_prompt == 0:
        raise invalid_request(f"The {what} is empty: it must contain at least one token.", param)
    if max_tokens is None:
        if n_prompt >= limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens; your {what} has "
                f"{n_prompt} tokens, which leaves no room for a completion. Shorten the {what}.",
                param,
            )
        return limit - n_prompt
    if max_tokens >= 1 and n_prompt + max_tokens > limit:
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens; your {what} has {n_prompt} "
            f"tokens and max_tokens asks for {max_tokens} more ({n_prompt + max_tokens} in "
            f"total). Shorten the {what} or lower max_tokens.",
            param,
        )
    return max_tokens


MAX_PRIORITY = 1000  # as a key's priority (api/keys/fields.py)


def check_priority(priority: int | None) -> None:
    if priority is not None and (isinstance(priority, bool) or abs(priority) > MAX_PRIORITY):
        raise invalid_request(
            f"priority must be a whole number from -{MAX_PRIORITY} to {MAX_PRIORITY} "
            "(lower runs first; a key's own priority is the best it may ask for).",
            "priority",
        )


def check_best_of(data: Any) -> int:
    """The engine's sample count for a completions body: best_of (at least n; not with
    stream when it exceeds n, as on OpenAI), else n."""
    n = 1 if data.n is None else data.n
    best_of = data.best_of
    if best_of is None:
        return n
    if isinstance(best_of, bool) or not 1 <= best_of <= MAX_N:
        raise invalid_request(f"best_of must be between 1 and {MAX_N}, got {best_of}.", "best_of")
    if best_of < n:
        raise invalid_request(
            f"best_of ({best_of}) must be greater than or equal to n ({n}).", "best_of"
        )
    if data.stream and best_of > n:
        raise invalid_request(
            "best_of greater than n cannot be streamed: the best samples are known only at "
            "the end; drop stream or set best_of to n.",
            "best_of",
        )
    return best_of


def sampling_params(
    data: Any,
    max_tokens: int,
    logprobs: int | None,
    defaults: dict[str, Any] | None = None,
    *,
    n: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The body's SamplingParams. defaults: the model's (generation_config.json, the engine's
    sampling_defaults) for what the body leaves unset, before the API's own; n: the engine's
    sample count where it differs from the body's (best_of); prompt_logprobs: where it differs
    from the body's (echo with logprobs)."""
    stop = [data.stop] if isinstance(data.stop, str) else list(data.stop or [])
    bias = None
    if data.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in data.logit_bias.items()}
        except ValueError:
            raise invalid_request(
                "logit_bias keys must be token ids (integers as strings).", "logit_bias"
            ) from None
    defaults = defaults or {}

    def given(name: str, fallback: Any) -> Any:
        value = getattr(data, name)
        return defaults.get(name, fallback) if value is None else value

    try:
        return SamplingParams(
            n=n if n is not None else 1 if data.n is None else data.n,
            max_tokens=max_tokens,
            min_tokens=data.min_tokens or 0,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            presence_penalty=data.presence_penalty or 0.0,
            frequency_penalty=data.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias=bias,
            seed=data.seed,
            stop=stop,
            stop_token_ids=list(data.stop_token_ids or []),
            include_stop_str_in_output=data.include_stop_str_in_output,
            ignore_eos=data.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=getattr(data, "prompt_logprobs", None)
            if prompt_logprobs is None
            else prompt_logprobs,
            skip_special_tokens=data.skip_special_tokens,
        )
    except ValueError as e:
        message = str(e)
        m = re.match(r"(\w+)", message)
        param = m.group(1) if m and m.group(1) in _PARAM_NAMES else None
        if param == "logprobs" and hasattr(data, "top_logprobs"):
            param, message = "top_logprobs", message.replace("logprobs", "top_logprobs", 1)
        raise invalid_request(message, param) from None


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    param: str | None,
    template_kwargs: dict[str, Any] | None = None,
    prepare: Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], dict[str, Any]]]
    | None = None,
) -> list[int]:
    """chat_messages + the chat template -> prompt token ids (one step, for the worker pool:
    every argument picklable). `prepare` rewrites the template's messages and adds variables
    (tool calling's api/openai/tools/plan.template_input, bound with functools.partial);
    `template_kwargs` are further template variables."""
    hf_messages = chat_messages(messages)
    kwargs = dict(template_kwargs or {})
    if prepare is not None:
        hf_messages, extra = prepare(hf_messages)
        kwargs.update(extra)
    try:
        return tokenizer.apply_chat_template(
            hf_messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ValueError as e:  # no chat template, or messages it cannot render
        hint = "" if param else " Use /v1/completions with a plain prompt."
        raise invalid_request(f"{e}{hint}", param) from None
    except TemplateError as e:  # the template refused the conversation (raise_exception)
        raise invalid_request(
            f"The chat template refused the messages: {e}", param or "messages"
        ) from None


async def chat_prompt(
    pool: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    param: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    prepare: Any = None,
) -> list[int]:
    """render_chat with the engine's tokenizer, in a worker process once the messages are
    large (count + characters)."""
    return await pool.tokenizer_call(
        messages_cost(messages),
        render_chat,
        messages,
        add_generation_prompt,
        param,
        template_kwargs,
        prepare,
    )
