"""Which request fields Tessera knows, and what it does with each: the parameter policy.

Every top-level field of a /v1/chat/completions or /v1/completions body is one of:

- IMPLEMENTED: decoded by the wire schema (api/openai/schemas.py) and acted on;
- IGNORED: accepted and deliberately without effect (README lists why), e.g. `store`;
- REJECTED: a 400 naming the field unless its value is one that changes nothing
  (`modalities: ["text"]`, `use_beam_search: false`, ...);
- anything else: unknown, a 400 naming it (as OpenAI does), unless the server runs with
  --lenient-request-fields, which lets unknown fields through (logged once per name).

The sets cover OpenAI's chat-completions and completions request bodies and vLLM's
documented extra parameters. This module is the one place that lists them; the README's
parameter table mirrors it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from api.server.errors import invalid_request

logger = logging.getLogger("tessera.api")

# --- implemented ---------------------------------------------------------------------------

_SAMPLING = {
    "model",
    "priority",  # vLLM's scheduling class, never better than the key's (api/tenants/tenancy.py)
    "cache_salt",  # vLLM: prefix-cache isolation within the key's or tenant's scope
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
    "user",  # recorded in the usage ledger
    # vLLM's sampling extras
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    # structured output (engine/structured, the `structured` branch)
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
}

CHAT_IMPLEMENTED = _SAMPLING | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    # vLLM's chat extras that go to the chat template
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",  # a template variable (gpt-oss reads it)
    "add_generation_prompt",
    "include_reasoning",  # vLLM: with --reasoning-parser
    "chat_template",  # vLLM: with --trust-request-chat-template
    "prompt_logprobs",  # vLLM's
}

COMPLETION_IMPLEMENTED = _SAMPLING | {
    "prompt",
    "echo",
    "logprobs",
    "suffix",
    "best_of",
    "prompt_logprobs",  # vLLM's
}

EMBEDDING_IMPLEMENTED = {
    "model",
    "input",
    "encoding_format",
    "dimensions",  # Matryoshka models only (config.json's is_matryoshka / matryoshka_dimensions)
    "user",  # recorded in the usage ledger
    "truncate_prompt_tokens",  # vLLM's: keep each input's last k tokens
}

# --- accepted, without effect ---------------------------------------------------------------

_IGNORED_COMMON = {
    "metadata",  # OpenAI's tags for stored completions: Tessera stores nothing
    "store",  # ditto
    "service_tier",  # one tier here
    "request_id",  # vLLM: Tessera makes its own ids (the response's `id`)
    "guided_decoding_backend",  # vLLM: one grammar backend, chosen by the server
    "spaces_between_special_tokens",  # vLLM: decoding never inserts spaces here
}
CHAT_IGNORED = _IGNORED_COMMON | {
    "prompt_cache_key",  # prefix caching is automatic
    "prompt_cache_retention",  # ditto: cached blocks live until evicted
    "safety_identifier",  # OpenAI's abuse-monitoring id; `user` is the one recorded
    "verbosity",  # no such control in the open models served
}
COMPLETION_IGNORED = _IGNORED_COMMON
EMBEDDING_IGNORED: set[str] = set()


# --- rejected unless harmless ------------------------------------------------------------------


def _only(*harmless: Any) -> Callable[[Any], bool]:
    """A value that changes nothing: None or one of `harmless`."""

    def check(v: Any) -> bool:
        return v is None or any(v == h and type(v) is type(h) for h in harmless)

    values: list[Any] = [None]
    for h in harmless:  # JSON Schema's enum compares numbers by value: 1 and 1.0 are one
        if not any(h == v and isinstance(v, bool) == isinstance(h, bool) for v in values):
            values.append(h)
    check.schema = {"enum": values}  # type: ignore[attr-defined]
    return check


def _unset(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


_unset.schema = {  # type: ignore[attr-defined]
    "anyOf": [
        {"type": "null"},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
        {"type": "string", "maxLength": 0},
    ]
}


_REJECTED_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_only(False), "beam search is not supported"),
    "length_penalty": (_only(1, 1.0), "length_penalty applies to beam search, not supported"),
    "truncate_prompt_tokens": (_unset, "prompt truncation is not supported; shorten the prompt"),
    "allowed_token_ids": (_unset, "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": (_unset, "bad_words is not supported; use logit_bias"),
    "logits_processors": (_unset, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (_only(False), "return_tokens_as_token_ids is not supported"),
    "return_token_ids": (_only(False), "return_token_ids is not supported; use /tokenize"),
    "kv_transfer_params": (_unset, "disaggregated serving is not supported"),
    "vllm_xargs": (_unset, "vllm_xargs is not supported"),
    "guided_whitespace_pattern": (_unset, "guided_whitespace_pattern is not supported"),
    "structural_tag": (_unset, "structural_tag is not supported"),
    "mm_processor_kwargs": (_unset, "this server serves text-only models"),
    "media_io_kwargs": (_unset, "this server serves text-only models"),
}
CHAT_REJECTED = _REJECTED_COMMON | {
    "audio": (_unset, "audio output is not supported"),
    "modalities": (_only(["text"]), "only the text modality is supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "functions": (
        _unset,
        "functions is deprecated and not supported: pass the functions as "
        'tools=[{"type": "function", "function": ...}]',
    ),
    "function_call": (_unset, "function_call is deprecated and not supported: use tool_choice"),
    "echo": (_only(False), "echo is not supported on chat completions"),
    "continue_final_message": (_only(False), "continue_final_message is not supported"),
    "add_special_tokens": (_only(False), "the chat template writes the special tokens"),
    "best_of": (_only(1), "best_of is not supported; use n"),
}
COMPLETION_REJECTED = _REJECTED_COMMON | {
    "prompt_embeds": (_unset, "prompt embeddings are not supported"),
    "add_special_tokens": (_only(True), "prompts are always tokenized with special tokens"),
}

EMBEDDING_REJECTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "add_special_tokens": (_only(True), "inputs are always tokenized with special tokens"),
    "normalize": (_unset, "the model's config says whether embeddings are normalized"),
}

_POLICIES = {
    "chat": (CHAT_IMPLEMENTED, CHAT_IGNORED, CHAT_REJECTED),
    "completion": (COMPLETION_IMPLEMENTED, COMPLETION_IGNORED, COMPLETION_REJECTED),
    "embedding": (EMBEDDING_IMPLEMENTED, EMBEDDING_IGNORED, EMBEDDING_REJECTED),
}
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_warned: set[str] = set()


def check_fields(body: bytes, endpoint: str, *, lenient: bool = False) -> None:
    """400 for a rejected or (unless lenient) unknown top-level field of the JSON `body`.

    A body that is not a JSON object is left to the schema, which says what is wrong."""
    implemented, ignored, rejected = _POLICIES[endpoint]
    try:
        fields = _FIELDS.decode(body)
    except msgspec.DecodeError:
        return
    for name, raw in fields.items():
        if name in implemented or name in ignored:
            continue
        rule = rejected.get(name)
        if rule is not None:
            harmless, why = rule
            if not harmless(msgspec.json.decode(raw)):
                raise invalid_request(f"{name}: {why}.", name, code="unsupported_parameter")
            continue
        if lenient:
            if name not in _warned:
                _warned.add(name)
                logger.warning("Unknown request field %r ignored (--lenient-request-fields)", name)
            continue
        raise invalid_request(
            f"Unrecognized request argument supplied: {name}. Remove it, or start the server "
            "with --lenient-request-fields to ignore unknown fields.",
            name,
            code="unknown_parameter",
        )


def documented_fields(endpoint: str) -> dict[str, dict[str, Any]]:
    """JSON schemas of the fields `endpoint` accepts beyond its wire schema (for the OpenAPI
    document): the ignored ones (any value), and the rejected ones (only values that change
    nothing)."""
    _, ignored, rejected = _POLICIES[endpoint]
    out: dict[str, dict[str, Any]] = {
        name: {"description": "Accepted for compatibility; has no effect on this server."}
        for name in sorted(ignored)
    }
    for name, (harmless, why) in sorted(rejected.items()):
        out[name] = {
            **harmless.schema,  # type: ignore[attr-defined]
            "description": f"Refused unless its value changes nothing: {why}.",
        }
    return out


def known_fields(endpoint: str) -> set[str]:
    """Every field the policy names for `endpoint` (for the README table check)."""
    implemented, ignored, rejected = _POLICIES[endpoint]
    return implemented | ignored | set(rejected)
